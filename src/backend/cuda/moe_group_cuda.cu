// The MoE op for many rows (prefill, wide batches): the (row, expert) choices grouped by expert,
// then each used expert's weights read once per pass of its rows (32 or 64; the register form
// MG_TOK) by tensor-core products, where
// the GEMV path (ops_cuda.cu) reads a chosen expert's 6 MB once per row that chose it. Weights are
// bf16 as stored; each activation is split into two bf16 parts (hi + lo, ~16 bits kept, as
// cu_matmul does) with fp32 accumulation; --precision bf16 keeps one part, --precision fp32
// keeps the GEMV path (fp32 activations).
#include <mma.h>

#include "backend/cuda/cuda_int.cuh"
#include "backend/cuda/quant.cuh"

namespace {

using namespace qfc;
using namespace nvcuda;

#define MG_TOK 32         // rows of one expert per pass at most: 2 tiles of 16
#define MG_FEAT 64        // output features per block: a warp per 16
#define MG_THREADS 128

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> frag_w;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> frag_x;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_acc;

// Groups the NK = N * K choices by expert: expert e's slots are gstart[e] .. gstart[e + 1],
// slot_row[s] is the row slot s takes, slot_of[r * K + k] the slot of row r's choice k. The order
// within a group is the atomics': a slot's results do not depend on its place, since every output
// column of a tile is a sum of its own.
__global__ void k_mg_group(const int *topi, int NK, int K, int E, int *gstart, int *slot_row, int *slot_of) {
    extern __shared__ int sh[];
    int *cnt = sh, *cur = sh + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < NK; i += blockDim.x) atomicAdd(&cnt[topi[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int e = 0; e < E; e++) gstart[e] = cur[e] = s, s += cnt[e];
        gstart[E] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NK; i += blockDim.x) {
        int s = atomicAdd(&cur[topi[i]], 1);
        slot_row[s] = i / K, slot_of[i] = s;
    }
}

__device__ __forceinline__ void split_bf16(float f, __nv_bfloat16 *hi, __nv_bfloat16 *lo) {
    __nv_bfloat16 h = __float2bfloat16(f);
    *hi = h;
    if (lo) *lo = __float2bfloat16(f - __bfloat162float(h));
}

// xh[s] (and xl[s], the low parts) = x[slot_row[s]] as bf16 parts, for the NK slots.
__global__ void k_mg_gather(const float *x, const int *slot_row, int NK, int H, __nv_bfloat16 *xh, __nv_bfloat16 *xl) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)NK * H) return;
    int64_t s = i / H, c = i - s * H;
    split_bf16(x[(int64_t)slot_row[s] * H + c], xh + i, xl ? xl + i : NULL);
}

// acc[t] += w (16 rows) times tile t of 16 slots (their parts' rows at bh, bl with pitch ld, from
// column k on).
template <int TL>
__device__ __forceinline__ void mg_mma(frag_acc *acc, const frag_w &w, const __nv_bfloat16 *bh, const __nv_bfloat16 *bl, int ld) {
#pragma unroll
    for (int t = 0; t < TL; t++) {
        frag_x b;
        wmma::load_matrix_sync(b, bh + (int64_t)t * 16 * ld, ld);
        wmma::mma_sync(acc[t], w, b, acc[t]);
        if (bl) {
            wmma::load_matrix_sync(b, bl + (int64_t)t * 16 * ld, ld);
            wmma::mma_sync(acc[t], w, b, acc[t]);
        }
    }
}

// One warp's pass over TL tiles of an expert's slots (their x parts at xh, xl): gate and up rows
// j .. j + 16 (at G, U) against them, then h = silu(gate) * up for the nt slots, out as bf16 parts
// at hh, hl (slot-major, I wide). No block barrier: each warp streams its own rows, 4
// steps of loads in flight.
template <int TL>
__device__ void mg_gu_pass(const __nv_bfloat16 *G, const __nv_bfloat16 *U, const __nv_bfloat16 *xh, const __nv_bfloat16 *xl, int H, int I, int nt,
                           float *ow, __nv_bfloat16 *hh, __nv_bfloat16 *hl) {
    frag_acc g[TL], u[TL];
#pragma unroll
    for (int t = 0; t < TL; t++) wmma::fill_fragment(g[t], 0.0f), wmma::fill_fragment(u[t], 0.0f);
#pragma unroll 4
    for (int k = 0; k < H; k += 16) {
        frag_w wg, wu;
        wmma::load_matrix_sync(wg, G + k, H);
        wmma::load_matrix_sync(wu, U + k, H);
        mg_mma<TL>(g, wg, xh + k, xl ? xl + k : NULL, H);
        mg_mma<TL>(u, wu, xh + k, xl ? xl + k : NULL, H);
    }
    float *ou = ow + 16 * MG_TOK;
#pragma unroll
    for (int t = 0; t < TL; t++) {
        wmma::store_matrix_sync(ow + t * 16, g[t], MG_TOK, wmma::mem_row_major);
        wmma::store_matrix_sync(ou + t * 16, u[t], MG_TOK, wmma::mem_row_major);
    }
    __syncwarp();
    for (int q = threadIdx.x & 31; q < 16 * nt; q += 32) {
        int m = q & 15, n = q >> 4;
        float h = silu(ow[m * MG_TOK + n]) * ou[m * MG_TOK + n];
        split_bf16(h, hh + (int64_t)n * I + m, hl ? hl + (int64_t)n * I + m : NULL);
    }
    __syncwarp();
}

// Block (feature tile, expert e): h[s][j] = silu(gate_e[j] . x[s]) * (up_e[j] . x[s]) for the
// expert's slots s, a pass per MG_TOK of them; warp w takes features j .. j + 16.
__global__ void __launch_bounds__(MG_THREADS) k_mg_gate_up(const void *const *tab, int E, const int *gstart, const __nv_bfloat16 *xh,
                                                           const __nv_bfloat16 *xl, int H, int I, __nv_bfloat16 *hh, __nv_bfloat16 *hl) {
    __shared__ __align__(32) float out[MG_THREADS / 32][2 * 16 * MG_TOK];
    int e = blockIdx.y, s0 = gstart[e], cnt = gstart[e + 1] - s0;
    int warp = threadIdx.x / 32, j = blockIdx.x * MG_FEAT + warp * 16;
    if (!cnt || j >= I) return; // no block barrier: warps leave on their own
    const __nv_bfloat16 *G = (const __nv_bfloat16 *)tab[e] + (int64_t)j * H, *U = (const __nv_bfloat16 *)tab[E + e] + (int64_t)j * H;
    for (int t0 = 0; t0 < cnt; t0 += MG_TOK) {
        int nt = min(MG_TOK, cnt - t0);
        int64_t xo = (int64_t)(s0 + t0) * H, ho = (int64_t)(s0 + t0) * I + j;
        if (nt > 16) mg_gu_pass<2>(G, U, xh + xo, xl ? xl + xo : NULL, H, I, nt, out[warp], hh + ho, hl ? hl + ho : NULL);
        else mg_gu_pass<1>(G, U, xh + xo, xl ? xl + xo : NULL, H, I, nt, out[warp], hh + ho, hl ? hl + ho : NULL);
    }
}

// One warp's pass of the down product: rows i .. i + 16 of the expert's down matrix (at D) against
// TL tiles of slots' h parts (at bh, bl), into y (slot-major, H wide) for the nt slots.
template <int TL>
__device__ void mg_dn_pass(const __nv_bfloat16 *D, const __nv_bfloat16 *bh, const __nv_bfloat16 *bl, int H, int I, int nt, float *ow, float *y) {
    frag_acc acc[TL];
#pragma unroll
    for (int t = 0; t < TL; t++) wmma::fill_fragment(acc[t], 0.0f);
#pragma unroll 4
    for (int k = 0; k < I; k += 16) {
        frag_w w;
        wmma::load_matrix_sync(w, D + k, I);
        mg_mma<TL>(acc, w, bh + k, bl ? bl + k : NULL, I);
    }
#pragma unroll
    for (int t = 0; t < TL; t++) wmma::store_matrix_sync(ow + t * 16, acc[t], MG_TOK, wmma::mem_row_major);
    __syncwarp();
    for (int q = threadIdx.x & 31; q < 16 * nt; q += 32) {
        int m = q & 15, n = q >> 4;
        y[(int64_t)n * H + m] = ow[m * MG_TOK + n];
    }
    __syncwarp();
}

// Block (output tile, expert e): y[s][i] = down_e[i] . h[s] for the expert's slots (their h parts
// adjacent, slot-major), a pass per MG_TOK of them.
__global__ void __launch_bounds__(MG_THREADS) k_mg_down(const void *const *tab, int E, const int *gstart, const __nv_bfloat16 *hh,
                                                        const __nv_bfloat16 *hl, int H, int I, float *y) {
    __shared__ __align__(32) float out[MG_THREADS / 32][16 * MG_TOK];
    int e = blockIdx.y, s0 = gstart[e], cnt = gstart[e + 1] - s0;
    int warp = threadIdx.x / 32, i = blockIdx.x * MG_FEAT + warp * 16;
    if (!cnt || i >= H) return;
    const __nv_bfloat16 *D = (const __nv_bfloat16 *)tab[2 * E + e] + (int64_t)i * I;
    for (int t0 = 0; t0 < cnt; t0 += MG_TOK) {
        int nt = min(MG_TOK, cnt - t0);
        int64_t ho = (int64_t)(s0 + t0) * I;
        float *yo = y + (int64_t)(s0 + t0) * H + i;
        if (nt > 16) mg_dn_pass<2>(D, hh + ho, hl ? hl + ho : NULL, H, I, nt, out[warp], yo);
        else mg_dn_pass<1>(D, hh + ho, hl ? hl + ho : NULL, H, I, nt, out[warp], yo);
    }
}

#define MC_KC 64            // columns of a stage
#define MC_LD (MC_KC + 8)   // a staged row's pitch (bf16): 144 bytes, 16-byte copies stay aligned

// Stages in the ring of k_mg_cp<NM, TL> (all but one in flight while one is summed): a pass of 32 slots
// keeps 4 (two blocks an SM at NM 2), a pass of 64 slots 3 (its stages are larger; still two).
// Quantised weights (F) are decoded into a stage by the threads themselves (a hi and a lo bf16 part
// of each weight, the rows of the lo parts after the inputs'), so two stages do: only the inputs
// are in flight.
__host__ __device__ constexpr int mc_stages(int tl, int f = QK_BF16) { return f != QK_BF16 ? 2 : tl == 2 ? 4 : 3; }
__host__ __device__ constexpr size_t mc_stage_elems(int nm, int tl, int f = QK_BF16) { return (size_t)(nm * (f != QK_BF16 ? 2 : 1) + tl / 2) * 64 * MC_LD; }

// Unit u of a quantised row (its bytes w, its scales sc) decoded into v: 16 weights (int4: 32) in
// column order.
template <int F>
__device__ __forceinline__ void qk_unit_vals(uint4 w, float2 sc, float *v) {
    uint32_t q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 16; j++) {
        uint32_t b = (q[j / 4] >> (8 * (j % 4))) & 0xffu;
        if constexpr (F == QK_I4) v[j] = sc.x * (float)(b & 15u) + sc.y, v[j + 16] = sc.x * (float)(b >> 4) + sc.y;
        else if constexpr (F == QK_I8) v[j] = sc.x * (float)(int8_t)b;
        else v[j] = qk_e4m3(b) * sc.x;
    }
}

// A stage's quantised weight rows (NM * 64 from f0, columns k0 ..), decoded: hi parts at sw, lo
// parts at swl (pitch MC_LD).
template <int F, int NM>
__device__ __forceinline__ void mc_dequant(__nv_bfloat16 *sw, __nv_bfloat16 *swl, const void *W0, const void *W1, int f0, int R, int K, int k0) {
    constexpr int CPU = F == QK_I4 ? 32 : 16, UPR = MC_KC / CPU; // columns a unit, units a row's stage
    int qo = qk_qoff(F, K);
    for (int q = threadIdx.x; q < NM * 64 * UPR; q += blockDim.x) {
        int r = q / UPR, uu = q % UPR, row = f0 + (r & 63), u = k0 / CPU + uu;
        if (row >= R) continue;
        const void *W = r < 64 ? W0 : W1;
        const uint8_t *rp = qk_row<F>(W, row, K);
        float v[CPU];
        qk_unit_vals<F>(*((const uint4 *)(rp + qo) + u), qk_scale<F>(rp, K, u, qk_band<F>(W, R, row, K)), v);
#pragma unroll
        for (int j = 0; j < CPU; j += 2) {
            __nv_bfloat162 h = __floats2bfloat162_rn(v[j], v[j + 1]);
            __nv_bfloat162 l = __floats2bfloat162_rn(v[j] - __low2float(h), v[j + 1] - __high2float(h));
            *(__nv_bfloat162 *)(sw + r * MC_LD + uu * CPU + j) = h;
            *(__nv_bfloat162 *)(swl + r * MC_LD + uu * CPU + j) = l;
        }
    }
}

// The rows and columns of stage c (columns c * MC_KC ..) into ring stage b: NM * 64 weight rows
// from f0 (rows past R left as they are: no warp sums them) and the pass's 16 TL input slots' parts.
template <int NM, int TL, int F = QK_BF16>
__device__ __forceinline__ void mc_issue(__nv_bfloat16 *ring, int b, int c, const void *W0v, const void *W1v, int f0, int R, int K,
                                         const __nv_bfloat16 *inh, const __nv_bfloat16 *inl) {
    __nv_bfloat16 *sw = ring + (size_t)b * mc_stage_elems(NM, TL, F), *sx = sw + NM * 64 * MC_LD, *sxl = sx + 16 * TL * MC_LD;
    int k0 = c * MC_KC;
    if constexpr (F != QK_BF16) mc_dequant<F, NM>(sw, sxl + 16 * TL * MC_LD, W0v, W1v, f0, R, K, k0);
    const __nv_bfloat16 *W0 = (const __nv_bfloat16 *)W0v, *W1 = (const __nv_bfloat16 *)W1v;
    for (int q = threadIdx.x; F == QK_BF16 && q < NM * 64 * 8; q += blockDim.x) {
        int r = q >> 3, p = (q & 7) * 8, row = f0 + (r & 63);
        if (row < R) cp16(sw + r * MC_LD + p, (r < 64 ? W0 : W1) + (int64_t)row * K + k0 + p);
    }
    for (int q = threadIdx.x; q < 16 * TL * 8; q += blockDim.x) {
        int n = q >> 3, p = (q & 7) * 8;
        cp16(sx + n * MC_LD + p, inh + (int64_t)n * K + k0 + p);
        if (inl) cp16(sxl + n * MC_LD + p, inl + (int64_t)n * K + k0 + p);
    }
}

// One stage's tensor-core steps of a warp: its 16 rows of each of the NM matrices against the
// TL tiles of 16 slots. The slots' fragments are loaded once for all NM matrices; each tile's sum
// takes the hi part then the lo part a step, as mg_mma.
// swl (quantised weights): the weights' lo parts, each times the inputs' hi part as well.
template <int NM, int TL>
__device__ __forceinline__ void mc_steps(const __nv_bfloat16 *sw, const __nv_bfloat16 *sx, bool lo, int warp, frag_acc (&acc)[NM][TL],
                                         const __nv_bfloat16 *swl = nullptr) {
#pragma unroll
    for (int kk = 0; kk < MC_KC; kk += 16) {
        frag_x xh[TL], xl[TL];
#pragma unroll
        for (int t = 0; t < TL; t++) {
            wmma::load_matrix_sync(xh[t], sx + t * 16 * MC_LD + kk, MC_LD);
            if (lo) wmma::load_matrix_sync(xl[t], sx + (16 * TL + t * 16) * MC_LD + kk, MC_LD);
        }
#pragma unroll
        for (int m = 0; m < NM; m++) {
            frag_w w;
            wmma::load_matrix_sync(w, sw + (m * 64 + warp * 16) * MC_LD + kk, MC_LD);
#pragma unroll
            for (int t = 0; t < TL; t++) {
                wmma::mma_sync(acc[m][t], w, xh[t], acc[m][t]);
                if (lo) wmma::mma_sync(acc[m][t], w, xl[t], acc[m][t]);
            }
            if (swl) {
                wmma::load_matrix_sync(w, swl + (m * 64 + warp * 16) * MC_LD + kk, MC_LD);
#pragma unroll
                for (int t = 0; t < TL; t++) wmma::mma_sync(acc[m][t], w, xh[t], acc[m][t]);
            }
        }
    }
}

// Block (feature tile f0 = 64 x, expert e) as k_mg_gate_up (NM 2: gate and up rows, input x's
// parts, out h's parts) or k_mg_down (NM 1: down rows, input h's parts, out y), a pass per 16 TL
// slots, but the weight rows and the pass's input slots reach shared memory by cp.async, 16
// coalesced bytes a copy, through a ring of stages of MC_KC columns, all but one in flight while
// the warps' tensor-core steps read the one that landed; one block barrier a stage. TL 4 (passes
// of 64 slots, for prompts whose experts average more than 24) reads each weight once per 64 slots
// where TL 2 reads it once per 32. (The default; option mg_cp=0 gives the register form back.
// Session 12 at 512 rows of the real shape: 839 us against 1939, 45% of the copy bandwidth for the
// bytes read once against 19%.) K: the summed width (H or I), R: the matrices' rows (I or H), also
// the output's pitch.
// dw (NM 1, bf16): one dense matrix for dn slots instead (tab and gstart unused), a decode step's
// product, blockIdx.y its split of the K columns (gridDim.y of them) into y's split-th n x R block.
template <int NM, int TL, int F = QK_BF16> // F: the experts' format
__global__ void __launch_bounds__(MG_THREADS) k_mg_cp(const void *const *tab, int E, const int *gstart, const __nv_bfloat16 *inh,
                                                      const __nv_bfloat16 *inl, int K, int R, __nv_bfloat16 *hh, __nv_bfloat16 *hl, float *y,
                                                      const void *dw, int dn) {
    constexpr int S = mc_stages(TL, F), P = 16 * TL; // stages, slots a pass
    extern __shared__ __align__(128) unsigned char mc_smem[];
    __nv_bfloat16 *ring = (__nv_bfloat16 *)mc_smem;
    int e = dw ? 0 : blockIdx.y, s0 = dw ? 0 : gstart[e], cnt = dw ? dn : gstart[e + 1] - s0; // block-uniform: before any barrier
    if (!cnt) return;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, f0 = blockIdx.x * 64, fw = f0 + warp * 16, nk = K / MC_KC / (dw ? gridDim.y : 1);
    const void *W0 = dw ? dw : tab[NM == 2 ? e : 2 * E + e], *W1 = dw ? dw : tab[E + e];
    if (dw) { // this split's columns: the rows keep their pitch K
        int64_t k0 = (int64_t)blockIdx.y * nk * MC_KC;
        W0 = W1 = (const __nv_bfloat16 *)dw + k0, inh += k0, inl = inl ? inl + k0 : NULL, y += (int64_t)blockIdx.y * dn * R;
    }
    for (int t0 = 0; t0 < cnt; t0 += P) {
        int nt = min(P, cnt - t0);
        const __nv_bfloat16 *ph = inh + (int64_t)(s0 + t0) * K, *pl = inl ? inl + (int64_t)(s0 + t0) * K : NULL;
        for (int c = 0; c < S - 1; c++) {
            if (c < nk) mc_issue<NM, TL, F>(ring, c, c, W0, W1, f0, R, K, ph, pl);
            cp_commit();
        }
        frag_acc acc[NM][TL];
#pragma unroll
        for (int m = 0; m < NM; m++)
#pragma unroll
            for (int t = 0; t < TL; t++) wmma::fill_fragment(acc[m][t], 0.0f);
        for (int c = 0; c < nk; c++) {
            cp_wait<S - 2>(); // this thread's copies of stage c have landed
            __syncthreads();  // everyone's have; stage c - 1 is summed by every warp
            if (c + S - 1 < nk) mc_issue<NM, TL, F>(ring, (c + S - 1) % S, c + S - 1, W0, W1, f0, R, K, ph, pl);
            cp_commit();
            if (fw >= R) continue;
            const __nv_bfloat16 *sw = ring + (size_t)(c % S) * mc_stage_elems(NM, TL, F);
            mc_steps<NM, TL>(sw, sw + NM * 64 * MC_LD, inl != NULL, warp, acc, F != QK_BF16 ? sw + (NM * 64 + 32 * TL) * MC_LD : nullptr);
        }
        cp_wait<0>();
        __syncthreads(); // the ring is free: its room takes the sums
        if (fw < R) {
            float *ow = (float *)mc_smem + warp * NM * 16 * P;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int t = 0; t < TL; t++) wmma::store_matrix_sync(ow + m * 16 * P + t * 16, acc[m][t], P, wmma::mem_row_major);
            __syncwarp();
            for (int q = lane; q < 16 * nt; q += 32) {
                int mm = q & 15, n = q >> 4;
                int64_t o = (int64_t)(s0 + t0 + n) * R + fw + mm;
                if (fw + mm >= R) continue; // a last tile past R (dense products: R need not be whole tiles)
                if constexpr (NM == 2) split_bf16(silu(ow[mm * P + n]) * ow[16 * P + mm * P + n], hh + o, hl ? hl + o : NULL);
                else y[o] = ow[mm * P + n];
            }
        }
        __syncthreads(); // the sums are read before the next pass's copies land
    }
}

size_t mc_smem_bytes(int nm, int tl, int f = QK_BF16) { return (size_t)mc_stages(tl, f) * mc_stage_elems(nm, tl, f) * sizeof(__nv_bfloat16); }

// Both products of the grouped experts by cp.async stages, passes of 16 TL slots.
template <int TL, int F = QK_BF16>
void mc_launch(ctx *c, const void **tab, int E, int H, int I, const int *gstart, const __nv_bfloat16 *xh, const __nv_bfloat16 *xl, __nv_bfloat16 *hh,
               __nv_bfloat16 *hl, float *y) {
    LAUNCH_S(c, (k_mg_cp<2, TL, F>), dim3((I + 63) / 64, E), MG_THREADS, mc_smem_bytes(2, TL, F), (const void *const *)tab, E, gstart, xh, xl, H, I, hh, hl,
             (float *)NULL, (const void *)NULL, 0);
    LAUNCH_S(c, (k_mg_cp<1, TL, F>), dim3((H + 63) / 64, E), MG_THREADS, mc_smem_bytes(1, TL, F), (const void *const *)tab, E, gstart, hh, hl, I, H,
             (__nv_bfloat16 *)NULL, (__nv_bfloat16 *)NULL, y, (const void *)NULL, 0);
}

// The shared memory the cp.async kernels of format F ask for past the 48 KB a kernel gets unasked.
template <int TL, int F>
static void mc_attr() {
    cudaFuncSetAttribute(k_mg_cp<2, TL, F>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)mc_smem_bytes(2, TL, F));
    cudaFuncSetAttribute(k_mg_cp<1, TL, F>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)mc_smem_bytes(1, TL, F));
}

// out[r] = sum over k (in order) of topw[r][k] * y[slot of (r, k)]: k_expert_sum's sum.
__global__ void k_mg_sum(const float *y, const int *slot_of, const float *topw, int K, int N, int H, float *out) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)N * H) return;
    int64_t r = i / H, c = i % H;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += topw[r * K + k] * y[(int64_t)slot_of[r * K + k] * H + c];
    out[i] = acc;
}

} // namespace

// Every kernel of k_mg_cp's forms opted in to the shared memory it asks for (once per context).
static void mc_attrs(ctx *c) {
    if (c->mg_cp_attr) return;
    mc_attr<2, QK_BF16>(), mc_attr<4, QK_BF16>(), mc_attr<2, QK_I8>(), mc_attr<2, QK_I4>();
    c->mg_cp_attr = 1;
}

int qfc::tc_splits(ctx *c, const qf_mat *w, int n) {
    int R = (int)w->rows, K = (int)w->cols;
    if (!QF_LAB(c, mg_cp) || c->fp32 || K % MC_KC || (uintptr_t)w->data % 16 || n < 1) return 0;
    // int8 rows (a quantised trunk) are decoded into the stages whole: one split (a split's column
    // offset would have to reach the units, not the pointer)
    if (w->dtype == QF_Q_I8B32) return qk_unit_ok(QK_I8, K) ? 1 : 0;
    if (w->dtype != QF_DT_BF16) return 0;
    // few output tiles (out_proj: 32 of 4096 columns each) leave most SMs idle: split the columns
    // while the tiles are fewer than 4 blocks an SM and a split keeps 4 stages or more
    int tiles = (R + 63) / 64, want = 4 * (c->sms > 0 ? c->sms : 132), splits = 1;
    while (tiles * splits < want && (K / MC_KC) % (2 * splits) == 0 && K / MC_KC / (2 * splits) >= 4) splits *= 2;
    return splits;
}

void qfc::tc_dense(ctx *c, const qf_mat *w, const __nv_bfloat16 *xh, const __nv_bfloat16 *xl, int n, int splits, float *y) {
    int R = (int)w->rows, K = (int)w->cols;
    mc_attrs(c);
    dim3 g((R + 63) / 64, splits);
    if (w->dtype == QF_Q_I8B32) // passes of 32 rows
        LAUNCH_S(c, (k_mg_cp<1, 2, QK_I8>), g, MG_THREADS, mc_smem_bytes(1, 2, QK_I8), (const void *const *)NULL, 1, (const int *)NULL, xh, xl, K, R,
                 (__nv_bfloat16 *)NULL, (__nv_bfloat16 *)NULL, y, (const void *)w->data, n);
    else if (n <= 32)
        LAUNCH_S(c, (k_mg_cp<1, 2>), g, MG_THREADS, mc_smem_bytes(1, 2), (const void *const *)NULL, 1, (const int *)NULL, xh, xl, K, R,
                 (__nv_bfloat16 *)NULL, (__nv_bfloat16 *)NULL, y, (const void *)w->data, n);
    else
        LAUNCH_S(c, (k_mg_cp<1, 4>), g, MG_THREADS, mc_smem_bytes(1, 4), (const void *const *)NULL, 1, (const int *)NULL, xh, xl, K, R,
                 (__nv_bfloat16 *)NULL, (__nv_bfloat16 *)NULL, y, (const void *)w->data, n);
}

// moe_grouped's group starts, slot maps and x's and h's bf16 parts for s->rows rows (none where
// it never runs).
size_t qfc::moe_grouped_scratch(ctx *c, const qf_scratch_shape *s) {
    if (!QF_LAB(c, mg) || c->fp32 || s->rows < c->mg_min_rows) return 0;
    size_t NK = (size_t)s->rows * s->top_k, ints = align256(((size_t)s->n_experts + 1 + 2 * NK) * sizeof(int));
    return ints + 2 * align256((NK + 64) * s->hidden * 2) + 2 * align256((NK + 64) * s->expert_ffn * 2);
}

int qfc::moe_grouped(ctx *c, const qf_moe_args *a, const void **tab, const int *topi, const float *topw, float *y) {
    int N = a->N, K = a->top_k, H = a->hidden, I = a->ffn, E = a->n_experts, NK = N * K;
    if (!QF_LAB(c, mg) || c->fp32 || N < c->mg_min_rows || H % 16 || I % 16 || E > 4096) return 0;
    int dt = a->experts[0].gate.dtype, F = qk_of(dt);
    for (int e = 0; e < E; e++)
        if (a->experts[e].gate.dtype != dt || a->experts[e].up.dtype != dt || a->experts[e].down.dtype != dt) return 0;
    // fp8 experts keep the GEMV path until their grouped form (mc_dequant<QK_F8>) is instantiated and
    // checked on a device (int8 and int4 are)
    if (dt != QF_DT_BF16 && (F == QK_BF16 || F == QK_F8 || !QF_LAB(c, mg_cp) || !qk_unit_ok(F, H) || !qk_unit_ok(F, I) || H % MC_KC || I % MC_KC)) return 0;
    int two = !c->bf16_single;
    // x's and h's parts padded by a pass of slots: a pass's last tile reads whole 16-slot columns
    size_t ints = align256((size_t)(E + 1 + 2 * NK) * sizeof(int)), xb = align256((size_t)(NK + 64) * H * 2), hb = align256((size_t)(NK + 64) * I * 2);
    char *s = (char *)scratch(c, &c->mg_buf, &c->mg_cap, ints + 2 * xb + 2 * hb);
    if (!s) return 0;
    int *gstart = (int *)s, *slot_row = gstart + E + 1, *slot_of = slot_row + NK;
    __nv_bfloat16 *xh = (__nv_bfloat16 *)(s + ints), *xl = two ? (__nv_bfloat16 *)(s + ints + xb) : NULL;
    __nv_bfloat16 *hh = (__nv_bfloat16 *)(s + ints + 2 * xb), *hl = two ? (__nv_bfloat16 *)(s + ints + 2 * xb + hb) : NULL;
    LAUNCH_S(c, k_mg_group, 1, 1024, 2 * E * sizeof(int), topi, NK, K, E, gstart, slot_row, slot_of);
    LAUNCH(c, k_mg_gather, blocks((int64_t)NK * H, 256), 256, a->x, slot_row, NK, H, xh, xl);
    if (QF_LAB(c, mg_cp)) mc_attrs(c);
    if (F == QK_I8) mc_launch<2, QK_I8>(c, tab, E, H, I, gstart, xh, xl, hh, hl, y); // quantised: passes of 32 slots
    else if (F == QK_I4) mc_launch<2, QK_I4>(c, tab, E, H, I, gstart, xh, xl, hh, hl, y);
    else if (QF_LAB(c, mg_cp) && H % MC_KC == 0 && I % MC_KC == 0) {
        // passes of 64 slots once the experts average more than 24 (option mg_p64=0: 32 always)
        if (QF_LAB(c, mg_p64) && NK > 24 * E) mc_launch<4>(c, tab, E, H, I, gstart, xh, xl, hh, hl, y);
        else mc_launch<2>(c, tab, E, H, I, gstart, xh, xl, hh, hl, y);
    } else {
        LAUNCH(c, k_mg_gate_up, dim3((I + MG_FEAT - 1) / MG_FEAT, E), MG_THREADS, (const void *const *)tab, E, gstart, xh, xl, H, I, hh, hl);
        LAUNCH(c, k_mg_down, dim3((H + MG_FEAT - 1) / MG_FEAT, E), MG_THREADS, (const void *const *)tab, E, gstart, hh, hl, H, I, y);
    }
    LAUNCH(c, k_mg_sum, blocks((int64_t)N * H, 256), 256, y, slot_of, topw, K, N, H, a->out);
    return 1;
}
