/* Writing a quantised copy of a model directory (`qflash quantize`).
 *
 * Layout written (readable by the loader, model/weights.c):
 *   - routed experts and, with a trunk format, the trunk's projections (qf_quant_trunk_format) in
 *     the chosen format; DeltaNet's conv1d / A_log / dt_bias / norm, every norm, the embeddings,
 *     lm_head and mtp.* stay as they are;
 *   - int8 / int4 (base/quant.h QF_Q_I8B32 / QF_Q_I4B32): a U8 tensor under the weight's own name,
 *     shaped [..., rows, row bytes] (one row of blocks per weight row; fused experts stay fused);
 *   - fp8: the official layout, F8_E4M3 [rows, cols] plus `<name>_scale_inv` F32 per 128 x 128
 *     block, experts one by one (mlp.experts.N.*);
 *   - config.json gains quantization_config {quant_method: "qflash", experts, trunk}; the other
 *     files are copied; shards of at most shard_bytes (model.safetensors when one suffices, else
 *     model-0000i-of-0000n.safetensors and model.safetensors.index.json); SHA256SUMS last, in
 *     sha256sum's format (qflash verify --manifest reads it).
 * Input weights may be BF16, F16, F32 or FP8 (dequantised with their scales first). Tensors are
 * read in bounded chunks with pread (the input's pages are not kept): memory stays at a few chunk
 * buffers whatever the model's size. */
#ifndef QF_MODEL_QUANTIZE_H
#define QF_MODEL_QUANTIZE_H

#include <stdint.h>

#include "base/pool.h"

typedef struct qf_quantize_opts {
    int experts;          /* QF_Q_I8B32, QF_Q_I4B32, QF_Q_FP8B128, or 0: as stored */
    int trunk;            /* 0: as stored; QF_DT_BF16 (FP8 trunks dequantised); QF_Q_I8B32 */
    uint64_t shard_bytes; /* 0: 4 GiB */
    qf_pool *pool;        /* may be NULL */
    void (*progress)(void *ud, uint64_t done, uint64_t total); /* bytes of input tensors */
    void *progress_ud;
} qf_quantize_opts;

/* What a trunk format makes of the weight `name` (0: it stays as stored). QF_DT_BF16 (an FP8
 * trunk dequantised): attention q/k/v/o, DeltaNet in_proj_qkv / in_proj_z / out_proj, the shared
 * expert's gate/up/down. QF_Q_I8B32: those and every matrix that joins them in the device's fused
 * decode products (DeltaNet in_proj_b / in_proj_a, the router, the shared expert's gate logit), so
 * each fused matrix is one format; the shared expert's down rows become bf16 (the fused MoE reads
 * them beside the routed experts, in bf16). */
int qf_quant_trunk_format(const char *name, int trunk);

int qf_quantize_dir(const char *in, const char *out, const qf_quantize_opts *o);

#endif
