// The Gated DeltaNet recurrence for one token per sequence.
#include "backend/cuda/dec_int.cuh"

namespace qfc {

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
    gdn_task<DK, LPC> w;
    w.load(a, blockIdx.x, blockIdx.y, blockIdx.z); // state of earlier steps: before the wait
    pdl_wait();
    pdl_launch();
    w.run(a, qn, kn);
}

// The step with a whole value head per block (dv / (32 / LPC) warps: 16 at dv 128, LPC 4) that
// also applies out_proj's gated norm to the head's output (the default; option gdn_gn=0: off):
// out_proj then stages its input with one load per element, where its gated staging walked 4 heads
// per warp one memory latency each (whole model 2948.1 -> 2820.0 us a step, docs/performance.md). The
// norm repeats stage_heads' sums in its order (a warp over the head, lane + 32 u), so the
// product's input is bit for bit what it was. gg: out_proj's GATED_NORM (norm weight w over dv, the
// gate of row t, head h at g + t * g_stride + h * g_hstride).
// CHAIN: the block steps every row of a.chain in order (blockIdx.z 0), the state carried in
// registers from one row to the next: a verify's rows in one launch, each row's numbers those of
// its own launch.
template <int DK, int LPC, bool CHAIN = false>
__global__ void __launch_bounds__(512) k_gdn_head(qf_gdn_dec a, dpre gg) {
    constexpr int CPW = 32 / LPC, NW = 512 / 32;
    __shared__ float qkn[NW * 2 * DK], on[NW * CPW], inv_s; // a warp's DK of qn then DK of kn; the head's outputs
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, h = blockIdx.x, dv = a.dv;
    gdn_task<DK, LPC> w;
    w.load(a, h, warp, blockIdx.z); // state of earlier steps: before the wait
    pdl_wait();
    pdl_launch();
    float *qk = qkn + warp * 2 * DK;
    for (int t = blockIdx.z; t < (CHAIN ? a.n : blockIdx.z + 1); t++) {
        w.t = t;
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
        __syncthreads(); // on and inv_s are the next row's
    }
}

// Lanes per value column of the DeltaNet step (option gdn_lpc): more lanes, more warps and
// shorter chains per warp; key dims up to 64 take 2.
static int gdn_lanes(const ctx *c, int dk) { return dk <= 64 ? 2 : QF_LAB(c, gdn_lpc) == 2 || QF_LAB(c, gdn_lpc) == 8 ? QF_LAB(c, gdn_lpc) : 4; }

void dec_gdn(qf_backend *be, const qf_gdn_dec *a) {
    ctx *c = C(be);
    int lpc = gdn_lanes(c, a->dk), cpw = 32 / lpc;
    dim3 g(a->nv, (a->dv + cpw - 1) / cpw, a->n);
    if (a->dk > 128) {
        return dev_fail(c, "linear-attention key dim %d > 128 is not supported", a->dk);
    }
    void (*k)(qf_gdn_dec) = a->dk <= 32 ? k_gdn_dec<32, 2> : a->dk <= 64 ? k_gdn_dec<64, 2> : k_gdn_dec<128, 4>;
#if QF_CUDA_LAB_BUILD
    if (a->dk > 64 && lpc != 4) k = lpc == 2 ? k_gdn_dec<128, 2> : k_gdn_dec<128, 8>; /* other lanes a column */
#endif
    if (!a->chain) return launch(c, "k_gdn_dec", 1, k, g, dim3(32), 0u, *a);
    for (int t = 0; t < a->n; t++) { // a chain: its rows one launch each, in order
        qf_gdn_dec r = *a;
        r.mixed = a->mixed + (int64_t)t * a->stride, r.out = a->out + (int64_t)t * a->nv * a->dv, r.n = 1, r.chain = 0, r.S[0] = a->S[t];
        launch(c, "k_gdn_dec", 1, k, dim3(g.x, g.y, 1), dim3(32), 0u, r);
    }
}

// gdn(g) then the gated norm of its output in place (k_gdn_head); 0: not taken (a shape it is not
// built for: key dims 128 at 4 lanes per column, value heads of 128).
int dec_gdn_gn(qf_backend *be, const qf_gdn_dec *a, const qf_pre *gn) {
    ctx *c = C(be);
    if (!QF_LAB(c, gdn_gn) || a->dk != 128 || a->dv != 128 || gdn_lanes(c, a->dk) != 4 || !gn || gn->kind != QF_PRE_GATED_NORM || gn->head != a->dv)
        return 0;
    if (a->chain) launch(c, "k_gdn_head", 1, k_gdn_head<128, 4, true>, dim3(a->nv, 1, 1), dim3(a->dv / 8 * 32), 0u, *a, dpre_of(gn));
    else launch(c, "k_gdn_head", 1, k_gdn_head<128, 4>, dim3(a->nv, 1, a->n), dim3(a->dv / 8 * 32), 0u, *a, dpre_of(gn));
    return 1;
}


} // namespace qfc
