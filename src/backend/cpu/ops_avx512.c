/* AVX-512F instance of ops_simd.inc (16 floats per vector). */
#include <immintrin.h>

#include "backend/ops.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

typedef __m512 V;
#define W            16
#define VZERO()      _mm512_setzero_ps()
#define VLOAD(p)     _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x)     _mm512_set1_ps(x)
#define VADD(a, b)   _mm512_add_ps(a, b)
#define VMUL(a, b)   _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VHSUM(v)     _mm512_reduce_add_ps(v)
#define VLOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
typedef __m512i VI;
#define VLOAD_I8(p)   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VLOAD_U8I(p)  _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_AND(a, k)  _mm512_and_si512(a, _mm512_set1_epi32(k))
#define VI_OR(a, b)   _mm512_or_si512(a, b)
#define VI_SRL(a, n)  _mm512_srli_epi32(a, n)
#define VI_SLL(a, n)  _mm512_slli_epi32(a, n)
#define VI_TOPS(a)    _mm512_cvtepi32_ps(a)
#define VI_CAST(a)    _mm512_castsi512_ps(a)
#define VSUB(a, b)    _mm512_sub_ps(a, b)
#define VDIV(a, b)    _mm512_div_ps(a, b)
#define VMAX(a, b)    _mm512_max_ps(a, b)
#define VMIN(a, b)    _mm512_min_ps(a, b)
#define VTO_I(a)      _mm512_cvtps_epi32(a) /* to nearest */
#define VI_ADD(a, b)  _mm512_add_epi32(a, b)
#define VI_BITS(a)    _mm512_castps_si512(a)
#define VI_LANES_X(k) _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(k))
#define VGATHER(p, idx) _mm512_i32gather_ps(idx, p, 4)
#define SIMD_NAME    avx512
#define OPS_NAME     "cpu-avx512"

#include "backend/cpu/ops_simd.inc"

const qf_ops *qf_cpu_ops_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? &avx512_table : NULL;
}
