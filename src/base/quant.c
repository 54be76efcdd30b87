#include "base/quant.h"

#include <math.h>

#include "base/err.h"
#include "base/numeric.h"
#include <stdlib.h>
#include <string.h>

const char *qf_qfmt_name(int fmt) {
    switch (fmt) {
    case QF_Q_I8B32: return "int8";
    case QF_Q_I4B32: return "int4";
    case QF_Q_FP8B128: return "fp8";
    default: return "none";
    }
}

int qf_qfmt_parse(const char *name) {
    if (!strcmp(name, "int8")) return QF_Q_I8B32;
    if (!strcmp(name, "int4")) return QF_Q_I4B32;
    if (!strcmp(name, "fp8")) return QF_Q_FP8B128;
    return QF_Q_NONE;
}

size_t qf_q_row_bytes(int fmt, int64_t cols) {
    switch (fmt) {
    case QF_Q_I8B32: return (size_t)(cols / QF_Q_BLOCK) * 34;
    case QF_Q_I4B32: return (size_t)(cols / QF_Q_BLOCK) * 20;
    case QF_Q_FP8B128: return (size_t)cols;
    default: return 0;
    }
}

/* ---- int8 / int4 blocks (fp16 scales) ---- */

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* Block b of a row: its scale (and minimum) and quants, in the row layout of quant.h. */
static void quant_i8(const float *w, uint8_t *row, int64_t nb, int64_t b) {
    float amax = 0;
    for (int i = 0; i < QF_Q_BLOCK; i++) amax = fmaxf(amax, fabsf(w[i]));
    uint16_t dh = qf_f32_to_f16(amax / 127.0f);
    float d = qf_f16_to_f32(dh), inv = d > 0 ? 1.0f / d : 0.0f;
    put16(row + 2 * b, dh);
    int8_t *q = (int8_t *)(row + 2 * nb) + QF_Q_BLOCK * b;
    for (int i = 0; i < QF_Q_BLOCK; i++) {
        long v = lrintf(w[i] * inv);
        q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
}

static void quant_i4(const float *w, uint8_t *row, int64_t nb, int64_t b) {
    float lo = w[0], hi = w[0];
    for (int i = 1; i < QF_Q_BLOCK; i++) lo = fminf(lo, w[i]), hi = fmaxf(hi, w[i]);
    uint16_t dh = qf_f32_to_f16((hi - lo) / 15.0f), mh = qf_f32_to_f16(lo);
    float d = qf_f16_to_f32(dh), m = qf_f16_to_f32(mh), inv = d > 0 ? 1.0f / d : 0.0f;
    put16(row + 2 * b, dh), put16(row + 2 * nb + 2 * b, mh);
    uint8_t *q = row + 4 * nb + 16 * b;
    memset(q, 0, QF_Q_BLOCK / 2);
    for (int i = 0; i < QF_Q_BLOCK; i++) {
        long v = lrintf((w[i] - m) * inv);
        v = v > 15 ? 15 : v < 0 ? 0 : v;
        q[i % 16] |= (uint8_t)(v << (i < 16 ? 0 : 4));
    }
}

void qf_q_quantize_row(int fmt, const float *w, int64_t cols, void *out) {
    uint8_t *o = out;
    if (fmt == QF_Q_FP8B128) {
        for (int64_t i = 0; i < cols; i++) o[i] = qf_f32_to_fp8(w[i]);
        return;
    }
    int64_t nb = cols / QF_Q_BLOCK;
    for (int64_t b = 0; b < nb; b++) {
        if (fmt == QF_Q_I8B32) quant_i8(w + b * QF_Q_BLOCK, o, nb, b);
        else quant_i4(w + b * QF_Q_BLOCK, o, nb, b);
    }
}

/* Weight c of a row of cols in an int format. */
static float int_weight(int fmt, const uint8_t *row, int64_t cols, int64_t c) {
    int64_t nb = cols / QF_Q_BLOCK, b = c / QF_Q_BLOCK;
    int i = (int)(c % QF_Q_BLOCK);
    float d = qf_f16_to_f32(get16(row + 2 * b));
    if (fmt == QF_Q_I8B32) return d * (float)((const int8_t *)(row + 2 * nb))[c];
    const uint8_t *q = row + 4 * nb + 16 * b;
    return qf_f16_to_f32(get16(row + 2 * nb + 2 * b)) + d * (float)((q[i % 16] >> (i < 16 ? 0 : 4)) & 15);
}

void qf_q_dequantize_row(int fmt, const void *q, int64_t cols, float *out) {
    const uint8_t *p = q;
    for (int64_t i = 0; i < cols; i++) out[i] = fmt == QF_Q_FP8B128 ? qf_fp8_to_f32(p[i]) : int_weight(fmt, p, cols, i);
}

/* ---- fp8 e4m3fn ---- */

float qf_fp8_to_f32(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    float v = e ? ldexpf((float)(8 | m), e - 10) : ldexpf((float)m, -9);
    return s ? -v : v;
}

uint8_t qf_f32_to_fp8(float f) {
    if (isnan(f)) return 0x7f;
    uint8_t s = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.0f) return s | 0x7e; /* saturate: the largest finite value */
    if (a < ldexpf(1.0f, -6)) {         /* subnormal: multiples of 2^-9, to nearest even */
        long q = lrintf(ldexpf(a, 9));
        return s | (uint8_t)q; /* q == 8 is the smallest normal, encoded alike */
    }
    int e;
    float m = frexpf(a, &e);              /* a = m * 2^e, m in [0.5, 1): 4 significant bits */
    long q = lrintf(ldexpf(m, 4));         /* 8..16, to nearest even */
    if (q == 16) q = 8, e++;
    int be = e - 1 + 7;
    if (be > 15 || (be == 15 && (q & 7) == 7)) return s | 0x7e;
    return s | (uint8_t)(be << 3) | (uint8_t)(q & 7);
}

void qf_fp8_dequantize_row(const uint8_t *w, const float *scales, int64_t r, int64_t cols, float *out) {
    int64_t nb = (cols + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK;
    const float *sr = scales + (r / QF_FP8_BLOCK) * nb;
    for (int64_t i = 0; i < cols; i++) out[i] = qf_fp8_to_f32(w[r * cols + i]) * sr[i / QF_FP8_BLOCK];
}

float qf_q_weight(int fmt, const void *w, const float *scales, int64_t cols, int64_t r, int64_t c) {
    const uint8_t *p = w;
    if (fmt == QF_Q_FP8B128) {
        int64_t nb = (cols + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK;
        return qf_fp8_to_f32(p[r * cols + c]) * scales[(r / QF_FP8_BLOCK) * nb + c / QF_FP8_BLOCK];
    }
    return int_weight(fmt, p + (size_t)r * qf_q_row_bytes(fmt, cols), cols, c);
}

int qf_q_matmul_ref(int fmt, const void *w, const float *scales, int64_t rows, int64_t cols, const float *x, int n, float *y) {
    float *row = malloc((size_t)cols * sizeof *row);
    if (!row) return qf_fail(QF_ENOMEM, "out of memory for a %lld-wide row", (long long)cols);
    size_t rb = qf_q_row_bytes(fmt, cols);
    for (int64_t o = 0; o < rows; o++) {
        if (fmt == QF_Q_FP8B128) qf_fp8_dequantize_row(w, scales, o, cols, row);
        else qf_q_dequantize_row(fmt, (const uint8_t *)w + o * rb, cols, row);
        for (int t = 0; t < n; t++) {
            float acc = 0;
            for (int64_t i = 0; i < cols; i++) acc += row[i] * x[(int64_t)t * cols + i];
            y[(int64_t)t * rows + o] = acc;
        }
    }
    free(row);
    return QF_OK;
}

void qf_float_row(int dtype, const void *p, int64_t cols, float *out) {
    const unsigned char *b = p;
    for (int64_t i = 0; i < cols; i++) {
        uint16_t h;
        if (dtype == QF_DT_F32) memcpy(&out[i], b + 4 * i, 4);
        else memcpy(&h, b + 2 * i, 2), out[i] = dtype == QF_DT_BF16 ? qf_bf16_to_f32(h) : qf_f16_to_f32(h);
    }
}
