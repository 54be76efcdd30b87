// The MoE block of one token per sequence: routing, the chosen experts, the shared expert and
// the residual add.
#include "backend/cuda/dec_int.cuh"
#include "backend/cuda/quant.cuh"

namespace qfc {

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

// The chosen logits tw[0..K) (tw[0] the largest) become their weights exp(l - max) normalised over
// the chosen: the full softmax's sum over E cancels in the renormalisation. Every routing takes its
// weights here, so a row's weights are the same bits in the one-row and the many-row kernels.
__device__ __forceinline__ void chosen_weights(float *tw, int K) {
    int tid = threadIdx.x, lane = tid & 31;
    if (tid < 32) {
        float p = lane < K ? expf(tw[lane] - tw[0]) : 0.0f, ts = warp_sum(p);
        if (lane < K) tw[lane] = p / ts;
    }
    __syncthreads();
}

__device__ void route_block(const float *rl, int E, int K, int *ti, float *tw) {
    __shared__ float cv[ROUTE_CAND];
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
    for (int c = tid; c < nc; c += blockDim.x) {
        float m = cv[c];
        int mi = ci[c], r = cand_rank(cv, ci, nc, m, mi);
        if (r < K) ti[r] = mi, tw[r] = m;
    }
    __syncthreads();
    chosen_weights(tw, K);
}

// route_block's choice by all pairs (the default for shapes route_sort does not take; option route=2): the logits go to
// shared memory once, and each thread ranks its own against all E (16-byte broadcast reads, no
// atomics, one barrier between), so the ranking is one pass of E compares per thread instead of
// a warp rank, a shared count and a second rank over the candidates. Weights as chosen_weights.
// L2: rl was written by other blocks of the same kernel (read past L1).
template <bool L2 = false>
__device__ void route_pairs(const float *rl, int E, int K, int *ti, float *tw) {
    __shared__ __align__(16) float lv[MOE_MAX_E];
    int tid = threadIdx.x, E4 = (E + 3) & ~3;
    if (tid < K) ti[tid] = tid, tw[tid] = 0.0f; // NaN logits can leave ranks untaken: slots stay valid experts
    for (int i = tid; i < E4; i += blockDim.x) lv[i] = i < E ? (L2 ? __ldcg(rl + i) : rl[i]) : -INFINITY; // padding ranks after every logit
    __syncthreads();
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

// route=3 (the default where E <= 256, K <= 8; whole model 2766.1 -> 2675.8 us a step,
// same digest, docs/performance.md): route_pairs' choice by sorting networks. Each of 8 warps sorts its 32 logits by
// shuffles (15 steps) and keeps its first 8; warp 0 sorts those 64 (2 a lane, 21 steps) and takes
// the first K. The trace put route_pairs' ranking at 3-5 us a layer: 256 compares per thread in
// all 16 warps of an SM at once, issue-bound; this is ~40 shuffle steps in 8 warps, then one warp.
__device__ void route_sort(const float *rl, int E, int K, int *ti, float *tw) {
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
    chosen_weights(tw, K);
}

// Sparsity's expert rule (qf_ref_route_drop) on the block's routed weights tw (rank order, in
// shared memory): how many lead ranks are kept, their weights renormalised, the rest 0. Every
// thread calls it; tau 0: all K, the weights as routed.
__device__ int route_keep(float *tw, int K, float tau, int min_k) {
    __shared__ int kept;
    if (tau <= 0.0f) return K;
    if (threadIdx.x == 0) {
        int k = 0;
        while (k < K && (k < min_k || tw[k] >= tau)) k++;
        if (k < K) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += tw[j];
            for (int j = 0; j < K; j++) tw[j] = j < k ? tw[j] / sum : 0.0f;
        }
        kept = k;
    }
    __syncthreads();
    return kept;
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

// gu_row for quantised experts (format F): UL units (16 bytes) per lane and row, all of the gate
// and up row's loads at once, decoded in registers.
template <int F, int UL>
__device__ __forceinline__ float gu_row_q(const void *const *tab, int E, int e, int j, int H, int I, const float *xs, float inv, int lane) {
    const uint8_t *G = qk_row<F>(tab[e], j, H), *Up = qk_row<F>(tab[E + e], j, H);
    const float *gs = qk_band<F>(tab[e], I, j, H), *us = qk_band<F>(tab[E + e], I, j, H);
    int nu = qk_units(F, H), qo = qk_qoff(F, H);
    uint4 wg[UL], wu[UL];
    float2 sg[UL], su[UL];
#pragma unroll
    for (int q = 0; q < UL; q++) {
        int u = lane + 32 * q;
        if (u < nu) {
            wg[q] = __ldcs((const uint4 *)(G + qo) + u), wu[q] = __ldcs((const uint4 *)(Up + qo) + u);
            sg[q] = qk_scale<F>(G, H, u, gs), su[q] = qk_scale<F>(Up, H, u, us);
        }
    }
    float g = 0.0f, v = 0.0f;
#pragma unroll
    for (int q = 0; q < UL; q++) {
        int u = lane + 32 * q;
        if (u < nu) g += qk_unit<F>(wg[q], sg[q], xs + qk_ucol<F>(u)), v += qk_unit<F>(wu[q], su[q], xs + qk_ucol<F>(u));
    }
    g = warp_sum(g) * inv, v = warp_sum(v) * inv;
    return silu(g) * v;
}

// One output row i of the MoE down step, in registers: part q is expert slot q's down row (q = K:
// the shared expert's), PL 16-byte loads per lane; G parts are loaded at once (one memory latency
// for the whole row at I = 512). dp[q]: part q's matrix; wk[q] its weight; hs + q * I its input.
template <int PL>
struct dn_row {
    static constexpr int G = 18 / PL < 1 ? 1 : 18 / PL; // parts a round: 18 loads per lane in flight
    int rows; // the down matrices' rows (unused: bf16 rows need no scales)
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

// dn_row for quantised experts (format F, UL units a lane of a row of I): the experts' parts in
// groups of 8 at once; the shared expert's part (bf16, SL loads a lane) loaded with the first group.
template <int F, int UL, int SL>
struct dn_row_q {
    int rows;
    uint4 w[8][UL], ws[SL];
    float2 sc[8][UL];
    __device__ __forceinline__ void load(const uint16_t *const *dp, int K, int I, int S, int i, int q0) {
        int lane = threadIdx.x & 31, nu = qk_units(F, I), qo = qk_qoff(F, I);
#pragma unroll
        for (int g = 0; g < 8; g++) {
            int q = q0 + g;
            const uint8_t *row = qk_row<F>(dp[q < K ? q : 0], i, I);
            const float *band = qk_band<F>(dp[q < K ? q : 0], rows, i, I);
#pragma unroll
            for (int u = 0; u < UL; u++)
                if (q < K && lane + 32 * u < nu) w[g][u] = __ldcs((const uint4 *)(row + qo) + lane + 32 * u), sc[g][u] = qk_scale<F>(row, I, lane + 32 * u, band);
        }
        if (q0 == 0) {
            const uint4 *sh = (const uint4 *)(dp[K] + (int64_t)i * S);
#pragma unroll
            for (int u = 0; u < SL; u++)
                if (lane + 32 * u < S / 8) ws[u] = __ldcs(sh + lane + 32 * u);
        }
    }
    __device__ __forceinline__ float sum(const uint16_t *const *dp, const float *wk, const float *hs, int K, int I, int S, int i, int have) {
        int lane = threadIdx.x & 31, nu = qk_units(F, I);
        float acc = 0.0f;
        for (int q0 = 0; q0 < K || q0 == 0; q0 += 8) {
            if (!have) load(dp, K, I, S, i, q0);
            have = 0;
#pragma unroll
            for (int g = 0; g < 8; g++) {
                int q = q0 + g;
                if (q >= K) break;
                float d = 0.0f;
#pragma unroll
                for (int u = 0; u < UL; u++)
                    if (lane + 32 * u < nu) d += qk_unit<F>(w[g][u], sc[g][u], hs + q * I + qk_ucol<F>(lane + 32 * u));
                acc += wk[q] * d;
            }
            if (q0 == 0) {
                float d = 0.0f;
#pragma unroll
                for (int u = 0; u < SL; u++)
                    if (lane + 32 * u < S / 8) d += dot8s(ws[u], hs + K * I + (lane + 32 * u) * 8, lane);
                acc += wk[K] * d;
            }
        }
        return warp_sum(acc);
    }
};

// Block (slot k, column y, row t): routes row t itself (cheaper than a launch between), stages
// x * norm weight, then its warps walk the expert's ffn rows y*8 + warp, stepping by the grid.
// Blocks of column 0 write slot k's expert and weight (the down kernel reads them when early is off).
// early: x (the kernel two back wrote it) is staged before the wait; only the routing waits.
template <int HL, int F = QK_BF16> // F: the experts' format (HL: units a lane of a row when quantised)
__global__ void __launch_bounds__(256, 2) k_moe_gu(const void *const *tab, qf_moe_dec a, float *hbuf, int *topi, float *topw, int early,
                                                   unsigned long long *ctr) {
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
    int kk = route_keep(tw, K, a.drop_tau[t], a.min_k), e = k < kk ? ti[k] : -1, lane = tid & 31, j = blockIdx.y * (blockDim.x / 32) + tid / 32;
    if (blockIdx.y == 0 && tid == 0) topi[t * K + k] = e, topw[t * K + k] = tw[k];
    if (blockIdx.y == 0 && tid == 0 && a.chosen) a.chosen[t * K + k] = e; // for the expert store
    if (blockIdx.y == 0 && tid == 0 && ctr && a.drop_tau[t] > 0.0f) atomicAdd(ctr + 2, 1ull), atomicAdd(ctr + 3, e < 0 ? 1ull : 0ull);
    if (e < 0) return; // dropped by sparsity
    for (; j < I; j += gridDim.y * (blockDim.x / 32)) {
        float h;
        if constexpr (F == QK_BF16) h = gu_row<HL>(tab, E, e, j, H, xs, inv, lane);
        else h = gu_row_q<F, HL>(tab, E, e, j, H, I, xs, inv, lane);
        if (lane == 0) hbuf[((int64_t)t * K + k) * I + j] = h;
    }
}

// The shared expert's input silu(sh_g) * sh_u (from the router product's row rl) into hsh.
__device__ __forceinline__ void shared_in(const qf_moe_dec &a, const float *rl, float *hsh) {
    int E = a.n_experts, S = a.sh_ffn;
#pragma unroll 4
    for (int j = threadIdx.x; j < S; j += blockDim.x) hsh[j] = silu(rl[E + j]) * rl[E + S + j];
}

// Part kk of a down row (after the kk experts kept): the shared expert, weighted by its sigmoid gate.
__device__ __forceinline__ void shared_slot(const qf_moe_dec &a, const float *rl, const uint16_t *sh_down, float *wk, const uint16_t **dp, int kk) {
    if (threadIdx.x == 0) wk[kk] = sigmoid(rl[a.n_experts + 2 * a.sh_ffn]), dp[kk] = sh_down;
}

// Block (a warp per output row, stepping by the grid; row t): x[t][i] += sum_k w_k down_k[i] . h_k
// + sigmoid(shared logit) * sh_down[i] . silu(sh_g) * sh_u, a dn_row each. early: the routing is
// redone here from the router logits (two kernels back, so before the wait) and the warp's first
// loads and the shared expert's input go out before it; else the routing comes from gate/up
// (topi, topw).
template <class DN> // dn_row or dn_row_q
__global__ void __launch_bounds__(256, 2) k_moe_down(const void *const *tab, qf_moe_dec a, const uint16_t *sh_down, const float *hbuf, const int *topi,
                                                     const float *topw, int early) {
    extern __shared__ float4 dyn[];
    __shared__ float wk[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, t = blockIdx.y;
    int i = blockIdx.x * (blockDim.x / 32) + tid / 32;
    float *hs = (float *)dyn; // part q's input at hs + q * I
    const float *rl = a.rl + (int64_t)t * a.rl_stride;
    DN w;
    w.rows = H;
    int have = 0;
    int kk = K; // the experts kept (sparsity drops the last ranks)
    if (early) {
        route_block(rl, E, K, ti, wk);
        kk = route_keep(wk, K, a.drop_tau[t], a.min_k);
        if (tid < kk) dp[tid] = (const uint16_t *)tab[2 * E + ti[tid]];
        shared_slot(a, rl, sh_down, wk, dp, kk);
        __syncthreads();
        if (i < H) w.load(dp, kk, I, S, i, 0), have = 1;
        shared_in(a, rl, hs + kk * I);
        pdl_wait();
        pdl_launch();
    } else {
        pdl_wait();
        pdl_launch();
        if (a.drop_tau[t] > 0.0f)
            for (kk = 0; kk < K && topi[t * K + kk] >= 0;) kk++;
        if (tid < kk) wk[tid] = topw[t * K + tid], dp[tid] = (const uint16_t *)tab[2 * E + topi[t * K + tid]];
        shared_slot(a, rl, sh_down, wk, dp, kk);
        shared_in(a, rl, hs + kk * I);
    }
#pragma unroll 8
    for (int j = tid; j < kk * I / 4; j += blockDim.x) ((float4 *)hs)[j] = ((const float4 *)(hbuf + (int64_t)t * K * I))[j];
    __syncthreads();
    for (; i < H; i += gridDim.x * (blockDim.x / 32), have = 0) {
        float acc = w.sum(dp, wk, hs, kk, I, S, i, have);
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
// trip (the default: 1.7% of a whole step with route_sort; `option moe_pf=0`
// reads the table from memory). (=1, every gate/up byte asked for at once through a cp.async slot
// per warp, was slower and is gone: docs/performance.md.)
__device__ __forceinline__ const void *const *moe_pf_table(const void *const *tab, int E, void *at) {
    const void **st = (const void **)at;
    for (int i = threadIdx.x; i < 3 * E; i += blockDim.x) st[i] = tab[i];
    return st; // published by the barriers of x's staging and of the routing
}

// The whole MoE block of one row in one kernel (option moe1, default on): every block stages
// x * norm weight and routes; the grid's warps compute the chosen experts' gate/up rows; then each
// warp issues its down row's loads and the grid waits for every block's gate/up rows (a count,
// not a launch), so the down weights stream while the gate/up rows end. Blocks wait for each
// other: the grid is never larger than what the SMs hold at once.
// F: the experts' format; quantised, HL counts 16-byte units a lane of a gate/up row and DN is
// dn_row_q (the shared expert stays bf16).
template <int HL, int PL, int ROUTE, bool TB = false, int F = QK_BF16, class DN = dn_row<PL>> // ROUTE 2: route_pairs, 3: route_sort (the default); TB: moe_pf_table
__global__ void __launch_bounds__(256, 2) k_moe_one(const void *const *tab, qf_moe_dec a, const uint16_t *sh_down, float *hbuf, unsigned *cnt,
                                                    unsigned long long *ctr) {
    extern __shared__ float4 dyn[];
    __shared__ float red[32], wk[MOE_MAX_K + 1];
    __shared__ int ti[MOE_MAX_K];
    __shared__ const uint16_t *dp[MOE_MAX_K + 1];
    int E = a.n_experts, K = a.top_k, H = a.hidden, I = a.ffn, S = a.sh_ffn, tid = threadIdx.x, lane = tid & 31;
    int gw = blockIdx.x * (blockDim.x / 32) + tid / 32, nw = gridDim.x * (blockDim.x / 32);
    float *xs = (float *)dyn, *hs = xs + H; // x * norm weight; the down parts' inputs (part q at hs + q * I)
    if constexpr (TB) tab = moe_pf_table(tab, E, hs + K * I + S);
    float inv = stage_normed(a, a.x, xs, red); // x: written two kernels back
    pdl_wait();
    pdl_launch();
    if constexpr (ROUTE == 3) route_sort(a.rl, E, K, ti, wk);
    else route_pairs(a.rl, E, K, ti, wk);
    int kk = route_keep(wk, K, a.drop_tau[0], a.min_k); // the experts kept (sparsity drops the last ranks)
    if (tid < kk) dp[tid] = (const uint16_t *)tab[2 * E + ti[tid]];
    if (blockIdx.x == 0 && tid < K && a.chosen) a.chosen[tid] = tid < kk ? ti[tid] : -1; // for the expert store
    if (blockIdx.x == 0 && tid == 0 && ctr && a.drop_tau[0] > 0.0f) atomicAdd(ctr + 2, (unsigned long long)K), atomicAdd(ctr + 3, (unsigned long long)(K - kk));
    shared_slot(a, a.rl, sh_down, wk, dp, kk);
    __syncthreads();
    for (int r = gw; r < kk * I; r += nw) {
        int k = r / I;
        float h;
        if constexpr (F == QK_BF16) h = gu_row<HL>(tab, E, ti[k], r - k * I, H, xs, inv, lane);
        else h = gu_row_q<F, HL>(tab, E, ti[k], r - k * I, H, I, xs, inv, lane);
        if (lane == 0) hbuf[r] = h;
    }
    DN w;
    w.rows = H;
    int i = gw, have = i < H;
    if (have) w.load(dp, kk, I, S, i, 0);
    shared_in(a, a.rl, hs + kk * I);
    grid_arrive_wait(cnt);
#pragma unroll 8
    for (int j = tid; j < kk * I / 4; j += blockDim.x) ((float4 *)hs)[j] = __ldcg((const float4 *)hbuf + j); // L2: other SMs wrote it
    __syncthreads();
    grid_leave(cnt);
    for (; i < H; i += nw, have = 0) {
        float acc = w.sum(dp, wk, hs, kk, I, S, i, have);
        if (lane == 0) a.x[i] += acc;
    }
}

// One row: k_moe_one for the shapes it is built for (0: not, use the two kernels). One wave: the
// blocks wait for each other, so the grid is what the SMs hold of it at once.
typedef void (*one_fn)(const void *const *, qf_moe_dec, const uint16_t *, float *, unsigned *, unsigned long long *);

// k_moe_one for quantised experts at the shapes of Qwen3.5/3.6's MoE (hidden 2048, widths 512).
template <int F>
static one_fn moe_one_q(int H, int I, int S, int route) {
    if (H != 2048 || I > 512 || S > 512) return NULL;
    constexpr int HL = F == QK_I4 ? 2 : 4;
    return route == 3 ? k_moe_one<HL, 2, 3, true, F, dn_row_q<F, 1, 2>> : k_moe_one<HL, 2, 2, true, F, dn_row_q<F, 1, 2>>;
}

static int moe_one(ctx *c, const void **tab, const qf_moe_dec *a, float *hbuf) {
    int H = a->hidden, I = a->ffn, S = a->sh_ffn;
    typedef one_fn fn;
    int mc = I > S ? I : S;
    int f = QF_LAB(c, route) == 3 && (a->n_experts > 256 || a->top_k > 8) ? 2 : QF_LAB(c, route); // route_sort's shapes, else route_pairs
    int tb = QF_LAB(c, moe_pf) && H <= 2048 && mc <= 512;
    int F = qk_of(a->experts[0].gate.dtype);
    if (F != QK_BF16) tb = QF_LAB(c, moe_pf); /* moe_one_q's shapes */
    fn k = F == QK_I8                 ? moe_one_q<QK_I8>(H, I, S, f)
           : F == QK_I4              ? moe_one_q<QK_I4>(H, I, S, f)
           : F == QK_F8              ? moe_one_q<QK_F8>(H, I, S, f)
           : tb                        ? (H <= 256 && mc <= 256 ? (f == 3 ? k_moe_one<1, 1, 3, true> : k_moe_one<1, 1, 2, true>)
                                                              : (f == 3 ? k_moe_one<8, 2, 3, true> : k_moe_one<8, 2, 2, true>))
           : H <= 256 && mc <= 256  ? (f == 3 ? k_moe_one<1, 1, 3> : k_moe_one<1, 1, 2>)
           : H <= 2048 && mc <= 512 ? (f == 3 ? k_moe_one<8, 2, 3> : k_moe_one<8, 2, 2>)
           : H <= 4096 && mc <= 512 ? k_moe_one<16, 2, 2>
                                    : NULL;
    if (!k) return 0;
    size_t smem = (size_t)(H + a->top_k * I + S) * sizeof(float) + (tb ? (size_t)3 * a->n_experts * sizeof(void *) : 0);
    int grid = resident(c, (const void *)k, 256, smem) * (c->sms > 0 ? c->sms : 1);
    // after an expert cache's fill, a plain launch: the kernel reads the table before its wait
    launch(c, "k_moe_one", a->cache ? 0 : 1, k, dim3((unsigned)grid), dim3(256), (unsigned)smem, tab, *a, (const uint16_t *)a->sh_down->data, hbuf, c->moe_cnt, c->sp_ctr);
    return 1;
}

// The two kernels for quantised experts: units a lane of a gate/up row (HL) and of a down row (UL),
// loads a lane of the shared expert's bf16 down row (SL). 0: a shape they are not built for.
typedef void (*gu_qfn)(const void *const *, qf_moe_dec, float *, int *, float *, int, unsigned long long *);
typedef void (*dn_qfn)(const void *const *, qf_moe_dec, const uint16_t *, const float *, const int *, const float *, int);
template <int F>
static int moe_q_pick(int H, int I, int S, gu_qfn *gu, dn_qfn *dn) {
    int hl = (qk_units(F, H) + 31) / 32, ul = (qk_units(F, I) + 31) / 32, sl = (S / 8 + 31) / 32;
    *gu = hl <= 1 ? k_moe_gu<1, F> : hl <= 2 ? k_moe_gu<2, F> : hl <= 4 ? k_moe_gu<4, F> : hl <= 8 ? k_moe_gu<8, F> : NULL;
    *dn = sl > 2 ? NULL : ul <= 1 ? k_moe_down<dn_row_q<F, 1, 2>> : ul <= 2 ? k_moe_down<dn_row_q<F, 2, 2>> : ul <= 4 ? k_moe_down<dn_row_q<F, 4, 2>> : NULL;
    return *gu && *dn;
}
static int moe_q_kernels(int F, int H, int I, int S, gu_qfn *gu, dn_qfn *dn) {
    return F == QK_I8 ? moe_q_pick<QK_I8>(H, I, S, gu, dn) : F == QK_I4 ? moe_q_pick<QK_I4>(H, I, S, gu, dn) : moe_q_pick<QK_F8>(H, I, S, gu, dn);
}

// The two-kernel MoE (gate/up, then down) for a's rows; scratch s: routing heads, then hbuf.
static void moe_kernels(ctx *c, const void **tab, const qf_moe_dec *a, float *hbuf, char *s, int F) {
    int n = a->n, K = a->top_k, H = a->hidden, I = a->ffn;
    int *topi = (int *)s;
    float *topw = (float *)(s + (size_t)n * K * 4);
    size_t sm_gu = (size_t)H * sizeof(float), sm_dn = (size_t)(K * I + a->sh_ffn) * sizeof(float);
    // one wave of blocks, each looping over rows, so routing and staging are paid once per block
    // lanes hold 8 (l + 32 u) columns: HL loads per lane for a gate/up row, PL for a down part
    int HL = H <= 256 ? 1 : H <= 512 ? 2 : H <= 1024 ? 4 : H <= 2048 ? 8 : 16, mc = I > a->sh_ffn ? I : a->sh_ffn;
    int PL = mc <= 256 ? 1 : mc <= 512 ? 2 : mc <= 1024 ? 4 : 8;
    if (H > 4096 || mc > 2048) return dev_fail(c, "fused moe: hidden %d > 4096 or expert width %d > 2048 is not supported", H, mc);
    typedef void (*gu_fn)(const void *const *, qf_moe_dec, float *, int *, float *, int, unsigned long long *);
    typedef void (*dn_fn)(const void *const *, qf_moe_dec, const uint16_t *, const float *, const int *, const float *, int);
    gu_fn gu = HL == 1 ? k_moe_gu<1> : HL == 2 ? k_moe_gu<2> : HL == 4 ? k_moe_gu<4> : HL == 8 ? k_moe_gu<8> : k_moe_gu<16>;
    dn_fn dn = PL == 1 ? k_moe_down<dn_row<1>> : PL == 2 ? k_moe_down<dn_row<2>> : PL == 4 ? k_moe_down<dn_row<4>> : k_moe_down<dn_row<8>>;
    if (F != QK_BF16 && !moe_q_kernels(F, H, I, a->sh_ffn, &gu, &dn))
        return dev_fail(c, "fused moe: %s experts of hidden %d, width %d, shared width %d are not supported", qf_dtype_name(a->experts[0].gate.dtype), H, I, a->sh_ffn);
    int sms = c->sms > 0 ? c->sms : 1, gu_res = resident(c, (const void *)gu, 256, sm_gu) * sms;
    int dn_res = resident(c, (const void *)dn, 256, sm_dn) * sms;
    int gy = gu_res / (K * n), dx = dn_res / n;
    gy = gy < 1 ? 1 : gy > (I + 7) / 8 ? (I + 7) / 8 : gy;
    dx = dx < 1 ? 1 : dx > (H + 7) / 8 ? (H + 7) / 8 : dx;
    int pdl = a->cache ? 0 : 1, early = a->cache ? 0 : QF_LAB(c, early); // an expert cache's table is read only after its fill
    launch(c, "k_moe_gu", pdl, gu, dim3(K, gy, n), dim3(256), (unsigned)sm_gu, tab, *a, hbuf, topi, topw, early, c->sp_ctr);
    launch(c, "k_moe_down", 1, dn, dim3(dx, n), dim3(256), (unsigned)sm_dn, tab, *a, (const uint16_t *)a->sh_down->data, (const float *)hbuf,
           (const int *)topi, (const float *)topw, early);
}


void dec_moe(qf_backend *be, const qf_moe_dec *a) {
    ctx *c = C(be);
    const void **tab = expert_table(a->table);
    int n = a->n, K = a->top_k, H = a->hidden, I = a->ffn, E = a->n_experts;
    size_t head = ((size_t)n * K * 8 + 15) & ~(size_t)15;
    char *s = (char *)scratch(c, &c->moe, &c->moe_cap, head + (size_t)n * K * I * sizeof(float));
    if (!tab || !s) return dev_fail(c, "fused moe: %s", !tab ? "no device expert table (the expert store keeps one)" : "out of device memory");
    int F = qk_of(a->experts[0].gate.dtype);
    if (K > MOE_MAX_K || E > MOE_MAX_E || a->sh_down->dtype != QF_DT_BF16 || !qf_moe_dec_fits(a->experts[0].gate.dtype, H, I, a->sh_ffn) || a->sh_ffn % 8)
        return dev_fail(c, "fused moe: top-k %d > %d, %d experts > %d, or weights not in whole 16-byte units a row", K, MOE_MAX_K, E, MOE_MAX_E);
    float *hbuf = (float *)(s + head);
    xc_drop drop = {};
    for (int t = 0; t < n && t < QF_DEC_ROWS; t++) drop.tau[t] = a->drop_tau[t];
    drop.min_k = a->min_k;
    int host = xcache_hybrid(a->cache, a->rl, n, K, drop); // misses computed on the host beside the kernels below
    if (a->cache) xcache_resolve(c, a->cache, NULL, 0, a->rl, a->rl_stride, n, K, drop, host);
    if (host) xcache_host_start(c, a->cache, a->x, a->norm_w, a->eps, H, a->rl, a->rl_stride, n, K);
    if (a->cache) xcache_fill(c, a->cache), xcache_link(c, a->cache); // beside the host's share, as the link would be
    if (!(n == 1 && QF_LAB(c, moe1) && c->moe_cnt && (F == QK_BF16 || QF_LAB(c, moe_pf)) && moe_one(c, tab, a, hbuf))) moe_kernels(c, tab, a, hbuf, s, F);
    if (host) xcache_host_join(c, a->cache, a->x, n, H);
}

} // namespace qfc
