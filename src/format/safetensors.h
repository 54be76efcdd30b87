/* safetensors checkpoints: one file or shards named by model.safetensors.index.json, mmap'd.
 * Every header is validated before any tensor is handed out (see st_parse_header in the .c). */
#ifndef QF_FORMAT_SAFETENSORS_H
#define QF_FORMAT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "base/hashmap.h"
#include "base/mapfile.h"

#define QF_ST_MAX_DIMS    8
#define QF_ST_HEADER_CAP  (100u << 20) /* largest header we accept: 100 MiB */

typedef struct qf_st_tensor {
    char *name;
    int dtype;
    int ndim;
    int64_t shape[QF_ST_MAX_DIMS];
    int64_t n_elem;
    const void *data; /* inside the file's map */
    size_t nbytes;
    int file;         /* index into qf_st_set.files; -1 for a tensor held in memory */
    void *owned;      /* memory tensors: the buffer, freed with the set */
} qf_st_tensor;

typedef struct qf_st_file {
    char *path;
    qf_mapfile map;
} qf_st_file;

typedef struct qf_st_set {
    qf_st_file *files;
    int n_files;
    qf_st_tensor *tensors;
    int n_tensors, cap_tensors;
    qf_strmap by_name;
} qf_st_set;

/* Maps and validates one file and adds its tensors. Fails on any header problem or a name
 * already present in the set. */
int qf_st_add_file(qf_st_set *set, const char *path);

/* Opens a model directory: model.safetensors.index.json (all shards) when present, else
 * model.safetensors. With diag, every problem is reported and checking goes on; the first
 * error code is returned. */
int qf_st_open_dir(qf_st_set *set, const char *dir, qf_diag *diag);

/* Opens a single file as a set (reference files, tests). */
int qf_st_open(qf_st_set *set, const char *path);

/* Adds a tensor held in memory (a synthetic model's weights). The set takes ownership of data
 * (malloc'd, n_elem * dtype size bytes), also on failure. */
int qf_st_add_memory(qf_st_set *set, const char *name, int dtype, int ndim, const int64_t *shape, void *data);

const qf_st_tensor *qf_st_find(const qf_st_set *set, const char *name);
/* n bytes at p (inside a tensor of the set) into dst: read from the file when p lies in a mapped
 * file, so its pages are not brought into this process; copied when p is memory. */
int qf_st_read(const qf_st_set *set, const void *p, void *dst, size_t n);
void qf_st_close(qf_st_set *set);

#endif
