#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

#include "backend/cuda/ops_cuda.h"
#include "base/err.h"

struct qf_backend_opts {
    qf_cuda_opts cuda;
};

int qf_backend_opts_create(qf_backend_opts **out) {
    *out = NULL;
    qf_backend_opts *o = calloc(1, sizeof *o);
    if (!o) return qf_fail(QF_ENOMEM, "out of memory");
    qf_cuda_opts_default(&o->cuda);
    int rc = qf_cuda_opts_from_env(&o->cuda);
    if (rc != QF_OK) return free(o), rc;
    *out = o;
    return QF_OK;
}

void qf_backend_opts_free(qf_backend_opts *o) { free(o); }

int qf_backend_opts_set(qf_backend_opts *o, const char *assignment) { return qf_cuda_opts_set(&o->cuda, assignment); }

int qf_backend_opts_precision(qf_backend_opts *o, const char *name) {
    int p = qf_cuda_precision_parse(name);
    if (p < 0) return qf_fail(QF_EINVAL, "--precision takes bf16x2 (the default), fp32 or bf16, not '%s'", name);
    o->cuda.precision = p;
    return QF_OK;
}

void qf_backend_opts_print(FILE *f, const qf_backend_opts *o) { qf_cuda_opts_print(f, o ? &o->cuda : NULL); }

int qf_backend_open(qf_backend *be, const char *name, qf_pool *pool, const qf_backend_opts *opts) {
    *be = (qf_backend){qf_cpu_ops_best(), pool, NULL};
    if (!name || !*name || strcmp(name, "cpu") == 0) return QF_OK;
    if (strncmp(name, "cuda", 4) != 0 || (name[4] && name[4] != ':'))
        return qf_fail(QF_EINVAL, "unknown device '%s' (cpu, cuda, cuda:N)", name);
    char *end = NULL;
    long dev = name[4] ? strtol(name + 5, &end, 10) : 0;
    if (name[4] && (end == name + 5 || *end || dev < 0 || dev > 64)) return qf_fail(QF_EINVAL, "device '%s': N in cuda:N is a GPU index", name);
    int rc = qf_cuda_backend_init(be, (int)dev, opts ? &opts->cuda : NULL);
    if (rc != QF_OK) return rc;
    be->pool = pool;
    return QF_OK;
}

int qf_backend_is_device(const qf_backend *be) { return be->ops && be->ops->alloc != NULL; }

void qf_backend_close(qf_backend *be) {
    if (qf_backend_is_device(be)) qf_cuda_backend_free(be);
    be->dev = NULL;
}

const char *qf_backend_device_name(const qf_backend *be) { return qf_backend_is_device(be) ? qf_cuda_device_name(be) : "cpu"; }

size_t qf_backend_peak_bytes(const qf_backend *be) { return qf_backend_is_device(be) ? qf_cuda_peak_bytes(be) : 0; }

int qf_backend_has_cuda(void) { return qf_cuda_available(); }
