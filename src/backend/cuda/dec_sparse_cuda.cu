// Trunk sparsity's decode products (ops.h dec matmul_sparse): each row's pre(x) masked by its
// threshold, the columns some row keeps listed in order, then only those rows of W^T read.
// Three kernels: the mask and list (one block), the products over slices of the list (partial
// sums per slice, so the order of every sum is fixed and the result does not vary run to run),
// and the sum of the slices with the epilogue.
#include "backend/cuda/dec_int.cuh"

namespace qfc {

#define SP_THREADS 1024
#define SP_MAX_COLS 8192 // inputs the list holds (the widest mixer input of this family is 4096)
#define SP_OUT 256       // outputs a block of the product covers: 32 lanes x 8
#define SP_NT 4          // rows a product kernel carries at once (more rows: passes)

struct sp_thr {
    float v[QF_DEC_ROWS];
};

// Block-wide exclusive prefix sum of v (every thread one value); *total gets the sum.
__device__ int block_scan(int v, int *wsum, int *total) {
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

// One block: xm[t] = mask_t(pre(x[t])) for every row; idx = the columns some row keeps, ascending;
// cnt[0] their count.
__global__ void __launch_bounds__(SP_THREADS) k_sp_mask(const float *x, int n, int cols, dpre p, sp_thr thr, float *xm, int *idx, int *cnt) {
    extern __shared__ float4 dyn[];
    __shared__ float red[QF_DEC_ROWS * PRE_MAX_HEADS];
    __shared__ unsigned char keep[SP_MAX_COLS];
    __shared__ int wsum[32], total;
    float *xs = (float *)dyn;
    int tid = threadIdx.x;
    for (int i = tid; i < cols; i += blockDim.x) keep[i] = 0;
    pdl_wait();
    pdl_launch();
    for (int t = 0; t < n; t++) {
        dpre pt = p;
        if (pt.g) pt.g += (int64_t)t * p.g_stride;
        stage<1>(x + (int64_t)t * cols, 1, cols, pt, xs, red);
        float sc = row_scale(pt, red, 0, cols);
        for (int i = tid; i < cols; i += blockDim.x) {
            float v = xs[i] * sc;
            int k = !(fabsf(v) < thr.v[t]);
            xm[(int64_t)t * cols + i] = k ? v : 0.0f;
            keep[i] |= (unsigned char)k;
        }
        __syncthreads();
    }
    int per = (cols + blockDim.x - 1) / blockDim.x, c0 = tid * per, mine = 0;
    for (int i = c0; i < c0 + per && i < cols; i++) mine += keep[i];
    int at = block_scan(mine, wsum, &total);
    for (int i = c0; i < c0 + per && i < cols; i++)
        if (keep[i]) idx[at++] = i;
    if (tid == 0) cnt[0] = total;
}

// Block (output slice, list slice s of S): partial[s][t][o] = sum over the slice's listed columns
// i of xm[t][i] * wt[i][o], for NT rows from t0. Warp w takes the slice's columns w, w + 8, ...;
// lane l holds outputs 8 l .. 8 l + 7 of the block's 256; the warps' sums meet in shared memory.
template <int NT>
__global__ void __launch_bounds__(256) k_sp_cols(const uint16_t *__restrict__ wt, int out, int cols, const float *__restrict__ xm, int n, int t0,
                                                 const int *idx, const int *cnt, float *partial) {
    __shared__ float sums[8][NT][SP_OUT];
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, S = gridDim.y, s = blockIdx.y;
    int o0 = blockIdx.x * SP_OUT + lane * 8, nt = min(NT, n - t0);
    pdl_wait();
    pdl_launch();
    int m = cnt[0], j0 = (int)((int64_t)m * s / S), j1 = (int)((int64_t)m * (s + 1) / S);
    float a[NT][8];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < 8; q++) a[t][q] = 0.0f;
    if (o0 < out) {
        int j = j0 + warp;
        for (; j + 8 < j1; j += 16) { // two columns' loads in flight per warp
            int i0 = idx[j], i1 = idx[j + 8];
            uint4 w0 = __ldcs((const uint4 *)(wt + (int64_t)i0 * out + o0)), w1 = __ldcs((const uint4 *)(wt + (int64_t)i1 * out + o0));
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                float x0 = xm[(int64_t)(t0 + t) * cols + i0], x1 = xm[(int64_t)(t0 + t) * cols + i1];
                const uint32_t p0[4] = {w0.x, w0.y, w0.z, w0.w}, p1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    a[t][2 * q] += x0 * bf16f(p0[q] & 0xffff) + x1 * bf16f(p1[q] & 0xffff);
                    a[t][2 * q + 1] += x0 * bf16f(p0[q] >> 16) + x1 * bf16f(p1[q] >> 16);
                }
            }
        }
        for (; j < j1; j += 8) {
            int i0 = idx[j];
            uint4 w0 = __ldcs((const uint4 *)(wt + (int64_t)i0 * out + o0));
            const uint32_t p0[4] = {w0.x, w0.y, w0.z, w0.w};
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                float x0 = xm[(int64_t)(t0 + t) * cols + i0];
#pragma unroll
                for (int q = 0; q < 4; q++) a[t][2 * q] += x0 * bf16f(p0[q] & 0xffff), a[t][2 * q + 1] += x0 * bf16f(p0[q] >> 16);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < 8; q++) sums[warp][t][lane * 8 + q] = a[t][q];
    __syncthreads();
    for (int e = threadIdx.x; e < nt * SP_OUT; e += blockDim.x) {
        int t = e / SP_OUT, o = e - t * SP_OUT, go = blockIdx.x * SP_OUT + o;
        float v = 0.0f;
        for (int w = 0; w < 8; w++) v += sums[w][t][o];
        if (go < out) partial[((int64_t)s * n + t0 + t) * out + go] = v;
    }
}

// y[t][o] (= or +=) the slices' sum in order, through the epilogue.
__global__ void k_sp_sum(const float *partial, int S, int n, int out, depi e, int acc, float *y) {
    pdl_wait();
    pdl_launch();
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < (int64_t)n * out; k += (int64_t)gridDim.x * blockDim.x) {
        int t = (int)(k / out), o = (int)(k - (int64_t)t * out);
        float v = 0.0f;
        for (int s = 0; s < S; s++) v += partial[((int64_t)s * n + t) * out + o];
        if (e.on) v = epi_value(e, t, o, v);
        y[k] = acc ? y[k] + v : v;
    }
}

void dec_matmul_sparse(qf_backend *be, const qf_mat *wt, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, const float *thr,
                       float *y) {
    ctx *c = C(be);
    int cols = (int)wt->rows, out = (int)wt->cols, sms = c->sms > 0 ? c->sms : 1;
    if (wt->dtype != QF_DT_BF16 || out % 8 || cols % 4 || cols > SP_MAX_COLS || n > QF_DEC_ROWS || (uintptr_t)wt->data % 16)
        return dev_fail(c, "sparse product: needs bf16 W^T with outputs a multiple of 8 and at most %d inputs (has %d x %d)", SP_MAX_COLS, cols, out);
    if (pre && (pre->kind == QF_PRE_GATED_NORM || pre->kind == QF_PRE_SIGMOID) && (pre->head < 1 || cols / pre->head > PRE_MAX_HEADS))
        return dev_fail(c, "sparse product: more than %d heads per row", PRE_MAX_HEADS);
    int slices = (out + SP_OUT - 1) / SP_OUT, S = (2 * sms + slices - 1) / slices;
    S = S < 1 ? 1 : S > 64 ? 64 : S;
    size_t xm_bytes = ((size_t)n * cols * 4 + 255) & ~(size_t)255, idx_bytes = ((size_t)cols * 4 + 4 + 255) & ~(size_t)255;
    char *s = (char *)scratch(c, &c->sp, &c->sp_cap, xm_bytes + idx_bytes + (size_t)S * n * out * 4);
    if (!s) return dev_fail(c, "sparse product: out of device memory");
    float *xm = (float *)s, *partial = (float *)(s + xm_bytes + idx_bytes);
    int *idx = (int *)(s + xm_bytes), *cnt = idx + cols;
    sp_thr th = {};
    for (int t = 0; t < n; t++) th.v[t] = thr[t];
    depi e = {};
    if (epi) {
        e = {1, epi->conv_dim, epi->z_dim, epi->nv, epi->conv_k, epi->conv_w, epi->dt_bias, epi->neg_A, {}};
        for (int t = 0; t < QF_DEC_ROWS; t++) e.st[t] = epi->conv_state[t];
    }
    resident(c, (const void *)k_sp_mask, SP_THREADS, (size_t)cols * 4);
    launch(c, "k_sp_mask", 1, k_sp_mask, dim3(1), dim3(SP_THREADS), (unsigned)(cols * 4), x, n, cols, dpre_of(pre), th, xm, idx, cnt);
    for (int t0 = 0; t0 < n; t0 += SP_NT) {
        if (n - t0 == 1) launch(c, "k_sp_cols", 1, k_sp_cols<1>, dim3(slices, S), dim3(256), 0u, (const uint16_t *)wt->data, out, cols, (const float *)xm, n, t0,
                                (const int *)idx, (const int *)cnt, partial);
        else launch(c, "k_sp_cols", 1, k_sp_cols<SP_NT>, dim3(slices, S), dim3(256), 0u, (const uint16_t *)wt->data, out, cols, (const float *)xm, n, t0,
                    (const int *)idx, (const int *)cnt, partial);
    }
    int blocks = (int)(((int64_t)n * out + 255) / 256);
    launch(c, "k_sp_sum", 1, k_sp_sum, dim3(blocks < 4 * sms ? blocks : 4 * sms), dim3(256), 0u, (const float *)partial, S, n, out, e, acc, y);
}

} // namespace qfc
