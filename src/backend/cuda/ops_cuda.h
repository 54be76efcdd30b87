/* The CUDA backend: the ops table on one NVIDIA GPU. Weights are bf16/f16/f32 as stored,
 * activations fp32. Decode-sized matrix products (up to 16 tokens) run fused GEMV kernels that
 * read each weight once; larger ones go to cuBLAS on the tensor cores (numerics: qf_cuda_opts'
 * precision). Decode steps run as CUDA graphs. Ops are asynchronous on one stream; download()
 * and sync() wait, and a failure inside a step is returned by step_end() (or sync()).
 * Code outside src/backend reaches it through backend/backend.h. */
#ifndef QF_BACKEND_CUDA_OPS_CUDA_H
#define QF_BACKEND_CUDA_OPS_CUDA_H

#include "backend/cuda/cuda_opts.h"
#include "backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills be with the CUDA table and a context on `device` (opts NULL: the defaults); an error (no
 * GPU, no driver) names it. */
int qf_cuda_backend_init(qf_backend *be, int device, const qf_cuda_opts *opts);
void qf_cuda_backend_free(qf_backend *be);
/* Bytes of device memory in use at the peak, and the card's name. */
size_t qf_cuda_peak_bytes(const qf_backend *be);
const char *qf_cuda_device_name(const qf_backend *be);
/* 1 when this build has the CUDA backend. */
int qf_cuda_available(void);

#ifdef __cplusplus
}
#endif

#endif
