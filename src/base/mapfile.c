#include "base/mapfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/err.h"

int qf_mapfile_open(qf_mapfile *m, const char *path) {
    memset(m, 0, sizeof *m);
    m->fd = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return qf_fail(QF_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return qf_fail(QF_EIO, "%s: not a regular file", path);
    }
    m->size = (size_t)sb.st_size;
    if (m->size > 0) {
        void *p = mmap(NULL, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return qf_fail(QF_EIO, "%s: mmap failed: %s", path, strerror(errno));
        }
        m->data = p;
    }
    m->fd = fd;
    return QF_OK;
}

void qf_mapfile_close(qf_mapfile *m) {
    if (m->data) munmap((void *)m->data, m->size);
    if (m->fd >= 0) close(m->fd);
    memset(m, 0, sizeof *m);
    m->fd = -1;
}

int qf_read_file(const char *path, char **out, size_t *len) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return qf_fail(QF_EIO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) break;
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        return bad ? qf_fail(QF_EIO, "%s: read error", path) : qf_fail(QF_ENOMEM, "out of memory");
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return QF_OK;
}
