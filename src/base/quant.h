/* Block-quantised weight formats and their plain reference conversions (the oracle every fast
 * product is tested against).
 *
 *   QF_Q_I8B32  int8, symmetric: per block of 32 weights of a row an fp16 scale d, w = d * q
 *               (q in -127..127). A row of nb blocks is {fp16 d[nb], int8 q[32 nb]}: 34 bytes a
 *               block, 8.5 bits a weight.
 *   QF_Q_I4B32  int4 with an offset: per block an fp16 scale d and an fp16 minimum m,
 *               w = m + d * q (q in 0..15). A row is {fp16 d[nb], fp16 m[nb], uint8 q[16 nb]}:
 *               block b's 16 bytes hold its q[j] in the low nibble of byte j and q[j + 16] in the
 *               high one. 20 bytes a block, 5 bits a weight.
 *   The scales lead the row so that the quants are whole 16-byte vectors (when the row's blocks
 *   are a multiple of 8, as in every Qwen3.5/3.6 weight) that a vector load unpacks at once.
 *   QF_Q_FP8B128 FP8 e4m3 (the OCP "fn" variant: no infinities, 0x7f / 0xff NaN, largest 448)
 *               with one fp32 scale per 128 x 128 block, w = e4m3 * scale (the official
 *               checkpoint's weight_scale_inv).
 *
 * Rows of the blocked int formats are whole blocks: cols must be a multiple of 32. */
#ifndef QF_BASE_QUANT_H
#define QF_BASE_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"

/* A format is the dtype of a weight that has it. */
enum qf_qfmt { QF_Q_NONE = 0, QF_Q_I8B32 = QF_DT_Q8_B32, QF_Q_I4B32 = QF_DT_Q4_B32, QF_Q_FP8B128 = QF_DT_F8_E4M3 };
static inline int qf_is_quant(int dtype) { return dtype == QF_Q_I8B32 || dtype == QF_Q_I4B32 || dtype == QF_Q_FP8B128; }

#define QF_Q_BLOCK 32
#define QF_FP8_BLOCK 128

const char *qf_qfmt_name(int fmt);
int qf_qfmt_parse(const char *name); /* "int8", "int4", "fp8"; QF_Q_NONE when unknown */
/* Bytes of one row of cols weights (blocked int formats) or of the e4m3 row (fp8: cols). */
size_t qf_q_row_bytes(int fmt, int64_t cols);

/* One row, cols a multiple of 32 (int formats): the scales are chosen per block (int8: max |w| /
 * 127; int4: the block's range / 15 from its minimum), values rounded to nearest. */
void qf_q_quantize_row(int fmt, const float *w, int64_t cols, void *out);
void qf_q_dequantize_row(int fmt, const void *q, int64_t cols, float *out);

/* A row of cols BF16, F16 or F32 values (little-endian bytes, as stored) as fp32: what the
 * quantiser reads from a float weight. */
void qf_float_row(int dtype, const void *p, int64_t cols, float *out);

/* e4m3fn: exact decode; encode rounds to nearest even and saturates to +-448 (NaN stays NaN). */
float qf_fp8_to_f32(uint8_t b);
uint8_t qf_f32_to_fp8(float f);
/* Row r of an fp8 [rows][cols] weight with its [ceil(rows/128)][ceil(cols/128)] fp32 scales. */
void qf_fp8_dequantize_row(const uint8_t *w, const float *scales, int64_t r, int64_t cols, float *out);

/* Element (r, c) of a [rows][cols] weight in fmt (fp8: with its scales), as the reference reads it. */
float qf_q_weight(int fmt, const void *w, const float *scales, int64_t cols, int64_t r, int64_t c);

/* The reference product y[t][o] = sum_i dequant(W)[o][i] * x[t][i], W [rows][cols] in fmt
 * (fp8: scales as above), for n rows of x; dequantise, then multiply in the row's order.
 * QF_ENOMEM when a row's scratch cannot be had. */
int qf_q_matmul_ref(int fmt, const void *w, const float *scales, int64_t rows, int64_t cols, const float *x, int n, float *y);

#endif
