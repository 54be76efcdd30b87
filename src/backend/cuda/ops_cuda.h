/* The CUDA backend: the ops table on one NVIDIA GPU. Weights are bf16/f16/f32 as stored,
 * activations fp32. Decode-sized matrix products (up to 8 tokens) run a GEMV kernel that reads
 * each weight once; larger ones go to cuBLAS on the tensor cores with each activation split into
 * two bf16 parts (hi + lo, ~16 bits kept) and fp32 accumulation; QFLASH_CUDA_BF16=1 uses one
 * bf16 part (faster, ~8 bits), QFLASH_CUDA_FP32=1 keeps fp32 activations everywhere (GEMV only:
 * the exact path). Decode steps of up to 8 rows run as CUDA graphs (QFLASH_CUDA_GRAPHS=0: off).
 * Ops are asynchronous on one stream; download() waits. */
#ifndef QF_BACKEND_CUDA_OPS_CUDA_H
#define QF_BACKEND_CUDA_OPS_CUDA_H

#include "backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills be with the CUDA table and a context on `device`; an error (no GPU, no driver) names it. */
int qf_cuda_backend_init(qf_backend *be, int device);
void qf_cuda_backend_free(qf_backend *be);
/* Bytes of device memory in use at the peak (cudaMalloc'd by this backend), and the card's name. */
size_t qf_cuda_peak_bytes(const qf_backend *be);
const char *qf_cuda_device_name(const qf_backend *be);
/* Waits for every queued op. */
void qf_cuda_sync(qf_backend *be);
/* 1 when this build has the CUDA backend. */
int qf_cuda_available(void);

#ifdef __cplusplus
}
#endif

#endif
