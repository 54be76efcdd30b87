/* Scalar conversions for the storage dtypes. bf16 is the upper half of an fp32; f16 is IEEE half. */
#ifndef QF_BASE_NUMERIC_H
#define QF_BASE_NUMERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The widest attention head the backends take (the CPU attention keeps one head's partial on the
 * stack); a config with a wider one is refused at load. */
#define QF_MAX_HEAD_DIM 512

static inline float qf_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as PyTorch does; NaN stays NaN. */
static inline uint16_t qf_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float qf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; overflow to infinity, NaN stays NaN. */
static inline uint16_t qf_f32_to_f16(float f) {
    uint16_t s = signbit(f) ? 0x8000 : 0;
    float a = fabsf(f);
    if (isnan(f)) return 0x7e00;
    if (a >= 65520.0f) return s | 0x7c00;
    if (a < ldexpf(1.0f, -14)) return s | (uint16_t)lrintf(a * ldexpf(1.0f, 24)); /* subnormal, to nearest even */
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    uint32_t q = (uint32_t)lrintf(ldexpf(m, 11));   /* 11 significant bits, to nearest even */
    if (q == 2048) q = 1024, e++;
    return s | (uint16_t)((e + 14) << 10) | (uint16_t)(q & 1023);
}

/* The greedy pick: the first index of the largest of x[0..n) (NaNs never win). */
static inline int32_t qf_argmax_f32(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

#endif
