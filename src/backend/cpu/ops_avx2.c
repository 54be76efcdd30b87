/* AVX2 + FMA instance of ops_simd.inc (8 floats per vector). */
#include <immintrin.h>

#include "backend/ops.h"

#pragma GCC target("avx2,fma,f16c")

typedef __m256 V;
#define W            8
#define VZERO()      _mm256_setzero_ps()
#define VLOAD(p)     _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x)     _mm256_set1_ps(x)
#define VADD(a, b)   _mm256_add_ps(a, b)
#define VMUL(a, b)   _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
/* W bytes widened to 32-bit lanes, and the few integer ops the quantised loads need */
typedef __m256i VI;
#define VLOAD_I8(p)   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VLOAD_U8I(p)  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_AND(a, k)  _mm256_and_si256(a, _mm256_set1_epi32(k))
#define VI_OR(a, b)   _mm256_or_si256(a, b)
#define VI_SRL(a, n)  _mm256_srli_epi32(a, n)
#define VI_SLL(a, n)  _mm256_slli_epi32(a, n)
#define VI_TOPS(a)    _mm256_cvtepi32_ps(a)
#define VI_CAST(a)    _mm256_castsi256_ps(a)
#define VSUB(a, b)    _mm256_sub_ps(a, b)
#define VDIV(a, b)    _mm256_div_ps(a, b)
#define VMAX(a, b)    _mm256_max_ps(a, b)
#define VMIN(a, b)    _mm256_min_ps(a, b)
#define VTO_I(a)      _mm256_cvtps_epi32(a) /* to nearest */
#define VI_ADD(a, b)  _mm256_add_epi32(a, b)
#define VI_BITS(a)    _mm256_castps_si256(a)
#define VI_LANES_X(k) _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(k))
#define VGATHER(p, idx) _mm256_i32gather_ps(p, idx, 4)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VHSUM(v)  hsum8(v)
#define SIMD_NAME avx2
#define OPS_NAME  "cpu-avx2"

#include "backend/cpu/ops_simd.inc"

const qf_ops *qf_cpu_ops_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? &avx2_table : NULL;
}
