// Prefill attention as tiles of query rows that share a kv head: a block takes up to 64 rows
// (AT_ROWS: Tt tokens x the G query heads of one kv head) and walks its key range 32 keys at a
// time, each key's and value's row loaded once into shared memory (cp.async, two stages) for all
// of them. k_attn_part reads every key once per (token, query head) and spends a warp's shuffle
// reduction on each: an 8K prompt's attention read ~1 TB a layer from L2. fp32 throughout, as the
// CPU reference; the sums run in another order (q.k over dims in one thread, the softmax sums in
// 4-lane groups). Partials (m, l, o[hd]) per (row, split) in k_attn_part's layout, combined by
// k_attn_combine.
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
    return (size_t)AT_ROWS * at_qp(hd) + 2 * (size_t)AT_KEYS * (at_qp(hd) + hd) + AT_ROWS * (AT_KEYS + 1) + 3 * AT_ROWS;
}

// Keys j0 .. j0 + 31 of kv head kvh into k (pitch hd + 4) and v (pitch hd) by cp.async; keys at or
// past j_end load key j_end - 1 instead (finite values: their scores are masked to -inf, p = 0).
__device__ void at_load_keys(const qf_attn_args &a, int kvh, int j0, int j_end, float *k, float *v) {
    int hd = a.hd, n4 = hd / 4;
    for (int i = threadIdx.x; i < AT_KEYS * n4; i += AT_THREADS) {
        int kk = i / n4, d = (i - kk * n4) * 4, j = min(j0 + kk, j_end - 1);
        cp16(k + kk * at_qp(hd) + d, kv_row(a.kv, j, a.nkv, hd, kvh, 0) + d);
        cp16(v + kk * hd + d, kv_row(a.kv, j, a.nkv, hd, kvh, 1) + d);
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
            float4 x = *(const float4 *)(v + j * hd + d);
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

// Block (token tile * nkv + kv head, split).
__global__ void __launch_bounds__(AT_THREADS, 1) k_attn_tile(qf_attn_args a, at_geom g, float *part) {
    extern __shared__ float4 at_sh[];
    int hd = a.hd, qp = at_qp(hd), kvh = blockIdx.x % a.nkv, t0 = blockIdx.x / a.nkv * g.Tt, sp = blockIdx.y;
    int R = min(g.Tt, a.T - t0) * g.G;
    float *q = (float *)at_sh, *kb = q + AT_ROWS * qp, *vb = kb + 2 * AT_KEYS * qp, *p = vb + 2 * AT_KEYS * hd;
    float *m = p + AT_ROWS * (AT_KEYS + 1), *l = m + AT_ROWS, *corr = l + AT_ROWS;
    int j_begin = sp * g.ks, j_end = min(j_begin + g.ks, a.pos0 + t0 + R / g.G); // past the tile's last row's keys: none
    for (int i = threadIdx.x; i < AT_ROWS * (hd / 4); i += AT_THREADS) {
        int r = i / (hd / 4), d = (i - r * (hd / 4)) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < R) x = *(const float4 *)(a.q + (int64_t)(t0 + r / g.G) * a.q_stride + (int64_t)(kvh * g.G + r % g.G) * a.q_hstride + d);
        *(float4 *)(q + r * qp + d) = x;
    }
    if (threadIdx.x < AT_ROWS) m[threadIdx.x] = -INFINITY, l[threadIdx.x] = 0.0f;
    float acc[4][16] = {};
    if (j_begin < j_end) at_load_keys(a, kvh, j_begin, j_end, kb, vb);
    cp_commit();
    for (int j0 = j_begin, s = 0; j0 < j_end; j0 += AT_KEYS, s ^= 1) {
        if (j0 + AT_KEYS < j_end) at_load_keys(a, kvh, j0 + AT_KEYS, j_end, kb + (s ^ 1) * AT_KEYS * qp, vb + (s ^ 1) * AT_KEYS * hd);
        cp_commit();
        cp_wait<1>();
        __syncthreads(); // this stage's keys and (first round) q, m, l are in
        at_scores(a, g, t0, R, j0, j_end, q, kb + s * AT_KEYS * qp, p);
        __syncthreads();
        at_softmax(p, m, l, corr);
        __syncthreads();
        at_pv(hd, p, vb + s * AT_KEYS * hd, corr, acc);
        __syncthreads(); // before the next round's loads reuse this stage and p
    }
    cp_wait<0>();
    __syncthreads();
    at_write(a, g, t0, R, kvh, sp, m, l, acc, part);
}

} // namespace

int qfc::attn_tiled(ctx *c, const qf_attn_args *a, float *part, int part_splits) {
    int G = a->nkv > 0 ? a->nh / a->nkv : 0, hd = a->hd;
    if (!c->att_tile || a->T < 8 || G < 1 || G > AT_ROWS || a->nh % a->nkv || hd % 4 || hd > 256 || a->q_stride % 4 || a->q_hstride % 4 ||
        ((uintptr_t)a->q & 15) || ((uintptr_t)a->kv.base & 15) || a->kv.page_stride % 4 || a->kv.k_off % 4 || a->kv.v_off % 4)
        return 0;
    size_t smem = at_smem_floats(hd) * sizeof(float);
    if ((int)smem > c->smem_optin) return 0;
    if (!c->att_tile_attr) {
        // once, for the widest head it takes (the attribute is the kernel's, not the launch's)
        cudaFuncSetAttribute(k_attn_tile, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)min((size_t)c->smem_optin, at_smem_floats(256) * sizeof(float)));
        c->att_tile_attr = 1;
    }
    at_geom g;
    g.G = G, g.Tt = AT_ROWS / G;
    int tiles = (a->T + g.Tt - 1) / g.Tt * a->nkv, max_keys = a->pos0 + a->T;
    // about two blocks an SM: the key range split so that the tiles alone do not leave SMs idle
    int want = max(1, min(part_splits, (2 * c->sms + tiles - 1) / tiles));
    g.ks = ((max_keys + want - 1) / want + AT_KEYS - 1) / AT_KEYS * AT_KEYS;
    g.splits = (max_keys + g.ks - 1) / g.ks;
    LAUNCH_S(c, k_attn_tile, dim3(tiles, g.splits), AT_THREADS, smem, *a, g, part);
    LAUNCH(c, k_attn_combine, a->T * a->nh, 128, g.splits, hd, (const float *)part, a->out, (const float *)NULL, 0, a->nh);
    return 1;
}
