// Trunk sparsity's decode products (ops.h dec matmul_sparse): each row's pre(x) masked by its
// threshold, the columns some row keeps listed in order, and only those rows of W^T read. One
// kernel: every block stages and masks the rows and lists the kept columns itself (a few KB of x
// against the MB of weights it reads), takes its slice of the list for its 256 outputs, writes
// the slice's partial sums, and the last block of an output slice to finish adds the partials in
// slice order and applies the epilogue (so every sum has a fixed order and the result does not
// vary run to run).
#include "backend/cuda/dec_int.cuh"

namespace qfc {

#define SP_MAX_COLS 8192 // inputs the list holds (the widest mixer input of this family is 4096)
#define SP_OUT 256       // outputs a block covers: 32 lanes x 8
#define SP_NT 4          // rows a launch carries (more rows: passes)
#define SP_SLICES 1024   // output slices the counters hold (out <= 262144)
#define SP_U 4           // listed columns a warp has in flight (16 lost: docs/performance.md)

struct sp_thr {
    float v[QF_DEC_ROWS];
};

// Outputs o0..o0+7 of row i of wt (out wide), bf16: one 16-byte load where rows are 16-byte
// aligned (VEC: out % 8 == 0), else element by element up to out (zeros past it).
template <bool VEC>
__device__ __forceinline__ uint4 ld8(const uint16_t *__restrict__ wt, int i, int out, int o0) {
    if constexpr (VEC) {
        return __ldcs((const uint4 *)(wt + (int64_t)i * out + o0));
    } else {
        uint16_t h[8];
#pragma unroll
        for (int q = 0; q < 8; q++) h[q] = o0 + q < out ? wt[(int64_t)i * out + o0 + q] : 0;
        return make_uint4(h[0] | (unsigned)h[1] << 16, h[2] | (unsigned)h[3] << 16, h[4] | (unsigned)h[5] << 16, h[6] | (unsigned)h[7] << 16);
    }
}

// a[q] += xv * the 8 bf16 of w
__device__ __forceinline__ void fma8(float a[8], uint4 w, float xv) {
    const uint32_t p[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int q = 0; q < 4; q++) a[2 * q] += xv * bf16f(p[q] & 0xffff), a[2 * q + 1] += xv * bf16f(p[q] >> 16);
}

// The block's copy of rows t0..t0+nt-1 of mask_t(pre(x[t])) into xm [nt][cols], and the columns
// some of them keep into idx (ascending); returns their count. counts: block (0, 0) adds the
// entries it masked and zeroed (ops.h sparse_counts).
__device__ int sp_stage(const float *x, int nt, int t0, int cols, const dpre &p, const sp_thr &thr, float *xm, int *idx, unsigned long long *counts) {
    __shared__ float red[PRE_MAX_HEADS];
    __shared__ unsigned char keep[SP_MAX_COLS];
    __shared__ int wsum[32], total;
    __shared__ unsigned zeroed;
    int tid = threadIdx.x, z = 0;
    for (int i = tid; i < cols; i += blockDim.x) keep[i] = 0;
    if (tid == 0) zeroed = 0;
    for (int t = 0; t < nt; t++) {
        dpre pt = p;
        if (pt.g) pt.g += (int64_t)(t0 + t) * p.g_stride;
        float *xs = xm + (int64_t)t * cols;
        stage<1>(x + (int64_t)(t0 + t) * cols, 1, cols, pt, xs, red);
        float sc = row_scale(pt, red, 0, cols), th = thr.v[t0 + t];
        for (int i = tid; i < cols; i += blockDim.x) {
            float v = xs[i] * sc;
            int k = !(fabsf(v) < th);
            xs[i] = k ? v : 0.0f;
            keep[i] |= (unsigned char)k;
            z += !k;
        }
        __syncthreads();
    }
    int per = (cols + blockDim.x - 1) / blockDim.x, c0 = tid * per, mine = 0;
    for (int i = c0; i < c0 + per && i < cols; i++) mine += keep[i];
    int at = block_scan(mine, wsum, &total);
    for (int i = c0; i < c0 + per && i < cols; i++)
        if (keep[i]) idx[at++] = i;
    if (counts && blockIdx.x == 0 && blockIdx.y == 0) atomicAdd(&zeroed, (unsigned)z);
    __syncthreads();
    if (counts && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) atomicAdd(counts, (unsigned long long)nt * cols), atomicAdd(counts + 1, (unsigned long long)zeroed);
    return total;
}

// Block (output slice, list slice s of S) for rows t0..t0+NT-1: warp w takes the slice's listed
// columns w, w + 8, ... (SP_U loads in flight); lane l holds outputs 8 l .. 8 l + 7 of the block's
// 256. The warps' sums meet in shared memory, the slices' in partial [S][NT][out]; the last block
// of an output slice (count) sums them in order into y, through the epilogue.
template <int NT, bool VEC>
__global__ void __launch_bounds__(256) k_sp(const uint16_t *__restrict__ wt, int out, int cols, const float *__restrict__ x, int n, int t0, dpre p, sp_thr thr,
                                            depi e, int acc, float *y, float *partial, unsigned *count, unsigned long long *counts) {
    extern __shared__ float4 dyn[];
    __shared__ float sums[8][NT][SP_OUT];
    __shared__ int last;
    float *xm = (float *)dyn;
    int *idx = (int *)(xm + NT * cols);
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, S = gridDim.y, s = blockIdx.y;
    int o0 = blockIdx.x * SP_OUT + lane * 8, nt = min(NT, n - t0);
    pdl_wait();
    pdl_launch();
    int m = sp_stage(x, nt, t0, cols, p, thr, xm, idx, counts), j0 = (int)((int64_t)m * s / S), j1 = (int)((int64_t)m * (s + 1) / S);
    float a[NT][8];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < 8; q++) a[t][q] = 0.0f;
    for (int j = j0 + warp; o0 < out && j < j1; j += 8 * SP_U) { // up to SP_U columns' loads in flight per warp
        int i[SP_U];
        uint4 w[SP_U];
#pragma unroll
        for (int u = 0; u < SP_U; u++) i[u] = j + 8 * u < j1 ? idx[j + 8 * u] : -1;
#pragma unroll
        for (int u = 0; u < SP_U; u++)
            if (i[u] >= 0) w[u] = ld8<VEC>(wt, i[u], out, o0);
#pragma unroll
        for (int u = 0; u < SP_U; u++)
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (i[u] >= 0 && t < nt) fma8(a[t], w[u], xm[t * cols + i[u]]);
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int q = 0; q < 8; q++) sums[warp][t][lane * 8 + q] = a[t][q];
    __syncthreads();
    for (int k = threadIdx.x; k < nt * SP_OUT; k += blockDim.x) {
        int t = k / SP_OUT, o = k - t * SP_OUT, go = blockIdx.x * SP_OUT + o;
        float v = 0.0f;
        for (int w = 0; w < 8; w++) v += sums[w][t][o];
        if (go < out) partial[((int64_t)s * NT + t) * out + go] = v;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&count[blockIdx.x], 1u) == (unsigned)S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int k = threadIdx.x; k < nt * SP_OUT; k += blockDim.x) {
        int t = k / SP_OUT, go = blockIdx.x * SP_OUT + k - t * SP_OUT;
        if (go >= out) continue;
        float v = 0.0f;
        for (int r = 0; r < S; r++) v += __ldcg(partial + ((int64_t)r * NT + t) * out + go);
        if (e.on) v = epi_value(e, t0 + t, go, v);
        float *yo = y + (int64_t)(t0 + t) * out + go;
        *yo = acc ? *yo + v : v;
    }
    if (threadIdx.x == 0) count[blockIdx.x] = 0;
}

// The partial sums of S launches' slices: S is about two blocks an SM over the slices, so S x out
// stays under (2 x SMs + slices) x SP_OUT for the widest output.
size_t sparse_scratch(ctx *c, const qf_scratch_shape *s) {
    if (!s->sparse_out) return 0;
    size_t slices = (size_t)((s->sparse_out + SP_OUT - 1) / SP_OUT), sms = (size_t)(c->sms > 0 ? c->sms : 1);
    return (2 * sms + slices) * SP_OUT * SP_NT * 4;
}

void dec_matmul_sparse(qf_backend *be, const qf_mat *wt, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, const float *thr,
                       float *y) {
    ctx *c = C(be);
    int cols = (int)wt->rows, out = (int)wt->cols, sms = c->sms > 0 ? c->sms : 1, slices = (out + SP_OUT - 1) / SP_OUT;
    if (wt->dtype != QF_DT_BF16 || cols % 4 || cols > SP_MAX_COLS || n > QF_DEC_ROWS || slices > SP_SLICES || (uintptr_t)wt->data % 16 || !c->sp_count)
        return dev_fail(c, "sparse product: needs bf16 W^T of at most %d inputs (a multiple of 4) and %d outputs (has %d x %d)", SP_MAX_COLS,
                        SP_SLICES * SP_OUT, cols, out);
    if (pre && (pre->kind == QF_PRE_GATED_NORM || pre->kind == QF_PRE_SIGMOID) && (pre->head < 1 || cols / pre->head > PRE_MAX_HEADS))
        return dev_fail(c, "sparse product: more than %d heads per row", PRE_MAX_HEADS);
    int S = (2 * sms + slices - 1) / slices; // about two blocks an SM
    S = S < 1 ? 1 : S > 64 ? 64 : S;
    float *partial = (float *)scratch(c, &c->sp, &c->sp_cap, (size_t)S * SP_NT * out * 4);
    if (!partial) return dev_fail(c, "sparse product: out of device memory");
    sp_thr th = {};
    for (int t = 0; t < n; t++) th.v[t] = thr[t];
    depi e = {};
    if (epi) {
        e = {1, epi->conv_dim, epi->z_dim, epi->nv, epi->conv_k, epi->conv_w, epi->dt_bias, epi->neg_A, {}};
        for (int t = 0; t < QF_DEC_ROWS; t++) e.st[t] = epi->conv_state[t];
    }
    typedef void (*fn)(const uint16_t *, int, int, const float *, int, int, dpre, sp_thr, depi, int, float *, float *, unsigned *, unsigned long long *);
    int vec = out % 8 == 0;
    for (int t0 = 0; t0 < n; t0 += SP_NT) {
        int one = n - t0 == 1;
        fn k = one ? (vec ? k_sp<1, true> : k_sp<1, false>) : (vec ? k_sp<SP_NT, true> : k_sp<SP_NT, false>);
        size_t smem = (size_t)((one ? 1 : SP_NT) + 1) * cols * 4;
        resident(c, (const void *)k, 256, smem);
        launch(c, "k_sp", 1, k, dim3(slices, S), dim3(256), (unsigned)smem, (const uint16_t *)wt->data, out, cols, x, n, t0, dpre_of(pre), th, e, acc, y,
               partial, c->sp_count, c->sp_ctr);
    }
}

void dec_sparse_counts(qf_backend *be, uint64_t out[4]) {
    ctx *c = C(be);
    unsigned long long v[4] = {0, 0, 0, 0};
    if (c->sp_ctr && cudaMemcpy(v, c->sp_ctr, sizeof v, cudaMemcpyDeviceToHost) != cudaSuccess) v[0] = v[1] = v[2] = v[3] = 0;
    for (int i = 0; i < 4; i++) out[i] = v[i];
}

} // namespace qfc
