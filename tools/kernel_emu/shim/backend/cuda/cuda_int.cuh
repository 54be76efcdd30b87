// What kernels see of the CUDA backend (cuda_int.cuh), for running them on the CPU one block at a
// time (tools/kernel_emu): a thread a std::thread, __syncthreads a barrier, warp shuffles through a
// buffer a warp, shared memory as statics, atomics under a lock. Checks kernel logic, not speed.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <algorithm>
extern "C" {
#include "backend/ops.h"
#include "base/numeric.h"
}
struct dim { unsigned x, y, z; };
extern thread_local dim threadIdx;
extern dim blockIdx, gridDim, blockDim;
extern std::barrier<> *g_bar;
extern std::barrier<> *w_bar[32];
extern uint64_t w_buf[32][32];
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
template <class T> static inline uint64_t to64(T v) { uint64_t u = 0; memcpy(&u, &v, sizeof v); return u; }
template <class T> static inline T from64(uint64_t u) { T v; memcpy(&v, &u, sizeof v); return v; }
template <class T> static T shfl(T v, int src) {
    int lane = threadIdx.x & 31, w = threadIdx.x / 32;
    w_buf[w][lane] = to64(v);
    w_bar[w]->arrive_and_wait();
    T r = from64<T>(w_buf[w][src & 31]);
    w_bar[w]->arrive_and_wait();
    return r;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int o) { return shfl(v, (threadIdx.x & 31) ^ o); }
template <class T> static T __shfl_sync(unsigned, T v, int o) { return shfl(v, o); }
template <class T> static T __shfl_up_sync(unsigned, T v, int o) { int l = threadIdx.x & 31; return shfl(v, l - o < 0 ? l : l - o); }
template <class T> static T __ldcs(const T *p) { return *p; }
#include <mutex>
extern std::mutex g_mu;
template <class T> static T atomicAdd(T *p, T v) {
    std::lock_guard<std::mutex> g(g_mu);
    T o = *p;
    *p += v;
    return o;
}
static inline void __syncwarp() { w_bar[threadIdx.x / 32]->arrive_and_wait(); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
namespace qfc {
struct ctx;
static inline void pdl_launch() {}
static inline void pdl_wait() {}
static inline float bf16f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
void dev_fail(ctx *c, const char *fmt, ...);
}
using std::min;
using std::max;
