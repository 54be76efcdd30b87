/* Memory through the backend: the device's functions when it has them, libc otherwise. */
#include <stdlib.h>
#include <string.h>

#include "backend/ops.h"

void *qf_be_alloc(qf_backend *be, size_t bytes) {
    if (be && be->ops->alloc) return be->ops->alloc(be, bytes ? bytes : 1);
    return calloc(1, bytes ? bytes : 1);
}

void qf_be_free(qf_backend *be, void *p) {
    if (!p) return;
    if (be && be->ops->free) be->ops->free(be, p);
    else free(p);
}

void qf_be_upload(qf_backend *be, void *dst, const void *src, size_t bytes) {
    if (be && be->ops->upload) be->ops->upload(be, dst, src, bytes);
    else memcpy(dst, src, bytes);
}

void qf_be_download(qf_backend *be, void *dst, const void *src, size_t bytes) {
    if (be && be->ops->download) be->ops->download(be, dst, src, bytes);
    else memcpy(dst, src, bytes);
}

void qf_be_zero(qf_backend *be, void *p, size_t bytes) {
    if (be && be->ops->zero) be->ops->zero(be, p, bytes);
    else memset(p, 0, bytes);
}

void qf_be_copy(qf_backend *be, void *dst, const void *src, size_t bytes) {
    if (be && be->ops->copy) be->ops->copy(be, dst, src, bytes);
    else memcpy(dst, src, bytes);
}

void *qf_be_host_alloc(qf_backend *be, size_t bytes) {
    if (be && be->ops->pin_alloc && be->ops->pin_free) return be->ops->pin_alloc(be, bytes ? bytes : 1);
    return calloc(1, bytes ? bytes : 1);
}

void qf_be_host_free(qf_backend *be, void *p) {
    if (!p) return;
    if (be && be->ops->pin_alloc && be->ops->pin_free) be->ops->pin_free(be, p);
    else free(p);
}

int qf_be_sync(qf_backend *be) { return be && be->ops->sync ? be->ops->sync(be) : 0; }
