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

// x[0..n) of shared memory read as float4s starting at a lane-dependent one (fewer bank conflicts).
template <int N4>
__device__ __forceinline__ void qk_xs(const float *x, int lane, float (&v)[4 * N4]) {
#pragma unroll
    for (int k = 0; k < N4; k++) {
        int j = (k + lane) % N4;
        float4 a = *(const float4 *)(x + 4 * j);
        v[4 * j] = a.x, v[4 * j + 1] = a.y, v[4 * j + 2] = a.z, v[4 * j + 3] = a.w;
    }
}

// Unit u of a row (row: the row's first byte; x: the row's input) dotted with x.
template <int F>
__device__ __forceinline__ float qk_unit(uint4 w, const uint8_t *row, int cols, int u, const float *x, const float *f8s, int lane) {
    uint32_t q[4] = {w.x, w.y, w.z, w.w};
    if constexpr (F == QK_I4) {
        float xv[32], s = 0.0f, xs = 0.0f;
        qk_xs<8>(x + 32 * u, lane, xv);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint32_t b = (q[j / 4] >> (8 * (j % 4))) & 0xffu;
            s += (float)(b & 15u) * xv[j] + (float)(b >> 4) * xv[j + 16];
            xs += xv[j] + xv[j + 16];
        }
        int nb = cols / 32;
        return qk_f16(row + 2 * u) * s + qk_f16(row + 2 * nb + 2 * u) * xs;
    } else {
        float xv[16], s = 0.0f;
        qk_xs<4>(x + 16 * u, lane, xv);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint32_t b = (q[j / 4] >> (8 * (j % 4))) & 0xffu;
            s += (F == QK_I8 ? (float)(int8_t)b : qk_e4m3(b)) * xv[j];
        }
        return F == QK_I8 ? qk_f16(row + 2 * (u / 2)) * s : s * 0x1p120f * f8s[u / 8];
    }
}

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
