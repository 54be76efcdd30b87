// Fused kernels for decode steps (one token per sequence, at most QF_DEC_ROWS sequences). Each
// replaces a chain of plain ops (ops.h names it) so a layer runs as 6-7 kernels instead of ~20:
// at batch 1 a 35B-A3B step is ~250 launches, and each launch boundary costs a few microseconds
// of an otherwise bandwidth-bound step. tests/test_cuda.c checks every one against its chain.
#include "backend/cuda/cuda_int.cuh"
#include "backend/cuda/bulk.cuh"

namespace {

using namespace qfc;

#define PW 2 // rows per warp in the fused products

struct dpre {
    int kind;
    const float *w, *g;
    int g_stride, g_hstride, head;
    float eps;
    int wide; // one row of GATED_NORM / SIGMOID that stage_wide can stage (dec_matmul checks the shape; one-row products of few rows use it)
};

// The device's copy of a pre (NULL: none); wide is set by the caller that checked the shape.
dpre dpre_of(const qf_pre *pre) {
    if (!pre) return {QF_PRE_NONE, NULL, NULL, 0, 0, 1, 0.0f, 0};
    return {pre->kind, pre->w, pre->g, pre->g_stride, pre->g_hstride, pre->head > 0 ? pre->head : 1, pre->eps, 0};
}

struct depi {
    int on, conv_dim, z_dim, nv, K;
    const float *conv_w, *dt_bias, *neg_A;
    float *st[QF_DEC_ROWS];
};

// Sum over the block; every thread gets it. red: 32 floats of shared memory.
__device__ float block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = (blockDim.x + 31) / 32;
    v = warp_sum(v);
    __syncthreads(); // red may still be read by an earlier call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += red[i];
    return t;
}

// pre(x) of NT contiguous rows of cols floats into shared memory xs. RMSNORM stages x * w only and
// leaves each row's sum of squares per warp in red[t * 32 + warp]: the row's 1/rms scales the
// finished dot products (row_scale), so no block-wide reduction stands before the first load.
// Every loop issues SU loads before it uses one: one memory latency per SU elements, not each.
#define PRE_MAX_HEADS 64 // GATED_NORM / SIGMOID heads per row that red holds
#define HD_REG 8         // a head's elements per lane that stage_heads keeps in registers (heads <= 256)

// GATED_NORM / SIGMOID of heads <= 32 * HD_REG wide: a warp per (row, head) loads the head, its
// gate and weight at once, takes the head's 1/rms and writes the gated values, so no element
// pays the index divisions of the general loop (they were most of a DeltaNet out_proj's time).
__device__ void stage_heads(const float *__restrict__ x, int n, int cols, const dpre &p, float *xs) {
    int lane = threadIdx.x & 31, heads = cols / p.head, gated = p.kind == QF_PRE_GATED_NORM;
    for (int th = threadIdx.x / 32; th < n * heads; th += blockDim.x / 32) {
        int t = th / heads, hh = th - t * heads;
        const float *xv = x + (int64_t)t * cols + (int64_t)hh * p.head, *gv = p.g + (int64_t)t * p.g_stride + (int64_t)hh * p.g_hstride;
        float v[HD_REG], g[HD_REG], w[HD_REG], ss = 0.0f;
#pragma unroll
        for (int u = 0; u < HD_REG; u++) {
            int d = lane + 32 * u;
            if (d < p.head) v[u] = xv[d], g[u] = gv[d], w[u] = gated ? p.w[d] : 1.0f;
        }
#pragma unroll
        for (int u = 0; u < HD_REG; u++)
            if (lane + 32 * u < p.head) ss += v[u] * v[u];
        float inv = gated ? 1.0f / sqrtf(warp_sum(ss) / (float)p.head + p.eps) : 0.0f;
        float *o = xs + (int64_t)t * cols + (int64_t)hh * p.head;
#pragma unroll
        for (int u = 0; u < HD_REG; u++) {
            int d = lane + 32 * u;
            if (d < p.head) o[d] = gated ? silu(g[u]) * (v[u] * inv * w[u]) : v[u] * sigmoid(g[u]);
        }
    }
    __syncthreads();
}
// One row of GATED_NORM / SIGMOID whose heads are multiples of 128 columns that divide 4 * 256
// (out_proj, o_proj): thread i holds float4s i + 256 u of x and of the gate, every load issued at
// once (one memory latency for the row; a warp per head walked the heads one latency each). A
// warp's float4s of one u lie in one head, so its sum of squares is a warp sum per 128 columns
// (red[q]) and a head's the sum of its parts; the norm weight is one float4 per thread.
#define SW_MAX 4 // float4s of a row per thread: 4096 columns at 256 threads
__device__ void stage_wide(const float *__restrict__ x, int cols, const dpre &p, float *xs, float *red) {
    int tid = threadIdx.x, nt = blockDim.x, f = cols / (4 * nt), hw4 = p.head / 4, gated = p.kind == QF_PRE_GATED_NORM;
    float4 v[SW_MAX], g[SW_MAX], w = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
#pragma unroll
    for (int u = 0; u < SW_MAX; u++) {
        int i = tid + u * nt, h = i / hw4;
        if (u < f) v[u] = ((const float4 *)x)[i], g[u] = *(const float4 *)(p.g + (int64_t)h * p.g_hstride + (i - h * hw4) * 4);
    }
    if (gated) {
        w = *(const float4 *)(p.w + (tid % hw4) * 4);
#pragma unroll
        for (int u = 0; u < SW_MAX; u++) {
            float ss = u < f ? v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w : 0.0f;
            ss = warp_sum(ss);
            if (u < f && (tid & 31) == 0) red[(tid + u * nt) / 32] = ss;
        }
        __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < SW_MAX; u++) {
        if (u >= f) continue;
        int i = tid + u * nt, h = i / hw4;
        float4 o;
        if (gated) {
            float ss = 0.0f;
            for (int q = h * (hw4 / 32); q < (h + 1) * (hw4 / 32); q++) ss += red[q];
            float inv = 1.0f / sqrtf(ss / (float)p.head + p.eps);
            o = make_float4(silu(g[u].x) * v[u].x * inv * w.x, silu(g[u].y) * v[u].y * inv * w.y, silu(g[u].z) * v[u].z * inv * w.z,
                            silu(g[u].w) * v[u].w * inv * w.w);
        } else {
            o = make_float4(v[u].x * sigmoid(g[u].x), v[u].y * sigmoid(g[u].y), v[u].z * sigmoid(g[u].z), v[u].w * sigmoid(g[u].w));
        }
        ((float4 *)xs)[i] = o;
    }
    __syncthreads();
}

template <int NT, bool WIDE = false> // WIDE: stage_wide (a template flag: its registers stay out of the other kernels)
__device__ void stage(const float *__restrict__ x, int n, int cols, const dpre &p, float *xs, float *red) {
    constexpr int SU = NT <= 2 ? 4 : 8; // one row: 4 covers 4096 columns in one round and leaves registers to the early loads
    int tid = threadIdx.x, nt = blockDim.x, c4 = cols / 4;
    const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)p.w;
    float4 *s4 = (float4 *)xs;
    if (p.kind == QF_PRE_RMSNORM) {
#pragma unroll 1
        for (int t = 0; t < n; t++) {
            float ss = 0.0f;
            for (int i0 = tid; i0 < c4; i0 += nt * SU) {
                float4 v[SU], w[SU];
#pragma unroll
                for (int u = 0; u < SU; u++)
                    if (i0 + u * nt < c4) v[u] = x4[t * c4 + i0 + u * nt], w[u] = w4[i0 + u * nt];
#pragma unroll
                for (int u = 0; u < SU; u++)
                    if (i0 + u * nt < c4) {
                        ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
                        s4[t * c4 + i0 + u * nt] = make_float4(v[u].x * w[u].x, v[u].y * w[u].y, v[u].z * w[u].z, v[u].w * w[u].w);
                    }
            }
            ss = warp_sum(ss);
            if ((tid & 31) == 0) red[t * 32 + tid / 32] = ss;
        }
        __syncthreads();
        return;
    }
    if constexpr (WIDE) {
        stage_wide(x, cols, p, xs, red);
        return;
    }
    if ((p.kind == QF_PRE_GATED_NORM || p.kind == QF_PRE_SIGMOID) && p.head <= 32 * HD_REG) {
        stage_heads(x, n, cols, p, xs);
        return;
    }
    for (int i0 = tid; i0 < n * c4; i0 += nt * SU) {
        float4 v[SU];
#pragma unroll
        for (int u = 0; u < SU; u++)
            if (i0 + u * nt < n * c4) v[u] = x4[i0 + u * nt];
#pragma unroll
        for (int u = 0; u < SU; u++)
            if (i0 + u * nt < n * c4) s4[i0 + u * nt] = v[u];
    }
    __syncthreads();
    int heads = cols / p.head;
    if (p.kind == QF_PRE_GATED_NORM) { // 1/rms per (row, head) from shared memory, a warp each
        int lane = tid & 31;
        for (int th = tid / 32; th < n * heads; th += nt / 32) {
            const float *v = xs + (th / heads) * cols + (th % heads) * p.head;
            float ss = 0.0f;
            for (int i = lane; i < p.head; i += 32) ss += v[i] * v[i];
            ss = warp_sum(ss);
            if (lane == 0) red[th] = 1.0f / sqrtf(ss / (float)p.head + p.eps);
        }
        __syncthreads();
    }
    if (p.kind == QF_PRE_GATED_NORM || p.kind == QF_PRE_SIGMOID) { // then every element with its gate
        for (int i0 = tid; i0 < n * cols; i0 += nt * SU) {
            float g[SU], w[SU];
#pragma unroll
            for (int u = 0; u < SU; u++) {
                int i = i0 + u * nt, t = i / cols, c = i % cols;
                if (i < n * cols) {
                    g[u] = p.g[(int64_t)t * p.g_stride + (int64_t)(c / p.head) * p.g_hstride + c % p.head];
                    w[u] = p.kind == QF_PRE_GATED_NORM ? p.w[c % p.head] : 1.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < SU; u++) {
                int i = i0 + u * nt, t = i / cols, c = i % cols;
                if (i >= n * cols) continue;
                if (p.kind == QF_PRE_GATED_NORM) xs[i] = silu(g[u]) * (xs[i] * red[t * heads + c / p.head] * w[u]);
                else xs[i] *= sigmoid(g[u]);
            }
        }
    }
    __syncthreads();
}

// 1/rms of row t from stage's per-warp sums (1 for the other kinds).
__device__ __forceinline__ float row_scale(const dpre &p, const float *red, int t, int cols) {
    if (p.kind != QF_PRE_RMSNORM) return 1.0f;
    float ss = 0.0f;
    for (int w = 0; w < (int)blockDim.x / 32; w++) ss += red[t * 32 + w];
    return 1.0f / sqrtf(ss / (float)cols + p.eps);
}

// dot8 with x in shared memory: lanes 4-7 of each quarter-warp read the high half first, so the
// eight 16-byte reads of a phase fall in distinct banks (32-byte strides otherwise pair them up).
__device__ __forceinline__ float dot8s(uint4 w, const float *x, int lane) {
    int sw = (lane >> 2) & 1;
    float4 p = *(const float4 *)(x + 4 * sw), q = *(const float4 *)(x + 4 - 4 * sw);
    float4 a = sw ? q : p, b = sw ? p : q;
    return bf16f(w.x & 0xffff) * a.x + bf16f(w.x >> 16) * a.y + bf16f(w.y & 0xffff) * a.z + bf16f(w.y >> 16) * a.w +
           bf16f(w.z & 0xffff) * b.x + bf16f(w.z >> 16) * b.y + bf16f(w.w & 0xffff) * b.z + bf16f(w.w >> 16) * b.w;
}

// dot8 with x in registers (a: columns 0-3, b: 4-7), summed in dot8s's order.
__device__ __forceinline__ float dot8r(uint4 w, float4 a, float4 b) {
    return bf16f(w.x & 0xffff) * a.x + bf16f(w.x >> 16) * a.y + bf16f(w.y & 0xffff) * a.z + bf16f(w.y >> 16) * a.w +
           bf16f(w.z & 0xffff) * b.x + bf16f(w.z >> 16) * b.y + bf16f(w.w & 0xffff) * b.z + bf16f(w.w >> 16) * b.w;
}

// The DeltaNet decay gate of an in_proj row (ops.h gdn_gates; beta is the row's sigmoid).
__device__ __forceinline__ float decay_gate(float v, float dt_bias, float neg_A) {
    float u = v + dt_bias;
    return neg_A * (u > 20.0f ? u : log1pf(expf(u)));
}

// What a DeltaNet in_proj row becomes (ops.h qf_gdn_epi): conv channel, z, beta or decay gate.
__device__ float epi_value(const depi &e, int t, int row, float v) {
    if (row < e.conv_dim) {
        float *st = e.st[t], acc = 0.0f;
        const float *w = e.conv_w + (int64_t)row * e.K;
        int64_t cd = e.conv_dim;
        for (int j = 0; j < e.K - 1; j++) acc += w[j] * st[j * cd + row];
        acc += w[e.K - 1] * v;
        for (int j = 0; j + 1 < e.K - 1; j++) st[j * cd + row] = st[(j + 1) * cd + row];
        if (e.K > 1) st[(e.K - 2) * cd + row] = v;
        return silu(acc);
    }
    int b0 = e.conv_dim + e.z_dim;
    if (row < b0) return v;
    if (row < b0 + e.nv) return sigmoid(v);
    return decay_gate(v, e.dt_bias[row - b0 - e.nv], e.neg_A[row - b0 - e.nv]);
}

// What a one-row product's row end needs besides its sum (a residual, the DeltaNet epilogue's conv
// weights and state or gate constants), loaded for the warp's rows at once, row r0 + l in lane
// l: one memory latency per warp instead of one per row, during which the other 31 lanes wait.
#define EPI_K 4 // conv taps kept in registers; longer convs read memory at the row's end
struct row_in {
    float y, w[EPI_K], st[EPI_K - 1], bias, negA;
};

__device__ __forceinline__ void row_in_load(const depi &e, int acc, const float *y, int row, row_in &r) {
    r.y = acc ? y[row] : 0.0f;
    if (!e.on) return;
    int b0 = e.conv_dim + e.z_dim;
    if (row < e.conv_dim && e.K <= EPI_K) { // constant indices (guarded) keep r in registers
#pragma unroll
        for (int j = 0; j < EPI_K; j++)
            if (j < e.K) r.w[j] = e.conv_w[(int64_t)row * e.K + j];
#pragma unroll
        for (int j = 0; j < EPI_K - 1; j++)
            if (j < e.K - 1) r.st[j] = e.st[0][(int64_t)j * e.conv_dim + row];
    } else if (row >= b0 + e.nv && row < b0 + 2 * e.nv) {
        r.bias = e.dt_bias[row - b0 - e.nv], r.negA = e.neg_A[row - b0 - e.nv];
    }
}

// epi_value (one row, t = 0) from what row_in_load put in registers.
__device__ __forceinline__ float row_epi(const depi &e, int row, float v, const row_in &r) {
    if (row < e.conv_dim) {
        if (e.K > EPI_K) return epi_value(e, 0, row, v);
        float acc = 0.0f, *st = e.st[0];
#pragma unroll
        for (int j = 0; j < EPI_K; j++) // taps over the K - 1 carried inputs, then the new one
            if (j < e.K - 1) acc += r.w[j] * r.st[j];
            else if (j == e.K - 1) acc += r.w[j] * v;
#pragma unroll
        for (int j = 0; j < EPI_K - 1; j++) // the carried inputs shift by one; v becomes the last
            if (j + 1 < e.K - 1) st[(int64_t)j * e.conv_dim + row] = r.st[j + 1];
            else if (j == e.K - 2) st[(int64_t)j * e.conv_dim + row] = v;
        return silu(acc);
    }
    int b0 = e.conv_dim + e.z_dim;
    if (row < b0) return v;
    if (row < b0 + e.nv) return sigmoid(v);
    return decay_gate(v, r.bias, r.negA);
}

// Diagnostics (QFLASH_CUDA_SKIP, a bit mask): a kernel whose bit is set returns at once, so a
// replayed step shows what each kind of kernel costs in place (results are then garbage).
enum { SK_OUT = 1, SK_LMHEAD = 2, SK_FFNIN = 4, SK_IN = 8, SK_GDN = 16, SK_ATTN = 32, SK_MOE_GU = 64, SK_MOE_DN = 128, SK_ARGMAX = 256 };
// The diagnostic switches share one constant word pair: a kernel's first constant read fetches both.
struct diag {
    unsigned skip, trace_cap; // QFLASH_CUDA_SKIP's mask; stamps the trace may take (0: off)
};
__constant__ diag g_diag;
__device__ __forceinline__ bool skipped(unsigned bit) { return (g_diag.skip & bit) != 0; }

// Diagnostics (QFLASH_CUDA_TRACE=1 in a build with -DQFLASH_CUDA_TRACE=ON): in one replayed step,
// thread 0 of every block of the decode kernels stamps the global timer at the block's start, when
// its wait returns, at its end and at the phases of the one-kernel MoE (trace_cuda.cu prints the
// step's timeline from them). Every traced kernel stamps TR_START first and TR_END last.
// Compiled out by default: even switched off, the checks cost ~5% of a step (measured), so only
// trace builds carry them.
__device__ trec *g_trace;
__device__ unsigned g_trace_n;
#ifdef QF_CUDA_TRACE
// The block's stamps wait in shared memory (one slot per event; 0: not taken) and go out at its
// end with one atomic for all of them, so a stamp costs a register move, not a memory round trip;
// only the block's exit is later by that one atomic.
__device__ __forceinline__ unsigned long long *tr_slots() {
    __shared__ unsigned long long slot[TR_EVENTS];
    return slot;
}
__device__ void tr_flush(unsigned tag) {
    unsigned long long *slot = tr_slots();
    unsigned n = 0, sm, b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x, g = gridDim.x * gridDim.y * gridDim.z;
    for (int ev = 0; ev < TR_EVENTS; ev++) n += slot[ev] != 0;
    unsigned i = atomicAdd(&g_trace_n, n);
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    for (int ev = 0; ev < TR_EVENTS; ev++)
        if (slot[ev] && i < g_diag.trace_cap) g_trace[i++] = {slot[ev], (unsigned short)tag, (unsigned char)ev, (unsigned char)sm, b, g};
}
__device__ __forceinline__ void tr(unsigned tag, unsigned ev) {
    if (!g_diag.trace_cap || threadIdx.x) return;
    unsigned long long *slot = tr_slots(), t;
    if (ev == TR_START)
        for (int e = 0; e < TR_EVENTS; e++) slot[e] = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    slot[ev] = t;
    if (ev == TR_END) tr_flush(tag);
}
// After every warp of the block has come this far.
__device__ __forceinline__ void tr_sync(unsigned tag, unsigned ev) {
    if (!g_diag.trace_cap) return;
    __syncthreads();
    tr(tag, ev);
}
#else
__device__ __forceinline__ void tr(unsigned, unsigned) {}
__device__ __forceinline__ void tr_sync(unsigned, unsigned) {}
#endif
__device__ __forceinline__ void tr_end(unsigned tag) { tr_sync(tag, TR_END); }

// which product a shape is in a Qwen3.5/3.6 step (hidden 2048..): out/o_proj, lm_head, router + shared gate/up, in/qkv projections
__host__ __device__ __forceinline__ unsigned gemv_bit(int rows, int cols) {
    return rows >= 65536 ? SK_LMHEAD : cols > 2048 ? SK_OUT : rows < 4096 ? SK_FFNIN : SK_IN;
}

// y[t][row] (= or +=) W[row] . pre(x[t]): bf16 W (cols % 8 == 0), x staged once per block, the
// blocks striding over groups of rows so the staging is paid once per resident block.
// early: the warp's first loads go out before the wait for the kernel before and the staging
// (weights never depend on them), so their memory latency overlaps both.
template <int NT, int PWT, bool WIDE = false> // PWT rows per warp (PW; 1 for one-row products of few rows: twice the warps); WIDE: stage_wide
__global__ void __launch_bounds__(256, 2) k_gemv_pre(const uint16_t *__restrict__ W, int rows, int cols, const float *__restrict__ x, int n, dpre p,
                                                     depi e, int acc, float *__restrict__ y, int early) {
    if (skipped(gemv_bit(rows, cols))) return;
    tr(gemv_bit(rows, cols), TR_START);
    constexpr int CU = PWT == 1 ? 16 : NT <= 2 ? 8 : 4; // 16-byte loads per lane and row in flight: one row is bound by them, more rows by the FMAs
    extern __shared__ float4 dyn[];
    __shared__ float red[NT * PRE_MAX_HEADS];
    float *xs = (float *)dyn;
    int warps = blockDim.x / 32, lane = threadIdx.x & 31, n8 = cols / 8, row0 = (blockIdx.x * warps + threadIdx.x / 32) * PWT;
    uint4 v[CU][PWT];
    auto load = [&](int nr, int cb) {
#pragma unroll
        for (int u = 0; u < CU; u++) {
            int c = cb + lane + 32 * u;
#pragma unroll
            for (int r = 0; r < PWT; r++) v[u][r] = r < nr && c < n8 ? __ldcs((const uint4 *)(W + (int64_t)(row0 + r) * cols) + c) : make_uint4(0, 0, 0, 0);
        }
    };
    int have = early && row0 < rows;
    if (have) load(min(PWT, rows - row0), 0);
    else if (row0 < rows) // the warp's first row streams into L2 while the kernel before ends and x is staged
        for (int l = lane * 64; l < cols; l += 32 * 64) asm volatile("prefetch.global.L2 [%0];" ::"l"(W + (int64_t)row0 * cols + l));
    pdl_wait();
    tr(gemv_bit(rows, cols), TR_WAIT);
    pdl_launch();
    stage<NT, WIDE>(x, n, cols, p, xs, red);
    float sc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) sc[t] = t < n ? row_scale(p, red, t, cols) : 0.0f;
    for (; row0 < rows; row0 += gridDim.x * warps * PWT) {
        int nr = min(PWT, rows - row0);
        row_in ri = {}; // one row: lane r holds row row0 + r's end inputs, loaded with the weights
        if (NT == 1 && lane < nr && (e.on || acc)) row_in_load(e, acc, y, row0 + lane, ri);
        float a[PWT][NT];
#pragma unroll
        for (int r = 0; r < PWT; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) a[r][t] = 0.0f;
        for (int cb = 0; cb < n8; cb += 32 * CU) {
            if (!have) load(nr, cb);
            have = 0;
#pragma unroll
            for (int u = 0; u < CU; u++) {
                int c = cb + lane + 32 * u;
                if (c < n8)
#pragma unroll
                    for (int t = 0; t < NT; t++)
                        if (t < n) // shared memory holds n rows
#pragma unroll
                            for (int r = 0; r < PWT; r++) a[r][t] += dot8s(v[u][r], xs + t * cols + c * 8, lane);
            }
        }
#pragma unroll
        for (int r = 0; r < PWT; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float s = warp_sum(a[r][t]) * sc[t]; // every lane has it
                if (NT == 1 && (e.on || acc)) {
                    if (lane == r && r < nr) {
                        if (e.on) s = row_epi(e, row0 + r, s, ri);
                        y[row0 + r] = acc ? ri.y + s : s;
                    }
                } else if (lane == 0 && r < nr && t < n) {
                    int64_t o = (int64_t)t * rows + row0 + r;
                    if (e.on) s = epi_value(e, t, row0 + r, s);
                    y[o] = acc ? y[o] + s : s;
                }
            }
    }
    if constexpr (NT <= 12) tr_end(gemv_bit(rows, cols)); // more rows: no registers left for it (it would spill)
}

// ---- one-row products that stream their weights ----
// At one row a product is bound by how soon and how deep its weight loads go out, not by
// arithmetic. Each warp owns a contiguous run of whole rows and copies it through its own ring of
// SR 512-byte slots (cp.async: each lane copies and later reads its own 16 bytes, so warps never
// wait for each other), and the first SR slots are asked for before the kernel waits for the one
// before it: weights never depend on it. One block of ~105-115 KB per SM leaves room beside it for
// the next kernel's block, which does the same while this one finishes.
#define SR 24 // slots per warp: 12 KB per warp, 96 KB per SM in flight (two blocks of ~110 KB still fit an SM)
#define RU 4  // slots used per round of the loop

// The share [*lo, *hi) of n items of warp `warp` of the block among all the grid's warps.
__device__ __forceinline__ void warp_share(int n, int *lo, int *hi) {
    int64_t warps = blockDim.x / 32, gw = (int64_t)blockIdx.x * warps + threadIdx.x / 32, tw = (int64_t)gridDim.x * warps;
    *lo = (int)(n * gw / tw), *hi = (int)(n * (gw + 1) / tw);
}

size_t stream_ring_bytes(int threads) { return (size_t)threads / 32 * SR * 512; }

// Blocks of a streamed kernel: one per SM (two with QFLASH_CUDA_STREAM_BLOCKS=2).
unsigned stream_grid(const ctx *c) { return (unsigned)(c->sms > 0 ? c->sms : 1) * (unsigned)c->stream_blocks; }

// A warp's first SR slots (of ne) asked for at once: next() gives the lane's 16-byte source of
// each slot in turn. One commit group per slot, empty or not, so ring_drain's count holds.
template <class Next>
__device__ __forceinline__ void ring_fill(uint4 *ring, int ne, Next &next) {
#pragma unroll 1
    for (int i = 0; i < SR; i++) {
        if (i < ne) cp16(ring + i * 32, next());
        cp_commit();
    }
}

// Every slot in order: use() takes the lane's 16 bytes, then the slot SR further is asked for in
// its place (next() continues where ring_fill stopped).
template <class Next, class Use>
__device__ __forceinline__ void ring_drain(uint4 *ring, int ne, Next &next, Use &use) {
    for (int e0 = 0; e0 < ne; e0 += RU) {
        cp_wait<SR - RU>(); // slots e0 .. e0 + RU - 1 have landed
#pragma unroll
        for (int u = 0; u < RU; u++) {
            int e = e0 + u;
            if (e < ne) {
                use(ring[(e % SR) * 32]);
                if (e + SR < ne) cp16(ring + (e % SR) * 32, next());
            }
            cp_commit();
        }
    }
}

// y[row] (= or +=) W[row] . pre(x) for one row of x: the warp's rows are one contiguous run of
// (r1 - r0) * cols / 256 slots; lane l holds 8 columns of each (cols % 256 == 0).
__global__ void __launch_bounds__(256, 2) k_gemv_stream(const uint16_t *__restrict__ W, int rows, int cols, const float *__restrict__ x, dpre p,
                                                        depi ep, int acc, float *__restrict__ y) {
    if (skipped(gemv_bit(rows, cols))) return;
    extern __shared__ float4 dyn[];
    __shared__ float red[PRE_MAX_HEADS];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, r0, r1;
    uint4 *ring = (uint4 *)dyn + warp * SR * 32 + lane;
    float *xs = (float *)((uint4 *)dyn + blockDim.x / 32 * SR * 32);
    warp_share(rows, &r0, &r1);
    int epr = cols / 256, ne = (r1 - r0) * epr;
    const uint4 *src = (const uint4 *)(W + (int64_t)r0 * cols) + lane; // the warp's rows are one run
    auto next = [&]() {
        const uint4 *at = src;
        src += 32;
        return at;
    };
    ring_fill(ring, ne, next);
    pdl_wait();
    pdl_launch();
    row_in ri = {};
    int cached = r1 - r0 <= 32; // more rows than lanes (large products, no epilogue): read at the row's end
    if (cached && r0 + lane < r1) row_in_load(ep, acc, y, r0 + lane, ri);
    stage<1>(x, 1, cols, p, xs, red);
    float sc = row_scale(p, red, 0, cols), a = 0.0f;
    int row = r0, c = 0;
    auto use = [&](uint4 w) {
        a += dot8s(w, xs + (c * 32 + lane) * 8, lane);
        if (++c < epr) return;
        float s = warp_sum(a) * sc; // every lane has it
        if (cached && lane == row - r0) {
            if (ep.on) s = row_epi(ep, row, s, ri);
            y[row] = acc ? ri.y + s : s;
        } else if (!cached && lane == 0) {
            if (ep.on) s = epi_value(ep, 0, row, s);
            y[row] = acc ? y[row] + s : s;
        }
        a = 0.0f, c = 0, row++;
    };
    ring_drain(ring, ne, next, use);
}

// ---- one-row products fed by bulk copies (sm_90: cp.async.bulk; QFLASH_CUDA_BULK, default in_proj/qkv) ----
// The register kernels above lose their time in rounds: a warp's next loads go out only after
// its last ones were used, so each of its ~3 rounds pays a full memory latency. Here each warp
// owns a ring of BK_SLOTS slots of 4 KB in shared memory that a single lane fills with one bulk
// copy per slot (the copy engine, not 32 lanes, moves the bytes: no per-load instructions), and
// refills a slot as soon as the warp has read it, so every warp keeps BK_SLOTS * 4 KB in flight
// from before the wait for the kernel before it to its last row. Warps never wait for each
// other: a warp's slots, barriers and rows are its own.
#define BK_SLOTS 3     // 12 KB a warp, 96 KB a block of 8 warps: two blocks (or one and the next kernel's) fit an SM
#define BK_UNITS 8     // 512-byte units (32 lanes x 16 bytes) per slot
#define BK_BYTES (BK_UNITS * 512)

// y[row] (= or +=) W[row] . pre(x) for one row of x: as k_gemv_stream, the warp's rows are one
// contiguous run of units (lane l holds 8 columns of each); EPR (cols / 256) known at compile time
// keeps the lane's x in registers (EPR 8: 64 floats) and a slot one row; EPR 0: any cols % 256,
// x read from shared memory.
template <int EPR>
__global__ void __launch_bounds__(256, 2) k_gemv_bulk(const uint16_t *__restrict__ W, int rows, int cols, const float *__restrict__ x, dpre p,
                                                      depi ep, int acc, float *__restrict__ y) {
    if (skipped(gemv_bit(rows, cols))) return;
    tr(gemv_bit(rows, cols), TR_START);
    extern __shared__ float4 dyn[];
    __shared__ float red[PRE_MAX_HEADS];
    __shared__ uint64_t bars[8 * BK_SLOTS];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, r0, r1;
    uint4 *ring = (uint4 *)dyn + warp * BK_SLOTS * BK_UNITS * 32;
    uint64_t *bar = bars + warp * BK_SLOTS;
    float *xs = (float *)((uint4 *)dyn + blockDim.x / 32 * BK_SLOTS * BK_UNITS * 32);
    warp_share(rows, &r0, &r1);
    int epr = EPR ? EPR : cols / 256, ne = (r1 - r0) * epr, nch = (ne + BK_UNITS - 1) / BK_UNITS;
    const char *src = (const char *)(W + (int64_t)r0 * cols);
    auto fill = [&](int ch) { // lane 0: chunk ch into its slot
        unsigned units = min(BK_UNITS, ne - ch * BK_UNITS);
        bulk_load(ring + (ch % BK_SLOTS) * BK_UNITS * 32, src + (int64_t)ch * BK_BYTES, units * 512, bar + ch % BK_SLOTS);
    };
    if (lane == 0) {
        for (int s = 0; s < BK_SLOTS; s++) mbar_init(bar + s);
        mbar_init_fence();
        for (int ch = 0; ch < min(BK_SLOTS, nch); ch++) fill(ch);
    }
    __syncwarp();
    pdl_wait();
    tr(gemv_bit(rows, cols), TR_WAIT);
    pdl_launch();
    row_in ri = {};
    int cached = r1 - r0 <= 32; // more rows than lanes (large products, no epilogue): read at the row's end
    if (cached && r0 + lane < r1) row_in_load(ep, acc, y, r0 + lane, ri);
    stage<1>(x, 1, cols, p, xs, red);
    float sc = row_scale(p, red, 0, cols), a = 0.0f;
    float4 xr[EPR == 8 ? 16 : 1];
    if constexpr (EPR == 8)
#pragma unroll
        for (int u = 0; u < 8; u++) xr[2 * u] = *(const float4 *)(xs + (u * 32 + lane) * 8), xr[2 * u + 1] = *(const float4 *)(xs + (u * 32 + lane) * 8 + 4);
    int row = r0, c = 0;
    auto finish = [&]() {
        float s = warp_sum(a) * sc; // every lane has it
        if (cached && lane == row - r0) {
            if (ep.on) s = row_epi(ep, row, s, ri);
            y[row] = acc ? ri.y + s : s;
        } else if (!cached && lane == 0) {
            if (ep.on) s = epi_value(ep, 0, row, s);
            y[row] = acc ? y[row] + s : s;
        }
        a = 0.0f, c = 0, row++;
    };
    for (int ch = 0; ch < nch; ch++) {
        const uint4 *slot = ring + (ch % BK_SLOTS) * BK_UNITS * 32 + lane;
        mbar_wait(bar + ch % BK_SLOTS, (ch / BK_SLOTS) & 1);
        if constexpr (EPR == 8) { // the slot is one whole row: all its loads at once
            uint4 w[8];
#pragma unroll
            for (int u = 0; u < 8; u++) w[u] = slot[u * 32];
#pragma unroll
            for (int u = 0; u < 8; u++) a += dot8r(w[u], xr[2 * u], xr[2 * u + 1]);
            finish();
        } else {
            int units = min(BK_UNITS, ne - ch * BK_UNITS);
#pragma unroll
            for (int u = 0; u < BK_UNITS; u++) {
                if (u >= units) break;
                a += dot8s(slot[u * 32], xs + (c * 32 + lane) * 8, lane);
                if (++c == epr) finish();
            }
        }
        __syncwarp();
        if (lane == 0 && ch + BK_SLOTS < nch) {
            fence_async_smem();
            fill(ch + BK_SLOTS);
        }
    }
    tr_end(gemv_bit(rows, cols));
}

size_t bulk_smem_bytes(int cols) { return (size_t)8 * BK_SLOTS * BK_BYTES + (size_t)cols * sizeof(float); }

// Blocks of a kernel resident per SM at this shared memory, asked once per kernel and size. The
// opt-in to dynamic shared memory is one value per kernel for every launch, so it is set to the
// largest size the kernel has been asked for (setting it to each new size in turn would leave it
// below an earlier, larger size that is then launched again).
int resident(ctx *c, const void *fn, int threads, size_t smem) {
    size_t most = smem;
    for (int i = 0; i < c->n_occ; i++) {
        if (c->occ[i].fn != fn) continue;
        if (c->occ[i].smem == smem) return c->occ[i].blocks;
        most = c->occ[i].smem > most ? c->occ[i].smem : most;
    }
    cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)most);
    int n = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem) != cudaSuccess || n < 1) n = 1;
    if (c->n_occ < (int)(sizeof c->occ / sizeof *c->occ)) c->occ[c->n_occ++] = {fn, smem, n};
    return n;
}

// Blocks per SM of a one-row decode kernel: all that fit, or QFLASH_CUDA_BPS (1 leaves half the
// SM to the next kernel's blocks, which a programmatic launch starts while this one ends).
int per_sm(const ctx *c, int n, int fit) { return n == 1 && c->bps > 0 && c->bps < fit ? c->bps : fit; }

template <int NT>
// n <= NT rows (the rows from n on are masked; called with n == NT)
void gemv_pre_launch(ctx *c, const qf_mat *w, const float *x, int n, const dpre &p, const depi &e, int acc, float *y) {
    size_t smem = (size_t)n * (size_t)w->cols * sizeof(float);
    int threads = 256, sms = c->sms > 0 ? c->sms : 1;
    // one row, few weight rows (out_proj, o_proj, the router): a warp per row, a whole row of up to
    // 4096 columns in flight per warp, so the SMs hold twice the warps (QFLASH_CUDA_PW1=0: off)
    int one = NT == 1 && c->pw1 && w->cols <= 32 * 16 * 8 && (w->rows + 8 * PW - 1) / (8 * PW) < 2 * sms;
    void (*k)(const uint16_t *, int, int, const float *, int, dpre, depi, int, float *, int) = k_gemv_pre<NT, PW>;
    if constexpr (NT == 1)
        if (one) k = p.wide ? k_gemv_pre<1, 1, true> : k_gemv_pre<1, 1>;
    int per_block = threads / 32 * (one ? 1 : PW);
    // no more blocks than fit at once: a second wave would pay the staging again, exposed
    int64_t need = (w->rows + per_block - 1) / per_block, cap = (int64_t)sms * per_sm(c, n, resident(c, (const void *)k, threads, smem));
    int64_t rounds = (need + cap - 1) / cap, grid = (need + rounds - 1) / rounds; // equal rounds for every block
    launch(c, "k_gemv_pre", 1, k, dim3((unsigned)grid), dim3(threads), (unsigned)smem, (const uint16_t *)w->data, (int)w->rows, (int)w->cols, x, n, p, e,
           acc, y, c->early);
}

void dec_matmul(qf_backend *be, const qf_mat *w, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, float *y) {
    ctx *c = C(be);
    if (w->dtype != QF_DT_BF16 || w->cols % 8 || (uintptr_t)w->data % 16 || (uintptr_t)x % 16) {
        fprintf(stderr, "qflash cuda: fused product needs 16-byte aligned bf16 rows of a multiple of 8 columns\n");
        return;
    }
    if (pre && (pre->kind == QF_PRE_GATED_NORM || pre->kind == QF_PRE_SIGMOID) && (pre->head < 1 || w->cols / pre->head > PRE_MAX_HEADS)) {
        fprintf(stderr, "qflash cuda: fused product: more than %d heads per row\n", PRE_MAX_HEADS);
        return;
    }
    dpre p = dpre_of(pre);
    // stage_wide's shape: 256 threads, 1024 | cols <= 4096, heads of 128 k dividing 1024, gates 16-byte aligned
    p.wide = c->wide && n == 1 && pre && (pre->kind == QF_PRE_GATED_NORM || pre->kind == QF_PRE_SIGMOID) && w->cols % 1024 == 0 &&
             w->cols <= 4096 && p.head % 128 == 0 && 1024 % p.head == 0 && (uintptr_t)p.g % 16 == 0 && p.g_hstride % 4 == 0 &&
             (pre->kind == QF_PRE_SIGMOID || (uintptr_t)p.w % 16 == 0);
    depi e = {};
    if (epi) {
        e = {1, epi->conv_dim, epi->z_dim, epi->nv, epi->conv_k, epi->conv_w, epi->dt_bias, epi->neg_A, {}};
        for (int t = 0; t < QF_DEC_ROWS; t++) e.st[t] = epi->conv_state[t];
    }
    if ((c->bulk & gemv_bit((int)w->rows, (int)w->cols)) && n == 1 && w->cols % 256 == 0 && w->cols <= 8192) {
        size_t smem = bulk_smem_bytes((int)w->cols);
        void (*k)(const uint16_t *, int, int, const float *, dpre, depi, int, float *) = w->cols == 2048 ? k_gemv_bulk<8> : k_gemv_bulk<0>;
        int fit = resident(c, (const void *)k, 256, smem), per = fit < c->bulk_blocks ? fit : c->bulk_blocks;
        launch(c, "k_gemv_bulk", 1, k, dim3((unsigned)(c->sms * per)), dim3(256), (unsigned)smem, (const uint16_t *)w->data, (int)w->rows, (int)w->cols, x, p, e,
               acc, y);
        return;
    }
    if (c->stream && n == 1 && w->cols % 256 == 0 && w->cols <= 8192) {
        size_t smem = stream_ring_bytes(256) + (size_t)w->cols * sizeof(float);
        resident(c, (const void *)k_gemv_stream, 256, smem); // opts in to the shared memory
        LAUNCH_PDL(c, k_gemv_stream, stream_grid(c), 256, smem, (const uint16_t *)w->data, (int)w->rows, (int)w->cols, x, p, e, acc, y);
        return;
    }
    // rows of x that fit beside the kernel's own shared memory (red: QF_DEC_ROWS * PRE_MAX_HEADS floats)
    size_t room = (size_t)(c->smem_optin > 0 ? c->smem_optin : 48 * 1024) - QF_DEC_ROWS * PRE_MAX_HEADS * sizeof(float) - 1024;
    int fit = (int)(room / ((size_t)w->cols * sizeof(float)));
    int cap = fit < 1 ? 1 : fit > QF_DEC_ROWS ? QF_DEC_ROWS : fit;
    for (int t0 = 0; t0 < n; t0 += cap) { // rows beyond what shared memory holds: another pass
        int nt = n - t0 < cap ? n - t0 : cap;
        dpre pt = p;
        if (pt.g) pt.g += (int64_t)t0 * p.g_stride;
        depi et = e;
        for (int t = 0; t < QF_DEC_ROWS; t++) et.st[t] = t0 + t < QF_DEC_ROWS ? e.st[t0 + t] : NULL;
        const float *xt = x + (int64_t)t0 * w->cols;
        float *yt = y + (int64_t)t0 * w->rows;
        switch (nt) { // one kernel per row count (rows below NT are masked, but only NT == nt ran on a GPU)
        case 1: gemv_pre_launch<1>(c, w, xt, nt, pt, et, acc, yt); break;
        case 2: gemv_pre_launch<2>(c, w, xt, nt, pt, et, acc, yt); break;
        case 3: gemv_pre_launch<3>(c, w, xt, nt, pt, et, acc, yt); break;
        case 4: gemv_pre_launch<4>(c, w, xt, nt, pt, et, acc, yt); break;
        case 5: gemv_pre_launch<5>(c, w, xt, nt, pt, et, acc, yt); break;
        case 6: gemv_pre_launch<6>(c, w, xt, nt, pt, et, acc, yt); break;
        case 7: gemv_pre_launch<7>(c, w, xt, nt, pt, et, acc, yt); break;
        case 8: gemv_pre_launch<8>(c, w, xt, nt, pt, et, acc, yt); break;
        case 9: gemv_pre_launch<9>(c, w, xt, nt, pt, et, acc, yt); break;
        case 10: gemv_pre_launch<10>(c, w, xt, nt, pt, et, acc, yt); break;
        case 11: gemv_pre_launch<11>(c, w, xt, nt, pt, et, acc, yt); break;
        case 12: gemv_pre_launch<12>(c, w, xt, nt, pt, et, acc, yt); break;
        case 13: gemv_pre_launch<13>(c, w, xt, nt, pt, et, acc, yt); break;
        case 14: gemv_pre_launch<14>(c, w, xt, nt, pt, et, acc, yt); break;
        case 15: gemv_pre_launch<15>(c, w, xt, nt, pt, et, acc, yt); break;
        default: gemv_pre_launch<16>(c, w, xt, nt, pt, et, acc, yt); break;
        }
    }
}

// One warp's share of a head's step: value columns j of head h (LPC lanes each) for row t. load()
// reads the state of earlier steps (it never depends on the kernel before, so it goes before the
// wait); run() the token's inputs, the update, the output and the new state. qn, kn: the warp's
// DK floats each of shared memory.
template <int DK, int LPC> // LPC lanes per value column, each DK / LPC of the key rows
struct gdn_task {
    static constexpr int HK = DK / LPC;
    float s[HK];
    float *S;
    int h, j, t, part, i0, n, live;
    __device__ __forceinline__ void load(const qf_gdn_dec &a, int h_, int jb, int t_) {
        int lane = threadIdx.x & 31, dk = a.dk, dv = a.dv;
        h = h_, t = t_, part = lane & (LPC - 1), j = jb * (32 / LPC) + lane / LPC, i0 = part * ((dk + LPC - 1) / LPC);
        S = a.S[t] + (int64_t)h * dk * dv + (int64_t)i0 * dv + j;
        live = j < dv, n = min(HK, dk - i0);
#pragma unroll
        for (int i = 0; i < HK; i++) s[i] = i < n && live ? S[(int64_t)i * dv] : 0.0f;
    }
    // returns the column's output (every lane of the column has it; 0 for dead lanes), also
    // written to a.out unless the caller writes it (normed) itself
    template <bool OUT = true>
    __device__ __forceinline__ float run(const qf_gdn_dec &a, float *qn, float *kn) {
        int lane = threadIdx.x & 31, dk = a.dk, dv = a.dv, kh = h / (a.nv / a.nk), qk = a.nk * dk, zb = 2 * qk + 2 * a.nv * dv;
        const float *row = a.mixed + (int64_t)t * a.stride, *q = row + kh * dk, *k = row + qk + kh * dk;
        // every load of this token's inputs issued before the first is used
        float qv[DK / 32], kv[DK / 32], graw = row[zb + a.nv + h], beta = row[zb + h], vj = live ? row[2 * qk + h * dv + j] : 0.0f;
#pragma unroll
        for (int u = 0; u < DK / 32; u++) qv[u] = lane + 32 * u < dk ? q[lane + 32 * u] : 0.0f, kv[u] = lane + 32 * u < dk ? k[lane + 32 * u] : 0.0f;
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int u = 0; u < DK / 32; u++) sq += qv[u] * qv[u], sk += kv[u] * kv[u];
        sq = warp_sum(sq), sk = warp_sum(sk);
        float iq = rsqrtf((float)dk) / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
#pragma unroll
        for (int u = 0; u < DK / 32; u++)
            if (lane + 32 * u < dk) qn[lane + 32 * u] = qv[u] * iq, kn[lane + 32 * u] = kv[u] * ik;
        __syncwarp();
        float decay = expf(graw), u = 0.0f, o = 0.0f;
#pragma unroll
        for (int i = 0; i < HK; i++)
            if (i < n) s[i] *= decay, u += s[i] * kn[i0 + i];
#pragma unroll
        for (int o = 1; o < LPC; o <<= 1) u += __shfl_xor_sync(0xffffffffu, u, o);
        u = beta * (vj - u);
#pragma unroll
        for (int i = 0; i < HK; i++)
            if (i < n) s[i] += kn[i0 + i] * u, o += s[i] * qn[i0 + i];
#pragma unroll
        for (int m = 1; m < LPC; m <<= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
        __syncwarp(); // qn, kn may be the next task's
        if (!live) return 0.0f;
        if (OUT && !part) a.out[((int64_t)t * a.nv + h) * dv + j] = o;
#pragma unroll
        for (int i = 0; i < HK; i++)
            if (i < n) S[(int64_t)i * dv] = s[i];
        return o;
    }
};

// ---- the delta rule, one token: LPC lanes per value column (each a share of the key rows, so a
// lane keeps DK/LPC state values in registers), 32/LPC columns per warp, a warp per block ----
template <int DK, int LPC>
__global__ void k_gdn_dec(qf_gdn_dec a) {
    __shared__ float qn[DK], kn[DK];
    if (skipped(SK_GDN)) return;
    tr(SK_GDN, TR_START);
    gdn_task<DK, LPC> w;
    w.load(a, blockIdx.x, blockIdx.y, blockIdx.z); // state of earlier steps: before the wait
    pdl_wait();
    tr(SK_GDN, TR_WAIT);
    pdl_launch();
    w.run(a, qn, kn);
    tr(SK_GDN, TR_END); // lane 0 (always live) after its writes: the block is one warp
}

// The step with a whole value head per block (dv / (32 / LPC) warps: 16 at dv 128, LPC 4) that
// also applies out_proj's gated norm to the head's output (the default; QFLASH_CUDA_GDN_GN=0: off):
// out_proj then stages its input with one load per element, where its gated staging walked 4 heads
// per warp one memory latency each (whole model 2948.1 -> 2820.0 us a step, notes session 9). The
// norm repeats stage_heads' sums in its order (a warp over the head, lane + 32 u), so the
// product's input is bit for bit what it was. gg: out_proj's GATED_NORM (norm weight w over dv, the
// gate of row t, head h at g + t * g_stride + h * g_hstride).
template <int DK, int LPC>
__global__ void __launch_bounds__(512) k_gdn_head(qf_gdn_dec a, dpre gg) {
    constexpr int CPW = 32 / LPC, NW = 512 / 32;
    __shared__ float qkn[NW * 2 * DK], on[NW * CPW], inv_s; // a warp's DK of qn then DK of kn; the head's outputs
    if (skipped(SK_GDN)) return;
    tr(SK_GDN, TR_START);
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, h = blockIdx.x, t = blockIdx.z, dv = a.dv;
    gdn_task<DK, LPC> w;
    w.load(a, h, warp, t); // state of earlier steps: before the wait
    pdl_wait();
    tr(SK_GDN, TR_WAIT);
    pdl_launch();
    float *qk = qkn + warp * 2 * DK;
    float o = w.template run<false>(a, qk, qk + DK); // the normed output only
    if (w.live && !w.part) on[w.j] = o;
    __syncthreads();
    const float *gv = gg.g + (int64_t)t * gg.g_stride + (int64_t)h * gg.g_hstride;
    if (warp == 0) { // stage_heads' 1/rms: lane + 32 u, then the warp's sum
        float ss = 0.0f;
        for (int d = lane; d < dv; d += 32) ss += on[d] * on[d];
        ss = warp_sum(ss);
        if (lane == 0) inv_s = 1.0f / sqrtf(ss / (float)dv + gg.eps);
    }
    __syncthreads();
    float inv = inv_s;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) a.out[((int64_t)t * a.nv + h) * dv + d] = silu(gv[d]) * (on[d] * inv * gg.w[d]);
    tr_end(SK_GDN);
}

// Lanes per value column of the DeltaNet step (QFLASH_CUDA_GDN_LPC): more lanes, more warps and
// shorter chains per warp; key dims up to 64 take 2.
int gdn_lanes(const ctx *c, int dk) { return dk <= 64 ? 2 : c->gdn_lpc == 2 || c->gdn_lpc == 8 ? c->gdn_lpc : 4; }

void dec_gdn(qf_backend *be, const qf_gdn_dec *a) {
    ctx *c = C(be);
    int lpc = gdn_lanes(c, a->dk), cpw = 32 / lpc;
    dim3 g(a->nv, (a->dv + cpw - 1) / cpw, a->n);
    if (a->dk > 128) {
        fprintf(stderr, "qflash cuda: linear-attention key dim %d > 128 is not supported\n", a->dk);
        return;
    }
    void (*k)(qf_gdn_dec) = a->dk <= 32 ? k_gdn_dec<32, 2> : a->dk <= 64 ? k_gdn_dec<64, 2> : lpc == 2 ? k_gdn_dec<128, 2> : lpc == 4 ? k_gdn_dec<128, 4> : k_gdn_dec<128, 8>;
    launch(c, "k_gdn_dec", 1, k, g, dim3(32), 0u, *a);
}

// gdn(g) then the gated norm of its output in place (k_gdn_head); 0: not taken (a shape it is not
// built for: key dims 128 at 4 lanes per column, value heads of 128).
int dec_gdn_gn(qf_backend *be, const qf_gdn_dec *a, const qf_pre *gn) {
    ctx *c = C(be);
    if (!c->gdn_gn || a->dk != 128 || a->dv != 128 || gdn_lanes(c, a->dk) != 4 || !gn || gn->kind != QF_PRE_GATED_NORM || gn->head != a->dv)
        return 0;
    launch(c, "k_gdn_head", 1, k_gdn_head<128, 4>, dim3(a->nv, 1, a->n), dim3(a->dv / 8 * 32), 0u, *a, dpre_of(gn));
    return 1;
}

// ---- attention, one new token per row ----

// One warp: rmsnorm(x) * w, then RoPE at pos over the first rot dims, into out (shared memory).
__device__ void norm_rope(const float *x, const float *w, int hd, int rot, int pos, const float *inv_freq, float eps, float *out) {
    int lane = threadIdx.x & 31, half = rot / 2;
    float ss = 0.0f;
    for (int d = lane; d < hd; d += 32) ss += x[d] * x[d];
    float inv = 1.0f / sqrtf(warp_sum(ss) / (float)hd + eps);
    for (int d = lane; d < hd; d += 32) out[d] = x[d] * inv * w[d];
    __syncwarp();
    for (int i = lane; i < half; i += 32) {
        float ang = (float)pos * inv_freq[i], cs = cosf(ang), sn = sinf(ang), a = out[i], b = out[i + half];
        out[i] = a * cs - b * sn;
        out[i + half] = b * cs + a * sn;
    }
    __syncwarp();
}

#define DATT_WARPS 8 // keys of a split shared by 8 warps: each walks few keys, one latency apiece

// After the wait for the qkv product: warp 0 normalises and rotates head h's query into qs; in the
// split that holds the new position warp 1 prepares the new key and value (kn, vn) of kv head kvh,
// and the kv group's first head stores them.
__device__ __forceinline__ void attn_new_token(const qf_attn_dec &a, const float *row, int h, int kvh, int pos, int fresh, const qf_kv_view &kv, float *qs,
                                               float *kn, float *vn) {
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, hd = a.hd;
    if (warp == 0) norm_rope(row + (int64_t)h * 2 * hd, a.q_norm, hd, a.rot, pos, a.inv_freq, a.eps, qs);
    else if (warp == 1 && fresh) {
        norm_rope(row + a.k_off + kvh * hd, a.k_norm, hd, a.rot, pos, a.inv_freq, a.eps, kn);
        for (int d = lane; d < hd; d += 32) vn[d] = row[a.v_off + kvh * hd + d];
        if (h % (a.nh / a.nkv) == 0) {
            float *kd = (float *)kv_row(kv, pos, a.nkv, hd, kvh, 0), *vd = (float *)kv_row(kv, pos, a.nkv, hd, kvh, 1);
            for (int d = lane; d < hd; d += 32) kd[d] = kn[d], vd[d] = vn[d];
        }
    }
    __syncthreads();
}

// A warp's keys j, j + DATT_WARPS, .. below j1 into its running softmax (the new position's from kn, vn).
__device__ __forceinline__ void attn_keys(const qf_attn_dec &a, const qf_kv_view &kv, int kvh, int pos, const float *kn, const float *vn, int j, int j1,
                                          const float *qr, float &m, float &l, float *o) {
    for (; j < j1; j += DATT_WARPS) {
        const float *k = j == pos ? kn : kv_row(kv, j, a.nkv, a.hd, kvh, 0), *v = j == pos ? vn : kv_row(kv, j, a.nkv, a.hd, kvh, 1);
        attn_key(qr, k, v, a.hd, a.scale, m, l, o);
    }
}

// Block (row t * nh + head h, split): as k_attn_part, with the query's norm and RoPE done here;
// the split that holds the new position prepares the new key and value itself (and the first
// head of each kv group stores them), so no block reads a key another block is writing.
// KP > 0 (QFLASH_CUDA_ATT1, the default): each warp loads its first KP keys and values before its
// wait (written by earlier steps: every kernel two launches back has ended), so those keys cost no
// memory latency after it. ONE: the last block of a head's splits to finish (a count per head, back
// at zero after it) combines the partials itself, so no combine kernel and its boundary follow;
// gate: the output heads times their sigmoid gate. Keys are summed in the same order either way.
template <int KP, bool ONE, bool PAR = true>
__global__ void __launch_bounds__(DATT_WARPS * 32) k_attn_dec(qf_attn_dec a, int chunk, int splits, float *part, unsigned *cnt, int gate) {
    __shared__ float qs[ATT_DPL * 32], kn[ATT_DPL * 32], vn[ATT_DPL * 32];
    __shared__ int last;
    int th = blockIdx.x, sp = blockIdx.y, t = th / a.nh, h = th % a.nh, kvh = h / (a.nh / a.nkv);
    int warp = threadIdx.x / 32, hd = a.hd, pos = a.pos[t];
    int j0 = sp * chunk, j1 = min(pos + 1, j0 + chunk), fresh = j0 <= pos && pos < j1;
    qf_kv_view kv = a.kv[t];
    const float *row = a.qkv + (int64_t)t * a.stride;
    if (skipped(SK_ATTN)) return;
    tr(SK_ATTN, TR_START);
    float kr[KP > 0 ? KP : 1][ATT_DPL], vr[KP > 0 ? KP : 1][ATT_DPL];
#pragma unroll
    for (int i = 0; i < KP; i++) {
        int j = j0 + warp + DATT_WARPS * i;
        if (j < j1 && j != pos) attn_row(kv_row(kv, j, a.nkv, hd, kvh, 0), hd, kr[i]), attn_row(kv_row(kv, j, a.nkv, hd, kvh, 1), hd, vr[i]);
    }
    pdl_wait();
    tr(SK_ATTN, TR_WAIT);
    pdl_launch();
    attn_new_token(a, row, h, kvh, pos, fresh, kv, qs, kn, vn);
    float qr[ATT_DPL], o[ATT_DPL], m = -INFINITY, l = 0.0f;
    attn_start(qs, hd, qr, o);
#pragma unroll
    for (int i = 0; i < KP; i++) {
        int j = j0 + warp + DATT_WARPS * i;
        if (j < j1) {
            if (j == pos) attn_key(qr, kn, vn, hd, a.scale, m, l, o);
            else attn_key_r(qr, kr[i], vr[i], hd, a.scale, m, l, o);
        }
    }
    attn_keys(a, kv, kvh, pos, kn, vn, j0 + warp + DATT_WARPS * KP, j1, qr, m, l, o);
    float *hp = part + (int64_t)th * splits * (hd + 2);
    attn_write_part<DATT_WARPS>(m, l, o, hd, hp + (int64_t)sp * (hd + 2));
    if constexpr (ONE) {
        __threadfence(); // the partial, before the count says it is there
        __syncthreads();
        if (threadIdx.x == 0) {
            last = atomicAdd(cnt + th, 1u) == (unsigned)splits - 1;
            if (last) cnt[th] = 0; // every split has counted: zero for the next launch
        }
        __syncthreads();
        if (last) {
            __threadfence();
            attn_combine_head<true, PAR>(hp, splits, hd, gate ? row + (int64_t)h * 2 * hd + hd : NULL, a.out + (int64_t)th * hd);
        }
    }
    tr(SK_ATTN, TR_END); // (without ONE: warp 0 writes the partial last)
}

static void attention_dec(ctx *c, const qf_attn_dec *a, int gate) {
    if (a->hd > ATT_DPL * 32 || a->nh % a->nkv) {
        fprintf(stderr, "qflash cuda: head_dim %d > %d (or heads %d not a multiple of kv heads %d) is not supported\n", a->hd, ATT_DPL * 32, a->nh,
                a->nkv);
        return;
    }
    int max_keys = 0, rows = a->n * a->nh, chunk;
    for (int t = 0; t < a->n; t++) max_keys = a->pos[t] + 1 > max_keys ? a->pos[t] + 1 : max_keys;
    // enough blocks for every SM, and splits of at most ~256 keys (32 per warp) while 64 allow
    int sms = c->sms > 0 ? c->sms : 132, splits = (2 * sms + rows - 1) / rows, by_len = (max_keys + 255) / 256;
    splits = splits < by_len ? by_len : splits;
    splits = splits < 1 ? 1 : splits > 64 ? 64 : splits;
    chunk = (max_keys + splits - 1) / splits;
    if (chunk < 32) chunk = 32, splits = (max_keys + 31) / 32;
    float *part = (float *)scratch(c, &c->attn, &c->attn_cap, (size_t)rows * 64 * (a->hd + 2) * sizeof(float));
    if (!part) return;
    if (c->att1 && c->att_cnt && rows <= ATT_MAX_HEADS) {
        void (*k)(qf_attn_dec, int, int, float *, unsigned *, int) = c->comb ? k_attn_dec<4, true> : k_attn_dec<4, true, false>;
        launch(c, "k_attn_dec", 1, k, dim3(rows, splits), dim3(DATT_WARPS * 32), 0u, *a, chunk, splits, part, c->att_cnt, gate);
        return;
    }
    LAUNCH_PDL(c, (k_attn_dec<0, false>), dim3(rows, splits), DATT_WARPS * 32, 0, *a, chunk, splits, part, (unsigned *)NULL, 0);
    LAUNCH_PDL(c, k_attn_combine, rows, 128, 0, splits, a->hd, part, a->out, gate ? a->qkv : (const float *)NULL, a->stride, a->nh);
}

void dec_attention(qf_backend *be, const qf_attn_dec *a) { attention_dec(C(be), a, 0); }

// attention with the output gate applied (QFLASH_CUDA_ATT_GATE); 0: not taken (the attention
// layers' joined tail applies the gate itself).
int dec_attn_gate(qf_backend *be, const qf_attn_dec *a) {
    ctx *c = C(be);
    if (!c->att_gate || c->tail == 4) return 0;
    attention_dec(c, a, 1);
    return 1;
}

// ---- MoE: routing and gate/up in one kernel, down + shared expert + residual in another ----

#define MOE_MAX_K 32 // route_block normalises the chosen weights in one warp
#define MOE_MAX_E 512 // route_block keeps E / 256 logits per thread in registers

// The block routes one row (every thread calls it; E <= MOE_MAX_E, K <= 32): a logit is chosen
// when fewer than K logits rank above it (greater, or equal at a lower index: the CPU's order).
// Only a warp's own top K of its 32 logits can be chosen, so each warp ranks its 32 by shuffles,
// and the candidates (K per 32 logits) are ranked among themselves: a few hundred parallel
// instructions where K rounds of a warp-wide argmax were a serial chain of ~6000 cycles. Then
// the softmax weights over all E, renormalised over the chosen, into ti/tw in rank order.
#define ROUTE_CAND (MOE_MAX_E / 32 * 32)

// How many of the warp's 32 logits rank above this lane's v (greater, or equal at a lower lane).
__device__ __forceinline__ int warp_rank(float v, int lane) {
    int r = 0;
#pragma unroll
    for (int o = 0; o < 32; o++) {
        float ov = __shfl_sync(0xffffffffu, v, o);
        r += ov > v || (ov == v && o < lane);
    }
    return r;
}

// How many of the nc candidates (cv values, ci expert indices) rank above candidate (m, mi).
__device__ __forceinline__ int cand_rank(const float *cv, const int *ci, int nc, float m, int mi) {
    int r = 0;
    for (int j = 0; j < nc; j++) r += cv[j] > m || (cv[j] == m && ci[j] < mi);
    return r;
}

__device__ void route_block(const float *rl, int E, int K, int *ti, float *tw, bool stamp = false) {
    __shared__ float cv[ROUTE_CAND], red[32];
    __shared__ int ci[ROUTE_CAND], nc;
    int tid = threadIdx.x, lane = tid & 31, nw = blockDim.x / 32;
    if (tid == 0) nc = 0;
    if (tid < K) ti[tid] = tid, tw[tid] = 0.0f; // NaN logits rank nothing: slots stay valid experts
    __syncthreads();
    float v[MOE_MAX_E / 256]; // this thread's logits (blocks of 256 threads)
#pragma unroll
    for (int u = 0; u < MOE_MAX_E / 256; u++) {
        int base = (u * nw + tid / 32) * 32;
        v[u] = base + lane < E ? rl[base + lane] : -INFINITY;
        if (base >= E) continue; // whole warp alike
        int r = warp_rank(v[u], lane);
        if (r < K && base + lane < E) {
            int at = atomicAdd(&nc, 1);
            cv[at] = v[u], ci[at] = base + lane;
        }
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_LOGITS);
    for (int c = tid; c < nc; c += blockDim.x) {
        float m = cv[c];
        int mi = ci[c], r = cand_rank(cv, ci, nc, m, mi);
        if (r < K) ti[r] = mi, tw[r] = m;
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_RANKED);
    float mx = tw[0], e = 0.0f;
#pragma unroll
    for (int u = 0; u < MOE_MAX_E / 256; u++)
        if ((u * nw + tid / 32) * 32 + lane < E) e += expf(v[u] - mx);
    float sum = block_sum(e, red);
    if (tid < 32) {
        float p = lane < K ? expf(tw[lane] - mx) / sum : 0.0f, ts = warp_sum(p);
        if (lane < K) tw[lane] = p / ts;
    }
    __syncthreads();
}

// The chosen logits tw[0..K) (tw[0] the largest) become their weights exp(l - max) normalised over
// the chosen: the full softmax's sum over E cancels in the renormalisation.
__device__ __forceinline__ void chosen_weights(float *tw, int K) {
    int tid = threadIdx.x, lane = tid & 31;
    if (tid < 32) {
        float p = lane < K ? expf(tw[lane] - tw[0]) : 0.0f, ts = warp_sum(p);
        if (lane < K) tw[lane] = p / ts;
    }
    __syncthreads();
}

// route_block's choice, with less in its way (QFLASH_CUDA_ROUTE=1; opt-in until measured): warp
// group g's candidate of rank r goes to slot g * K + r (ranks in a group are a permutation, so no
// shared atomic and no count to read back), and the weights are exp(l - max) normalised over the
// chosen: the full softmax's sum cancels in the renormalisation, so no block-wide sum of E exps.
__device__ void route_fixed(const float *rl, int E, int K, int *ti, float *tw, bool stamp = false) {
    __shared__ float cv[ROUTE_CAND];
    __shared__ int ci[ROUTE_CAND];
    int tid = threadIdx.x, lane = tid & 31, nw = blockDim.x / 32, nc = (E + 31) / 32 * K;
    if (tid < K) ti[tid] = tid, tw[tid] = 0.0f; // NaN logits can leave ranks untaken: slots stay valid experts
#pragma unroll
    for (int u = 0; u < MOE_MAX_E / 256; u++) {
        int g = u * nw + tid / 32, base = g * 32;
        if (base >= E) continue; // whole warp alike
        float v = base + lane < E ? rl[base + lane] : -INFINITY;
        int r = warp_rank(v, lane);
        if (r < K) cv[g * K + r] = v, ci[g * K + r] = base + lane; // lanes past E: -inf, ranked after every logit
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_LOGITS);
    for (int c = tid; c < nc; c += blockDim.x) {
        float m = cv[c];
        int mi = ci[c], r = cand_rank(cv, ci, nc, m, mi);
        if (r < K) ti[r] = mi < E ? mi : 0, tw[r] = m;
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_RANKED);
    chosen_weights(tw, K);
}

// route_block's choice by all pairs (QFLASH_CUDA_ROUTE=2, the default for shapes route_sort does not take): the logits go to
// shared memory once, and each thread ranks its own against all E (16-byte broadcast reads, no
// atomics, one barrier between), so the ranking is one pass of E compares per thread instead of
// a warp rank, a shared count and a second rank over the candidates. Weights as route_fixed.
// L2: rl was written by other blocks of the same kernel (read past L1).
template <bool L2 = false>
__device__ void route_pairs(const float *rl, int E, int K, int *ti, float *tw, bool stamp = false) {
    __shared__ __align__(16) float lv[MOE_MAX_E];
    int tid = threadIdx.x, E4 = (E + 3) & ~3;
    if (tid < K) ti[tid] = tid, tw[tid] = 0.0f; // NaN logits can leave ranks untaken: slots stay valid experts
    for (int i = tid; i < E4; i += blockDim.x) lv[i] = i < E ? (L2 ? __ldcg(rl + i) : rl[i]) : -INFINITY; // padding ranks after every logit
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_LOGITS);
    for (int i = tid; i < E; i += blockDim.x) {
        float v = lv[i];
        int r = 0;
#pragma unroll 4
        for (int j = 0; j < E4; j += 4) {
            float4 o = *(const float4 *)(lv + j);
            r += (o.x > v || (o.x == v && j < i)) + (o.y > v || (o.y == v && j + 1 < i)) + (o.z > v || (o.z == v && j + 2 < i)) +
                 (o.w > v || (o.w == v && j + 3 < i));
        }
        if (r < K) ti[r] = i, tw[r] = v;
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_RANKED);
    chosen_weights(tw, K);
}

// (v, i) before (w, j) in the routing order: greater, or equal at a lower index (the CPU's).
__device__ __forceinline__ bool route_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// One compare-exchange of a bitonic sort into route order: the element at position pos (register
// v, i) against the one at pos ^ j (the same register of lane ^ j), in a run of k sorted
// descending where pos & k is 0.
__device__ __forceinline__ void bitonic_step(float &v, int &i, int pos, int k, int j) {
    float w = __shfl_xor_sync(0xffffffffu, v, j);
    int q = __shfl_xor_sync(0xffffffffu, i, j);
    bool first = ((pos & k) == 0) == ((pos & j) == 0); // this position keeps the one that comes first
    if (route_before(w, q, v, i) == first) v = w, i = q;
}

// QFLASH_CUDA_ROUTE=3 (the default where E <= 256, K <= 8; whole model 2766.1 -> 2675.8 us a step,
// same digest, notes session 11): route_pairs' choice by sorting networks. Each of 8 warps sorts its 32 logits by
// shuffles (15 steps) and keeps its first 8; warp 0 sorts those 64 (2 a lane, 21 steps) and takes
// the first K. The trace put route_pairs' ranking at 3-5 us a layer: 256 compares per thread in
// all 16 warps of an SM at once, issue-bound; this is ~40 shuffle steps in 8 warps, then one warp.
__device__ void route_sort(const float *rl, int E, int K, int *ti, float *tw, bool stamp = false) {
    __shared__ float cv[64];
    __shared__ int ci[64];
    int tid = threadIdx.x, lane = tid & 31, w = tid / 32;
    if (w < 8) {
        int i = w * 32 + lane;
        float v = i < E ? rl[i] : -INFINITY; // lanes past E: -inf at indices past E, after every logit
        for (int k = 2; k <= 32; k <<= 1)
            for (int j = k >> 1; j > 0; j >>= 1) bitonic_step(v, i, lane, k, j);
        if (lane < 8) cv[w * 8 + lane] = v, ci[w * 8 + lane] = i; // the warp's first 8 in order
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_LOGITS);
    if (w == 0) {
        float v0 = cv[lane], v1 = cv[lane + 32];
        int i0 = ci[lane], i1 = ci[lane + 32];
        for (int k = 2; k <= 64; k <<= 1)
            for (int j = k >> 1; j > 0; j >>= 1) {
                if (j == 32) { // positions lane and lane + 32, both in this lane (k = 64: one run, descending)
                    if (route_before(v1, i1, v0, i0)) {
                        float tv = v0;
                        int t = i0;
                        v0 = v1, i0 = i1, v1 = tv, i1 = t;
                    }
                } else bitonic_step(v0, i0, lane, k, j), bitonic_step(v1, i1, lane + 32, k, j);
            }
        if (lane < K) ti[lane] = i0 < E ? i0 : 0, tw[lane] = v0;
    }
    __syncthreads();
    if (stamp) tr(SK_MOE_GU, TR_RANKED);
    chosen_weights(tw, K);
}

// x * norm weight into xs; returns x's 1/rms, which scales the finished sums (the barriers of the
// sum publish xs).
__device__ float stage_normed(const qf_moe_dec &a, const float *x, float *xs, float *red) {
    int H = a.hidden, tid = threadIdx.x;
    float ss = 0.0f;
#pragma unroll 4
    for (int i = tid; i < H / 4; i += blockDim.x) {
        float4 v = ((const float4 *)x)[i], w = ((const float4 *)a.norm_w)[i];
        ((float4 *)xs)[i] = make_float4(v.x * w.x, v.y * w.y, v.z * w.z, v.w * w.w);
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    return 1.0f / sqrtf(block_sum(ss, red) / (float)H + a.eps);
}

// The block routes row t (router logits rl, into ti/tw), then stages x * norm weight into xs;
// returns x's 1/rms, which scales the finished sums.
__device__ float route_and_stage(const qf_moe_dec &a, const float *x, const float *rl, int *ti, float *tw, float *xs, float *red) {
    route_block(rl, a.n_experts, a.top_k, ti, tw);
    return stage_normed(a, x, xs, red);
}

// silu(gate row j . xs) * (up row j . xs) of expert e, each sum scaled by inv. Lane l holds
// columns 8 (l + 32 u) of a row: HL (H / 256, rounded up) 16-byte loads per row, at most 8 of the
// gate row and 8 of the up row in flight a round, with no index arithmetic per load.
template <int HL>
__device__ __forceinline__ float gu_row(const void *const *tab, int E, int e, int j, int H, const float *xs, float inv, int lane) {
    constexpr int HC = HL < 8 ? HL : 8;
    int h8 = H / 8;
    const uint4 *G = (const uint4 *)((const uint16_t *)tab[e] + (int64_t)j * H), *Up = (const uint4 *)((const uint16_t *)tab[E + e] + (int64_t)j * H);
    float g = 0.0f, u = 0.0f;
#pragma unroll
    for (int c0 = 0; c0 < HL; c0 += HC) {
        uint4 wg[HC], wu[HC];
#pragma unroll
        for (int q = 0; q < HC; q++) {
            int c = lane + 32 * (c0 + q);
            if (c < h8) wg[q] = __ldcs(G + c), wu[q] = __ldcs(Up + c);
        }
#pragma unroll
        for (int q = 0; q < HC; q++) {
            int c = lane + 32 * (c0 + q);
            if (c < h8) g += dot8s(wg[q], xs + c * 8, lane), u += dot8s(wu[q], xs + c * 8, lane);
        }
    }
    g = warp_sum(g) * inv, u = warp_sum(u) * inv;
    return silu(g) * u;
}

// One output row i of the MoE down step, in registers: part q is expert slot q's down row (q = K:
// the shared expert's), PL 16-byte loads per lane; G parts are loaded at once (one memory latency
// for the whole row at I = 512). dp[q]: part q's matrix; wk[q] its weight; hs + q * I its input.
template <int PL>
struct dn_row {
    static constexpr int G = 18 / PL < 1 ? 1 : 18 / PL; // parts a round: 18 loads per lane in flight
    uint4 w[G][PL];
    __device__ __forceinline__ void load(const uint16_t *const *dp, int K, int I, int S, int i, int q0) {
        int lane = threadIdx.x & 31, P = K + 1;
#pragma unroll
        for (int g = 0; g < G; g++) {
            int q = q0 + g, cols = q < K ? I : S;
            const uint4 *src = (const uint4 *)(dp[q < P ? q : 0] + (int64_t)i * cols);
#pragma unroll
            for (int u = 0; u < PL; u++)
                if (q < P && lane + 32 * u < cols / 8) w[g][u] = __ldcs(src + lane + 32 * u);
        }
    }
    // The row's sum over every part (every lane gets it); have: the first round is loaded.
    __device__ __forceinline__ float sum(const uint16_t *const *dp, const float *wk, const float *hs, int K, int I, int S, int i, int have) {
        int lane = threadIdx.x & 31, P = K + 1;
        float acc = 0.0f;
        for (int q0 = 0; q0 < P; q0 += G) {
            if (!have) load(dp, K, I, S, i, q0);
            have = 0;
#pragma unroll
            for (int g = 0; g < G; g++) {
                int q = q0 + g, cols = q < K ? I : S;
                float d = 0.0f;
#pragma unroll
                for (int u = 0; u < PL; u++)
                    if (q < P && lane + 32 * u < cols / 8) d += dot8s(w[g][u], hs + q * I + (lane + 32 * u) * 8, lane);
                if (q < P) acc += wk[q] * d;
            }
        }
        return warp_sum(acc);
    }
};

// Block (slot k, column y, row t): routes row t itself (cheaper than a launch between), stages
// x * norm weight, then its warps walk the expert's ffn rows y*8 + warp, stepping by the grid.
// Blocks of column 0 write slot k's expert and weight (the down kernel reads them when early is off).
// early: x (the kernel two back wrote it) is staged before the wait; only the routing waits.
template <int HL>
__global__ void __launch_bounds__(256, 2) k_moe_gu(const void *const *tab, qf_moe_dec a, float *hbuf, int *topi, float *topw, int early) {
    if (skipped(SK_MOE_GU)) return;
    extern __shared__ float4 dyn[];
    __shared__ float red[32], tw[MOE_MAX_K];
    __shared__ int ti[MOE_MAX_K];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, tid = threadIdx.x, t = blockIdx.z, k = blockIdx.x;
    float *xs = (float *)dyn, inv;
    const float *x = a.x + (int64_t)t * H, *rl = a.rl + (int64_t)t * a.rl_stride;
    if (early) {
        inv = stage_normed(a, x, xs, red);
        pdl_wait();
        pdl_launch();
        route_block(rl, E, K, ti, tw);
    } else {
        pdl_wait();
        pdl_launch();
        inv = route_and_stage(a, x, rl, ti, tw, xs, red);
    }
    int e = ti[k], lane = tid & 31, j = blockIdx.y * (blockDim.x / 32) + tid / 32;
    if (blockIdx.y == 0 && tid == 0) topi[t * K + k] = e, topw[t * K + k] = tw[k];
    for (; j < I; j += gridDim.y * (blockDim.x / 32)) {
        float h = gu_row<HL>(tab, E, e, j, H, xs, inv, lane);
        if (lane == 0) hbuf[((int64_t)t * K + k) * I + j] = h;
    }
}

// The shared expert's input silu(sh_g) * sh_u (from the router product's row rl) into hsh.
__device__ __forceinline__ void shared_in(const qf_moe_dec &a, const float *rl, float *hsh) {
    int E = a.n_experts, S = a.sh_ffn;
#pragma unroll 4
    for (int j = threadIdx.x; j < S; j += blockDim.x) hsh[j] = silu(rl[E + j]) * rl[E + S + j];
}

// Part K of a down row: the shared expert, weighted by its sigmoid gate.
__device__ __forceinline__ void shared_slot(const qf_moe_dec &a, const float *rl, const uint16_t *sh_down, float *wk, const uint16_t **dp) {
    if (threadIdx.x == 0) wk[a.top_k] = sigmoid(rl[a.n_experts + 2 * a.sh_ffn]), dp[a.top_k] = sh_down;
}

// Block (a warp per output row, stepping by the grid; row t): x[t][i] += sum_k w_k down_k[i] . h_k
// + sigmoid(shared logit) * sh_down[i] . silu(sh_g) * sh_u, a dn_row each. early: the routing is
// redone here from the router logits (two kernels back, so before the wait) and the warp's first
// loads and the shared expert's input go out before it; else the routing comes from gate/up
// (topi, topw).
template <int PL>
__global__ void __launch_bounds__(256, 2) k_moe_down(const void *const *tab, qf_moe_dec a, const uint16_t *sh_down, const float *hbuf, const int *topi,
                                                     const float *topw, int early) {
    if (skipped(SK_MOE_DN)) return;
    extern __shared__ float4 dyn[];
    __shared__ float wk[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, t = blockIdx.y;
    int i = blockIdx.x * (blockDim.x / 32) + tid / 32;
    float *hs = (float *)dyn; // part q's input at hs + q * I
    const float *rl = a.rl + (int64_t)t * a.rl_stride;
    dn_row<PL> w;
    int have = 0;
    if (early) {
        route_block(rl, E, K, ti, wk);
        if (tid < K) dp[tid] = (const uint16_t *)tab[2 * E + ti[tid]];
        shared_slot(a, rl, sh_down, wk, dp);
        __syncthreads();
        if (i < H) w.load(dp, K, I, S, i, 0), have = 1;
        shared_in(a, rl, hs + K * I);
        pdl_wait();
        pdl_launch();
    } else {
        pdl_wait();
        pdl_launch();
        if (tid < K) wk[tid] = topw[t * K + tid], dp[tid] = (const uint16_t *)tab[2 * E + topi[t * K + tid]];
        shared_slot(a, rl, sh_down, wk, dp);
        shared_in(a, rl, hs + K * I);
    }
#pragma unroll 8
    for (int j = tid; j < K * I / 4; j += blockDim.x) ((float4 *)hs)[j] = ((const float4 *)(hbuf + (int64_t)t * K * I))[j];
    __syncthreads();
    for (; i < H; i += gridDim.x * (blockDim.x / 32), have = 0) {
        float acc = w.sum(dp, wk, hs, K, I, S, i, have);
        if ((tid & 31) == 0) a.x[(int64_t)t * H + i] += acc;
    }
}

// A grid-wide count (one thread per block), read with acquire semantics.
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Block-wide wait until every block of the grid has arrived at cnt[0] (the grid must be resident
// at once). The last block past it resets both counts for the next launch.
__device__ void grid_arrive_wait(unsigned *cnt) {
    __threadfence(); // this thread's writes before the count says so
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(cnt, 1u);
        long long t0 = clock64();
        while (ld_acquire(cnt) < gridDim.x)
            if (clock64() - t0 > (1ll << 34)) __trap(); // ~8 s: the grid is not resident at once, a bug
        __threadfence();
    }
    __syncthreads();
}
__device__ void grid_leave(unsigned *cnt) {
    if (threadIdx.x == 0 && atomicAdd(cnt + 1, 1u) == gridDim.x - 1) atomicExch(cnt, 0u), atomicExch(cnt + 1, 0u);
}

// The expert table (3 E pointers, constant per layer) copied to shared memory before the wait, so
// the chosen experts' row addresses are shared-memory reads after the routing, not a memory round
// trip (default since session 14: 1.7% of a whole step with route_sort; `QFLASH_CUDA_MOE_PF=0`
// reads the table from memory). (=1, every gate/up byte asked for at once through a cp.async slot
// per warp, was slower and is gone: notes, session 9.)
__device__ __forceinline__ const void *const *moe_pf_table(const void *const *tab, int E, void *at) {
    const void **st = (const void **)at;
    for (int i = threadIdx.x; i < 3 * E; i += blockDim.x) st[i] = tab[i];
    return st; // published by the barriers of x's staging and of the routing
}

// The whole MoE block of one row in one kernel (QFLASH_CUDA_MOE1, default on): every block stages
// x * norm weight and routes; the grid's warps compute the chosen experts' gate/up rows; then each
// warp issues its down row's loads and the grid waits for every block's gate/up rows (a count,
// not a launch), so the down weights stream while the gate/up rows end. Blocks wait for each
// other: the grid is never larger than what the SMs hold at once.
template <int HL, int PL, int ROUTE = 0, bool TB = false> // ROUTE 0: route_block, 1: route_fixed, 2: route_pairs, 3: route_sort (the default); TB: moe_pf_table
__global__ void __launch_bounds__(256, 2) k_moe_one(const void *const *tab, qf_moe_dec a, const uint16_t *sh_down, float *hbuf, unsigned *cnt, int late) {
    extern __shared__ float4 dyn[];
    __shared__ float red[32], wk[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, lane = tid & 31;
    int gw = blockIdx.x * (blockDim.x / 32) + tid / 32, nw = gridDim.x * (blockDim.x / 32);
    float *xs = (float *)dyn, *hs = xs + H; // x * norm weight; the down parts' inputs (part q at hs + q * I)
    tr(SK_MOE_GU, TR_START);
    if constexpr (TB) tab = moe_pf_table(tab, E, hs + K * I + S);
    float inv = late ? 0.0f : stage_normed(a, a.x, xs, red); // x: two kernels back (late: the kernel before wrote it)
    pdl_wait();
    tr(SK_MOE_GU, TR_WAIT);
    pdl_launch();
    if (late) inv = stage_normed(a, a.x, xs, red);
    if constexpr (ROUTE == 3) route_sort(a.rl, E, K, ti, wk, true);
    else if constexpr (ROUTE == 2) route_pairs(a.rl, E, K, ti, wk, true);
    else if constexpr (ROUTE == 1) route_fixed(a.rl, E, K, ti, wk, true);
    else route_block(a.rl, E, K, ti, wk, true);
    if (tid < K) dp[tid] = (const uint16_t *)tab[2 * E + ti[tid]];
    shared_slot(a, a.rl, sh_down, wk, dp);
    __syncthreads();
    tr(SK_MOE_GU, TR_ROUTED);
    for (int r = gw; r < K * I && !skipped(SK_MOE_GU); r += nw) {
        int k = r / I;
        float h = gu_row<HL>(tab, E, ti[k], r - k * I, H, xs, inv, lane);
        if (lane == 0) hbuf[r] = h;
    }
    dn_row<PL> w;
    int i = gw, have = i < H;
    if (have) w.load(dp, K, I, S, i, 0);
    shared_in(a, a.rl, hs + K * I);
    tr_sync(SK_MOE_GU, TR_PHASE1);
    grid_arrive_wait(cnt);
    tr(SK_MOE_GU, TR_BARRIER);
#pragma unroll 8
    for (int j = tid; j < K * I / 4; j += blockDim.x) ((float4 *)hs)[j] = __ldcg((const float4 *)hbuf + j); // L2: other SMs wrote it
    __syncthreads();
    grid_leave(cnt);
    for (; i < H && !skipped(SK_MOE_DN); i += nw, have = 0) {
        float acc = w.sum(dp, wk, hs, K, I, S, i, have);
        if (lane == 0) a.x[i] += acc;
    }
    tr_end(SK_MOE_GU);
}

// Where a streamed slot of gate/up lies: expert slot k, ffn row j, half h (gate 0, up 1), slot c.
struct gu_pos {
    int k, j, h, c;
    __device__ void next(int epr, int I) {
        if (++c == epr && (c = 0, h ^= 1) == 0 && ++j == I) j = 0, k++;
    }
};

// Where a streamed slot of down lies: output row i, part q (expert slot, K: the shared expert), slot c.
struct dn_pos {
    int i, q, c;
    __device__ int cols(int K, int I, int S) const { return q < K ? I : S; }
    __device__ int next(int K, int I, int S) { // 1 when the row is complete
        if (++c < cols(K, I, S) / 256) return 0;
        c = 0;
        if (++q <= K) return 0;
        q = 0, i++;
        return 1;
    }
};

// One row, streamed (as k_gemv_stream): routing and x * norm weight first (they need the kernel
// before), then the warps stream their share of the K * I (gate row, up row) pairs of the chosen
// experts, gate row j then up row j, each H / 256 slots.
__global__ void __launch_bounds__(256, 2) k_moe_gu_stream(const void *const *tab, qf_moe_dec a, float *hbuf) {
    if (skipped(SK_MOE_GU)) return;
    extern __shared__ float4 dyn[];
    __shared__ float red[32], tw[MOE_MAX_K];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *gp[2 * MOE_MAX_K];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, tid = threadIdx.x, lane = tid & 31, p0, p1;
    uint4 *ring = (uint4 *)dyn + tid / 32 * SR * 32 + lane;
    float *xs = (float *)((uint4 *)dyn + blockDim.x / 32 * SR * 32);
    pdl_wait();
    pdl_launch();
    float inv = route_and_stage(a, a.x, a.rl, ti, tw, xs, red);
    if (tid < 2 * K) gp[tid] = (const uint16_t *)tab[(tid & 1) * E + ti[tid / 2]];
    __syncthreads();
    warp_share(K * I, &p0, &p1);
    int epr = H / 256, ne = (p1 - p0) * 2 * epr;
    gu_pos in = {p0 / I, p0 % I, 0, 0}, at = in; // the next slot to ask for, the next to use
    auto next = [&]() {
        const uint4 *src = (const uint4 *)(gp[2 * in.k + in.h] + (int64_t)in.j * H) + in.c * 32 + lane;
        in.next(epr, I);
        return src;
    };
    float acc = 0.0f, g = 0.0f;
    auto use = [&](uint4 w) {
        acc += dot8s(w, xs + (at.c * 32 + lane) * 8, lane);
        if (at.c == epr - 1) {
            float s = warp_sum(acc) * inv;
            if (at.h == 0) g = s;
            else if (lane == 0) hbuf[(int64_t)at.k * I + at.j] = silu(g) * s;
            acc = 0.0f;
        }
        at.next(epr, I);
    };
    ring_fill(ring, ne, next);
    ring_drain(ring, ne, next, use);
}

// One row, streamed: output row i is the K experts' down rows i and the shared expert's, each
// I / 256 (S / 256) slots. The routing is redone here before the wait (the router logits come
// from two kernels back), so the chosen down rows are asked for while gate/up still runs.
__global__ void __launch_bounds__(256, 2) k_moe_down_stream(const void *const *tab, qf_moe_dec a, const uint16_t *sh_down, const float *hbuf) {
    if (skipped(SK_MOE_DN)) return;
    extern __shared__ float4 dyn[];
    __shared__ float tw[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, lane = tid & 31, i0, i1;
    uint4 *ring = (uint4 *)dyn + tid / 32 * SR * 32 + lane;
    float *hs = (float *)((uint4 *)dyn + blockDim.x / 32 * SR * 32), *hsh = hs + K * I;
    route_block(a.rl, E, K, ti, tw);
    if (tid < K) dp[tid] = (const uint16_t *)tab[2 * E + ti[tid]];
    shared_slot(a, a.rl, sh_down, tw, dp);
    __syncthreads();
    warp_share(H, &i0, &i1);
    int ne = (i1 - i0) * (K * (I / 256) + S / 256);
    dn_pos in = {i0, 0, 0}, at = in; // the next slot to ask for, the next to use
    auto next = [&]() {
        const uint4 *src = (const uint4 *)(dp[in.q] + (int64_t)in.i * in.cols(K, I, S)) + in.c * 32 + lane;
        in.next(K, I, S);
        return src;
    };
    ring_fill(ring, ne, next);
    pdl_wait();
    pdl_launch();
    float res = i0 + lane < i1 ? a.x[i0 + lane] : 0.0f; // the residual of row i0 + lane (rows per warp <= 32, checked at launch)
#pragma unroll 8
    for (int i = tid; i < K * I / 4; i += blockDim.x) ((float4 *)hs)[i] = ((const float4 *)hbuf)[i];
    shared_in(a, a.rl, hsh);
    __syncthreads();
    float acc = 0.0f;
    auto use = [&](uint4 w) {
        acc += tw[at.q] * dot8s(w, (at.q < K ? hs + at.q * I : hsh) + (at.c * 32 + lane) * 8, lane);
        int row = at.i;
        if (!at.next(K, I, S)) return;
        float s = warp_sum(acc);
        if (lane == row - i0) a.x[row] = res + s;
        acc = 0.0f;
    };
    ring_drain(ring, ne, next, use);
}

// One row: k_moe_one for the shapes it is built for (0: not, use the two kernels). One wave: the
// blocks wait for each other, so the grid is what the SMs hold of it at once.
int moe_one(ctx *c, const void **tab, const qf_moe_dec *a, float *hbuf, int late) {
    int H = a->hidden, I = a->ffn, S = a->sh_ffn;
    typedef void (*fn)(const void *const *, qf_moe_dec, const uint16_t *, float *, unsigned *, int);
    int mc = I > S ? I : S;
    int f = c->route == 3 && (a->n_experts > 256 || a->top_k > 8) ? 2 : c->route; // route_sort's shapes, else route_pairs
    int tb = c->moe_pf && f >= 2 && H <= 2048 && mc <= 512;
    fn k = tb                        ? (H <= 256 && mc <= 256 ? (f == 3 ? k_moe_one<1, 1, 3, true> : k_moe_one<1, 1, 2, true>)
                                                              : (f == 3 ? k_moe_one<8, 2, 3, true> : k_moe_one<8, 2, 2, true>))
           : H <= 256 && mc <= 256  ? (f == 3 ? k_moe_one<1, 1, 3> : f == 2 ? k_moe_one<1, 1, 2> : f ? k_moe_one<1, 1, 1> : k_moe_one<1, 1>)
           : H <= 2048 && mc <= 512 ? (f == 3 ? k_moe_one<8, 2, 3> : f == 2 ? k_moe_one<8, 2, 2> : f ? k_moe_one<8, 2, 1> : k_moe_one<8, 2>)
           : H <= 4096 && mc <= 512 ? (f >= 2 ? k_moe_one<16, 2, 2> : f ? k_moe_one<16, 2, 1> : k_moe_one<16, 2>)
                                    : NULL;
    if (!k) return 0;
    size_t smem = (size_t)(H + a->top_k * I + S) * sizeof(float) + (tb ? (size_t)3 * a->n_experts * sizeof(void *) : 0);
    int grid = resident(c, (const void *)k, 256, smem) * (c->sms > 0 ? c->sms : 1);
    launch(c, "k_moe_one", 1, k, dim3((unsigned)grid), dim3(256), (unsigned)smem, tab, *a, (const uint16_t *)a->sh_down->data, hbuf, c->moe_cnt,
           late);
    return 1;
}

void dec_moe(qf_backend *be, const qf_moe_dec *a) {
    ctx *c = C(be);
    int late = c->x_late; // x was written by the kernel just before (the DeltaNet tail), not two back
    c->x_late = 0;
    const void **tab = expert_table(c, a->experts, a->n_experts);
    int n = a->n, K = a->top_k, H = a->hidden, I = a->ffn, E = a->n_experts;
    size_t head = ((size_t)n * K * 8 + 15) & ~(size_t)15;
    char *s = (char *)scratch(c, &c->moe, &c->moe_cap, head + (size_t)n * K * I * sizeof(float));
    if (!tab || !s || K > MOE_MAX_K || E > MOE_MAX_E || a->sh_down->dtype != QF_DT_BF16 || a->experts[0].gate.dtype != QF_DT_BF16 || H % 8 || I % 8 || a->sh_ffn % 8) {
        fprintf(stderr, "qflash cuda: fused moe: out of device memory, top-k %d > %d, %d experts > %d, or weights not bf16 in rows of 8\n", K, MOE_MAX_K,
                E, MOE_MAX_E);
        return;
    }
    if (c->stream && n == 1 && H % 256 == 0 && I % 256 == 0 && a->sh_ffn % 256 == 0 && H <= 32 * 8 * (int)stream_grid(c)) {
        float *hb = (float *)(s + head);
        size_t ring = stream_ring_bytes(256), sm_gu = ring + (size_t)H * sizeof(float), sm_dn = ring + (size_t)(K * I + a->sh_ffn) * sizeof(float);
        resident(c, (const void *)k_moe_gu_stream, 256, sm_gu), resident(c, (const void *)k_moe_down_stream, 256, sm_dn); // shared-memory opt-in
        unsigned g = stream_grid(c);
        LAUNCH_PDL(c, k_moe_gu_stream, g, 256, sm_gu, tab, *a, hb);
        LAUNCH_PDL(c, k_moe_down_stream, g, 256, sm_dn, tab, *a, (const uint16_t *)a->sh_down->data, (const float *)hb);
        return;
    }
    int *topi = (int *)s;
    float *topw = (float *)(s + (size_t)n * K * 4), *hbuf = (float *)(s + head);
    if (n == 1 && c->moe1 && c->moe_cnt && moe_one(c, tab, a, hbuf, late)) return;
    size_t sm_gu = (size_t)H * sizeof(float), sm_dn = (size_t)(K * I + a->sh_ffn) * sizeof(float);
    // one wave of blocks, each looping over rows, so routing and staging are paid once per block
    // lanes hold 8 (l + 32 u) columns: HL loads per lane for a gate/up row, PL for a down part
    int HL = H <= 256 ? 1 : H <= 512 ? 2 : H <= 1024 ? 4 : H <= 2048 ? 8 : 16, mc = I > a->sh_ffn ? I : a->sh_ffn;
    int PL = mc <= 256 ? 1 : mc <= 512 ? 2 : mc <= 1024 ? 4 : 8;
    if (H > 4096 || mc > 2048) {
        fprintf(stderr, "qflash cuda: fused moe: hidden %d > 4096 or expert width %d > 2048 is not supported\n", H, mc);
        return;
    }
    typedef void (*gu_fn)(const void *const *, qf_moe_dec, float *, int *, float *, int);
    typedef void (*dn_fn)(const void *const *, qf_moe_dec, const uint16_t *, const float *, const int *, const float *, int);
    gu_fn gu = HL == 1 ? k_moe_gu<1> : HL == 2 ? k_moe_gu<2> : HL == 4 ? k_moe_gu<4> : HL == 8 ? k_moe_gu<8> : k_moe_gu<16>;
    dn_fn dn = PL == 1 ? k_moe_down<1> : PL == 2 ? k_moe_down<2> : PL == 4 ? k_moe_down<4> : k_moe_down<8>;
    int sms = c->sms > 0 ? c->sms : 1, gu_res = per_sm(c, n, resident(c, (const void *)gu, 256, sm_gu)) * sms;
    int dn_res = per_sm(c, n, resident(c, (const void *)dn, 256, sm_dn)) * sms;
    int gy = gu_res / (K * n), dx = dn_res / n;
    gy = gy < 1 ? 1 : gy > (I + 7) / 8 ? (I + 7) / 8 : gy;
    dx = dx < 1 ? 1 : dx > (H + 7) / 8 ? (H + 7) / 8 : dx;
    launch(c, "k_moe_gu", 1, gu, dim3(K, gy, n), dim3(256), (unsigned)sm_gu, tab, *a, hbuf, topi, topw, c->early && !late);
    launch(c, "k_moe_down", 1, dn, dim3(dx, n), dim3(256), (unsigned)sm_dn, tab, *a, (const uint16_t *)a->sh_down->data, (const float *)hbuf,
           (const int *)topi, (const float *)topw, c->early);
}

// ---- greedy pick: the first index of the largest value per row ----

#define AMAX_BLOCKS 128

__device__ void better(float &bv, int &bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

// The block's best over the block's reach: every thread ends with it.
__device__ void block_best(float &bv, int &bi, float *rv, int *ri) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int o = 16; o > 0; o >>= 1) better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    __syncthreads();
    if (lane == 0) rv[warp] = bv, ri[warp] = bi;
    __syncthreads();
    for (int w = 0; w < nw; w++) better(bv, bi, rv[w], ri[w]);
}

// Grid (AMAX_BLOCKS, rows): each block its slice; the last block of a row to finish (a counter
// per row, which it resets) picks among the partials.
__global__ void k_argmax(const float *x, int cols, float *pv, int *pi, unsigned *count, int32_t *out) {
    __shared__ float rv[32];
    __shared__ int ri[32], last;
    int t = blockIdx.y, per = (cols + gridDim.x - 1) / gridDim.x, c0 = blockIdx.x * per, c1 = min(cols, c0 + per);
    const float *r = x + (int64_t)t * cols;
    if (skipped(SK_ARGMAX)) return;
    pdl_wait();
    pdl_launch();
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) better(bv, bi, r[i], i);
    block_best(bv, bi, rv, ri);
    if (threadIdx.x == 0) {
        pv[t * gridDim.x + blockIdx.x] = bv, pi[t * gridDim.x + blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(&count[t], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = -INFINITY, bi = 0x7fffffff;
    for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) better(bv, bi, ((volatile float *)pv)[t * gridDim.x + i], ((volatile int *)pi)[t * gridDim.x + i]);
    block_best(bv, bi, rv, ri);
    if (threadIdx.x == 0) out[t] = bi == 0x7fffffff ? 0 : bi, count[t] = 0;
}

void dec_argmax(qf_backend *be, const float *x, int n, int cols, int32_t *out) {
    ctx *c = C(be);
    if (!c->amax || n > QF_DEC_ROWS * 8) {
        fprintf(stderr, "qflash cuda: argmax over %d rows is not supported\n", n);
        return;
    }
    float *pv = (float *)c->amax;
    int *pi = (int *)(pv + QF_DEC_ROWS * 8 * AMAX_BLOCKS);
    unsigned *count = (unsigned *)(pi + QF_DEC_ROWS * 8 * AMAX_BLOCKS);
    LAUNCH_PDL(c, k_argmax, dim3(AMAX_BLOCKS, n), 256, 0, x, cols, pv, pi, count, out);
}

// ---- a DeltaNet layer's step, out_proj and ffn_in in one kernel (one row; QFLASH_CUDA_TAIL) ----
// Apart, the three kernels each wait for the one before, then load their weights: ~28 us a layer
// for 22 MB of weights (5 us at 4.3 TB/s) and a 4 MB state. Here every block asks the copy engine
// for its share of both products' weights (~170 KB) the moment it starts, before the wait for
// in_proj; the step runs meanwhile, and each product only waits for a grid count (its input is
// made by every block) and finds its weights in shared memory. One block per SM, all resident.
struct tail_args {
    const uint16_t *wo; // out_proj [hidden][o_cols]
    int hidden, o_cols, head;
    const float *gnw, *z; // gated norm weight [head] (NULL: a sigmoid gate, o_proj's); the gate of head h at z + h * z_hstride
    int z_hstride;
    float eps;
    float *x;           // residual [hidden]: += out_proj
    const uint16_t *wf; // ffn_in [f_rows][hidden]
    int f_rows;
    const float *fnw; // ffn norm weight [hidden]
    float *rl;        // ffn_in's output [f_rows]
};

// bytes (a multiple of 16, < 1 MB) from global to shared memory in pieces, all counted on b.
__device__ void bulk_span(void *dst, const void *src, unsigned bytes, uint64_t *b) {
    mbar_arrive_expect(b, bytes);
    for (unsigned o = 0; o < bytes; o += 32768) bulk_copy((char *)dst + o, (const char *)src + o, bytes - o < 32768 ? bytes - o : 32768, b);
}

// Row r of a bf16 matrix in shared memory (cols % 256 == 0) . xs, every lane gets it.
__device__ __forceinline__ float smem_dot(const uint16_t *Ws, int cols, const float *xs, int lane) {
    const uint4 *w = (const uint4 *)Ws;
    float a = 0.0f;
#pragma unroll 4
    for (int c = lane; c < cols / 8; c += 32) a += dot8s(w[c], xs + c * 8, lane);
    return warp_sum(a);
}

// silu(z) * rmsnorm(core head) * w into xs; core was written by other blocks of this kernel: read
// from L2. Heads of 128 (a warp's float4s): thread i holds float4s i + 256 u, every load at once.
// Other heads (<= 32 * HD_REG wide): a warp per head.
__device__ void tail_stage_gated(const float *core, const tail_args &a, float *xs) {
    int lane = threadIdx.x & 31, heads = a.o_cols / a.head;
    if (a.head == 128 && a.o_cols <= 4 * 1024 && blockDim.x == 256) {
        float4 v[4], g[4], w = ((const float4 *)a.gnw)[lane];
        int f = a.o_cols / 1024;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = threadIdx.x + 256 * u, h = i / 32;
            if (u < f) v[u] = __ldcg((const float4 *)core + i), g[u] = *(const float4 *)(a.z + (int64_t)h * a.z_hstride + lane * 4);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (u >= f) continue;
            float inv = 1.0f / sqrtf(warp_sum(v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w) / 128.0f + a.eps);
            ((float4 *)xs)[threadIdx.x + 256 * u] = make_float4(silu(g[u].x) * v[u].x * inv * w.x, silu(g[u].y) * v[u].y * inv * w.y,
                                                               silu(g[u].z) * v[u].z * inv * w.z, silu(g[u].w) * v[u].w * inv * w.w);
        }
        __syncthreads();
        return;
    }
    for (int hh = threadIdx.x / 32; hh < heads; hh += blockDim.x / 32) {
        float v[HD_REG], g[HD_REG], w[HD_REG], ss = 0.0f;
#pragma unroll
        for (int u = 0; u < HD_REG; u++) {
            int d = lane + 32 * u;
            if (d < a.head) v[u] = __ldcg(core + hh * a.head + d), g[u] = a.z[(int64_t)hh * a.z_hstride + d], w[u] = a.gnw[d];
        }
#pragma unroll
        for (int u = 0; u < HD_REG; u++)
            if (lane + 32 * u < a.head) ss += v[u] * v[u];
        float inv = 1.0f / sqrtf(warp_sum(ss) / (float)a.head + a.eps);
#pragma unroll
        for (int u = 0; u < HD_REG; u++) {
            int d = lane + 32 * u;
            if (d < a.head) xs[hh * a.head + d] = silu(g[u]) * (v[u] * inv * w[u]);
        }
    }
    __syncthreads();
}

// An attention layer's o_proj input: core * sigmoid(gate) per head (core: the kernel before wrote it).
// Loads go out SG at a time before any store (a store to xs may alias them for the compiler,
// which then waits one latency per element).
#define SG 8
__device__ void tail_stage_sigmoid(const float *core, const tail_args &a, float *xs) {
    for (int i0 = threadIdx.x; i0 < a.o_cols; i0 += SG * blockDim.x) {
        float v[SG], gt[SG];
#pragma unroll
        for (int u = 0; u < SG; u++) {
            int i = i0 + u * blockDim.x, h = i / a.head;
            if (i < a.o_cols) v[u] = core[i], gt[u] = a.z[(int64_t)h * a.z_hstride + (i - h * a.head)];
        }
#pragma unroll
        for (int u = 0; u < SG; u++)
            if (i0 + u * blockDim.x < a.o_cols) xs[i0 + u * blockDim.x] = v[u] * sigmoid(gt[u]);
    }
    __syncthreads();
}

// x * norm weight into xs (x from L2: other blocks of this kernel wrote it); returns x's 1/rms.
__device__ float tail_stage_rms(const tail_args &a, float *xs, float *red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < a.hidden / 4; i += blockDim.x) {
        float4 v = __ldcg((const float4 *)a.x + i), w = ((const float4 *)a.fnw)[i];
        ((float4 *)xs)[i] = make_float4(v.x * w.x, v.y * w.y, v.z * w.z, v.w * w.w);
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    return 1.0f / sqrtf(block_sum(ss, red) / (float)a.hidden + a.eps);
}

__device__ __forceinline__ int share_of(int n, int b, int G) { return (int)((int64_t)n * b / G); }

// The MoE block joined to the tail (QFLASH_CUDA_TAIL=3): the expert table, the op's arguments
// (its host pointers unused here) and the gate/up rows' scratch.
struct tail_moe {
    const void *const *tab;
    qf_moe_dec a;
    const uint16_t *sh_down;
    float *hbuf;
    int dsm; // a warp's second down row bulk-copied into its ring once its gate/up rows are done (QFLASH_CUDA_TAIL_DSM, default 1)
};

// One down row whose K + 1 parts lie in shared memory (part q at rb + q * I, the shared expert's
// at rb + K * I), summed in dn_row::sum's order (so both give the same bits).
template <int PL>
__device__ float dn_smem_sum(const uint16_t *rb, const float *wk, const float *hs, int K, int I, int S) {
    int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int q = 0; q <= K; q++) {
        int cols = q < K ? I : S;
        const uint4 *src = (const uint4 *)(rb + (int64_t)q * I);
        float d = 0.0f;
#pragma unroll
        for (int u = 0; u < PL; u++)
            if (lane + 32 * u < cols / 8) d += dot8s(src[lane + 32 * u], hs + q * I + (lane + 32 * u) * 8, lane);
        acc += wk[q] * d;
    }
    return warp_sum(acc);
}
#define TM_SLOTS 2 // (gate row, up row) pairs in flight per warp, each pair one slot of 4 * hidden bytes

// Shared memory of the MoE part, laid over the products' weights once they are used: each warp's
// ring of TM_SLOTS pairs, then the down parts' inputs (K * I + S floats).
__host__ __device__ inline size_t tm_ring_bytes(int H) { return (size_t)8 * TM_SLOTS * 4 * H; }

// The joined MoE's start: route (logits from L2), each part's down matrix and weight (K: the
// shared expert's, by its sigmoid gate) and the shared expert's input into hs + K * I.
__device__ void tail_route(const tail_moe &m, int *ti, float *wk, const uint16_t **dp, float *hs) {
    const qf_moe_dec &a = m.a;
    int E = a.n_experts, K = a.top_k, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x;
    route_pairs<true>(a.rl, E, K, ti, wk);
    if (tid < K) dp[tid] = (const uint16_t *)m.tab[2 * E + ti[tid]];
    if (tid == 0) wk[K] = sigmoid(__ldcg(a.rl + E + 2 * S)), dp[K] = m.sh_down;
    for (int j = tid; j < S; j += blockDim.x) hs[K * I + j] = silu(__ldcg(a.rl + E + j)) * __ldcg(a.rl + E + S + j);
}

// Past the count of every block's gate/up rows, the n of them (written by other SMs: from L2) into hs.
__device__ void tail_gather_h(unsigned *cnt, const float *hbuf, float *hs, int n) {
    grid_arrive_wait(cnt);
    tr(SK_GDN, TR_DN);
#pragma unroll 8
    for (int j = threadIdx.x; j < n / 4; j += blockDim.x) ((float4 *)hs)[j] = __ldcg((const float4 *)hbuf + j);
    __syncthreads();
    grid_leave(cnt);
}

// The one-row MoE of k_moe_one inside the tail, after ffn_in's rows (router logits, the shared
// expert's gate/up) are written by every block: each block routes, its warps stream their share of
// the chosen experts' (gate row, up row) pairs into shared memory with bulk copies (two pairs in
// flight per warp; the copy engine moves the bytes), each warp then issues its first down row's
// loads, a grid count (every gate/up row written), and the down rows into x. xs holds
// x * norm weight (ffn_in's input, the experts' too), inv x's 1/rms.
// XR (H / 256 where known, else 0): the lane's 8 XR floats of xs kept in registers for both rows
// of every pair (else each dot reads them from shared memory again, 4 bytes of xs per weight).
template <int PL, int XR>
__device__ void tail_moe_run(const tail_moe &m, const float *xs, float inv, char *region, unsigned *cnt) {
    __shared__ float wk[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    __shared__ uint64_t bars[8 * TM_SLOTS], dbar[8];
    const qf_moe_dec &a = m.a;
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    int gw = warp * gridDim.x + blockIdx.x, nw = gridDim.x * 8, np = gw < K * I ? (K * I - gw + nw - 1) / nw : 0;
    uint4 *ring = (uint4 *)region + warp * TM_SLOTS * (H / 4);
    float *hs = (float *)(region + tm_ring_bytes(H));
    uint64_t *bar = bars + warp * TM_SLOTS;
    tail_route(m, ti, wk, dp, hs);
    auto fill = [&](int q) { // lane 0: pair q of the warp (row gw + q * nw of the K * I) into its slot
        int r = gw + q * nw, k = r / I, j = r - k * I, e = ti[k];
        uint4 *dst = ring + (q % TM_SLOTS) * (H / 4);
        mbar_arrive_expect(bar + q % TM_SLOTS, 4 * H);
        bulk_copy(dst, (const uint16_t *)m.tab[e] + (int64_t)j * H, 2 * H, bar + q % TM_SLOTS);
        bulk_copy(dst + H / 8, (const uint16_t *)m.tab[E + e] + (int64_t)j * H, 2 * H, bar + q % TM_SLOTS);
    };
    if (lane == 0) {
        for (int q = 0; q < TM_SLOTS; q++) mbar_init(bar + q);
        mbar_init(dbar + warp);
        mbar_init_fence();
        fence_async_smem(); // the products' reads of this region come before the copies into it
        for (int q = 0; q < TM_SLOTS && q < np; q++) fill(q);
    }
    __syncwarp();
    float4 xr[XR ? 2 * XR : 1];
    if constexpr (XR > 0)
#pragma unroll
        for (int v = 0; v < XR; v++) xr[2 * v] = *(const float4 *)(xs + (v * 32 + lane) * 8), xr[2 * v + 1] = *(const float4 *)(xs + (v * 32 + lane) * 8 + 4);
    for (int q = 0; q < np; q++) {
        const uint4 *slot = ring + (q % TM_SLOTS) * (H / 4);
        mbar_wait(bar + q % TM_SLOTS, (q / TM_SLOTS) & 1);
        float g = 0.0f, u = 0.0f;
        if constexpr (XR > 0) {
            uint4 wg[XR], wu[XR];
#pragma unroll
            for (int v = 0; v < XR; v++) wg[v] = slot[v * 32 + lane], wu[v] = slot[H / 8 + v * 32 + lane];
#pragma unroll
            for (int v = 0; v < XR; v++) g += dot8r(wg[v], xr[2 * v], xr[2 * v + 1]), u += dot8r(wu[v], xr[2 * v], xr[2 * v + 1]);
        } else {
            for (int c = lane; c < H / 8; c += 32) g += dot8s(slot[c], xs + c * 8, lane), u += dot8s(slot[H / 8 + c], xs + c * 8, lane);
        }
        g = warp_sum(g) * inv, u = warp_sum(u) * inv;
        if (lane == 0) m.hbuf[gw + q * nw] = silu(g) * u;
        __syncwarp();
        if (lane == 0 && q + TM_SLOTS < np) {
            fence_async_smem();
            fill(q + TM_SLOTS);
        }
    }
    int i = blockIdx.x * 8 + warp, i2 = i + nw, have = i < H;
    // the warp's second down row into its ring (free now: every pair was read), so it is not
    // fetched after the count as the first row's loads are before it
    int dsm = m.dsm && i2 < H && (size_t)(K * I + S) * 2 <= (size_t)TM_SLOTS * 4 * H;
    if (lane == 0 && dsm) {
        fence_async_smem();
        mbar_arrive_expect(dbar + warp, (unsigned)(K * I + S) * 2);
        for (int q = 0; q < K; q++) bulk_copy((uint16_t *)ring + q * I, (const uint16_t *)m.tab[2 * E + ti[q]] + (int64_t)i2 * I, I * 2, dbar + warp);
        bulk_copy((uint16_t *)ring + K * I, m.sh_down + (int64_t)i2 * S, S * 2, dbar + warp);
    }
    tr_sync(SK_GDN, TR_GU);
    __syncthreads(); // dp, wk
    dn_row<PL> w;
    if (have) w.load(dp, K, I, S, i, 0);
    tail_gather_h(cnt, m.hbuf, hs, K * I);
    for (int r = 0; i < H; i += nw, r++) {
        float acc;
        if (r == 1 && dsm) mbar_wait(dbar + warp, 0), acc = dn_smem_sum<PL>((const uint16_t *)ring, wk, hs, K, I, S);
        else acc = w.sum(dp, wk, hs, K, I, S, i, r == 0 && have);
        if (lane == 0) a.x[i] = __ldcg(a.x + i) + acc;
    }
}

// The joined MoE with the gate/up and down rows loaded into registers, as k_moe_one does (blocks
// of 16 warps: one row pair per warp in flight, every down row in the first round). Measured: the
// bulk-copy ring above moves ~2 TB/s at 128 KB in flight per SM where register loads of the same
// bytes in flight move ~4 (notes, session 8).
template <int HL, int PL>
__device__ void tail_moe_regs(const tail_moe &m, const float *xs, float inv, float *hs, unsigned *cnt) {
    __shared__ float wk[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    const qf_moe_dec &a = m.a;
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, lane = tid & 31;
    int gw = blockIdx.x * (blockDim.x / 32) + tid / 32, nw = gridDim.x * (blockDim.x / 32);
    tail_route(m, ti, wk, dp, hs);
    for (int r = gw; r < K * I; r += nw) {
        int k = r / I;
        float h = gu_row<HL>(m.tab, E, ti[k], r - k * I, H, xs, inv, lane);
        if (lane == 0) m.hbuf[r] = h;
    }
    __syncthreads(); // dp, wk
    dn_row<PL> w;
    int i = gw, have = i < H;
    if (have) w.load(dp, K, I, S, i, 0);
    tr(SK_GDN, TR_GU);
    tail_gather_h(cnt, m.hbuf, hs, K * I);
    for (; i < H; i += nw, have = 0) {
        float acc = w.sum(dp, wk, hs, K, I, S, i, have);
        if (lane == 0) a.x[i] = __ldcg(a.x + i) + acc;
    }
}

// PL > 0: the MoE block joins (tail_moe_run; PL as k_moe_one's, XR its x in registers). NW warps a
// block; NW 16: the MoE part in registers (tail_moe_regs, HL as k_moe_one's).
template <int DK, int LPC, int PL = 0, int XR = 0, int NW = 8, int HL = 0>
__global__ void __launch_bounds__(NW * 32, 1) k_gdn_tail(qf_gdn_dec g, tail_args a, unsigned *cnt, int pre, tail_moe m) {
    extern __shared__ float4 dyn[];
    __shared__ float red[32], qk[NW][2][DK];
    __shared__ uint64_t bar[2];
    int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, G = gridDim.x, b = blockIdx.x;
    int o0 = share_of(a.hidden, b, G), o1 = share_of(a.hidden, b + 1, G), f0 = share_of(a.f_rows, b, G), f1 = share_of(a.f_rows, b + 1, G);
    size_t wbytes = ((size_t)(a.hidden + G - 1) / G * a.o_cols + (size_t)(a.f_rows + G - 1) / G * a.hidden) * 2;
    if constexpr (PL > 0) wbytes = max(wbytes, (NW == 8 ? tm_ring_bytes(a.hidden) : 0) + (size_t)(m.a.top_k * m.a.ffn + m.a.sh_ffn) * 4);
    uint16_t *wos = (uint16_t *)dyn, *wfs = wos + (int64_t)(o1 - o0) * a.o_cols;
    float *xs = (float *)((char *)dyn + wbytes);
    tr(SK_GDN, TR_START);
    if (!pre) wos = (uint16_t *)a.wo + (int64_t)o0 * a.o_cols, wfs = (uint16_t *)a.wf + (int64_t)f0 * a.hidden; // read in place (QFLASH_CUDA_TAIL=2)
    if (tid == 0 && pre) { // the weights never depend on the kernels before: asked for first
        mbar_init(bar), mbar_init(bar + 1);
        mbar_init_fence();
        bulk_span(wos, a.wo + (int64_t)o0 * a.o_cols, (unsigned)((o1 - o0) * a.o_cols * 2), bar);
        bulk_span(wfs, a.wf + (int64_t)f0 * a.hidden, (unsigned)((f1 - f0) * a.hidden * 2), bar + 1);
    }
    constexpr int CPW = 32 / LPC;
    int jg = (g.dv + CPW - 1) / CPW, tasks = g.nv * jg, task = warp * G + b; // tasks spread over every SM first
    gdn_task<DK, LPC> w;
    if (task < tasks) w.load(g, task / jg, task % jg, 0); // state of earlier steps: before the wait
    pdl_wait();
    tr(SK_GDN, TR_WAIT);
    pdl_launch();
    for (int first = 1; task < tasks; task += G * NW, first = 0) {
        if (!first) w.load(g, task / jg, task % jg, 0);
        w.run(g, qk[warp][0], qk[warp][1]);
    }
    tr_sync(SK_GDN, TR_LOGITS);
    if (g.nv) { // no step (an attention layer): core came from the kernel before
        grid_arrive_wait(cnt); // the whole step's output (core) is written
        grid_leave(cnt);
    }
    tr(SK_GDN, TR_RANKED);
    if (a.gnw) tail_stage_gated(g.out, a, xs);
    else tail_stage_sigmoid(g.out, a, xs);
    if (pre) mbar_wait(bar, 0);
    tr(SK_GDN, TR_ROUTED);
    for (int r = o0 + warp; r < o1; r += NW) {
        float s = smem_dot(wos + (int64_t)(r - o0) * a.o_cols, a.o_cols, xs, lane);
        if (lane == 0) a.x[r] = __ldcg(a.x + r) + s;
    }
    tr_sync(SK_GDN, TR_PHASE1);
    grid_arrive_wait(cnt + 2); // the whole residual is updated
    grid_leave(cnt + 2);
    tr(SK_GDN, TR_BARRIER);
    float inv = tail_stage_rms(a, xs, red);
    if (pre) mbar_wait(bar + 1, 0);
    for (int r = f0 + warp; r < f1; r += NW) {
        float s = smem_dot(wfs + (int64_t)(r - f0) * a.hidden, a.hidden, xs, lane);
        if (lane == 0) a.rl[r] = s * inv;
    }
    if constexpr (PL > 0) {
        grid_arrive_wait(cnt + 4); // every router logit and shared gate/up row is written
        grid_leave(cnt + 4);
        tr(SK_GDN, TR_RL);
        if constexpr (NW == 16) tail_moe_regs<HL, PL>(m, xs, inv, (float *)dyn, cnt + 6);
        else tail_moe_run<PL, XR>(m, xs, inv, (char *)dyn, cnt + 6);
    }
    tr_end(SK_GDN);
}

// The MoE kernel for the tail's shapes (NULL: the tail runs without it): the real shape and one
// small shape for the tests (each instantiation costs CI compile time on four architectures).
typedef void (*tail_fn)(qf_gdn_dec, tail_args, unsigned *, int, tail_moe);
tail_fn tail_with_moe(const qf_gdn_dec *g, const qf_moe_dec *mo, int lpc, int nw) {
    int mc = mo->ffn > mo->sh_ffn ? mo->ffn : mo->sh_ffn;
    if (mo->n != 1 || mo->top_k > MOE_MAX_K || mo->n_experts > MOE_MAX_E || mo->ffn % 8 || mo->sh_ffn % 8 || (mo->top_k * mo->ffn) % 4 ||
        mo->sh_down->dtype != QF_DT_BF16 || mo->experts[0].gate.dtype != QF_DT_BF16)
        return NULL;
    int any = !g->nv; // no step: any of them
    if (nw == 16) {
        if ((any || (g->dk == 128 && lpc == 4)) && mc <= 512 && mo->hidden == 2048) return k_gdn_tail<128, 4, 2, 0, 16, 8>;
        if ((any || g->dk <= 32) && mc <= 256 && mo->hidden <= 256) return k_gdn_tail<32, 2, 1, 0, 16, 1>;
        return NULL;
    }
    if ((any || (g->dk == 128 && lpc == 4)) && mc <= 512 && mo->hidden == 2048) return k_gdn_tail<128, 4, 2, 8>;
    if ((any || g->dk <= 32) && mc <= 256) return k_gdn_tail<32, 2, 1>;
    return NULL;
}

// The step's absence (g->nv == 0, an attention layer's o_proj with its sigmoid gate) or its shape.
int tail_input_ok(const ctx *c, const qf_gdn_dec *g, const qf_pre *gn, int oc) {
    if (!g->nv) return c->tail == 4 && gn->kind == QF_PRE_SIGMOID && gn->head > 0 && oc % gn->head == 0;
    return g->dk <= 128 && g->dv <= 32 * HD_REG && oc == g->nv * g->dv && gn->kind == QF_PRE_GATED_NORM && gn->head == g->dv;
}

// The tail in one kernel when the shapes fit (returns 0 otherwise: the caller runs the three
// ops): one row, sm_90, both products' shares of a block in shared memory beside x. With mo (not
// NULL) and QFLASH_CUDA_TAIL=3 the MoE block joins it where tail_with_moe has a kernel: 2. With
// QFLASH_CUDA_TAIL=4 also an attention layer's o_proj, ffn_in and MoE (g->nv == 0: no step).
int dec_gdn_tail(qf_backend *be, const qf_gdn_dec *g, const qf_mat *wo, const qf_pre *gn, float *x, const qf_mat *wf, const qf_pre *fn, float *rl,
                 const qf_moe_dec *mo) {
    ctx *c = C(be);
    int H = (int)wo->rows, oc = (int)wo->cols, fr = (int)wf->rows;
    if (!c->tail || c->stream || !c->moe_cnt || g->n != 1 || wo->dtype != QF_DT_BF16 || wf->dtype != QF_DT_BF16 || (int)wf->cols != H || oc % 8 ||
        H % 8 || !tail_input_ok(c, g, gn, oc) || fn->kind != QF_PRE_RMSNORM || (uintptr_t)wo->data % 16 || (uintptr_t)wf->data % 16 ||
        (uintptr_t)x % 16)
        return 0;
    int G = c->sms > 0 ? c->sms : 1;
    G = G < H ? G : H, G = G < fr ? G : fr;
    size_t wbytes = ((size_t)(H + G - 1) / G * oc + (size_t)(fr + G - 1) / G * H) * 2;
    int lpc = gdn_lanes(c, g->dk);
    tail_fn k = g->dk <= 32 ? k_gdn_tail<32, 2> : g->dk <= 64 ? k_gdn_tail<64, 2> : lpc == 2 ? k_gdn_tail<128, 2> : lpc == 4 ? k_gdn_tail<128, 4> : k_gdn_tail<128, 8>;
    tail_moe tm = {};
    int nthr = 256;
    if (c->tail >= 3 && mo && mo->x == x && mo->rl == rl && mo->hidden == H && mo->rl_stride == fr && mo->n_experts + 2 * mo->sh_ffn + 1 <= fr) {
        tail_fn km = tail_with_moe(g, mo, lpc, c->tail_nw);
        const void **tab = km ? expert_table(c, mo->experts, mo->n_experts) : NULL;
        float *hb = tab ? (float *)scratch(c, &c->moe, &c->moe_cap, (size_t)mo->top_k * mo->ffn * sizeof(float)) : NULL;
        size_t mb = (c->tail_nw == 16 ? 0 : tm_ring_bytes(H)) + (size_t)(mo->top_k * mo->ffn + mo->sh_ffn) * 4;
        if (hb) // the threads follow the kernel taken (without the MoE it is the 256-thread tail)
            k = km, nthr = c->tail_nw * 32, tm = {tab, *mo, (const uint16_t *)mo->sh_down->data, hb, c->tail_dsm}, wbytes = wbytes > mb ? wbytes : mb;
    }
    if (!g->nv && !tm.tab) return 0; // an attention layer's tail is only taken with its MoE
    size_t smem = wbytes + (size_t)(oc > H ? oc : H) * sizeof(float);
    if (smem + 8 * 1024 > (size_t)c->smem_optin || resident(c, (const void *)k, nthr, smem) < 1) return 0;
    tail_args t = {(const uint16_t *)wo->data, H, oc, gn->head, g->nv ? gn->w : NULL, gn->g, gn->g_hstride, gn->eps, x, (const uint16_t *)wf->data, fr, fn->w, rl};
    launch(c, "k_gdn_tail", 1, k, dim3((unsigned)G), dim3((unsigned)nthr), (unsigned)smem, *g, t, c->moe_cnt + 4, c->tail != 2, tm);
    if (tm.tab) return 2;
    c->x_late = 1; // the MoE kernel after it must not read x before its wait
    return 1;
}

} // namespace

const qf_dec_ops qfc::k_dec_ops = {dec_matmul, dec_gdn, dec_attention, dec_moe, dec_argmax, dec_gdn_tail, dec_gdn_gn, dec_attn_gate};

void qfc::dec_setup(ctx *c) {
    const char *bps = getenv("QFLASH_CUDA_BPS"), *early = getenv("QFLASH_CUDA_EARLY"), *skip = getenv("QFLASH_CUDA_SKIP");
    c->bps = bps ? atoi(bps) : 0;
    c->early = !(early && *early == '0');
    const char *pw1 = getenv("QFLASH_CUDA_PW1");
    c->pw1 = !(pw1 && *pw1 == '0');
    const char *lpc = getenv("QFLASH_CUDA_GDN_LPC");
    c->gdn_lpc = lpc ? atoi(lpc) : 4;
    const char *m1 = getenv("QFLASH_CUDA_MOE1"); // one-row MoE in one kernel (0: gate/up and down apart)
    c->moe1 = !(m1 && *m1 == '0');
    // one-row gated norms of wide heads staged with every load at once (QFLASH_CUDA_WIDE=1; off until
    // measured in its template form: notes, session 6)
    const char *wd = getenv("QFLASH_CUDA_WIDE");
    c->wide = wd && *wd == '1';
    // one-row products fed by bulk copies (sm_90; QFLASH_CUDA_BULK=mask of kinds, QFLASH_CUDA_BULK_BLOCKS per SM, default 2)
    const char *bk = getenv("QFLASH_CUDA_BULK"), *bb = getenv("QFLASH_CUDA_BULK_BLOCKS");
    // kinds as QFLASH_CUDA_SKIP's: 1 out_proj, 2 lm_head, 4 ffn_in, 8 in_proj (the default: whole model 3152 -> 3002 us a step, notes)
    c->bulk = c->cc_major >= 9 ? (bk ? (int)strtol(bk, NULL, 0) : 8) : 0;
    c->bulk_blocks = bb && *bb == '1' ? 1 : 2;
    // a DeltaNet layer's step, out_proj and ffn_in in one kernel at one row (sm_90; QFLASH_CUDA_TAIL=1)
    const char *tl = getenv("QFLASH_CUDA_TAIL");
    c->tail = c->cc_major >= 9 && tl ? atoi(tl) : 0; // 2: the same kernel reading its weights in place (a diagnosis)
    const char *td = getenv("QFLASH_CUDA_TAIL_DSM"); // 0: the joined MoE fetches every down row after its count
    c->tail_dsm = !(td && *td == '0');
    const char *tw = getenv("QFLASH_CUDA_TAIL_NW"); // 16: the joined MoE in registers at 16 warps a block
    c->tail_nw = tw && atoi(tw) == 16 ? 16 : 8;
    // the one-kernel MoE's routing: 0 route_block, 1 route_fixed, 2 route_pairs (whole model 2996.9 ->
    // 2945.2 us a step in one call, notes session 7), 3 route_sort (the default: 2766.1 -> 2675.8, session 11)
    const char *ro = getenv("QFLASH_CUDA_ROUTE");
    c->route = ro ? atoi(ro) : 3;
    const char *pf = getenv("QFLASH_CUDA_MOE_PF"); // the one-kernel MoE's expert table in shared memory (moe_pf_table); 0: off
    c->moe_pf = !(pf && *pf == '0');
    // the DeltaNet step a value head per block, with out_proj's gated norm (k_gdn_head; QFLASH_CUDA_GDN_GN=0: off): whole
    // model 2948.1 -> 2820.0 us a step in one call (notes, session 9)
    const char *a1 = getenv("QFLASH_CUDA_ATT1"), *ag = getenv("QFLASH_CUDA_ATT_GATE");
    c->att1 = !(a1 && *a1 == '0');     // default on: whole model 2804.4 -> 2758.5 us a step with ATT_GATE (notes, session 10)
    c->att_gate = !(ag && *ag == '0');
    const char *cb = getenv("QFLASH_CUDA_COMB"); // 0: the attention's combine with a memory latency per split (attn_combine_head)
    c->comb = !(cb && *cb == '0');
    const char *gg = getenv("QFLASH_CUDA_GDN_GN");
    c->gdn_gn = !(gg && *gg == '0');
    unsigned m = skip ? (unsigned)strtoul(skip, NULL, 0) : 0u;
    if (m) fprintf(stderr, "qflash cuda: QFLASH_CUDA_SKIP=%#x: decode kernels of those kinds do nothing (timing only, results are wrong)\n", m);
    cudaMemcpyToSymbol(g_diag, &m, sizeof m, offsetof(diag, skip));
}

int qfc::trace_arm(ctx *c) {
    if (!c->trace.buf && cudaMalloc(&c->trace.buf, TRACE_CAP * sizeof(trec)) != cudaSuccess) c->trace.buf = NULL;
    if (!c->trace.buf) return 0;
    unsigned zero = 0, cap = TRACE_CAP;
    cudaMemcpyToSymbol(g_trace, &c->trace.buf, sizeof c->trace.buf);
    cudaMemcpyToSymbol(g_trace_n, &zero, sizeof zero);
    cudaMemcpyToSymbol(g_diag, &cap, sizeof cap, offsetof(diag, trace_cap));
    return 1;
}

unsigned qfc::trace_disarm(ctx *c) {
    unsigned n = 0, zero = 0;
    cudaMemcpyToSymbol(g_diag, &zero, sizeof zero, offsetof(diag, trace_cap));
    cudaMemcpyFromSymbol(&n, g_trace_n, sizeof n);
    return n < TRACE_CAP ? n : TRACE_CAP;
}

size_t qfc::argmax_scratch_bytes(void) { return (size_t)QF_DEC_ROWS * 8 * (AMAX_BLOCKS * 8 + 4); }
