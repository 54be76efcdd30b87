// step_probe: how fast can ONE persistent kernel run a decode step's layers of Qwen3.6-35B-A3B at
// batch 1? The engine launches ~5 kernels a layer and loses ~30 us a layer to their boundaries
// (docs/notes.md, sessions 5-13); the only design left that could reach 650 tok/s (1538 us a step:
// ~32.5 us a layer beside the lm_head) is one kernel per step whose blocks never leave and stream
// the next phase's weights while the current phase's dependency chain runs. Before writing that
// engine kernel this probe measures its skeleton at the real sizes and dependency points:
//
//   in_proj [12352 x 2048] on rmsnorm(x) | grid barrier | DeltaNet-like step over a 32 x 128 x 128
//   fp32 state (read and written) | barrier | out_proj [2048 x 4096] into x | barrier | ffn_in
//   [1281 x 2048] (router 256, shared gate/up 2 x 512, shared gate 1) | barrier | top-8 of 256 in
//   every block, the chosen experts' gate/up rows (8 x 2 x [512 x 2048]) | barrier | down rows
//   (8 x [2048 x 512] + the shared expert's) into x | barrier | next layer.
//
// 129.2 MB a layer (30.0 us at the 4.3 TB/s the H200's copy measures). Every layer has its own
// weights and 256 experts (1.6 GB), so nothing is served from L2 across layers. The DeltaNet step
// is simplified (no conv, one-token delta rule with l2-normed q/k, no gated norm) and attention
// layers are left out: the probe is about bytes, boundaries and prefetch, and the numbers it gives
// are a lower bound for the real kernel.
//
// Modes (the same sums in the same order in every mode, so modes 0 and 1 must agree bit for bit):
//   0: dense rows through a per-warp ring of 3 bulk-copied 4 KB slots, refilled within a phase only
//      (each phase asks for its first bytes after its barrier: a fused kernel without prefetch);
//   1: the same ring running ahead across barriers and layers (a phase's first rows arrive while
//      the phases before it finish; the next layer's in_proj streams during the MoE's routing);
//   2: mode 1 without the grid barriers (wrong results; the time of the bytes alone).
// Build: part of the CUDA build (target step_probe, sm_90 only). Run: step_probe [layers] [iters]
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/bulk.cuh"
#include "backend/cuda/cuda_int.cuh"

using qfc::bf16f;
using qfc::silu;
using qfc::warp_sum;

#define HID 2048
#define NQK 16
#define NV 32
#define DK 128
#define IN_ROWS (2 * NQK * DK + 2 * NV * DK + 2 * NV) // q, k, v, z, b, a: 12352
#define O_COLS (NV * DK)
#define NE 256
#define TOPK 8
#define FF 512
#define F_ROWS (NE + 2 * FF + 1)
// Block shape (-D to override): one block a SM of NW warps. NW 8 gives 255 registers a thread;
// every warp holds GU_PAIRS (gate, up) row pairs in flight (2 spill even at 255: the compiler
// unpacks every loaded bf16 before the sums), its first DN_PRE down rows and ST_PRE state columns
// from before their barriers, and NS ring slots of 4 KB (192 KB a block).
#ifndef NW
#define NW 8
#endif
#ifndef NS
#define NS (48 / NW)
#endif
#ifndef GU_PAIRS
#define GU_PAIRS 1
#endif
#define ST_PRE (32 / NW) // 4096 state columns over 132 x NW warps
#define DN_PRE (16 / NW) // 2048 down rows over 132 x NW warps
#define MAXL 40
#define XS_FLOATS (TOPK * FF + FF) // the largest staged input: the experts' h and the shared expert's

struct layer_w {
    const uint16_t *win, *wo, *wf, *eg, *eu, *ed, *sd; // in_proj, out_proj, ffn_in, experts' gate/up/down, shared down
    float *state;                                      // [NV][DK cols][DK rows]
};
struct probe_args {
    const layer_w *l; // [L] in device memory (a kernel parameter array indexed by the layer would go to local memory)
    int L, mode;
    float *x, *y1, *core, *rl, *hbuf;
    unsigned *bar;
    unsigned long long *stamps; // NULL, or [L][NPH][blocks]: when each block finished each phase
};
#define NPH 6 // in_proj, step, out_proj, ffn_in, routing + gate/up, down

// 4 KB from global into a slot, counted on its barrier; the warp's reads of the slot come first.
__device__ __forceinline__ void mb_load4k(void *dst, const void *src, uint64_t *b) {
    fence_async_smem();
    bulk_load(dst, src, 4096u, b);
}
__device__ __forceinline__ unsigned ld_acq(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// x is in shared memory and read at every use: left to itself the compiler keeps a lane's 64 floats
// of x in registers for both rows of a pair, and with the rows' 64 registers that spills.
__device__ __forceinline__ float4 lds4(const float *p) {
    float4 v;
    asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ float dot8(uint4 w, const float *x) {
    float4 a = lds4(x), b = lds4(x + 4);
    return bf16f(w.x & 0xffff) * a.x + bf16f(w.x >> 16) * a.y + bf16f(w.y & 0xffff) * a.z + bf16f(w.y >> 16) * a.w + bf16f(w.z & 0xffff) * b.x +
           bf16f(w.z >> 16) * b.y + bf16f(w.w & 0xffff) * b.z + bf16f(w.w >> 16) * b.w;
}
// A lane's part of a 2048-column piece: uint4 lane + 32 v holds columns 8 (lane + 32 v) ...
__device__ __forceinline__ float piece_dot(const uint4 *w, const float *xs, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < 8; v++) s += dot8(w[v], xs + (lane + 32 * v) * 8);
    return s;
}

// Every block has written what the next phase reads (thread 0: fence, count, spin).
__device__ void grid_sync(const probe_args &a, unsigned &gen, int l, int ph) {
    __syncthreads();
    if (a.stamps && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        a.stamps[((size_t)l * NPH + ph) * gridDim.x + blockIdx.x] = t;
    }
    if (a.mode != 2 && threadIdx.x == 0) {
        gen += gridDim.x;
        __threadfence();
        atomicAdd(a.bar, 1u);
        long long t0 = clock64();
        while (ld_acq(a.bar) < gen)
            if (clock64() - t0 > (1ll << 34)) __trap(); // ~8 s: not co-resident, a bug
    }
    __syncthreads();
}

// The warp's dense 4 KB pieces over the step, in the order it uses them: layer by layer, in_proj
// rows, out_proj rows (two pieces each), ffn_in rows; row r = gw + t * nwg.
struct cursor {
    int l, ph, t, h;
};
__device__ __forceinline__ int ph_rows(int ph) { return ph == 0 ? IN_ROWS : ph == 1 ? HID : F_ROWS; }
__device__ __forceinline__ const uint16_t *ph_w(const layer_w &w, int ph) { return ph == 0 ? w.win : ph == 1 ? w.wo : w.wf; }
struct ring {
    uint4 *slot; // NS slots of 256 uint4
    uint64_t *bar;
    unsigned used, asked;
    cursor p; // the next piece to ask for (lane 0)
    int more, stop_l, stop_ph; // mode 0: no piece past (stop_l, stop_ph)
};
__device__ int cur_valid(const probe_args &a, ring &r, int gw, int nwg) {
    cursor &c = r.p;
    while (c.l < a.L) {
        if (a.mode == 0 && (c.l != r.stop_l || c.ph != r.stop_ph)) return 0;
        if (gw + c.t * nwg < ph_rows(c.ph)) return 1;
        c.t = 0, c.h = 0;
        if (++c.ph == 3) c.ph = 0, c.l++;
    }
    return 0;
}
__device__ void ring_ask(const probe_args &a, ring &r, int gw, int nwg) { // lane 0
    const cursor &c = r.p;
    int row = gw + c.t * nwg, cols = c.ph == 1 ? O_COLS : HID;
    mb_load4k(r.slot + (r.asked % NS) * 256, ph_w(a.l[c.l], c.ph) + (size_t)row * cols + c.h * HID, r.bar + r.asked % NS);
    r.asked++;
    if (c.ph == 1 && c.h == 0) r.p.h = 1;
    else r.p.h = 0, r.p.t++;
    r.more = cur_valid(a, r, gw, nwg);
}
// Mode 0: the phase's first pieces, asked for after its barrier.
__device__ void ring_seed(const probe_args &a, ring &r, int l, int ph, int gw, int nwg, int lane) {
    if (a.mode != 0) return;
    if (lane == 0) {
        r.p = {l, ph, 0, 0}, r.stop_l = l, r.stop_ph = ph;
        r.more = cur_valid(a, r, gw, nwg);
        while (r.more && r.asked - r.used < NS) ring_ask(a, r, gw, nwg);
    }
    __syncwarp();
}
// The ring lives in shared memory (its bookkeeping in registers spilled the MoE's loads): lane 0
// writes it, the warp reads it.
__device__ void ring_get(const probe_args &a, ring &r, uint4 *w, int gw, int nwg, int lane) {
    unsigned u = r.used, s = u % NS;
    mbar_wait(r.bar + s, (u / NS) & 1);
#pragma unroll
    for (int v = 0; v < 8; v++) w[v] = r.slot[s * 256 + lane + 32 * v];
    __syncwarp();
    if (lane == 0) {
        r.used = u + 1;
        if (r.more) ring_ask(a, r, gw, nwg);
    }
    __syncwarp();
}

// rows of phase ph: out[r] = scale * W[r] . xs, or out[r] += W[r] . xs (acc).
__device__ void dense(const probe_args &a, ring &r, int l, int ph, const float *xs, float scale, float *out, int acc, int gw, int nwg, int lane) {
    ring_seed(a, r, l, ph, gw, nwg, lane);
    int np = ph == 1 ? 2 : 1;
    for (int row = gw; row < ph_rows(ph); row += nwg) {
        float s = 0.0f;
        for (int h = 0; h < np; h++) {
            uint4 w[8];
            ring_get(a, r, w, gw, nwg, lane);
            s += piece_dot(w, xs + h * HID, lane);
        }
        s = warp_sum(s);
        if (lane == 0) out[row] = acc ? __ldcg(out + row) + s : s * scale;
    }
}

// x (written by other blocks) into xs; returns 1 / rms(x).
__device__ float stage_x(const probe_args &a, float *xs, float *red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < HID; i += blockDim.x) {
        float v = __ldcg(a.x + i);
        xs[i] = v, ss += v * v;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = ss;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < NW; i++) t += red[i];
    __syncthreads();
    return 1.0f / sqrtf(t / HID + 1e-6f);
}

// One column j of value head h: S = decay S; S += k (beta (v_j - k.S)); out = q.S; lane holds rows 4 lane..
struct step_task {
    float4 s;
    int h, j, ok;
    __device__ void load(const probe_args &a, const layer_w &w, int task) {
        ok = task < NV * DK;
        if (!ok) return;
        h = task / DK, j = task % DK;
        s = ((const float4 *)(w.state + ((size_t)h * DK + j) * DK))[threadIdx.x & 31];
    }
    __device__ void run(const probe_args &a, const layer_w &w) {
        int lane = threadIdx.x & 31, qh = h / 2;
        float4 q = __ldcg((const float4 *)(a.y1 + qh * DK) + lane), k = __ldcg((const float4 *)(a.y1 + NQK * DK + qh * DK) + lane);
        float v = __ldcg(a.y1 + 2 * NQK * DK + h * DK + j), z = __ldcg(a.y1 + 2 * NQK * DK + NV * DK + h * DK + j);
        float b = __ldcg(a.y1 + 2 * NQK * DK + 2 * NV * DK + h), ga = __ldcg(a.y1 + 2 * NQK * DK + 2 * NV * DK + NV + h);
        float qn = rsqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f), kn = rsqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        float decay = expf(-log1pf(expf(ga))), beta = 1.0f / (1.0f + expf(-b));
        s.x *= decay, s.y *= decay, s.z *= decay, s.w *= decay;
        float ks = warp_sum(k.x * s.x + k.y * s.y + k.z * s.z + k.w * s.w) * kn, u = beta * (v - ks);
        s.x += k.x * kn * u, s.y += k.y * kn * u, s.z += k.z * kn * u, s.w += k.w * kn * u;
        float o = warp_sum(q.x * s.x + q.y * s.y + q.z * s.z + q.w * s.w) * qn * rsqrtf((float)DK);
        ((float4 *)(w.state + ((size_t)h * DK + j) * DK))[lane] = s;
        if (lane == 0) a.core[h * DK + j] = o * silu(z);
    }
};

// Top-8 of the 256 router logits by warp 0 (greater, or equal at a lower index, first), the
// chosen weights exp(l - max) normalised over the chosen; and the shared expert's h into hs.
__device__ __noinline__ void route(const probe_args &a, int *ti, float *wk, float *hs) {
    __shared__ float top[TOPK];
    int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        float v[NE / 32];
#pragma unroll
        for (int i = 0; i < NE / 32; i++) v[i] = __ldcg(a.rl + lane * (NE / 32) + i);
#pragma unroll 1
        for (int k = 0; k < TOPK; k++) {
            float m = -INFINITY;
            int mi = NE;
#pragma unroll
            for (int i = 0; i < NE / 32; i++)
                if (v[i] > m) m = v[i], mi = lane * (NE / 32) + i;
            for (int o = 16; o; o >>= 1) {
                float om = __shfl_xor_sync(0xffffffffu, m, o);
                int oi = __shfl_xor_sync(0xffffffffu, mi, o);
                if (om > m || (om == m && oi < mi)) m = om, mi = oi;
            }
            if (lane == 0) top[k] = m, ti[k] = mi < NE ? mi : 0; // NaN logits (mode 2's races) still name an expert
            if (mi / (NE / 32) == lane)
#pragma unroll
                for (int i = 0; i < NE / 32; i++)
                    if (i == mi % (NE / 32)) v[i] = -INFINITY;
        }
        __syncwarp();
        float sum = 0.0f;
        for (int k = 0; k < TOPK; k++) sum += expf(top[k] - top[0]);
        if (lane < TOPK) wk[lane] = expf(top[lane] - top[0]) / sum;
        if (lane == 0) wk[TOPK] = 1.0f / (1.0f + expf(-__ldcg(a.rl + NE + 2 * FF)));
    }
    for (int j = threadIdx.x; j < FF; j += blockDim.x) hs[j] = silu(__ldcg(a.rl + NE + j)) * __ldcg(a.rl + NE + FF + j);
    __syncthreads();
}

// A down row's 9 parts of 512 columns (the chosen experts', then the shared expert's): lane holds
// uint4 lane and lane + 32 of each.
struct down_row {
    uint4 w[TOPK + 1][2];
    __device__ void load(const layer_w &L, const int *ti, int i) {
        int lane = threadIdx.x & 31;
#pragma unroll
        for (int k = 0; k <= TOPK; k++) {
            const uint4 *p = (const uint4 *)(k < TOPK ? L.ed + ((size_t)ti[k] * HID + i) * FF : L.sd + (size_t)i * FF);
            w[k][0] = __ldg(p + lane), w[k][1] = __ldg(p + lane + 32);
        }
    }
    __device__ float sum(const float *hs, const float *wk) const {
        int lane = threadIdx.x & 31;
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k <= TOPK; k++) acc += wk[k] * (dot8(w[k][0], hs + k * FF + lane * 8) + dot8(w[k][1], hs + k * FF + (lane + 32) * 8));
        return warp_sum(acc);
    }
};

__global__ void __launch_bounds__(NW * 32, 1) k_probe(probe_args a) {
    extern __shared__ float4 dyn[];
    __shared__ uint64_t bars[NW * NS];
    __shared__ float red[NW], wk[TOPK + 1];
    __shared__ int ti[TOPK];
    __shared__ ring rings[NW];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, G = gridDim.x, nwg = G * NW, gw = warp * G + blockIdx.x;
    float *xs = (float *)dyn;
    ring &r = rings[warp];
    unsigned gen = 0;
    if (lane == 0) {
        r = {(uint4 *)(xs + XS_FLOATS) + warp * NS * 256, bars + warp * NS, 0, 0, {0, 0, 0, 0}, 0, -1, -1};
        for (int s = 0; s < NS; s++) mbar_init(r.bar + s);
        mbar_init_fence();
        if (a.mode != 0) { // the ring runs ahead from the start
            r.more = cur_valid(a, r, gw, nwg);
            while (r.more && r.asked < NS) ring_ask(a, r, gw, nwg);
        }
    }
    __syncwarp();
    for (int l = 0; l < a.L; l++) {
        const layer_w &w = a.l[l];
        step_task st[ST_PRE];
#pragma unroll
        for (int t = 0; t < ST_PRE; t++) st[t].load(a, w, gw + t * nwg); // earlier steps' state: before anything this step writes
        float inv = stage_x(a, xs, red);
        dense(a, r, l, 0, xs, inv, a.y1, 0, gw, nwg, lane);
        grid_sync(a, gen, l, 0); // y1 written
#pragma unroll
        for (int t = 0; t < ST_PRE; t++)
            if (st[t].ok) st[t].run(a, w);
        for (int task = gw + ST_PRE * nwg; task < NV * DK; task += nwg) {
            st[0].load(a, w, task);
            st[0].run(a, w);
        }
        grid_sync(a, gen, l, 1); // core written
        for (int i = threadIdx.x; i < O_COLS; i += blockDim.x) xs[i] = __ldcg(a.core + i);
        __syncthreads();
        dense(a, r, l, 1, xs, 1.0f, a.x, 1, gw, nwg, lane);
        grid_sync(a, gen, l, 2); // x += out_proj
        inv = stage_x(a, xs, red);
        dense(a, r, l, 2, xs, inv, a.rl, 0, gw, nwg, lane);
        grid_sync(a, gen, l, 3); // router logits, shared gate/up written
        route(a, ti, wk, xs + TOPK * FF);
#pragma unroll 1
        for (int row0 = gw; row0 < TOPK * FF; row0 += GU_PAIRS * nwg) {
            uint4 wg[GU_PAIRS][8], wu[GU_PAIRS][8];
#pragma unroll
            for (int p = 0; p < GU_PAIRS; p++) {
                int row = row0 + p * nwg, k = row / FF, j = row % FF;
                if (row >= TOPK * FF) break;
                const uint4 *pg = (const uint4 *)(w.eg + ((size_t)ti[k] * FF + j) * HID), *pu = (const uint4 *)(w.eu + ((size_t)ti[k] * FF + j) * HID);
#pragma unroll
                for (int v = 0; v < 8; v++) wg[p][v] = __ldg(pg + lane + 32 * v), wu[p][v] = __ldg(pu + lane + 32 * v);
            }
#pragma unroll
            for (int p = 0; p < GU_PAIRS; p++) {
                int row = row0 + p * nwg;
                if (row >= TOPK * FF) break;
                float g = warp_sum(piece_dot(wg[p], xs, lane)) * inv, u = warp_sum(piece_dot(wu[p], xs, lane)) * inv;
                if (lane == 0) a.hbuf[row] = silu(g) * u;
            }
        }
        down_row d[DN_PRE];
#pragma unroll
        for (int t = 0; t < DN_PRE; t++)
            if (gw + t * nwg < HID) d[t].load(w, ti, gw + t * nwg);
        grid_sync(a, gen, l, 4); // every gate/up row written
#pragma unroll 1
        for (int i = threadIdx.x; i < TOPK * FF; i += blockDim.x) xs[i] = __ldcg(a.hbuf + i);
        __syncthreads();
#pragma unroll
        for (int t = 0; t < DN_PRE; t++) {
            int i = gw + t * nwg;
            if (i >= HID) break;
            float s = d[t].sum(xs, wk);
            if (lane == 0) a.x[i] = __ldcg(a.x + i) + s;
        }
        for (int i = gw + DN_PRE * nwg; i < HID; i += nwg) {
            d[0].load(w, ti, i);
            float s = d[0].sum(xs, wk);
            if (lane == 0) a.x[i] = __ldcg(a.x + i) + s;
        }
        grid_sync(a, gen, l, 5); // x += the MoE's output
    }
}

__global__ void k_fill(uint16_t *p, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        float f = ((h & 0xffff) / 32768.0f - 1.0f) * scale;
        p[i] = (uint16_t)(__float_as_uint(f) >> 16);
    }
}
__global__ void k_fillf(float *p, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2246822519u ^ seed;
        h ^= h >> 15, h *= 2654435761u, h ^= h >> 13;
        p[i] = ((h & 0xffff) / 32768.0f - 1.0f) * scale;
    }
}

// The bytes alone: 4 KB rows (row r of region r / per at base[r / per]) read by warps of 8 (two
// blocks a SM), RPW rows in flight a warp (4 KB each), as the engine's one-row kernels read.
#define ST_MAX_REG 64
struct regions {
    const uint16_t *base[ST_MAX_REG];
};
// chunked: block b reads rows [b n / blocks, (b + 1) n / blocks) (its warps interleaved), so a SM
// touches one or two 2 MB pages of a region, not every page (a TLB question).
template <int RPW>
__global__ void __launch_bounds__(256, 2) k_stream(regions g, int per, int nrows, float *out, int chunked) {
    int lane = threadIdx.x & 31, nwg = gridDim.x * 8, gw = (threadIdx.x / 32) * gridDim.x + blockIdx.x;
    int r_lo = 0, r_hi = nrows;
    if (chunked) {
        r_lo = (int)((int64_t)nrows * blockIdx.x / gridDim.x), r_hi = (int)((int64_t)nrows * (blockIdx.x + 1) / gridDim.x);
        nwg = 8, gw = r_lo + threadIdx.x / 32;
    }
    nrows = r_hi;
    uint32_t acc = 0;
    for (int r0 = gw; r0 < nrows; r0 += RPW * nwg) {
        uint4 w[RPW][8];
#pragma unroll
        for (int p = 0; p < RPW; p++) {
            int r = r0 + p * nwg;
            const uint4 *src = (const uint4 *)(g.base[r / per] + (size_t)(r % per) * HID);
#pragma unroll
            for (int v = 0; v < 8; v++) w[p][v] = r < nrows ? __ldg(src + lane + 32 * v) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int p = 0; p < RPW; p++)
#pragma unroll
            for (int v = 0; v < 8; v++) acc ^= w[p][v].x ^ w[p][v].y ^ w[p][v].z ^ w[p][v].w;
    }
    if (acc == 0x12345678u) out[0] = 1.0f; // keeps the loads
}

#define CK(e)                                                                                                                              \
    do {                                                                                                                                   \
        cudaError_t err_ = (e);                                                                                                            \
        if (err_ != cudaSuccess) {                                                                                                         \
            fprintf(stderr, "step_probe: %s: %s (line %d)\n", #e, cudaGetErrorString(err_), __LINE__);                                    \
            return 1;                                                                                                                      \
        }                                                                                                                                  \
    } while (0)

static uint16_t *wmat(size_t n, uint32_t seed, float scale, size_t *total) {
    uint16_t *p = NULL;
    if (cudaMalloc(&p, n * 2) != cudaSuccess) return NULL;
    k_fill<<<1024, 256>>>(p, n, seed, scale);
    *total += n * 2;
    return p;
}

static double phase_mb(int ph) {
    static const double b[NPH] = {(double)IN_ROWS * HID * 2, 2.0 * NV * DK * DK * 4, (double)HID * O_COLS * 2, (double)F_ROWS * HID * 2,
                                  2.0 * TOPK * FF * HID * 2, (double)HID * (TOPK + 1) * FF * 2};
    return b[ph] / 1e6;
}

// Per phase, from a stamped launch: the last block's end minus the previous phase's last end
// (barrier waits fall in the phase after them), and the spread of the blocks' ends; layers 1..
static void phase_report(const unsigned long long *st, int L, int G) {
    static const char *name[NPH] = {"in_proj", "step", "out_proj", "ffn_in", "route+gate/up", "down"};
    for (int ph = 0; ph < NPH; ph++) {
        double dur = 0.0, spread = 0.0;
        for (int l = 1; l < L; l++) {
            const unsigned long long *e = st + ((size_t)l * NPH + ph) * G, *pe = e - G; // the phase before: [l][ph - 1] or [l - 1][NPH - 1]
            unsigned long long mx = 0, mn = ~0ull, pmx = 0;
            for (int b = 0; b < G; b++) mx = e[b] > mx ? e[b] : mx, mn = e[b] < mn ? e[b] : mn, pmx = pe[b] > pmx ? pe[b] : pmx;
            dur += (double)(mx - pmx), spread += (double)(mx - mn);
        }
        dur /= 1e3 * (L - 1), spread /= 1e3 * (L - 1);
        printf("   %-14s %6.2f us (blocks' ends over %5.2f us)  %5.1f MB: %5.0f GB/s\n", name[ph], dur, spread, phase_mb(ph), phase_mb(ph) * 1e3 / dur);
    }
}

static int launch_probe(probe_args &a, int L, int G, size_t smem, const layer_w *lw, const float *state0, const float *x0, float *ms) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaMemcpy(a.x, x0, HID * 4, cudaMemcpyDeviceToDevice)); // every run from the same x and state: the same experts
    for (int l = 0; l < L; l++) CK(cudaMemcpy(lw[l].state, state0 + (size_t)l * NV * DK * DK, (size_t)NV * DK * DK * 4, cudaMemcpyDeviceToDevice));
    CK(cudaMemset(a.bar, 0, 4));
    void *args[] = {&a};
    CK(cudaEventRecord(e0));
    CK(cudaLaunchCooperativeKernel((void *)k_probe, dim3(G), dim3(NW * 32), args, smem));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    CK(cudaEventElapsedTime(ms, e0, e1));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return 0;
}

// One mode: a first run kept for the comparison, iters timed runs, a stamped run for the phases.
static int run_mode(probe_args a, int mode, int L, int iters, int G, size_t smem, const layer_w *lw, const float *state0, const float *x0, double lb,
                    float *xr) {
    a.mode = mode;
    float ms, best = 1e30f, sum = 0.0f;
    if (launch_probe(a, L, G, smem, lw, state0, x0, &ms)) return 1;
    CK(cudaMemcpy(xr, a.x, HID * 4, cudaMemcpyDeviceToHost));
    for (int it = 0; it < iters; it++) {
        if (launch_probe(a, L, G, smem, lw, state0, x0, &ms)) return 1;
        best = ms < best ? ms : best, sum += ms;
    }
    double us = 1e3 * sum / iters;
    printf("mode %d (%s): %.1f us a launch (best %.1f), %.2f us a layer, %.0f GB/s = %.1f%% of 4.3 TB/s\n", mode,
           mode == 0 ? "ring within a phase" : mode == 1 ? "ring across barriers" : "ring, no barriers", us, 1e3 * best, us / L, lb * L / us / 1e3,
           lb * L / us / 1e3 / 43.0);
    size_t n = (size_t)L * NPH * G;
    CK(cudaMalloc(&a.stamps, n * 8));
    if (launch_probe(a, L, G, smem, lw, state0, x0, &ms)) return 1;
    unsigned long long *st = (unsigned long long *)malloc(n * 8);
    CK(cudaMemcpy(st, a.stamps, n * 8, cudaMemcpyDeviceToHost));
    printf("  stamped run %.1f us; per phase (layers 1..%d):\n", 1e3 * ms, L - 1);
    phase_report(st, L, G);
    free(st);
    CK(cudaFree(a.stamps));
    return 0;
}

// 33.5 MB of 4 KB rows (a layer's gate/up bytes) read contiguously, or as 16 experts' 2 MB
// matrices of one layer (the real pattern), or 1 GB contiguously; a new place each launch (L2 is
// 50 MB). RPW 1, 2, 4: 64, 128, 256 KB in flight a SM.
template <int RPW>
static int stream_one(const layer_w *lw, int L, int G, int pattern, float *out, float *us, int chunked) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float tot = 0.0f;
    int n = 12;
    for (int it = 0; it < n; it++) {
        const layer_w &w = lw[it % L];
        regions g = {};
        int per = TOPK * FF * 2, rows = per;
        if (pattern == 0) g.base[0] = w.eg + (size_t)(it / L % 7) * per * HID;
        if (pattern == 1)
            for (int i = 0; i < 16; i++) g.base[i] = (i & 1 ? w.eu : w.eg) + (size_t)((i / 2 * 37 + it * 11) % NE) * FF * HID, per = FF;
        if (pattern == 2) g.base[0] = w.eg, rows = per = NE * FF; // 512 MB
        if (pattern == 4) // 64 experts' 2 MB gate or up matrices, 16 from each of 4 layers: 134 MB
            for (int i = 0; i < ST_MAX_REG; i++) {
                const layer_w &v = lw[(it * 4 + i / 16) % L];
                g.base[i] = (i & 1 ? v.eu : v.eg) + (size_t)((i % 16 / 2 * 37 + it * 11) % NE) * FF * HID, per = FF, rows = ST_MAX_REG * FF;
            }
        if (pattern == 5) g.base[0] = w.ed, rows = per = ST_MAX_REG * FF; // 134 MB contiguous
        CK(cudaEventRecord(e0));
        if (pattern != 3) k_stream<RPW><<<2 * G, 256>>>(g, per, rows, out, chunked);
        else k_stream<RPW><<<2 * G, 256>>>(g, per, 0, out, chunked); // nothing read: the launch and the events
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it) tot += ms;
    }
    *us = 1e3f * tot / (n - 1);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return 0;
}

// 33.5 MB read where nothing was read before, then again after 512 MB elsewhere (out of L2 by
// then): a second read faster than the first would be the address translation's (TLB) warmth.
static int stream_revisit(const layer_w *lw, int L, int G, float *out) {
    cudaEvent_t e[4];
    for (int i = 0; i < 4; i++) CK(cudaEventCreate(&e[i]));
    float first = 0.0f, again = 0.0f;
    int n = L < 6 ? L : 6, per = TOPK * FF * 2;
    for (int it = 0; it < n; it++) {
        regions a = {}, b = {};
        a.base[0] = lw[it].ed + (size_t)9 * per * HID, b.base[0] = lw[it].eu;
        CK(cudaEventRecord(e[0]));
        k_stream<2><<<2 * G, 256>>>(a, per, per, out, 0);
        CK(cudaEventRecord(e[1]));
        k_stream<2><<<2 * G, 256>>>(b, NE * FF, NE * FF, out, 0);
        CK(cudaEventRecord(e[2]));
        k_stream<2><<<2 * G, 256>>>(a, per, per, out, 0);
        CK(cudaEventRecord(e[3]));
        CK(cudaEventSynchronize(e[3]));
        float m1, m3;
        CK(cudaEventElapsedTime(&m1, e[0], e[1]));
        CK(cudaEventElapsedTime(&m3, e[2], e[3]));
        first += m1, again += m3;
    }
    printf("stream 33.5 MB: first read %.1f us, again after 512 MB elsewhere %.1f us\n", 1e3 * first / n, 1e3 * again / n);
    for (int i = 0; i < 4; i++) CK(cudaEventDestroy(e[i]));
    return 0;
}

static int stream_tests(const layer_w *lw, int L, int G, float *out) {
    if (stream_revisit(lw, L, G, out)) return 1;
    static const char *pname[6] = {"33.5 MB contiguous", "16 x 2 MB experts", "512 MB contiguous", "nothing (launch)", "64 x 2 MB experts", "134 MB contiguous"};
    for (int chunked = 0; chunked < 2; chunked++)
        for (int pattern = 0; pattern < 6; pattern++) {
            float us[3];
            if (stream_one<1>(lw, L, G, pattern, out, us, chunked) || stream_one<2>(lw, L, G, pattern, out, us + 1, chunked) ||
                stream_one<4>(lw, L, G, pattern, out, us + 2, chunked))
                return 1;
            double mb = pattern == 2 ? 536.870912 : pattern == 3 ? 0.0 : pattern >= 4 ? 134.217728 : 33.554432;
            printf("stream %-20s %s 64 KB/SM %.1f us (%.0f GB/s) | 128 KB/SM %.1f us (%.0f GB/s) | 256 KB/SM %.1f us (%.0f GB/s)\n", pname[pattern],
                   chunked ? "chunked    " : "interleaved", us[0], mb * 1e3 / us[0], us[1], mb * 1e3 / us[1], us[2], mb * 1e3 / us[2]);
        }
    return 0;
}

int main(int argc, char **argv) {
    int L = argc > 1 ? atoi(argv[1]) : 8, iters = argc > 2 ? atoi(argv[2]) : 10;
    if (L < 1 || L > MAXL || iters < 1) {
        fprintf(stderr, "usage: step_probe [layers 1..%d] [iters]\n", MAXL);
        return 2;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major < 9) {
        fprintf(stderr, "step_probe: needs sm_90 (bulk copies); this is sm_%d%d\n", prop.major, prop.minor);
        return 1;
    }
    probe_args a;
    memset(&a, 0, sizeof a);
    a.L = L;
    size_t total = 0;
    layer_w lw[MAXL];
    for (int l = 0; l < L; l++) {
        layer_w &w = lw[l];
        uint32_t s = 1000u * (uint32_t)l;
        w.win = wmat((size_t)IN_ROWS * HID, s + 1, 0.04f, &total);
        w.wo = wmat((size_t)HID * O_COLS, s + 2, 0.02f, &total);
        w.wf = wmat((size_t)F_ROWS * HID, s + 3, 0.04f, &total);
        w.eg = wmat((size_t)NE * FF * HID, s + 4, 0.04f, &total);
        w.eu = wmat((size_t)NE * FF * HID, s + 5, 0.04f, &total);
        w.ed = wmat((size_t)NE * HID * FF, s + 6, 0.05f, &total);
        w.sd = wmat((size_t)HID * FF, s + 7, 0.05f, &total);
        if (!w.win || !w.wo || !w.wf || !w.eg || !w.eu || !w.ed || !w.sd) {
            fprintf(stderr, "step_probe: out of device memory at layer %d (%.1f GB so far)\n", l, total / 1e9);
            return 1;
        }
        CK(cudaMalloc(&w.state, (size_t)NV * DK * DK * 4));
    }
    layer_w *lwd;
    CK(cudaMalloc(&lwd, sizeof lw));
    CK(cudaMemcpy(lwd, lw, sizeof lw, cudaMemcpyHostToDevice));
    a.l = lwd;
    size_t sbytes = (size_t)L * NV * DK * DK * 4;
    float *state0, *x0;
    CK(cudaMalloc(&state0, sbytes));
    CK(cudaMalloc(&x0, HID * 4));
    CK(cudaMalloc(&a.x, HID * 4));
    CK(cudaMalloc(&a.y1, IN_ROWS * 4));
    CK(cudaMalloc(&a.core, O_COLS * 4));
    CK(cudaMalloc(&a.rl, F_ROWS * 4));
    CK(cudaMalloc(&a.hbuf, TOPK * FF * 4));
    CK(cudaMalloc(&a.bar, 4));
    k_fillf<<<256, 256>>>(state0, sbytes / 4, 77u, 0.05f);
    k_fillf<<<8, 256>>>(x0, HID, 78u, 1.0f);
    CK(cudaDeviceSynchronize());

    size_t smem = (size_t)XS_FLOATS * 4 + (size_t)NW * NS * 4096;
    CK(cudaFuncSetAttribute(k_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k_probe, NW * 32, smem));
    if (per < 1) {
        fprintf(stderr, "step_probe: the block does not fit a SM (%zu bytes of shared memory)\n", smem);
        return 1;
    }
    int G = prop.multiProcessorCount;
    double lb = (double)IN_ROWS * HID * 2 + (double)HID * O_COLS * 2 + (double)F_ROWS * HID * 2 + 2.0 * TOPK * FF * HID * 2 +
                (double)HID * (TOPK + 1) * FF * 2 + 2.0 * NV * DK * DK * 4;
    printf("step_probe: %s, %d SMs, %d layers (%.1f GB of weights), %d x %d threads, %zu B shared memory a block\n", prop.name, G, L, total / 1e9, G,
           NW * 32, smem);
    printf("bytes a layer %.1f MB: %.1f us at 4.3 TB/s; 650 tok/s leaves ~32.5 us a layer beside the lm_head\n", lb / 1e6, lb / 4.3e12 * 1e6);
    float *xr[3];
    for (int mode = 0; mode < 3; mode++) {
        xr[mode] = (float *)malloc(HID * 4);
        if (run_mode(a, mode, L, iters, G, smem, lw, state0, x0, lb, xr[mode])) return 1;
    }
    if (stream_tests(lw, L, G, a.y1)) return 1;
    double ss = 0.0;
    int diff = 0, bad = 0;
    for (int i = 0; i < HID; i++) {
        diff += memcmp(&xr[0][i], &xr[1][i], 4) != 0;
        bad += !isfinite(xr[0][i]);
        ss += (double)xr[0][i] * xr[0][i];
    }
    printf("modes 0 and 1: %d of %d outputs differ (must be 0), %d not finite, rms(x) %.4g\n", diff, HID, bad, sqrt(ss / HID));
    return diff || bad ? 1 : 0;
}
