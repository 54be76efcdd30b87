// The CUDA ops table. Every kernel mirrors the CPU reference op of the same name
// (src/backend/cpu/ops_ref.c); tests/test_cuda.c compares them on random data of the real shapes.
#include "backend/cuda/cuda_int.cuh"
#include "backend/cuda/dec_int.cuh"
#include "backend/cuda/quant.cuh"
#include "base/timer.h"

namespace {

using namespace qfc;


// ---- matrix-vector products: a warp per output row, NT tokens at once ----

// bf16 rows, 16-byte aligned, cols % 8 == 0, x 16-byte aligned: each lane streams 8 weights at a
// time (bypassing L1, which keeps x), two rows per warp for more loads in flight.
#define GEMV_ROWS 2
template <int NT>
__global__ void gemv_bf16(const uint16_t *__restrict__ W, int64_t rows, int64_t cols, const float *__restrict__ x, float *__restrict__ y) {
    int64_t row0 = ((int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * GEMV_ROWS;
    int lane = threadIdx.x & 31;
    if (row0 >= rows) return;
    int nr = rows - row0 < GEMV_ROWS ? (int)(rows - row0) : GEMV_ROWS;
    float acc[GEMV_ROWS][NT];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
    int64_t n8 = cols / 8;
    // unrolled so a lane issues several 16-byte loads before it needs the first: small matrices
    // (a few rows) are bound by load latency, not bandwidth
#pragma unroll 4
    for (int64_t c = lane; c < n8; c += 32) {
        uint4 v[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) v[r] = r < nr ? __ldcs((const uint4 *)(W + (row0 + r) * cols) + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) acc[r][t] += dot8(v[r], x + t * cols + c * 8);
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = warp_sum(acc[r][t]);
            if (lane == 0 && r < nr) y[t * rows + row0 + r] = s;
        }
}

// Any dtype and alignment.
template <int NT>
__global__ void gemv_any(const void *__restrict__ W, int dtype, int64_t rows, int64_t cols, const float *__restrict__ x, float *__restrict__ y) {
    int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    for (int64_t c = lane; c < cols; c += 32) {
        float w = ldwq(W, dtype, rows, cols, row, c);
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] += w * x[t * cols + c];
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) y[t * rows + row] = s;
    }
}

template <int NT>
void gemv_launch(ctx *c, const qf_mat *w, const float *x, float *y) {
    int warps = 8;
    int fast = w->dtype == QF_DT_BF16 && w->cols % 8 == 0 && ((uintptr_t)w->data % 16) == 0 && ((uintptr_t)x % 16) == 0;
    if (fast) {
        int64_t per_block = (int64_t)warps * GEMV_ROWS;
        LAUNCH(c, gemv_bf16<NT>, (unsigned)((w->rows + per_block - 1) / per_block), warps * 32, (const uint16_t *)w->data, w->rows, w->cols, x, y);
    } else {
        LAUNCH(c, gemv_any<NT>, (unsigned)((w->rows + warps - 1) / warps), warps * 32, w->data, w->dtype, w->rows, w->cols, x, y);
    }
}

void gemv(ctx *c, const qf_mat *w, const float *x, int n, float *y) {
    for (int t0 = 0; t0 < n; t0 += 8) {
        int nt = n - t0 < 8 ? n - t0 : 8;
        const float *xt = x + (int64_t)t0 * w->cols;
        float *yt = y + (int64_t)t0 * w->rows;
        switch (nt) {
        case 1: gemv_launch<1>(c, w, xt, yt); break;
        case 2: gemv_launch<2>(c, w, xt, yt); break;
        case 3: gemv_launch<3>(c, w, xt, yt); break;
        case 4: gemv_launch<4>(c, w, xt, yt); break;
        case 5: gemv_launch<5>(c, w, xt, yt); break;
        case 6: gemv_launch<6>(c, w, xt, yt); break;
        case 7: gemv_launch<7>(c, w, xt, yt); break;
        default: gemv_launch<8>(c, w, xt, yt); break;
        }
    }
}

// x = hi + lo, both bf16: two tensor-core products keep ~16 bits of each activation (one bf16
// keeps 8, which moves trained-model logits by ~1).
__global__ void to_bf16x2(const float *__restrict__ x, __nv_bfloat16 *__restrict__ hi, __nv_bfloat16 *__restrict__ lo, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    __nv_bfloat16 h = __float2bfloat16(x[i]);
    hi[i] = h;
    if (lo) lo[i] = __float2bfloat16(x[i] - __bfloat162float(h));
}

void cu_matmul(qf_backend *be, const qf_mat *w, const float *x, int n, float *y) {
    ctx *c = C(be);
    if (n <= GEMV_MAX_N || c->fp32 || (w->dtype != QF_DT_BF16 && w->dtype != QF_DT_F32)) {
        gemv(c, w, x, n, y);
        return;
    }
    float one = 1.0f, zero = 0.0f;
    if (w->dtype == QF_DT_F32) {
        cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, n, (int)w->cols, &one, (const float *)w->data, (int)w->cols, x,
                    (int)w->cols, &zero, y, (int)w->rows);
        return;
    }
    int64_t nx = (int64_t)n * w->cols;
    __nv_bfloat16 *xb = (__nv_bfloat16 *)scratch(c, &c->xb, &c->xb_cap, (size_t)nx * 4), *lo = c->bf16_single ? NULL : xb + nx;
    if (!xb) {
        gemv(c, w, x, n, y);
        return;
    }
    LAUNCH(c, to_bf16x2, blocks(nx, 256), 256, x, xb, lo, nx);
    cublasStatus_t st = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, n, (int)w->cols, &one, w->data, CUDA_R_16BF,
                                     (int)w->cols, xb, CUDA_R_16BF, (int)w->cols, &zero, y, CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT);
    if (st == CUBLAS_STATUS_SUCCESS && lo)
        st = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, n, (int)w->cols, &one, w->data, CUDA_R_16BF, (int)w->cols, lo,
                          CUDA_R_16BF, (int)w->cols, &one, y, CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) gemv(c, w, x, n, y);
}

// ---- small ops ----

__global__ void k_embed(const void *emb, int dtype, int64_t cols, const int32_t *ids, int n, float *y) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * cols) return;
    int64_t t = i / cols, c = i % cols;
    y[i] = ldw(emb, dtype, (int64_t)ids[t] * cols + c);
}

// Eager, the ids of each call are staged at the start (after the previous copy from there ran); in
// a recorded step every copy node reads the staging when the graph runs, so each call of the step
// has its own place (tok_off), which step_begin made room for.
void cu_embed(qf_backend *be, const qf_mat *emb, const int32_t *ids, int n, float *y) {
    ctx *c = C(be);
    size_t off = c->gs.mode == G_EAGER ? 0 : c->gs.tok_off;
    if (!tok_room(c, off + (size_t)n)) return;
    int32_t *d = (int32_t *)c->tok + off, *pin = c->gs.pin_tok + off;
    if (c->gs.mode == G_EAGER && c->tok_ev_set) check(c, cudaEventSynchronize(c->tok_ev), "embed: the previous ids' copy");
    memcpy(pin, ids, (size_t)n * 4);
    g_copy(c, d, pin, (size_t)n * 4, cudaMemcpyHostToDevice);
    c->tok_ev_set = c->gs.mode == G_EAGER && c->tok_ev && cudaEventRecord(c->tok_ev, 0) == cudaSuccess;
    c->gs.tok_off = off + (size_t)n;
    LAUNCH(c, k_embed, blocks((int64_t)n * emb->cols, 256), 256, emb->data, emb->dtype, emb->cols, d, n, y);
}

__global__ void k_rmsnorm(const float *x, int xs, const float *w, int dim, float eps, float *y, int ys) {
    __shared__ float red[32];
    const float *xr = x + (int64_t)blockIdx.x * xs;
    float *yr = y + (int64_t)blockIdx.x * ys;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    float inv = 1.0f / sqrtf(red[0] / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * (w ? w[i] : 1.0f);
}

void cu_rmsnorm(qf_backend *be, const float *x, int xs, const float *w, int n_rows, int dim, float eps, float *y, int ys) {
    ctx *c = C(be);
    if (n_rows > 0) LAUNCH(c, k_rmsnorm, n_rows, 256, x, xs, w, dim, eps, y, ys);
}

__global__ void k_rope(float *x, int stride, int hstride, int T, int nh, int half, int pos0, const float *inv_freq) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)T * nh * half) return;
    int k = (int)(i % half), h = (int)((i / half) % nh), t = (int)(i / half / nh);
    float *v = x + (int64_t)t * stride + (int64_t)h * hstride;
    float ang = (float)(pos0 + t) * inv_freq[k];
    float cs = cosf(ang), sn = sinf(ang), a = v[k], b = v[k + half];
    v[k] = a * cs - b * sn;
    v[k + half] = b * cs + a * sn;
}

void cu_rope(qf_backend *be, float *x, int stride, int hstride, int T, int nh, int rot, int pos0, const float *inv_freq) {
    ctx *c = C(be);
    int64_t n = (int64_t)T * nh * (rot / 2);
    if (n > 0) LAUNCH(c, k_rope, blocks(n, 256), 256, x, stride, hstride, T, nh, rot / 2, pos0, inv_freq);
}

// The causal conv + SiLU over T tokens, a thread per (token, channel): y[t] needs only the K - 1
// inputs before it (from the state for the first ones), so the tokens need not be walked in order
// (a thread per channel walking them left 64 blocks on the chip). The same sum in the same order
// as the CPU: the K - 1 older inputs oldest first, then x[t].
__global__ void k_conv_tok(const float *x, int xs, int T, int Cn, int K, const float *w, const float *state, float *y) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)T * Cn) return;
    int c = (int)(i % Cn), t = (int)(i / Cn);
    float acc = 0.0f;
    for (int j = 0; j < K - 1; j++) {
        int tt = t - (K - 1) + j; // the input's time; before 0: the state's row K - 1 + tt
        acc += w[c * K + j] * (tt >= 0 ? x[(int64_t)tt * xs + c] : state[(int64_t)(K - 1 + tt) * Cn + c]);
    }
    acc += w[c * K + K - 1] * x[(int64_t)t * xs + c];
    y[(int64_t)t * Cn + c] = silu(acc);
}

// The state after the T tokens: the last K - 1 inputs (older state rows where T < K - 1). A thread
// per channel, rows in ascending order: row j reads old row T + j, not yet overwritten. After
// k_conv_tok, which reads the old state.
__global__ void k_conv_state(const float *x, int xs, int T, int Cn, int K, float *state) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= Cn) return;
    for (int j = 0; j < K - 1; j++) {
        int tt = T - (K - 1) + j;
        state[(int64_t)j * Cn + c] = tt >= 0 ? x[(int64_t)tt * xs + c] : state[(int64_t)(K - 1 + tt) * Cn + c];
    }
}

void cu_conv_silu(qf_backend *be, const float *x, int xs, int T, int Cn, int K, const float *w, float *state, float *y) {
    ctx *c = C(be);
    LAUNCH(c, k_conv_tok, blocks((int64_t)T * Cn, 256), 256, x, xs, T, Cn, K, w, (const float *)state, y);
    LAUNCH(c, k_conv_state, blocks(Cn, 128), 128, x, xs, T, Cn, K, state);
}

#if QF_CUDA_LAB_BUILD
// Gated delta rule: a block per v-head, a thread per value column j holding S[:, j].
template <int DK>
__global__ void k_gdn(qf_gdn_args a) {
    __shared__ float qn[DK], kn[DK], red[2][32];
    int h = blockIdx.x, j = threadIdx.x, dk = a.dk, dv = a.dv, kh = h / (a.nv / a.nk);
    float s[DK];
    float *S = a.S + (int64_t)h * dk * dv;
#pragma unroll
    for (int i = 0; i < DK; i++) s[i] = i < dk && j < dv ? S[(int64_t)i * dv + j] : 0.0f;
    float qscale = rsqrtf((float)dk);
    for (int t = 0; t < a.T; t++) {
        const float *q = a.q + (int64_t)t * a.stride + kh * dk, *k = a.k + (int64_t)t * a.stride + kh * dk;
        float sq = 0.0f, sk = 0.0f;
        for (int i = j; i < dk; i += blockDim.x) sq += q[i] * q[i], sk += k[i] * k[i];
        sq = warp_sum(sq), sk = warp_sum(sk);
        if ((j & 31) == 0) red[0][j / 32] = sq, red[1][j / 32] = sk;
        __syncthreads();
        float tq = 0.0f, tk = 0.0f;
        for (int w = 0; w < (int)(blockDim.x + 31) / 32; w++) tq += red[0][w], tk += red[1][w];
        float iq = qscale / sqrtf(tq + 1e-6f), ik = 1.0f / sqrtf(tk + 1e-6f);
        for (int i = j; i < dk; i += blockDim.x) qn[i] = q[i] * iq, kn[i] = k[i] * ik;
        __syncthreads();
        if (j < dv) {
            float decay = expf(a.g[t * a.nv + h]), beta = a.beta[t * a.nv + h], u = 0.0f, o = 0.0f;
#pragma unroll
            for (int i = 0; i < DK; i++)
                if (i < dk) s[i] *= decay, u += s[i] * kn[i];
            u = beta * (a.v[(int64_t)t * a.stride + h * dv + j] - u);
#pragma unroll
            for (int i = 0; i < DK; i++)
                if (i < dk) s[i] += kn[i] * u, o += s[i] * qn[i];
            a.out[((int64_t)t * a.nv + h) * dv + j] = o;
        }
        __syncthreads(); // qn/kn and red are rewritten by the next token
    }
#pragma unroll
    for (int i = 0; i < DK; i++)
        if (i < dk && j < dv) S[(int64_t)i * dv + j] = s[i];
}
#endif

#define GDN_TC 8 // tokens whose inputs a warp of k_gdn_cols loads in one round

// The gated delta rule as k_gdn, a warp per (v-head, 32 / LPC value columns): the columns of S are
// independent given the normalised q and k, so LPC lanes keep a column S[:, j] in registers (lane
// sub of a column: rows sub, sub + LPC, ...), and the warp normalises q and k itself (no block
// barrier). The inputs of GDN_TC tokens reach shared memory in one round of cp.async copies, the
// next round's issued before the current one is used (CP; where rows are not 16-byte aligned,
// plain loads a round at a time), then 4 lanes a token scale them; k_gdn paid several memory
// latencies per token (12 us a token at the real shape). LPC 4 (the default; option gdn_plpc)
// gives 4x the warps of one lane a column and a quarter of each dependent chain of sums (one lane a
// column left 1 warp an SM: one of its 4 schedulers busy). The column sums are
// LPC partial sums, added by shuffles.
template <int DK, int LPC>
struct gdn_stage {
    float q[GDN_TC][DK], k[GDN_TC][DK], v[GDN_TC][32 / LPC], g[GDN_TC], b[GDN_TC];
};

// Tokens t0 .. t0 + tc - 1's q, k, the warp's v columns, decay and beta into st.
template <bool CP, int DK, int LPC>
__device__ __forceinline__ void gdn_stage_in(const qf_gdn_args &a, int h, int kh, int t0, int tc, gdn_stage<DK, LPC> &st) {
    constexpr int CPW = 32 / LPC;
    int lane = threadIdx.x, dk = a.dk, dv = a.dv, j0 = blockIdx.y * CPW;
#pragma unroll
    for (int u = 0; u < GDN_TC; u++) {
        if (u >= tc) break;
        int64_t t = t0 + u;
        const float *q = a.q + t * a.stride + kh * dk, *k = a.k + t * a.stride + kh * dk, *v = a.v + t * a.stride + h * dv + j0;
        if (CP) {
            for (int i = lane * 4; i < dk; i += 128) cp16(&st.q[u][i], q + i), cp16(&st.k[u][i], k + i);
            if (lane * 4 < CPW) cp16(&st.v[u][lane * 4], v + lane * 4);
            if (lane == 0) cp4(&st.g[u], a.g + t * a.nv + h), cp4(&st.b[u], a.beta + t * a.nv + h);
        } else {
            for (int i = lane; i < dk; i += 32) st.q[u][i] = q[i], st.k[u][i] = k[i];
            if (lane < CPW) st.v[u][lane] = j0 + lane < dv ? v[lane] : 0.0f;
            if (lane == 0) st.g[u] = a.g[t * a.nv + h], st.b[u] = a.beta[t * a.nv + h];
        }
    }
}

// A round's q and k scaled in place: 4 lanes a token.
template <int DK, int LPC>
__device__ __forceinline__ void gdn_stage_norm(int dk, int tc, float qscale, gdn_stage<DK, LPC> &st) {
    int u = threadIdx.x >> 2, p = threadIdx.x & 3;
    float sq = 0.0f, sk = 0.0f;
    if (u < tc)
        for (int i = p; i < dk; i += 4) sq += st.q[u][i] * st.q[u][i], sk += st.k[u][i] * st.k[u][i];
    sq += __shfl_xor_sync(0xffffffffu, sq, 1), sk += __shfl_xor_sync(0xffffffffu, sk, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2), sk += __shfl_xor_sync(0xffffffffu, sk, 2);
    float iq = qscale / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
    __syncwarp();
    if (u < tc)
        for (int i = p; i < dk; i += 4) st.q[u][i] *= iq, st.k[u][i] *= ik;
}

template <bool CP, int DK, int LPC>
__global__ void __launch_bounds__(32) k_gdn_cols(qf_gdn_args a) {
    constexpr int RPL = DK / LPC; // state rows a lane
    static_assert(GDN_TC * 4 == 32, "4 lanes a token scale a round's q and k");
    __shared__ __align__(16) gdn_stage<DK, LPC> st[CP ? 2 : 1];
    int h = blockIdx.x, lane = threadIdx.x, sub = lane % LPC, c = lane / LPC, j = blockIdx.y * (32 / LPC) + c, dk = a.dk, dv = a.dv;
    int kh = h / (a.nv / a.nk);
    bool col = j < dv;
    float s[RPL];
    float *S = a.S + (int64_t)h * dk * dv;
#pragma unroll
    for (int r = 0; r < RPL; r++) s[r] = r * LPC + sub < dk && col ? S[(int64_t)(r * LPC + sub) * dv + j] : 0.0f;
    float qscale = rsqrtf((float)dk);
    if (CP) gdn_stage_in<CP>(a, h, kh, 0, min(GDN_TC, a.T), st[0]), cp_commit();
    for (int t0 = 0, b = 0; t0 < a.T; t0 += GDN_TC, b ^= CP ? 1 : 0) {
        int tc = min(GDN_TC, a.T - t0);
        gdn_stage<DK, LPC> &x = st[b];
        if (CP) {
            if (t0 + GDN_TC < a.T) gdn_stage_in<CP>(a, h, kh, t0 + GDN_TC, min(GDN_TC, a.T - t0 - GDN_TC), st[b ^ 1]);
            cp_commit();
            cp_wait<1>();
        } else gdn_stage_in<CP>(a, h, kh, t0, tc, x);
        __syncwarp();
        gdn_stage_norm(dk, tc, qscale, x);
        __syncwarp();
        for (int u = 0; u < tc; u++) {
            float decay = expf(x.g[u]), beta = x.b[u], d = 0.0f, o = 0.0f;
#pragma unroll
            for (int r = 0; r < RPL; r++)
                if (r * LPC + sub < dk) s[r] *= decay, d += s[r] * x.k[u][r * LPC + sub];
#pragma unroll
            for (int m = 1; m < LPC; m <<= 1) d += __shfl_xor_sync(0xffffffffu, d, m);
            d = beta * (x.v[u][c] - d);
#pragma unroll
            for (int r = 0; r < RPL; r++)
                if (r * LPC + sub < dk) s[r] += x.k[u][r * LPC + sub] * d, o += s[r] * x.q[u][r * LPC + sub];
#pragma unroll
            for (int m = 1; m < LPC; m <<= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
            if (col && sub == 0) a.out[((t0 + u) * (int64_t)a.nv + h) * dv + j] = o;
        }
        __syncwarp(); // a later round overwrites this stage
    }
    if (CP) cp_wait<0>();
#pragma unroll
    for (int r = 0; r < RPL; r++)
        if (r * LPC + sub < dk && col) S[(int64_t)(r * LPC + sub) * dv + j] = s[r];
}

template <bool CP, int DK>
void gdn_cols_launch(ctx *c, const qf_gdn_args *a) {
    int lpc = QF_LAB(c, gdn_plpc), cpw = 32 / lpc;
    dim3 g(a->nv, (a->dv + cpw - 1) / cpw);
#if QF_CUDA_LAB_BUILD
    if (lpc == 1) return LAUNCH(c, (k_gdn_cols<CP, DK, 1>), g, 32, *a);
    if (lpc == 2) return LAUNCH(c, (k_gdn_cols<CP, DK, 2>), g, 32, *a);
    if (lpc == 8) return LAUNCH(c, (k_gdn_cols<CP, DK, 8>), g, 32, *a);
#endif
    LAUNCH(c, (k_gdn_cols<CP, DK, 4>), g, 32, *a);
}

template <int DK>
void gdn_cols_pick(ctx *c, const qf_gdn_args *a) {
    // cp.async copies 16 aligned bytes: every q, k and v row and each warp's v columns must start on 16
    int cpw = 32 / QF_LAB(c, gdn_plpc);
    bool cp = QF_LAB(c, gdn_cp) && a->stride % 4 == 0 && a->dk % 4 == 0 && a->dv % cpw == 0 && cpw % 4 == 0 && !((uintptr_t)a->q & 15) &&
              !((uintptr_t)a->k & 15) && !((uintptr_t)a->v & 15);
    if (cp) gdn_cols_launch<true, DK>(c, a);
    else gdn_cols_launch<false, DK>(c, a);
}

void cu_gdn(qf_backend *be, const qf_gdn_args *a) {
    ctx *c = C(be);
    if (a->dk > 128) {
        return dev_fail(c, "linear-attention key dim %d > 128 is not supported", a->dk);
    }
    if (gdn_chunked(c, a)) return;
#if QF_CUDA_LAB_BUILD
    if (QF_LAB(c, gdn_seq)) { // k_gdn: a block per head (option gdn_seq=1, the kernel before k_gdn_cols)
        int threads = ((a->dv + 31) / 32) * 32;
        if (a->dk <= 32) LAUNCH(c, k_gdn<32>, a->nv, threads, *a);
        else if (a->dk <= 64) LAUNCH(c, k_gdn<64>, a->nv, threads, *a);
        else LAUNCH(c, k_gdn<128>, a->nv, threads, *a);
        return;
    }
#endif
    if (a->dk <= 32) gdn_cols_pick<32>(c, a);
    else if (a->dk <= 64) gdn_cols_pick<64>(c, a);
    else gdn_cols_pick<128>(c, a);
}

// ---- paged attention: split over keys, then combined ----


// Block (t*nh + h, split): keys [split*chunk, ...) up to the query's position; writes the
// unnormalised partial (m, l, o[hd]).
__global__ void k_attn_part(qf_attn_args a, int chunk, int splits, float *part) {
    int th = blockIdx.x, sp = blockIdx.y, t = th / a.nh, h = th % a.nh, kvh = h / (a.nh / a.nkv);
    int warp = threadIdx.x / 32, hd = a.hd;
    int n_keys = a.pos0 + t + 1, j0 = sp * chunk, j1 = min(n_keys, j0 + chunk);
    const float *q = a.q + (int64_t)t * a.q_stride + (int64_t)h * a.q_hstride;
    float qr[ATT_DPL], o[ATT_DPL], m = -INFINITY, l = 0.0f;
    attn_start(q, hd, qr, o);
    for (int j = j0 + warp; j < j1; j += ATT_WARPS) {
        const float *k = kv_row(a.kv, j, a.nkv, hd, kvh, 0), *v = kv_row(a.kv, j, a.nkv, hd, kvh, 1);
        attn_key(qr, k, v, hd, a.scale, m, l, o);
    }
    attn_write_part<ATT_WARPS>(m, l, o, hd, part + ((int64_t)th * splits + sp) * (hd + 2));
}

} // namespace

__global__ void qfc::k_attn_combine(int splits, int hd, const float *part, float *out, const float *gate, int gstride, int nh) {
    int th = blockIdx.x, t = th / nh, h = th - t * nh;
    pdl_wait(); // the decode step launches it programmatically; elsewhere a no-op
    pdl_launch();
    attn_combine_head<false>(part + (int64_t)th * splits * (hd + 2), splits, hd, gate ? gate + (int64_t)t * gstride + (int64_t)h * 2 * hd + hd : NULL,
                      out + (int64_t)th * hd);
}

int qfc::attn_splits(int max_keys, int rows, int *chunk) {
    // few query rows (decode): split the keys so every SM has work
    int splits = rows >= 264 ? 1 : min(64, max(1, (264 / rows)));
    *chunk = (max_keys + splits - 1) / splits;
    if (*chunk < 64) *chunk = 64, splits = (max_keys + 63) / 64;
    return splits;
}

// attn_splits' splits fall as the keys shrink below 64 a split: its most is the one at many keys.
int qfc::attn_part_splits(ctx *c, int T, int nh, int nkv) {
    int rows = T * nh, untiled = rows >= 264 ? 1 : min(64, max(1, 264 / rows)), tiled = attn_tile_splits(c, T, nh, nkv);
    return max(untiled, tiled);
}

size_t qfc::attn_scratch(ctx *c, const qf_scratch_shape *s) {
    size_t most = (size_t)QF_DEC_ROWS * s->n_heads * 64; // dec_attn's (query, head) rows, 64 splits each
    for (int T = 1; T <= s->rows; T++) {
        size_t r = (size_t)T * s->n_heads * attn_part_splits(c, T, s->n_heads, s->n_kv_heads);
        most = r > most ? r : most;
    }
    return most * (s->head_dim + 2) * sizeof(float);
}

// The products' bf16 parts of up to s->rows rows (cu_matmul on cuBLAS), and the MoE op's routing
// and per-slot products: a decode step's (dec_moe) or a many-row op's (cu_moe), whichever is more.
size_t qfc::matmul_scratch(const qf_scratch_shape *s) { return (size_t)s->rows * (size_t)s->mat_cols * 4; }

size_t qfc::moe_scratch(const qf_scratch_shape *s) {
    size_t K = (size_t)s->top_k, I = (size_t)s->expert_ffn, H = (size_t)s->hidden, n = QF_DEC_ROWS, N = (size_t)s->rows;
    size_t dec = ((n * K * 8 + 15) & ~(size_t)15) + n * K * I * sizeof(float);
    size_t many = ((N * K * 8 + 15) & ~(size_t)15) + N * K * (I + H) * sizeof(float);
    return dec > many ? dec : many;
}

namespace {

void cu_attention(qf_backend *be, const qf_attn_args *a) {
    ctx *c = C(be);
    if (a->hd > ATT_DPL * 32) {
        return dev_fail(c, "head_dim %d > %d is not supported", a->hd, ATT_DPL * 32);
    }
    int rows = a->T * a->nh, chunk, splits = attn_splits(a->pos0 + a->T, rows, &chunk), most = attn_part_splits(c, a->T, a->nh, a->nkv);
    // sized for the most splits at any context, so a recorded graph's scratch never moves as the context grows
    float *part = (float *)scratch(c, &c->attn, &c->attn_cap, (size_t)rows * most * (a->hd + 2) * sizeof(float));
    if (!part || attn_tiled(c, a, part, most)) return;
    LAUNCH(c, k_attn_part, dim3(rows, splits), ATT_WARPS * 32, *a, chunk, splits, part);
    LAUNCH(c, k_attn_combine, rows, 128, splits, a->hd, part, a->out, (const float *)NULL, 0, a->nh);
}

__global__ void k_kv_store(qf_kv_view kv, const float *k, const float *v, int T, int pos0, int nkv, int hd) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)T * nkv * hd) return;
    int d = (int)(i % hd), h = (int)((i / hd) % nkv), t = (int)(i / hd / nkv);
    size_t page = (size_t)kv.pages[(pos0 + t) / kv.page_tokens];
    size_t at = page * kv.page_stride + ((size_t)((pos0 + t) % kv.page_tokens) * nkv + h) * hd + d;
    kv.base[at + kv.k_off] = k[i];
    kv.base[at + kv.v_off] = v[i];
}

void cu_kv_store(qf_backend *be, const qf_kv_view *kv, const float *k, const float *v, int T, int pos0, int nkv, int hd) {
    ctx *c = C(be);
    int64_t n = (int64_t)T * nkv * hd;
    if (n > 0) LAUNCH(c, k_kv_store, blocks(n, 256), 256, *kv, k, v, T, pos0, nkv, hd);
}

// Block (page p0 + blockIdx.x, kv head blockIdx.y): each channel's min and max over the page's
// keys into its summary (ops.h qf_kv_view s_off). Launched even for no pages (p1 <= p0), so a
// recorded step keeps its shape.
__global__ void k_kv_summarize(qf_kv_view kv, int p0, int p1, int nkv, int hd) {
    int p = p0 + blockIdx.x, h = blockIdx.y;
    if (p >= p1) return;
    float *page = kv.base + (size_t)kv.pages[p] * kv.page_stride;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float lo = INFINITY, hi = -INFINITY;
        for (int t = 0; t < kv.page_tokens; t++) {
            float k = page[kv.k_off + ((size_t)t * nkv + h) * hd + c];
            lo = k < lo ? k : lo, hi = k > hi ? k : hi;
        }
        page[kv.s_off + (size_t)h * hd + c] = lo, page[kv.s_off + (size_t)(nkv + h) * hd + c] = hi;
    }
}

void cu_kv_summarize(qf_backend *be, const qf_kv_view *kv, int p0, int p1, int nkv, int hd) {
    ctx *c = C(be);
    LAUNCH(c, k_kv_summarize, dim3(p1 > p0 ? p1 - p0 : 1, nkv), 256, *kv, p0, p1, nkv, hd);
}

__global__ void k_swiglu(const float *g, const float *u, int stride, int n, int d, float *y) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * d) return;
    int64_t t = i / d, c = i % d;
    y[i] = silu(g[t * stride + c]) * u[t * stride + c];
}

void cu_swiglu(qf_backend *be, const float *g, const float *u, int stride, int n, int d, float *y) {
    ctx *c = C(be);
    if ((int64_t)n * d > 0) LAUNCH(c, k_swiglu, blocks((int64_t)n * d, 256), 256, g, u, stride, n, d, y);
}

__global__ void k_sigmoid_mul(float *x, int xs, const float *g, int gs, int n, int d) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * d) return;
    int64_t t = i / d, c = i % d;
    x[t * xs + c] *= sigmoid(g[t * gs + c]);
}

void cu_sigmoid_mul(qf_backend *be, float *x, int xs, const float *g, int gs, int n, int d) {
    ctx *c = C(be);
    if ((int64_t)n * d > 0) LAUNCH(c, k_sigmoid_mul, blocks((int64_t)n * d, 256), 256, x, xs, g, gs, n, d);
}

__global__ void k_axpy(float *y, const float *a, float s, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a[i] * s;
}

void cu_axpy(qf_backend *be, float *y, const float *a, float s, int64_t n) {
    ctx *c = C(be);
    if (n > 0) LAUNCH(c, k_axpy, blocks(n, 256), 256, y, a, s, n);
}

__global__ void k_gdn_gates(float *b, float *a, const float *dt_bias, const float *neg_A, int n, int nv) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * nv) return;
    int h = i % nv;
    float u = a[i] + dt_bias[h];
    b[i] = sigmoid(b[i]);
    a[i] = neg_A[h] * (u > 20.0f ? u : log1pf(expf(u)));
}

void cu_gdn_gates(qf_backend *be, float *b, float *a, const float *dt_bias, const float *neg_A, int n, int nv) {
    ctx *c = C(be);
    if (n * nv > 0) LAUNCH(c, k_gdn_gates, blocks((int64_t)n * nv, 256), 256, b, a, dt_bias, neg_A, n, nv);
}

__global__ void k_sig_scale_add(float *y, const float *x, const float *g, int n, int d) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * d) return;
    y[i] += x[i] * sigmoid(g[i / d]);
}

void cu_sigmoid_scale_add(qf_backend *be, float *y, const float *x, const float *g, int n, int d) {
    ctx *c = C(be);
    if ((int64_t)n * d > 0) LAUNCH(c, k_sig_scale_add, blocks((int64_t)n * d, 256), 256, y, x, g, n, d);
}

// ---- MoE: routing, then one GEMV per (row, chosen expert); from option mg_min rows grouped by expert (moe_group_cuda.cu) ----

// A block per row: softmax over E, k rounds of argmax (ties to the lower index, as the CPU), renormalise.
__global__ void k_route(const float *logits, int E, int K, int *topi, float *topw) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float s_mx, s_sum;
    __shared__ int chosen[64];
    const float *l = logits + (int64_t)blockIdx.x * E;
    int tid = threadIdx.x, lane = tid & 31, warp = tid / 32, nw = blockDim.x / 32;
    float mx = -INFINITY;
    for (int e = tid; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) sv[warp] = mx;
    __syncthreads();
    if (tid == 0) {
        float m = sv[0];
        for (int w = 1; w < nw; w++) m = fmaxf(m, sv[w]);
        s_mx = m;
    }
    __syncthreads();
    float sum = 0.0f;
    for (int e = tid; e < E; e += blockDim.x) sum += expf(l[e] - s_mx);
    sum = warp_sum(sum);
    __syncthreads();
    if (lane == 0) sv[warp] = sum;
    __syncthreads();
    if (tid == 0) {
        float s = 0.0f;
        for (int w = 0; w < nw; w++) s += sv[w];
        s_sum = s;
    }
    __syncthreads();
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int e = tid; e < E; e += blockDim.x) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= chosen[j] == e;
            if (!taken && (l[e] > bv || (l[e] == bv && e < bi))) bv = l[e], bi = e;
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
        }
        if (lane == 0) sv[warp] = bv, si[warp] = bi;
        __syncthreads();
        if (tid == 0) {
            float v = sv[0];
            int i = si[0];
            for (int w = 1; w < nw; w++)
                if (sv[w] > v || (sv[w] == v && si[w] < i)) v = sv[w], i = si[w];
            chosen[k] = i;
        }
        __syncthreads();
    }
    if (tid == 0) {
        float w[64], ts = 0.0f;
        for (int k = 0; k < K; k++) w[k] = expf(l[chosen[k]] - s_mx) / s_sum, ts += w[k];
        for (int k = 0; k < K; k++) topi[blockIdx.x * K + k] = chosen[k], topw[blockIdx.x * K + k] = w[k] / ts;
    }
}

// h[rk][j] = silu(gate_e[j] . x[r]) * (up_e[j] . x[r]) for the pair rk = r*K + k; a warp per j.
__global__ void k_expert_gate_up(const void *const *tab, int E, int dtype, const int *topi, int K, const float *x, int H, int I, float *hbuf) {
    int rk = blockIdx.x, j = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (j >= I) return;
    int e = topi[rk], r = rk / K;
    const void *G = tab[e], *U = tab[E + e];
    const float *xr = x + (int64_t)r * H;
    float g = 0.0f, u = 0.0f;
    if (dtype == QF_DT_BF16 && H % 8 == 0) {
        const uint4 *gr = (const uint4 *)((const uint16_t *)G + (int64_t)j * H), *ur = (const uint4 *)((const uint16_t *)U + (int64_t)j * H);
#pragma unroll 4
        for (int c = lane; c < H / 8; c += 32) {
            uint4 a = __ldcs(gr + c), b = __ldcs(ur + c);
            g += dot8(a, xr + c * 8);
            u += dot8(b, xr + c * 8);
        }
    } else {
        for (int c = lane; c < H; c += 32) g += ldwq(G, dtype, I, H, j, c) * xr[c], u += ldwq(U, dtype, I, H, j, c) * xr[c];
    }
    g = warp_sum(g), u = warp_sum(u);
    if (lane == 0) hbuf[(int64_t)rk * I + j] = silu(g) * u;
}

// y[rk][i] = down_e[i] . h[rk]; a warp per DOWN_ROWS rows i (the rows are short: 512 columns give
// a lane only two 16-byte loads each, so several rows keep more loads in flight).
#define DOWN_ROWS 4
__global__ void k_expert_down(const void *const *tab, int E, int dtype, const int *topi, const float *hbuf, int H, int I, float *ybuf) {
    int rk = blockIdx.x, i0 = (blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32) * DOWN_ROWS, lane = threadIdx.x & 31;
    if (i0 >= H) return;
    const void *D = tab[2 * E + topi[rk]];
    const float *hr = hbuf + (int64_t)rk * I;
    float s[DOWN_ROWS] = {0};
    if (dtype == QF_DT_BF16 && I % 8 == 0) {
        for (int c = lane; c < I / 8; c += 32) {
            uint4 a[DOWN_ROWS];
#pragma unroll
            for (int r = 0; r < DOWN_ROWS; r++) a[r] = i0 + r < H ? __ldcs((const uint4 *)((const uint16_t *)D + (int64_t)(i0 + r) * I) + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int r = 0; r < DOWN_ROWS; r++) s[r] += dot8(a[r], hr + c * 8);
        }
    } else {
        for (int r = 0; r < DOWN_ROWS && i0 + r < H; r++)
            for (int c = lane; c < I; c += 32) s[r] += ldwq(D, dtype, H, I, i0 + r, c) * hr[c];
    }
#pragma unroll
    for (int r = 0; r < DOWN_ROWS; r++) {
        float v = warp_sum(s[r]);
        if (lane == 0 && i0 + r < H) ybuf[(int64_t)rk * H + i0 + r] = v;
    }
}

__global__ void k_expert_sum(const float *ybuf, const float *topw, int K, int N, int H, float *out) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)N * H) return;
    int64_t r = i / H, c = i % H;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += topw[r * K + k] * ybuf[(r * K + k) * H + c];
    out[i] = acc;
}

} // namespace

namespace {

void cu_moe(qf_backend *be, const qf_moe_args *a) {
    ctx *c = C(be);
    const void **tab = expert_table(a->table);
    int N = a->N, K = a->top_k, H = a->hidden, I = a->ffn, E = a->n_experts;
    size_t head = ((size_t)N * K * (sizeof(int) + sizeof(float)) + 15) & ~(size_t)15; // hbuf 16-byte aligned for dot8
    size_t need = head + (size_t)N * K * (size_t)(I + H) * sizeof(float);
    char *s = (char *)scratch(c, &c->moe, &c->moe_cap, need);
    if (!tab || !s || K > 64) {
        return dev_fail(c, "moe: %s", !tab ? "no device expert table (the expert store keeps one)" : !s ? "out of device memory" : "top-k above 64");
    }
    int *topi = (int *)s;
    float *topw = (float *)(s + (size_t)N * K * sizeof(int)), *hbuf = (float *)(s + head), *ybuf = hbuf + (size_t)N * K * I;
    LAUNCH(c, k_route, N, 256, a->router_logits, E, K, topi, topw);
    if (a->cache) xcache_resolve(c, a->cache, topi, N * K, NULL, 0, 0, K, xc_drop{}, 0), xcache_fill(c, a->cache), xcache_link(c, a->cache);
    if (a->chosen) g_copy(c, a->chosen, topi, (size_t)(N < a->chosen_rows ? N : a->chosen_rows) * K * sizeof(int), cudaMemcpyDeviceToDevice);
    if (moe_grouped(c, a, tab, topi, topw, ybuf)) return;
    int dtype = a->experts[0].gate.dtype;
    LAUNCH(c, k_expert_gate_up, dim3(N * K, (I + 7) / 8), 256, tab, E, dtype, topi, K, a->x, H, I, hbuf);
    LAUNCH(c, k_expert_down, dim3(N * K, (H + 8 * DOWN_ROWS - 1) / (8 * DOWN_ROWS)), 256, tab, E, dtype, topi, hbuf, H, I, ybuf);
    LAUNCH(c, k_expert_sum, blocks((int64_t)N * H, 256), 256, ybuf, topw, K, N, H, a->out);
}

} // namespace

static const qf_dec_ops k_dec_ops = {dec_matmul, dec_gdn, dec_attention, dec_moe, dec_argmax, dec_gdn_gn, dec_attn_gate, dec_matmul_sparse, dec_sparse_counts, dec_page_select, dec_draw};

const qf_ops qfc::k_cuda_ops = {
    "cuda",
    cu_matmul,
    NULL, // matmul_cols: a device's sparse products are its decode steps' matmul_sparse
    cu_embed,
    cu_rmsnorm,
    cu_rope,
    cu_conv_silu,
    cu_gdn,
    cu_attention,
    cu_kv_store,
    cu_kv_summarize,
    cu_swiglu,
    cu_sigmoid_mul,
    cu_axpy,
    cu_gdn_gates,
    cu_sigmoid_scale_add,
    cu_moe,
    &k_dec_ops,
    cu_alloc,
    cu_free,
    cu_upload,
    cu_download,
    cu_zero,
    cu_step_begin,
    cu_step_end,
    cu_sync,
    cu_pin,
    cu_unpin,
    cu_pin_alloc,
    cu_pin_free,
    cu_mem_info,
    cu_stage,
    cu_stage_wait,
    cu_scratch_bytes,
    cu_scratch_reserve,
    cu_scratch_grown,
    cu_copy,
    cu_read_pinned,
};

