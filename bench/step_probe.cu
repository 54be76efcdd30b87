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
#define NW 16 // warps a block, one block a SM
#define NS 3  // 4 KB ring slots a warp: 192 KB a block
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
};

__device__ __forceinline__ unsigned saddr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(uint64_t *b) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(b)) : "memory"); }
__device__ __forceinline__ void mb_wait(uint64_t *b, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(saddr(b)), "r"(parity)
                     : "memory");
}
// 4 KB from global into a slot, counted on its barrier.
__device__ __forceinline__ void mb_load4k(void *dst, const void *src, uint64_t *b) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); // the warp's reads of the slot come first
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(4096u) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(saddr(dst)), "l"(src),
                 "r"(4096u), "r"(saddr(b))
                 : "memory");
}
__device__ __forceinline__ unsigned ld_acq(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float bf(uint32_t h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float wsum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float dot8(uint4 w, const float *x) {
    float4 a = *(const float4 *)x, b = *(const float4 *)(x + 4);
    return bf(w.x & 0xffff) * a.x + bf(w.x >> 16) * a.y + bf(w.y & 0xffff) * a.z + bf(w.y >> 16) * a.w + bf(w.z & 0xffff) * b.x +
           bf(w.z >> 16) * b.y + bf(w.w & 0xffff) * b.z + bf(w.w >> 16) * b.w;
}
// A lane's part of a 2048-column piece: uint4 lane + 32 v holds columns 8 (lane + 32 v) ...
__device__ __forceinline__ float piece_dot(const uint4 *w, const float *xs, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < 8; v++) s += dot8(w[v], xs + (lane + 32 * v) * 8);
    return s;
}

// Every block has written what the next phase reads (thread 0: fence, count, spin).
__device__ void grid_sync(const probe_args &a, unsigned &gen) {
    __syncthreads();
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
    mb_wait(r.bar + s, (u / NS) & 1);
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
        s = wsum(s);
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
    ss = wsum(ss);
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
        float qn = rsqrtf(wsum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f), kn = rsqrtf(wsum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        float decay = expf(-log1pf(expf(ga))), beta = 1.0f / (1.0f + expf(-b));
        s.x *= decay, s.y *= decay, s.z *= decay, s.w *= decay;
        float ks = wsum(k.x * s.x + k.y * s.y + k.z * s.z + k.w * s.w) * kn, u = beta * (v - ks);
        s.x += k.x * kn * u, s.y += k.y * kn * u, s.z += k.z * kn * u, s.w += k.w * kn * u;
        float o = wsum(q.x * s.x + q.y * s.y + q.z * s.z + q.w * s.w) * qn * rsqrtf((float)DK);
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

// A down row's 9 parts of 512 columns: lane holds uint4 lane and lane + 32 of each. The first
// DPRE chosen experts' parts are loaded before the barrier, the rest after it (all 9 held across
// the barrier spill at 128 registers).
#define DPRE 4
struct down_row {
    uint4 w[DPRE][2];
    __device__ const uint4 *part(const layer_w &L, const int *ti, int k, int i) const {
        return (const uint4 *)(k < TOPK ? L.ed + ((size_t)ti[k] * HID + i) * FF : L.sd + (size_t)i * FF);
    }
    __device__ void load(const layer_w &L, const int *ti, int i) {
        int lane = threadIdx.x & 31;
#pragma unroll
        for (int k = 0; k < DPRE; k++) w[k][0] = __ldg(part(L, ti, k, i) + lane), w[k][1] = __ldg(part(L, ti, k, i) + lane + 32);
    }
    __device__ float sum(const layer_w &L, const int *ti, int i, const float *hs, const float *wk) const {
        int lane = threadIdx.x & 31;
        uint4 r[TOPK + 1 - DPRE][2];
#pragma unroll
        for (int k = DPRE; k <= TOPK; k++) r[k - DPRE][0] = __ldg(part(L, ti, k, i) + lane), r[k - DPRE][1] = __ldg(part(L, ti, k, i) + lane + 32);
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < DPRE; k++) acc += wk[k] * (dot8(w[k][0], hs + k * FF + lane * 8) + dot8(w[k][1], hs + k * FF + (lane + 32) * 8));
#pragma unroll
        for (int k = DPRE; k <= TOPK; k++)
            acc += wk[k] * (dot8(r[k - DPRE][0], hs + k * FF + lane * 8) + dot8(r[k - DPRE][1], hs + k * FF + (lane + 32) * 8));
        return wsum(acc);
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
        for (int s = 0; s < NS; s++) mb_init(r.bar + s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        if (a.mode != 0) { // the ring runs ahead from the start
            r.more = cur_valid(a, r, gw, nwg);
            while (r.more && r.asked < NS) ring_ask(a, r, gw, nwg);
        }
    }
    __syncwarp();
    for (int l = 0; l < a.L; l++) {
        const layer_w &w = a.l[l];
        step_task st;
        st.load(a, w, gw); // earlier steps' state: before anything this step writes
        float inv = stage_x(a, xs, red);
        dense(a, r, l, 0, xs, inv, a.y1, 0, gw, nwg, lane);
        grid_sync(a, gen); // y1 written
        for (int task = gw; task < NV * DK; task += nwg) {
            if (task != gw) st.load(a, w, task);
            st.run(a, w);
        }
        grid_sync(a, gen); // core written
        for (int i = threadIdx.x; i < O_COLS; i += blockDim.x) xs[i] = __ldcg(a.core + i);
        __syncthreads();
        dense(a, r, l, 1, xs, 1.0f, a.x, 1, gw, nwg, lane);
        grid_sync(a, gen); // x += out_proj
        inv = stage_x(a, xs, red);
        dense(a, r, l, 2, xs, inv, a.rl, 0, gw, nwg, lane);
        grid_sync(a, gen); // router logits, shared gate/up written
        route(a, ti, wk, xs + TOPK * FF);
#pragma unroll 1
        for (int row = gw; row < TOPK * FF; row += nwg) {
            int k = row / FF, j = row % FF;
            const uint4 *pg = (const uint4 *)(w.eg + ((size_t)ti[k] * FF + j) * HID), *pu = (const uint4 *)(w.eu + ((size_t)ti[k] * FF + j) * HID);
            uint4 wg[8], wu[8];
#pragma unroll
            for (int v = 0; v < 8; v++) wg[v] = __ldg(pg + lane + 32 * v), wu[v] = __ldg(pu + lane + 32 * v);
            float g = wsum(piece_dot(wg, xs, lane)) * inv, u = wsum(piece_dot(wu, xs, lane)) * inv;
            if (lane == 0) a.hbuf[row] = silu(g) * u;
        }
        down_row d;
        if (gw < HID) d.load(w, ti, gw);
        grid_sync(a, gen); // every gate/up row written
#pragma unroll 1
        for (int i = threadIdx.x; i < TOPK * FF; i += blockDim.x) xs[i] = __ldcg(a.hbuf + i);
        __syncthreads();
        for (int i = gw; i < HID; i += nwg) {
            if (i != gw) d.load(w, ti, i);
            float s = d.sum(w, ti, i, xs, wk);
            if (lane == 0) a.x[i] = __ldcg(a.x + i) + s;
        }
        grid_sync(a, gen); // x += the MoE's output
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
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float *xr[2];
    for (int mode = 0; mode < 3; mode++) {
        a.mode = mode;
        void *args[] = {&a};
        float best = 1e30f, sum = 0.0f;
        for (int it = -1; it < iters; it++) { // every run from the same x and state (the same experts); the first one kept
            CK(cudaMemcpy(a.x, x0, HID * 4, cudaMemcpyDeviceToDevice));
            for (int l = 0; l < L; l++)
                CK(cudaMemcpy(lw[l].state, state0 + (size_t)l * NV * DK * DK, (size_t)NV * DK * DK * 4, cudaMemcpyDeviceToDevice));
            CK(cudaMemsetAsync(a.bar, 0, 4));
            CK(cudaEventRecord(e0));
            CK(cudaLaunchCooperativeKernel((void *)k_probe, dim3(G), dim3(NW * 32), args, smem));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            CK(cudaGetLastError());
            if (it < 0 && mode < 2) {
                xr[mode] = (float *)malloc(HID * 4);
                CK(cudaMemcpy(xr[mode], a.x, HID * 4, cudaMemcpyDeviceToHost));
                continue;
            }
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= 0) best = ms < best ? ms : best, sum += ms;
        }
        double us = 1e3 * sum / iters;
        printf("mode %d (%s): %.1f us a launch (best %.1f), %.2f us a layer, %.0f GB/s = %.1f%% of 4.3 TB/s\n", mode,
               mode == 0 ? "ring within a phase" : mode == 1 ? "ring across barriers" : "ring, no barriers", us, 1e3 * best, us / L, lb * L / us / 1e3,
               lb * L / us / 1e3 / 43.0);
    }
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
