// Prefill attention as tiles of query rows that share a kv head: a block takes up to 64 rows
// (AT_ROWS: Tt tokens x the G query heads of one kv head) and walks its key range 32 keys at a
// time, each key's and value's row loaded once into shared memory (cp.async, two stages) for all
// of them. k_attn_part reads every key once per (token, query head) and spends a warp's shuffle
// reduction on each: an 8K prompt's attention read ~1 TB a layer from L2. fp32 throughout, as the
// CPU reference; the sums run in another order (q.k over dims in one thread, the softmax sums in
// 4-lane groups). Partials (m, l, o[hd]) per (row, split) in k_attn_part's layout, combined by
// k_attn_combine. The products run on the tensor cores by default (bf16 parts, below).
#include <cuda_bf16.h>

#include "backend/cuda/cuda_int.cuh"

namespace {

using namespace qfc;

#define AT_ROWS 64
#define AT_KEYS 32
#define AT_THREADS 256

struct at_geom {
    int G, Tt, ks, splits; // query heads per kv head, tokens a tile, keys a split, splits
};

__host__ __device__ inline int at_qp(int hd) { return hd + 4; } // q's and k's row pitch: 16 keys' float4 loads fall in distinct banks
__host__ __device__ inline size_t at_smem_floats(int hd) {
    return (size_t)AT_ROWS * at_qp(hd) + 4 * (size_t)AT_KEYS * at_qp(hd) + AT_ROWS * (AT_KEYS + 1) + 3 * AT_ROWS;
}

// Keys j0 .. j0 + 31 of kv head kvh into k and v (pitch hd + 4: the tensor-core form's 8-byte reads
// of a value column's key pairs fall in distinct banks) by cp.async; keys at or
// past j_end load key j_end - 1 instead (finite values: their scores are masked to -inf, p = 0).
__device__ void at_load_keys(const qf_attn_args &a, int kvh, int j0, int j_end, float *k, float *v) {
    int hd = a.hd, n4 = hd / 4;
    for (int i = threadIdx.x; i < AT_KEYS * n4; i += AT_THREADS) {
        int kk = i / n4, d = (i - kk * n4) * 4, j = min(j0 + kk, j_end - 1);
        cp16(k + kk * at_qp(hd) + d, kv_row(a.kv, j, a.nkv, hd, kvh, 0) + d);
        cp16(v + kk * at_qp(hd) + d, kv_row(a.kv, j, a.nkv, hd, kvh, 1) + d);
    }
}

// The scores of rows rg * 4 + i against keys kg and kg + 16 of the tile, scaled and masked, into p.
__device__ void at_scores(const qf_attn_args &a, const at_geom &g, int t0, int R, int j0, int j_end, const float *q, const float *k,
                          float *p) {
    int rg = threadIdx.x >> 4, kg = threadIdx.x & 15, hd = a.hd, qp = at_qp(hd);
    float s[4][2] = {};
    for (int d = 0; d < hd; d += 4) {
        float4 k0 = *(const float4 *)(k + kg * qp + d), k1 = *(const float4 *)(k + (kg + 16) * qp + d);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 x = *(const float4 *)(q + (rg * 4 + i) * qp + d);
            s[i][0] += x.x * k0.x + x.y * k0.y + x.z * k0.z + x.w * k0.w;
            s[i][1] += x.x * k1.x + x.y * k1.y + x.z * k1.z + x.w * k1.w;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = rg * 4 + i, last = a.pos0 + t0 + r / g.G; // the row's own position: its last key
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int j = j0 + kg + 16 * c;
            bool ok = r < R && j < j_end && j <= last;
            p[r * (AT_KEYS + 1) + kg + 16 * c] = ok ? s[i][c] * a.scale : -INFINITY;
        }
    }
}

// The tile's scores into probabilities against each row's running max (4 threads a row, 8 keys
// each); the row's correction of its earlier sums into corr.
__device__ void at_softmax(float *p, float *m, float *l, float *corr) {
    int r = threadIdx.x >> 2, sub = threadIdx.x & 3;
    float *pr = p + r * (AT_KEYS + 1) + sub * 8, mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < 8; u++) mx = fmaxf(mx, pr[u]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float mo = m[r], mn = fmaxf(mo, mx), sum = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; u++) {
        float e = pr[u] == -INFINITY ? 0.0f : expf(pr[u] - mn);
        pr[u] = e, sum += e;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (sub == 0) {
        float cr = mo == -INFINITY ? 0.0f : expf(mo - mn);
        corr[r] = cr, l[r] = l[r] * cr + sum, m[r] = mn;
    }
}

// acc (rows rg * 4 + i, dims dg * 4 + 64 u + c) = acc * corr + p . v over the tile's keys.
__device__ void at_pv(int hd, const float *p, const float *v, const float *corr, float (&acc)[4][16]) {
    int rg = threadIdx.x >> 4, dg = threadIdx.x & 15;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float cr = corr[rg * 4 + i];
#pragma unroll
        for (int u = 0; u < 16; u++) acc[i][u] *= cr;
    }
    for (int j = 0; j < AT_KEYS; j++) {
        float pj[4];
#pragma unroll
        for (int i = 0; i < 4; i++) pj[i] = p[(rg * 4 + i) * (AT_KEYS + 1) + j];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int d = dg * 4 + 64 * u;
            if (d >= hd) break;
            float4 x = *(const float4 *)(v + j * at_qp(hd) + d);
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[i][4 * u] += pj[i] * x.x, acc[i][4 * u + 1] += pj[i] * x.y, acc[i][4 * u + 2] += pj[i] * x.z, acc[i][4 * u + 3] += pj[i] * x.w;
        }
    }
}

// The block's rows' partials (m, l, o) at part ((t * nh + h) * splits + split) * (hd + 2).
__device__ void at_write(const qf_attn_args &a, const at_geom &g, int t0, int R, int kvh, int sp, const float *m, const float *l,
                         const float (&acc)[4][16], float *part) {
    int rg = threadIdx.x >> 4, dg = threadIdx.x & 15, hd = a.hd;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = rg * 4 + i;
        if (r >= R) break;
        int t = t0 + r / g.G, h = kvh * g.G + r % g.G;
        float *o = part + ((int64_t)(t * a.nh + h) * g.splits + sp) * (hd + 2);
        if (dg == 0) o[0] = m[r], o[1] = l[r];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int d = dg * 4 + 64 * u;
            if (d >= hd) break;
#pragma unroll
            for (int c = 0; c < 4; c++) o[2 + d + c] = acc[i][4 * u + c]; // rows of hd + 2 floats: not 16-byte aligned
        }
    }
}

// ---- the same tile on the tensor cores (option att_tc, the default; sm_80+) ----
// Both products as bf16 mma.sync m16n8k16 with fp32 sums, each fp32 operand split into bf16 hi +
// lo parts and three products taken (hi.hi + hi.lo + lo.hi; lo.lo is below fp32's rounding of the
// sum): ~16 bits of each operand kept, as the prompt's other products (cu_matmul, the grouped
// experts). Warp w takes rows 16 (w / 2) .. + 15: scores against keys 16 (w % 2) .. + 15, then
// head dims (w % 2) hd / 2 .. + hd / 2 - 1 of the output (acc: 8-column tiles, 4 floats each in
// the mma's accumulator layout). The softmax between stays the fp32 form's.

// bf16 hi and lo parts of (x, y), packed as an mma operand register each (x in the low half).
__device__ __forceinline__ void at_split(float x, float y, unsigned &hi, unsigned &lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    float2 hf = __bfloat1622float2(h);
    __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
    hi = *(unsigned *)&h, lo = *(unsigned *)&l;
}

__device__ __forceinline__ void at_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += (a's hi + lo) . (b's hi + lo) without lo . lo.
__device__ __forceinline__ void at_mma3(float (&c)[4], const unsigned (&ah)[4], const unsigned (&al)[4], const unsigned (&bh)[2], const unsigned (&bl)[2]) {
    at_mma(c, ah, bh[0], bh[1]);
    at_mma(c, ah, bl[0], bl[1]);
    at_mma(c, al, bh[0], bh[1]);
}

// The A operand of a 16 x 16 tile whose first element x points at (pitch ld): rows g and g + 8
// (g = lane / 4), columns 2 (lane % 4), + 1 (and + 8), read as 8-byte pairs, as hi and lo parts.
__device__ __forceinline__ void at_frag_a2(const float *x, int ld, unsigned (&ah)[4], unsigned (&al)[4]) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const float *r0 = x + g * ld + 2 * t, *r1 = r0 + 8 * ld;
    float2 v0 = *(const float2 *)r0, v1 = *(const float2 *)r1, v2 = *(const float2 *)(r0 + 8), v3 = *(const float2 *)(r1 + 8);
    at_split(v0.x, v0.y, ah[0], al[0]), at_split(v1.x, v1.y, ah[1], al[1]), at_split(v2.x, v2.y, ah[2], al[2]), at_split(v3.x, v3.y, ah[3], al[3]);
}

__device__ void at_scores_tc(const qf_attn_args &a, const at_geom &g, int t0, int R, int j0, int j_end, const float *q, const float *k, float *p) {
    int warp = threadIdx.x >> 5, gi = (threadIdx.x & 31) >> 2, ti = threadIdx.x & 3, hd = a.hd, qp = at_qp(hd);
    int r0 = 16 * (warp >> 1), k0 = 16 * (warp & 1);
    float c[2][4] = {};
    for (int d = 0; d < hd; d += 16) {
        unsigned ah[4], al[4];
        at_frag_a2(q + r0 * qp + d, qp, ah, al);
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const float *kr = k + (k0 + 8 * n + gi) * qp + d + 2 * ti; // B: key k0 + 8 n + g, dims 2 t, 2 t + 1 (+ 8)
            float2 y0 = *(const float2 *)kr, y1 = *(const float2 *)(kr + 8);
            unsigned bh[2], bl[2];
            at_split(y0.x, y0.y, bh[0], bl[0]), at_split(y1.x, y1.y, bh[1], bl[1]);
            at_mma3(c[n], ah, al, bh, bl);
        }
    }
#pragma unroll
    for (int n = 0; n < 2; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = r0 + gi + 8 * (e >> 1), kk = k0 + 8 * n + 2 * ti + (e & 1), j = j0 + kk, last = a.pos0 + t0 + r / g.G;
            bool ok = r < R && j < j_end && j <= last;
            p[r * (AT_KEYS + 1) + kk] = ok ? c[n][e] * a.scale : -INFINITY;
        }
}

#define AT_NT 16 // 8-column output tiles a warp at most (hd 256)

// acc = acc * corr + p . v over the tile's keys, the warp's rows and half of the head dims.
__device__ void at_pv_tc(int hd, const float *p, const float *v, const float *corr, float (&acc)[AT_NT][4]) {
    int warp = threadIdx.x >> 5, gi = (threadIdx.x & 31) >> 2, ti = threadIdx.x & 3, vp = at_qp(hd), r0 = 16 * (warp >> 1);
    int nt = hd / 16, d0 = (warp & 1) * (hd / 2);
    float c0 = corr[r0 + gi], c1 = corr[r0 + gi + 8];
#pragma unroll
    for (int n = 0; n < AT_NT; n++) acc[n][0] *= c0, acc[n][1] *= c0, acc[n][2] *= c1, acc[n][3] *= c1;
#pragma unroll
    for (int kk = 0; kk < AT_KEYS; kk += 16) {
        unsigned ah[4], al[4];
        const float *pr = p + (r0 + gi) * (AT_KEYS + 1) + kk + 2 * ti, *pr8 = pr + 8 * (AT_KEYS + 1); // pitch 33: no pairs
        at_split(pr[0], pr[1], ah[0], al[0]), at_split(pr8[0], pr8[1], ah[1], al[1]);
        at_split(pr[8], pr[9], ah[2], al[2]), at_split(pr8[8], pr8[9], ah[3], al[3]);
        const float *vr = v + (kk + 2 * ti) * vp + d0 + gi; // B: keys kk + 2 t, + 1 (+ 8), dim d0 + 8 n + g
#pragma unroll
        for (int n = 0; n < AT_NT; n++) {
            if (n >= nt) break;
            const float *x = vr + 8 * n;
            unsigned bh[2], bl[2];
            at_split(x[0], x[vp], bh[0], bl[0]), at_split(x[8 * vp], x[9 * vp], bh[1], bl[1]);
            at_mma3(acc[n], ah, al, bh, bl);
        }
    }
}

// The block's rows' partials (m, l, o) from the accumulator layout.
__device__ void at_write_tc(const qf_attn_args &a, const at_geom &g, int t0, int R, int kvh, int sp, const float *m, const float *l,
                            const float (&acc)[AT_NT][4], float *part) {
    int warp = threadIdx.x >> 5, gi = (threadIdx.x & 31) >> 2, ti = threadIdx.x & 3, hd = a.hd, r0 = 16 * (warp >> 1);
    int nt = hd / 16, d0 = (warp & 1) * (hd / 2);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        int r = r0 + gi + 8 * hf;
        if (r >= R) continue;
        int t = t0 + r / g.G, h = kvh * g.G + r % g.G;
        float *o = part + ((int64_t)(t * a.nh + h) * g.splits + sp) * (hd + 2);
        if ((warp & 1) == 0 && ti == 0) o[0] = m[r], o[1] = l[r];
#pragma unroll
        for (int n = 0; n < AT_NT; n++) {
            if (n >= nt) break;
            int d = d0 + 8 * n + 2 * ti;
            o[2 + d] = acc[n][2 * hf], o[3 + d] = acc[n][2 * hf + 1];
        }
    }
}

// The fp32 form's accumulator and steps, or the tensor cores'.
template <bool TC> struct at_acc { float v[4][16]; };
template <> struct at_acc<true> { float v[AT_NT][4]; };

// Block (token tile * nkv + kv head, split).
template <bool TC>
__global__ void __launch_bounds__(AT_THREADS, 1) k_attn_tile(qf_attn_args a, at_geom g, float *part) {
    extern __shared__ float4 at_sh[];
    int hd = a.hd, qp = at_qp(hd), kvh = blockIdx.x % a.nkv, t0 = blockIdx.x / a.nkv * g.Tt, sp = blockIdx.y;
    int R = min(g.Tt, a.T - t0) * g.G;
    float *q = (float *)at_sh, *kb = q + AT_ROWS * qp, *vb = kb + 2 * AT_KEYS * qp, *p = vb + 2 * AT_KEYS * qp;
    float *m = p + AT_ROWS * (AT_KEYS + 1), *l = m + AT_ROWS, *corr = l + AT_ROWS;
    int j_begin = sp * g.ks, j_end = min(j_begin + g.ks, a.pos0 + t0 + R / g.G); // past the tile's last row's keys: none
    for (int i = threadIdx.x; i < AT_ROWS * (hd / 4); i += AT_THREADS) {
        int r = i / (hd / 4), d = (i - r * (hd / 4)) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < R) x = *(const float4 *)(a.q + (int64_t)(t0 + r / g.G) * a.q_stride + (int64_t)(kvh * g.G + r % g.G) * a.q_hstride + d);
        *(float4 *)(q + r * qp + d) = x;
    }
    if (threadIdx.x < AT_ROWS) m[threadIdx.x] = -INFINITY, l[threadIdx.x] = 0.0f;
    at_acc<TC> acc = {};
    if (j_begin < j_end) at_load_keys(a, kvh, j_begin, j_end, kb, vb);
    cp_commit();
    for (int j0 = j_begin, s = 0; j0 < j_end; j0 += AT_KEYS, s ^= 1) {
        if (j0 + AT_KEYS < j_end) at_load_keys(a, kvh, j0 + AT_KEYS, j_end, kb + (s ^ 1) * AT_KEYS * qp, vb + (s ^ 1) * AT_KEYS * qp);
        cp_commit();
        cp_wait<1>();
        __syncthreads(); // this stage's keys and (first round) q, m, l are in
        if constexpr (TC) at_scores_tc(a, g, t0, R, j0, j_end, q, kb + s * AT_KEYS * qp, p);
        else at_scores(a, g, t0, R, j0, j_end, q, kb + s * AT_KEYS * qp, p);
        __syncthreads();
        at_softmax(p, m, l, corr);
        __syncthreads();
        if constexpr (TC) at_pv_tc(hd, p, vb + s * AT_KEYS * qp, corr, acc.v);
        else at_pv(hd, p, vb + s * AT_KEYS * qp, corr, acc.v);
        __syncthreads(); // before the next round's loads reuse this stage and p
    }
    cp_wait<0>();
    __syncthreads();
    if constexpr (TC) at_write_tc(a, g, t0, R, kvh, sp, m, l, acc.v, part);
    else at_write(a, g, t0, R, kvh, sp, m, l, acc.v, part);
}

} // namespace

// The splits attn_tiled takes at most for T queries (about two blocks an SM over the tiles), at
// any context; 1 where it takes none.
int qfc::attn_tile_splits(ctx *c, int T, int nh, int nkv) {
    int G = nkv > 0 ? nh / nkv : 0;
    if (!QF_LAB(c, att_tile) || G < 1 || G > AT_ROWS) return 1;
    int Tt = AT_ROWS / G, tiles = (T + Tt - 1) / Tt * nkv;
    return max(1, min(64, (2 * c->sms + tiles - 1) / tiles));
}

int qfc::attn_tiled(ctx *c, const qf_attn_args *a, float *part, int part_splits) {
    int G = a->nkv > 0 ? a->nh / a->nkv : 0, hd = a->hd;
    if (!QF_LAB(c, att_tile) || a->T < 8 || G < 1 || G > AT_ROWS || a->nh % a->nkv || hd % 4 || hd > 256 || a->q_stride % 4 || a->q_hstride % 4 ||
        ((uintptr_t)a->q & 15) || ((uintptr_t)a->kv.base & 15) || a->kv.page_stride % 4 || a->kv.k_off % 4 || a->kv.v_off % 4)
        return 0;
    size_t smem = at_smem_floats(hd) * sizeof(float);
    if ((int)smem > c->smem_optin) return 0;
    if (!c->att_tile_attr) {
        // once, for the widest head it takes (the attribute is the kernel's, not the launch's)
        int most = (int)min((size_t)c->smem_optin, at_smem_floats(256) * sizeof(float));
        cudaFuncSetAttribute(k_attn_tile<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        cudaFuncSetAttribute(k_attn_tile<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        c->att_tile_attr = 1;
    }
    at_geom g;
    g.G = G, g.Tt = AT_ROWS / G;
    int tiles = (a->T + g.Tt - 1) / g.Tt * a->nkv, max_keys = a->pos0 + a->T;
    // about two blocks an SM: the key range split so that the tiles alone do not leave SMs idle
    int want = max(1, min(part_splits, (2 * c->sms + tiles - 1) / tiles));
    g.ks = ((max_keys + want - 1) / want + AT_KEYS - 1) / AT_KEYS * AT_KEYS;
    g.splits = (max_keys + g.ks - 1) / g.ks;
    if (QF_LAB(c, att_tc) && hd % 16 == 0 && c->cc_major >= 8) LAUNCH_S(c, k_attn_tile<true>, dim3(tiles, g.splits), AT_THREADS, smem, *a, g, part);
    else LAUNCH_S(c, k_attn_tile<false>, dim3(tiles, g.splits), AT_THREADS, smem, *a, g, part);
    LAUNCH(c, k_attn_combine, a->T * a->nh, 128, g.splits, hd, (const float *)part, a->out, (const float *)NULL, 0, a->nh);
    return 1;
}
