// The gated delta rule over a prompt in chunks of 64 tokens: the WY form whose algebra and CPU
// reference are backend/cpu/gdn_chunked.c. k_gdn_cols walks the tokens one at a time (each a chain
// of ~2 x 128 dependent FMAs a value column, 1.42 us a token at the real shape); here everything
// but the chunk-to-chunk state update is done for all chunks at once:
//   k_gdnc_prep, a block per (head, chunk): q and k normalised, the decays' running log sums G,
//     A = beta e^(G_t - G_s) k_t.k_s and P = e^(G_t - G_s) q_t.k_s, and one forward substitution
//     through (I + A) for Ut and W at once (a thread per column: no barrier inside the solve);
//   k_gdnc_walk, a block per (head, 32 value columns) walking the chunks in order with its slice
//     of the state in shared memory: U = Ut - W S, o = (e^G q) S + P U, S = e^G_last S + Kd^T U.
// fp32 throughout, as the CPU; the sums over the key dims run in the reference's order, the
// e^G_t of the output is applied to q before its sum instead of after (rounding-level).
#include "backend/cuda/cuda_int.cuh"

namespace {

using namespace qfc;

#define GC_T 64       // tokens a chunk
#define GC_COLS 32    // value columns a walking block
#define GC_THREADS 256
#define GC_GROUP 8    // chunks a prep + walk pair: bounds the scratch to 8 x heads x ~147 KB

// One (chunk, head)'s products in the scratch, in floats from its start (all multiples of 4 when
// dk and dv are, so every row is a whole number of 16-byte copies):
//   Ut [64][dv] | WT [dk][64] | QT [dk][64] (e^G_t q_t) | KD [64][dk] (e^(G_last - G_s) k_s) |
//   PT [64][64] (P transposed, zero above the diagonal) | e^G_last, 3 floats of padding
struct gc_off {
    size_t wt, qt, kd, pt, eg, all;
};
__host__ __device__ inline gc_off gc_offsets(int dk, int dv) {
    gc_off o;
    o.wt = (size_t)GC_T * dv, o.qt = o.wt + (size_t)dk * GC_T, o.kd = o.qt + (size_t)dk * GC_T;
    o.pt = o.kd + (size_t)GC_T * dk, o.eg = o.pt + GC_T * GC_T, o.all = o.eg + 4;
    return o;
}
__host__ __device__ inline int gc_kp(int dk) { return dk + 4; } // q's and k's row pitch: 16-byte rows, 8 rows' float4s in distinct banks
__host__ __device__ inline size_t gc_prep_floats(int dk, int dv) {
    return 2 * (size_t)GC_T * gc_kp(dk) + (size_t)GC_T * dv + GC_T * GC_T + 2 * GC_T;
}
__host__ __device__ inline size_t gc_walk_floats(int dk) {
    return (size_t)dk * GC_COLS + 2 * GC_T * GC_COLS + 3 * (size_t)dk * GC_T + GC_T * GC_T;
}

// The chunk's q and k rows (raw) and v rows into shared memory by cp.async (rows past n zero), and
// on warp 0 meanwhile the decays' running sums G (in token order, as the CPU) and beta (zero past n:
// a padded token then changes nothing, and G stays at G_{n-1} to the chunk's end).
__device__ void gc_load(const qf_gdn_args &a, int h, int t0, int n, float *qn, float *kn, float *V, float *G, float *beta) {
    int dk = a.dk, dv = a.dv, kp = gc_kp(dk), kh = h / (a.nv / a.nk), q4 = dk / 4, v4 = dv / 4;
    for (int e = threadIdx.x; e < GC_T * (2 * q4 + v4); e += GC_THREADS) {
        int t = e / (2 * q4 + v4), c = e - t * (2 * q4 + v4);
        int64_t row = (int64_t)(t0 + t) * a.stride;
        float *dst = c < q4 ? qn + t * kp + c * 4 : c < 2 * q4 ? kn + t * kp + (c - q4) * 4 : V + t * dv + (c - 2 * q4) * 4;
        const float *src = c < q4 ? a.q + row + kh * dk + c * 4 : c < 2 * q4 ? a.k + row + kh * dk + (c - q4) * 4 : a.v + row + (int64_t)h * dv + (c - 2 * q4) * 4;
        if (t < n) cp16(dst, src);
        else *(float4 *)dst = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cp_commit();
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        float g[2];
        for (int u = 0; u < 2; u++) {
            int t = lane + 32 * u;
            g[u] = t < n ? a.g[(int64_t)(t0 + t) * a.nv + h] : 0.0f;
            beta[t] = t < n ? a.beta[(int64_t)(t0 + t) * a.nv + h] : 0.0f;
        }
        float run = 0.0f;
#pragma unroll
        for (int t = 0; t < GC_T; t++) {
            run += __shfl_sync(0xffffffffu, g[t >> 5], t & 31);
            if (lane == 0) G[t] = run;
        }
    }
}

// q and k normalised in place (qf_ref_l2norm; a warp a token, the sum of squares over the warp).
__device__ void gc_norm(int dk, float *qn, float *kn) {
    int kp = gc_kp(dk), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float qscale = 1.0f / sqrtf((float)dk);
#pragma unroll 2
    for (int t = warp; t < GC_T; t += GC_THREADS / 32) {
        float qv[4], kv[4], sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = lane + 32 * u;
            qv[u] = i < dk ? qn[t * kp + i] : 0.0f, kv[u] = i < dk ? kn[t * kp + i] : 0.0f;
            sq += qv[u] * qv[u], sk += kv[u] * kv[u];
        }
        float iq = qscale / sqrtf(warp_sum(sq) + 1e-6f), ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (lane + 32 * u < dk) qn[t * kp + lane + 32 * u] = qv[u] * iq, kn[t * kp + lane + 32 * u] = kv[u] * ik;
    }
}

// A transposed (AT[s][t], into shared memory, zero where s >= t) and P transposed (PT[s][t], into
// the scratch, zero where s > t): thread (ty, tx) takes s = 4 ty .. 4 ty + 3 against t = tx + 16 m,
// the key dims in order, four at a time from 16-byte rows.
__device__ void gc_products(const float *qn, const float *kn, const float *G, const float *beta, int dk, float *AT, float *pt) {
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15, kp = gc_kp(dk);
    float kk[4][4] = {}, qk[4][4] = {};
    for (int i = 0; i < dk; i += 4) {
        float4 ks[4], kt[4], qt[4];
#pragma unroll
        for (int r = 0; r < 4; r++)
            ks[r] = *(const float4 *)(kn + (ty * 4 + r) * kp + i), kt[r] = *(const float4 *)(kn + (tx + 16 * r) * kp + i),
            qt[r] = *(const float4 *)(qn + (tx + 16 * r) * kp + i);
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int m = 0; m < 4; m++) {
                kk[r][m] += kt[m].x * ks[r].x, qk[r][m] += qt[m].x * ks[r].x;
                kk[r][m] += kt[m].y * ks[r].y, qk[r][m] += qt[m].y * ks[r].y;
                kk[r][m] += kt[m].z * ks[r].z, qk[r][m] += qt[m].z * ks[r].z;
                kk[r][m] += kt[m].w * ks[r].w, qk[r][m] += qt[m].w * ks[r].w;
            }
    }
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int m = 0; m < 4; m++) {
            int s = ty * 4 + r, t = tx + 16 * m;
            float d = expf(G[t] - G[s]);
            AT[s * GC_T + t] = s < t ? beta[t] * d * kk[r][m] : 0.0f;
            pt[s * GC_T + t] = s <= t ? d * qk[r][m] : 0.0f;
        }
}

// Column col of (I + A)^-1 R, R = [beta_t v_t | beta_t e^G_t k_t], in registers: when X_s is final
// it leaves every later row (X_t -= A[t][s] X_s, s in order: the CPU's order for each t, with 63 - s
// independent FMAs a step where a row-by-row sum is one chain), then out to the scratch (Ut's
// column, or W's as WT's row).
__device__ void gc_solve(const float *AT, const float *V, const float *kn, const float *G, const float *beta, int dk, int dv, float *out, size_t wt) {
    int col = threadIdx.x, kp = gc_kp(dk);
    if (col >= dv + dk) return;
    float x[GC_T];
#pragma unroll
    for (int t = 0; t < GC_T; t++) x[t] = col < dv ? beta[t] * V[t * dv + col] : beta[t] * expf(G[t]) * kn[t * kp + col - dv];
#pragma unroll
    for (int s = 0; s < GC_T - 1; s++)
#pragma unroll
        for (int g = (s + 1) & ~3; g < GC_T; g += 4) { // AT[s][t] is zero for t <= s: the group's first rows lose nothing
            float4 a4 = *(const float4 *)(AT + s * GC_T + g);
            x[g] -= a4.x * x[s], x[g + 1] -= a4.y * x[s], x[g + 2] -= a4.z * x[s], x[g + 3] -= a4.w * x[s];
        }
    if (col < dv) {
#pragma unroll
        for (int t = 0; t < GC_T; t++) out[(size_t)t * dv + col] = x[t];
    } else {
        float *w = out + wt + (size_t)(col - dv) * GC_T;
#pragma unroll
        for (int t = 0; t < GC_T; t += 4) *(float4 *)(w + t) = make_float4(x[t], x[t + 1], x[t + 2], x[t + 3]);
    }
}

__global__ void __launch_bounds__(GC_THREADS) k_gdnc_prep(qf_gdn_args a, int c0, float *scr) {
    extern __shared__ __align__(16) float sm[];
    int h = blockIdx.x, t0 = c0 + blockIdx.y * GC_T, n = min(GC_T, a.T - t0), dk = a.dk, dv = a.dv, kp = gc_kp(dk);
    float *qn = sm, *kn = qn + GC_T * kp, *V = kn + GC_T * kp, *AT = V + GC_T * dv, *G = AT + GC_T * GC_T, *beta = G + GC_T;
    gc_off off = gc_offsets(dk, dv);
    float *out = scr + ((size_t)blockIdx.y * a.nv + h) * off.all;
    gc_load(a, h, t0, n, qn, kn, V, G, beta);
    cp_wait<0>();
    __syncthreads();
    gc_norm(dk, qn, kn);
    __syncthreads();
    gc_products(qn, kn, G, beta, dk, AT, out + off.pt);
    __syncthreads();
    gc_solve(AT, V, kn, G, beta, dk, dv, out, off.wt);
    float glast = G[GC_T - 1];
    for (int e = threadIdx.x; e < dk * GC_T; e += GC_THREADS) {
        int i = e / GC_T, t = e % GC_T;
        out[off.qt + e] = expf(G[t]) * qn[t * kp + i];
    }
    for (int e = threadIdx.x; e < GC_T * dk; e += GC_THREADS) {
        int s = e / dk, i = e % dk;
        out[off.kd + e] = expf(glast - G[s]) * kn[s * kp + i];
    }
    if (threadIdx.x == 0) out[off.eg] = expf(glast);
}

// The chunk's products into shared memory (WT, QT, KD, PT lie one after another in both), and the
// block's 32 columns of Ut.
__device__ void gc_stage(const float *b, const gc_off &off, int dv, int j0, float *ut, float *wt) {
    for (int e = threadIdx.x; e < GC_T * GC_COLS / 4; e += GC_THREADS) {
        int t = e / (GC_COLS / 4), q = e % (GC_COLS / 4);
        cp16(ut + t * GC_COLS + q * 4, b + (size_t)t * dv + j0 + q * 4);
    }
    int n4 = (int)((off.eg - off.wt) / 4);
    for (int e = threadIdx.x; e < n4; e += GC_THREADS) cp16(wt + e * 4, b + off.wt + e * 4);
    cp_commit();
}

// acc[r][c] += sum over i < dk of WT[i][ty + 32 r] * S[i][tx * 4 + c], and o likewise with QT: the
// two products that read the state, in one pass over it (i in order).
__device__ __forceinline__ void gc_left_mul(const float *wt, const float *qt, const float *Ss, int dk, int ty, int tx, float acc[2][4], float o[2][4]) {
#pragma unroll 4
    for (int i = 0; i < dk; i++) {
        float w0 = wt[i * GC_T + ty], w1 = wt[i * GC_T + ty + 32], q0 = qt[i * GC_T + ty], q1 = qt[i * GC_T + ty + 32];
        float4 r = *(const float4 *)(Ss + i * GC_COLS + tx * 4);
        acc[0][0] += w0 * r.x, acc[0][1] += w0 * r.y, acc[0][2] += w0 * r.z, acc[0][3] += w0 * r.w;
        acc[1][0] += w1 * r.x, acc[1][1] += w1 * r.y, acc[1][2] += w1 * r.z, acc[1][3] += w1 * r.w;
        o[0][0] += q0 * r.x, o[0][1] += q0 * r.y, o[0][2] += q0 * r.z, o[0][3] += q0 * r.w;
        o[1][0] += q1 * r.x, o[1][1] += q1 * r.y, o[1][2] += q1 * r.z, o[1][3] += q1 * r.w;
    }
}

// One chunk of the walk for the block's columns: U, the outputs, then the state.
__device__ void gc_chunk(const qf_gdn_args &a, int h, int j0, int t0, int n, float eg, float *Ss, float *U, const float *ut, const float *wt,
                         const float *qt, const float *kd, const float *pt) {
    int dk = a.dk, ty = threadIdx.x >> 3, tx = threadIdx.x & 7;
    float acc[2][4] = {}, o[2][4] = {};
    gc_left_mul(wt, qt, Ss, dk, ty, tx, acc, o);
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int c = 0; c < 4; c++) U[(ty + 32 * r) * GC_COLS + tx * 4 + c] = ut[(ty + 32 * r) * GC_COLS + tx * 4 + c] - acc[r][c];
    __syncthreads();
    int send = min(GC_T, (ty | 3) + 33); // P is zero past the diagonal: the warp's last row's reach
#pragma unroll 4
    for (int s = 0; s < send; s++) {
        float p0 = pt[s * GC_T + ty], p1 = pt[s * GC_T + ty + 32];
        float4 u = *(const float4 *)(U + s * GC_COLS + tx * 4);
        o[0][0] += p0 * u.x, o[0][1] += p0 * u.y, o[0][2] += p0 * u.z, o[0][3] += p0 * u.w;
        o[1][0] += p1 * u.x, o[1][1] += p1 * u.y, o[1][2] += p1 * u.z, o[1][3] += p1 * u.w;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int t = ty + 32 * r;
        if (t < n) *(float4 *)(a.out + ((int64_t)(t0 + t) * a.nv + h) * a.dv + j0 + tx * 4) = make_float4(o[r][0], o[r][1], o[r][2], o[r][3]);
    }
    __syncthreads(); // every read of this chunk's S is done
    for (int i = ty; i < dk; i += 32) {
        float4 s4 = *(float4 *)(Ss + i * GC_COLS + tx * 4);
        float s[4] = {s4.x * eg, s4.y * eg, s4.z * eg, s4.w * eg};
#pragma unroll 4
        for (int t = 0; t < n; t++) {
            float k = kd[t * dk + i];
            float4 u = *(const float4 *)(U + t * GC_COLS + tx * 4);
            s[0] += k * u.x, s[1] += k * u.y, s[2] += k * u.z, s[3] += k * u.w;
        }
        *(float4 *)(Ss + i * GC_COLS + tx * 4) = make_float4(s[0], s[1], s[2], s[3]);
    }
}

__global__ void __launch_bounds__(GC_THREADS) k_gdnc_walk(qf_gdn_args a, int c0, int nch, const float *scr) {
    extern __shared__ __align__(16) float sm[];
    int h = blockIdx.x, j0 = blockIdx.y * GC_COLS, dk = a.dk, dv = a.dv;
    gc_off off = gc_offsets(dk, dv);
    float *Ss = sm, *U = Ss + dk * GC_COLS, *ut = U + GC_T * GC_COLS, *wt = ut + GC_T * GC_COLS;
    float *qt = wt + dk * GC_T, *kd = qt + dk * GC_T, *pt = kd + GC_T * dk;
    float *S = a.S + (int64_t)h * dk * dv;
    for (int e = threadIdx.x; e < dk * GC_COLS; e += GC_THREADS) Ss[e] = S[(int64_t)(e / GC_COLS) * dv + j0 + e % GC_COLS];
    for (int ch = 0; ch < nch; ch++) {
        const float *b = scr + ((size_t)ch * a.nv + h) * off.all;
        int t0 = c0 + ch * GC_T;
        gc_stage(b, off, dv, j0, ut, wt);
        float eg = b[off.eg];
        cp_wait<0>();
        __syncthreads(); // the stage is in, and the last chunk's state written
        gc_chunk(a, h, j0, t0, min(GC_T, a.T - t0), eg, Ss, U, ut, wt, qt, kd, pt);
        __syncthreads(); // before the next stage overwrites what this chunk read
    }
    for (int e = threadIdx.x; e < dk * GC_COLS; e += GC_THREADS) S[(int64_t)(e / GC_COLS) * dv + j0 + e % GC_COLS] = Ss[e];
}

} // namespace

size_t qfc::gdn_chunk_scratch(ctx *c, const qf_scratch_shape *s) {
    if (!QF_LAB(c, gdn_chunk) || !s->gdn_heads || s->rows < c->gdn_chunk_min) return 0;
    int nch = (s->rows + GC_T - 1) / GC_T, per = min(nch, GC_GROUP);
    return (size_t)per * s->gdn_heads * gc_offsets(s->gdn_dk, s->gdn_dv).all * sizeof(float);
}

int qfc::gdn_chunked(ctx *c, const qf_gdn_args *a) {
    int dk = a->dk, dv = a->dv;
    // cp.async and float4 stores: every q, k, v and output row must start on 16 bytes
    if (!QF_LAB(c, gdn_chunk) || a->T < c->gdn_chunk_min || dk > 128 || dk % 4 || dv % GC_COLS || dv > 128 || a->stride % 4 || ((uintptr_t)a->out & 15) ||
        ((uintptr_t)a->q & 15) || ((uintptr_t)a->k & 15) || ((uintptr_t)a->v & 15))
        return 0;
    size_t p_smem = gc_prep_floats(dk, dv) * sizeof(float), w_smem = gc_walk_floats(dk) * sizeof(float);
    if ((int)p_smem > c->smem_optin || (int)w_smem > c->smem_optin) return 0;
    gc_off off = gc_offsets(dk, dv);
    int nch = (a->T + GC_T - 1) / GC_T, per = min(nch, GC_GROUP);
    float *scr = (float *)scratch(c, &c->gdnc, &c->gdnc_cap, (size_t)per * a->nv * off.all * sizeof(float));
    if (!scr) return 0;
    if (!c->gdnc_attr) { // once, for the widest heads it takes (the attribute is the kernel's, not the launch's)
        cudaFuncSetAttribute(k_gdnc_prep, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(gc_prep_floats(128, 128) * sizeof(float)));
        cudaFuncSetAttribute(k_gdnc_walk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(gc_walk_floats(128) * sizeof(float)));
        c->gdnc_attr = 1;
    }
    for (int g0 = 0; g0 < nch; g0 += GC_GROUP) {
        int m = min(GC_GROUP, nch - g0);
        LAUNCH_S(c, k_gdnc_prep, dim3(a->nv, m), GC_THREADS, p_smem, *a, g0 * GC_T, scr);
        LAUNCH_S(c, k_gdnc_walk, dim3(a->nv, dv / GC_COLS), GC_THREADS, w_smem, *a, g0 * GC_T, m, (const float *)scr);
    }
    return 1;
}
