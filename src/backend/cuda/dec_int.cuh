// What the decode kernel files (dec_*_cuda.cu) share: the fused decode ops they define (ops.h
// qf_dec_ops; one file per job: products and the greedy pick, the DeltaNet step, attention, the
// MoE block) and the device helpers that stage a product's input. A decode step has one token per
// sequence and at most QF_DEC_ROWS sequences; each op replaces a chain of plain ops (ops.h names
// it) so a layer runs as 6-7 kernels instead of ~20: at batch 1 a 35B-A3B step is ~250 launches,
// and each launch boundary costs a few microseconds of an otherwise bandwidth-bound step.
// tests/test_cuda.c checks every one against its chain.
#ifndef QF_CUDA_DEC_INT_CUH
#define QF_CUDA_DEC_INT_CUH

#include "backend/cuda/cuda_int.cuh"

namespace qfc {

void dec_matmul(qf_backend *be, const qf_mat *w, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, float *y);
void dec_argmax(qf_backend *be, const float *x, int n, int cols, int32_t *out);
void dec_draw(qf_backend *be, float *logits, int n, int cols, const qf_draw *d, int32_t *out);
void dec_gdn(qf_backend *be, const qf_gdn_dec *a);
int dec_gdn_gn(qf_backend *be, const qf_gdn_dec *a, const qf_pre *gn);
void dec_attention(qf_backend *be, const qf_attn_dec *a);
int dec_attn_gate(qf_backend *be, const qf_attn_dec *a);
void dec_moe(qf_backend *be, const qf_moe_dec *a);
void dec_sparse_counts(qf_backend *be, uint64_t out[4]);
void dec_page_select(qf_backend *be, const qf_attn_dec *a, const int *n_pages, const int *budget, int32_t *const *sel);
void dec_matmul_sparse(qf_backend *be, const qf_mat *wt, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, const float *thr,
                       float *y);

// Blocks of a kernel resident per SM at this dynamic shared memory (and the kernel's opt-in to it).
int resident(ctx *c, const void *fn, int threads, size_t smem);

} // namespace qfc

namespace {

using namespace qfc;

#define PW 2 // rows per warp in the fused products

struct dpre {
    int kind;
    const float *w, *g;
    int g_stride, g_hstride, head;
    float eps;
};

// The device's copy of a pre (NULL: none).
inline dpre dpre_of(const qf_pre *pre) {
    if (!pre) return {QF_PRE_NONE, NULL, NULL, 0, 0, 1, 0.0f};
    return {pre->kind, pre->w, pre->g, pre->g_stride, pre->g_hstride, pre->head > 0 ? pre->head : 1, pre->eps};
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
template <int NT>
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

// Block-wide exclusive prefix sum of v (every thread one value); *total gets the sum.
__device__ inline int block_scan(int v, int *wsum, int *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = blockDim.x / 32, s = v;
    for (int o = 1; o < 32; o <<= 1) {
        int u = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += u;
    }
    if (lane == 31) wsum[warp] = s;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nw ? wsum[lane] : 0, ws = w;
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(0xffffffffu, ws, o);
            if (lane >= o) ws += u;
        }
        if (lane < nw) wsum[lane] = ws - w; // exclusive per warp
        if (lane == 31) *total = ws;
    }
    __syncthreads();
    return wsum[warp] + s - v;
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


} // namespace

#endif
