/* Writing safetensors files: the header first (every tensor's dtype, shape and byte range, in the
 * order the caller then writes their bytes), so a file of any size is written in one pass. */
#ifndef QF_FORMAT_ST_WRITE_H
#define QF_FORMAT_ST_WRITE_H

#include <stdint.h>
#include <stdio.h>

typedef struct qf_st_entry {
    const char *name;
    const char *dtype; /* "BF16", "U8", "F8_E4M3", ... */
    int ndim;
    int64_t shape[8];
    uint64_t nbytes;
} qf_st_entry;

/* The 8-byte length, the JSON header (with __metadata__ {"format": "pt"}) padded to 8 bytes.
 * QF_EIO naming path when the write fails. */
int qf_st_write_header(FILE *f, const char *path, const qf_st_entry *e, int n);

#endif
