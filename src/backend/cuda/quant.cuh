// Quantised weights on the device (formats of base/quant.h): an element reader for the generic
// kernels, and 16-byte units decoded in registers for the decode products. A row of an int format
// is {scales | quants}; a unit is 16 bytes of its quants (int8: 16 weights, half a block; int4:
// one block of 32; fp8: 16 weights). FP8 block scales follow the matrix at qf_mat_scale_off.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>

#include "backend/ops.h"
#include "base/quant.h"

namespace qfc {

enum { QK_BF16 = 0, QK_I8 = 1, QK_I4 = 2, QK_F8 = 3 };

__host__ __device__ __forceinline__ int qk_of(int dtype) {
    return dtype == QF_Q_I8B32 ? QK_I8 : dtype == QF_Q_I4B32 ? QK_I4 : dtype == QF_Q_FP8B128 ? QK_F8 : QK_BF16;
}
__host__ __device__ __forceinline__ int64_t qk_row_bytes(int F, int64_t cols) {
    return F == QK_I8 ? cols / 32 * 34 : F == QK_I4 ? cols / 32 * 20 : F == QK_F8 ? cols : cols * 2;
}
// Where the quants of a row start, and how many units it has.
__host__ __device__ __forceinline__ int qk_qoff(int F, int cols) { return F == QK_I8 ? cols / 16 : F == QK_I4 ? cols / 8 : 0; }
__host__ __device__ __forceinline__ int qk_units(int F, int cols) { return F == QK_I4 ? cols / 32 : F == QK_BF16 ? cols / 8 : cols / 16; }
// The device kernels' unit path needs whole 16-byte units at 16-byte aligned row starts.
__host__ __device__ __forceinline__ bool qk_unit_ok(int F, int64_t cols) {
    return F == QK_BF16 ? cols % 8 == 0 : F == QK_F8 ? cols % 16 == 0 : cols % 256 == 0;
}
// An FP8 matrix's scales, from its data pointer.
__host__ __device__ __forceinline__ const float *qk_fp8_scales(const void *data, int64_t rows, int64_t cols) {
    return (const float *)((const char *)data + ((rows * cols + 255) & ~(int64_t)255));
}

__device__ __forceinline__ float qk_f16(const uint8_t *p) { return __half2float(__ushort_as_half(*(const unsigned short *)p)); }

// e4m3 byte as fp32 times 2^-120 (sign, exponent and mantissa moved into place; subnormals too).
__device__ __forceinline__ float qk_e4m3(uint32_t b) { return __uint_as_float(((b & 0x7fu) << 20) | ((b & 0x80u) << 24)); }

// Element (r, c), any format (the generic kernels).
__device__ __forceinline__ float ldwq(const void *w, int dtype, int64_t rows, int64_t cols, int64_t r, int64_t c) {
    const uint8_t *p = (const uint8_t *)w;
    if (dtype == QF_Q_FP8B128)
        return qk_e4m3(p[r * cols + c]) * 0x1p120f * qk_fp8_scales(w, rows, cols)[(r / 128) * ((cols + 127) / 128) + c / 128];
    if (dtype == QF_Q_I8B32 || dtype == QF_Q_I4B32) {
        int64_t nb = cols / 32, b = c / 32;
        int i = (int)(c % 32);
        const uint8_t *row = p + r * (dtype == QF_Q_I8B32 ? 34 : 20) * nb;
        float d = qk_f16(row + 2 * b);
        if (dtype == QF_Q_I8B32) return d * (float)(int8_t)row[2 * nb + c];
        return qk_f16(row + 2 * nb + 2 * b) + d * (float)((row[4 * nb + 16 * b + i % 16] >> (i < 16 ? 0 : 4)) & 15);
    }
    if (dtype == QF_DT_BF16) return __uint_as_float((uint32_t)((const uint16_t *)w)[r * cols + c] << 16);
    if (dtype == QF_DT_F16) return __half2float(((const __half *)w)[r * cols + c]);
    return ((const float *)w)[r * cols + c];
}

// The scales unit u of a row needs (d, and int4's minimum m; fp8: its band's scale times 2^120),
// loaded beside the unit's weights so that no load waits on the arithmetic.
template <int F>
__device__ __forceinline__ float2 qk_scale(const uint8_t *row, int cols, int u, const float *band) {
    if constexpr (F == QK_I8) return make_float2(qk_f16(row + 2 * (u / 2)), 0.0f);
    if constexpr (F == QK_I4) return make_float2(qk_f16(row + 2 * u), qk_f16(row + cols / 16 + 2 * u));
    return make_float2(band[u / 8] * 0x1p120f, 0.0f);
}

// A small unsigned integer as fp32 by the 2^23 magic number: an OR and an add at full rate, where
// an int-to-float conversion runs at a quarter of it (what bound the int4 decode).
__device__ __forceinline__ float qk_u2f(uint32_t v) { return __uint_as_float(0x4B000000u | v) - 8388608.0f; }

// Unit u's weights dotted with its inputs x (int4: 32 of them, else 16), read from shared memory
// in a fixed order (indexing a register array by lane would put it in local memory).
template <int F>
__device__ __forceinline__ float qk_unit(uint4 w, float2 sc, const float *x) {
    uint32_t q[4] = {w.x, w.y, w.z, w.w};
    float s = 0.0f;
    if constexpr (F == QK_I4) {
        float xs = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float4 lo = *(const float4 *)(x + 4 * k), hi = *(const float4 *)(x + 16 + 4 * k);
            float l[4] = {lo.x, lo.y, lo.z, lo.w}, h[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint32_t b = (q[k] >> (8 * j)) & 0xffu;
                s += qk_u2f(b & 15u) * l[j] + qk_u2f(b >> 4) * h[j];
                xs += l[j] + h[j];
            }
        }
        return sc.x * s + sc.y * xs;
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float4 a = *(const float4 *)(x + 4 * k);
            float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint32_t b = (q[k] >> (8 * j)) & 0xffu;
                s += (F == QK_I8 ? __uint_as_float(0x4B000000u | (b ^ 0x80u)) - 8388736.0f : qk_e4m3(b)) * v[j]; // int8: b ^ 0x80 is q + 128
            }
        }
        return sc.x * s;
    }
}
// The first input of unit u.
template <int F>
__device__ __forceinline__ int qk_ucol(int u) { return F == QK_I4 ? 32 * u : 16 * u; }

// The unit pointer of row i of a matrix in format F.
template <int F>
__device__ __forceinline__ const uint8_t *qk_row(const void *m, int64_t i, int cols) {
    return (const uint8_t *)m + i * qk_row_bytes(F, cols);
}
// An fp8 row's band of scales (NULL for the other formats).
template <int F>
__device__ __forceinline__ const float *qk_band(const void *m, int64_t rows, int64_t i, int cols) {
    if constexpr (F == QK_F8) return qk_fp8_scales(m, rows, cols) + (i / 128) * ((cols + 127) / 128);
    return nullptr;
}

} // namespace qfc
