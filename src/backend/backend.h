/* Choosing a backend: the one place that knows which ones exist. Code above src/backend opens
 * one by name and reaches it through its ops table (backend/ops.h). */
#ifndef QF_BACKEND_BACKEND_H
#define QF_BACKEND_BACKEND_H

#include <stddef.h>

#include "backend/cuda/cuda_opts.h"
#include "backend/ops.h"

/* "cpu" (the fastest CPU table this machine runs), "cuda" or "cuda:N" (GPU N; cuda: its options,
 * NULL for the defaults). pool: the CPU threads (may be NULL). QF_EINVAL for an unknown name,
 * QF_EUNSUPPORTED when the build or the machine has no such device. */
int qf_backend_open(qf_backend *be, const char *name, qf_pool *pool, const qf_cuda_opts *cuda);
void qf_backend_close(qf_backend *be);
/* 1 when the backend's memory is not host memory (weights must be moved there). */
int qf_backend_is_device(const qf_backend *be);
/* The device's name ("cpu" for the CPU) and its peak memory in use (0 on the CPU). */
const char *qf_backend_device_name(const qf_backend *be);
size_t qf_backend_peak_bytes(const qf_backend *be);
/* 1 when this build has the CUDA backend. */
int qf_backend_has_cuda(void);

#endif
