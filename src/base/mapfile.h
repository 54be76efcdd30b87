/* Read-only memory map of a whole file; the map owns its descriptor. */
#ifndef QF_BASE_MAPFILE_H
#define QF_BASE_MAPFILE_H

#include <stddef.h>

typedef struct qf_mapfile {
    const unsigned char *data;
    size_t size;
    int fd;
} qf_mapfile;

/* 0 on success; on failure *m is zeroed and the message names the path. */
int qf_mapfile_open(qf_mapfile *m, const char *path);
void qf_mapfile_close(qf_mapfile *m);

/* Reads a whole (small) file into a NUL-terminated heap buffer the caller frees. */
int qf_read_file(const char *path, char **out, size_t *len);

#endif
