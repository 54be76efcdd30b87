// Decode products (one token per sequence) with their input's norm or gate and, for a DeltaNet
// in_proj, the conv and gate epilogue; and the greedy pick over the logits.
#include "backend/cuda/dec_int.cuh"
#include "backend/cuda/bulk.cuh"
#include "backend/cuda/quant.cuh"

namespace qfc {

// The kinds of one-row products in a Qwen3.5/3.6 step (hidden 2048..), the bits of the bulk option:
// out/o_proj, lm_head, router + shared gate/up, in/qkv projections.
enum { PK_OUT = 1, PK_LMHEAD = 2, PK_FFNIN = 4, PK_IN = 8 };
__host__ __device__ __forceinline__ unsigned gemv_bit(int rows, int cols) {
    return rows >= 65536 ? PK_LMHEAD : cols > 2048 ? PK_OUT : rows < 4096 ? PK_FFNIN : PK_IN;
}


// Unit u of an int8 row (16 weights under scale d) dotted with x in shared memory: the four
// float4 reads go out rotated by (lane >> 1) & 3 so that the 8 lanes of a phase, 64 bytes apart,
// fall in distinct banks (in order, lanes 0, 2, 4 and 6 would share theirs); the weight words are
// rotated to match by selects, not by indexing a register array (which would go to local memory).
__device__ __forceinline__ float dot16q8s(uint4 w, float d, const float *x, int lane) {
    int rot = (lane >> 1) & 3;
    uint32_t q0 = w.x, q1 = w.y, q2 = w.z, q3 = w.w, t;
    if (rot & 1) t = q0, q0 = q1, q1 = q2, q2 = q3, q3 = t;
    if (rot & 2) t = q0, q0 = q2, q2 = t, t = q1, q1 = q3, q3 = t;
    uint32_t q[4] = {q0, q1, q2, q3};
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float4 a = *(const float4 *)(x + 4 * ((k + rot) & 3));
        float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int j = 0; j < 4; j++) s += (__uint_as_float(0x4B000000u | (((q[k] >> (8 * j)) & 0xffu) ^ 0x80u)) - 8388736.0f) * v[j]; // b ^ 0x80 is q + 128
    }
    return d * s;
}

// y[t][row] (= or +=) W[row] . pre(x[t]): W bf16 (cols % 8 == 0) or int8 rows of whole 16-byte
// units (F, quant.cuh; cols % 256 == 0), x staged once per block, the blocks striding over groups
// of rows so the staging is paid once per resident block.
// early: the warp's first loads go out before the wait for the kernel before and the staging
// (weights never depend on them), so their memory latency overlaps both.
template <int NT, int PWT, int F = QK_BF16> // PWT rows per warp (PW; 1 for one-row products of few rows: twice the warps)
__global__ void __launch_bounds__(256, 2) k_gemv_pre(const uint8_t *__restrict__ W, int rows, int cols, const float *__restrict__ x, int n, dpre p,
                                                     depi e, int acc, float *__restrict__ y, int early) {
    static_assert(F == QK_BF16 || F == QK_I8, "bf16 or int8 rows");
    // 16-byte loads per lane and row in flight: one row is bound by them, more rows by the FMAs; an
    // int8 load holds twice the columns, so half as many cover the same part of a row
    constexpr int CU = (PWT == 1 ? 16 : NT <= 2 ? 8 : 4) / (F == QK_BF16 ? 1 : 2);
    constexpr int QS = F == QK_BF16 ? 1 : CU; // a scale per load (int8)
    extern __shared__ float4 dyn[];
    __shared__ float red[NT * PRE_MAX_HEADS];
    float *xs = (float *)dyn;
    int warps = blockDim.x / 32, lane = threadIdx.x & 31, nu = qk_units(F, cols), qo = qk_qoff(F, cols), row0 = (blockIdx.x * warps + threadIdx.x / 32) * PWT;
    int64_t rb = qk_row_bytes(F, cols);
    uint4 v[CU][PWT];
    float d[QS][PWT];
    auto load = [&](int nr, int cb) {
#pragma unroll
        for (int u = 0; u < CU; u++) {
            int c = cb + lane + 32 * u;
#pragma unroll
            for (int r = 0; r < PWT; r++) {
                const uint8_t *row = W + (int64_t)(row0 + r) * rb;
                bool in = r < nr && c < nu;
                v[u][r] = in ? __ldcs((const uint4 *)(row + qo) + c) : make_uint4(0, 0, 0, 0);
                if constexpr (F != QK_BF16) d[u][r] = in ? qk_f16(row + 2 * (c / 2)) : 0.0f;
            }
        }
    };
    int have = early && row0 < rows;
    if (have) load(min(PWT, rows - row0), 0);
    else if (row0 < rows) // the warp's first row streams into L2 while the kernel before ends and x is staged
        for (int64_t l = lane * 128; l < rb; l += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(W + (int64_t)row0 * rb + l));
    pdl_wait();
    pdl_launch();
    stage<NT>(x, n, cols, p, xs, red);
    float sc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) sc[t] = t < n ? row_scale(p, red, t, cols) : 0.0f;
    for (; row0 < rows; row0 += gridDim.x * warps * PWT) {
        int nr = min(PWT, rows - row0);
        row_in ri = {}; // one row: lane r holds row row0 + r's end inputs, loaded with the weights
        if (NT == 1 && lane < nr && (e.on || acc)) row_in_load(e, acc, y, row0 + lane, ri);
        float a[PWT][NT];
#pragma unroll
        for (int r = 0; r < PWT; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) a[r][t] = 0.0f;
        for (int cb = 0; cb < nu; cb += 32 * CU) {
            if (!have) load(nr, cb);
            have = 0;
#pragma unroll
            for (int u = 0; u < CU; u++) {
                int c = cb + lane + 32 * u;
                if (c < nu)
#pragma unroll
                    for (int t = 0; t < NT; t++)
                        if (t < n) // shared memory holds n rows
#pragma unroll
                            for (int r = 0; r < PWT; r++) {
                                if constexpr (F == QK_BF16) a[r][t] += dot8s(v[u][r], xs + t * cols + c * 8, lane);
                                else a[r][t] += dot16q8s(v[u][r], d[u][r], xs + t * cols + c * 16, lane);
                            }
            }
        }
#pragma unroll
        for (int r = 0; r < PWT; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float s = warp_sum(a[r][t]) * sc[t]; // every lane has it
                if (NT == 1 && (e.on || acc)) {
                    if (lane == r && r < nr) {
                        if (e.on) s = row_epi(e, row0 + r, s, ri);
                        y[row0 + r] = acc ? ri.y + s : s;
                    }
                } else if (lane == 0 && r < nr && t < n) {
                    int64_t o = (int64_t)t * rows + row0 + r;
                    if (e.on) s = epi_value(e, t, row0 + r, s);
                    y[o] = acc ? y[o] + s : s;
                }
            }
    }
}

// The share [*lo, *hi) of n items of the calling warp among all the grid's warps.
__device__ __forceinline__ void warp_share(int n, int *lo, int *hi) {
    int64_t warps = blockDim.x / 32, gw = (int64_t)blockIdx.x * warps + threadIdx.x / 32, tw = (int64_t)gridDim.x * warps;
    *lo = (int)(n * gw / tw), *hi = (int)(n * (gw + 1) / tw);
}

// ---- one-row products fed by bulk copies (sm_90: cp.async.bulk; option bulk, default in_proj/qkv) ----
// The register kernels above lose their time in rounds: a warp's next loads go out only after
// its last ones were used, so each of its ~3 rounds pays a full memory latency. Here each warp
// owns a ring of BK_SLOTS slots of 4 KB in shared memory that a single lane fills with one bulk
// copy per slot (the copy engine, not 32 lanes, moves the bytes: no per-load instructions), and
// refills a slot as soon as the warp has read it, so every warp keeps BK_SLOTS * 4 KB in flight
// from before the wait for the kernel before it to its last row. Warps never wait for each
// other: a warp's slots, barriers and rows are its own.
#define BK_SLOTS 3     // 12 KB a warp, 96 KB a block of 8 warps: two blocks (or one and the next kernel's) fit an SM
#define BK_UNITS 8     // 512-byte units (32 lanes x 16 bytes) per slot
#define BK_BYTES (BK_UNITS * 512)

// y[row] (= or +=) W[row] . pre(x) for one row of x: the warp's rows (warp_share) are one
// contiguous run of units (lane l holds 8 columns of each); EPR (cols / 256) known at compile time
// keeps the lane's x in registers (EPR 8: 64 floats) and a slot one row; EPR 0: any cols % 256,
// x read from shared memory.
template <int EPR>
__global__ void __launch_bounds__(256, 2) k_gemv_bulk(const uint16_t *__restrict__ W, int rows, int cols, const float *__restrict__ x, dpre p,
                                                      depi ep, int acc, float *__restrict__ y) {
    extern __shared__ float4 dyn[];
    __shared__ float red[PRE_MAX_HEADS];
    __shared__ uint64_t bars[8 * BK_SLOTS];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, r0, r1;
    uint4 *ring = (uint4 *)dyn + warp * BK_SLOTS * BK_UNITS * 32;
    uint64_t *bar = bars + warp * BK_SLOTS;
    float *xs = (float *)((uint4 *)dyn + blockDim.x / 32 * BK_SLOTS * BK_UNITS * 32);
    warp_share(rows, &r0, &r1);
    int epr = EPR ? EPR : cols / 256, ne = (r1 - r0) * epr, nch = (ne + BK_UNITS - 1) / BK_UNITS;
    const char *src = (const char *)(W + (int64_t)r0 * cols);
    auto fill = [&](int ch) { // lane 0: chunk ch into its slot
        unsigned units = min(BK_UNITS, ne - ch * BK_UNITS);
        bulk_load(ring + (ch % BK_SLOTS) * BK_UNITS * 32, src + (int64_t)ch * BK_BYTES, units * 512, bar + ch % BK_SLOTS);
    };
    if (lane == 0) {
        for (int s = 0; s < BK_SLOTS; s++) mbar_init(bar + s);
        mbar_init_fence();
        for (int ch = 0; ch < min(BK_SLOTS, nch); ch++) fill(ch);
    }
    __syncwarp();
    pdl_wait();
    pdl_launch();
    row_in ri = {};
    int cached = r1 - r0 <= 32; // more rows than lanes (large products, no epilogue): read at the row's end
    if (cached && r0 + lane < r1) row_in_load(ep, acc, y, r0 + lane, ri);
    stage<1>(x, 1, cols, p, xs, red);
    float sc = row_scale(p, red, 0, cols), a = 0.0f;
    float4 xr[EPR == 8 ? 16 : 1];
    if constexpr (EPR == 8)
#pragma unroll
        for (int u = 0; u < 8; u++) xr[2 * u] = *(const float4 *)(xs + (u * 32 + lane) * 8), xr[2 * u + 1] = *(const float4 *)(xs + (u * 32 + lane) * 8 + 4);
    int row = r0, c = 0;
    auto finish = [&]() {
        float s = warp_sum(a) * sc; // every lane has it
        if (cached && lane == row - r0) {
            if (ep.on) s = row_epi(ep, row, s, ri);
            y[row] = acc ? ri.y + s : s;
        } else if (!cached && lane == 0) {
            if (ep.on) s = epi_value(ep, 0, row, s);
            y[row] = acc ? y[row] + s : s;
        }
        a = 0.0f, c = 0, row++;
    };
    for (int ch = 0; ch < nch; ch++) {
        const uint4 *slot = ring + (ch % BK_SLOTS) * BK_UNITS * 32 + lane;
        mbar_wait(bar + ch % BK_SLOTS, (ch / BK_SLOTS) & 1);
        if constexpr (EPR == 8) { // the slot is one whole row: all its loads at once
            uint4 w[8];
#pragma unroll
            for (int u = 0; u < 8; u++) w[u] = slot[u * 32];
#pragma unroll
            for (int u = 0; u < 8; u++) a += dot8r(w[u], xr[2 * u], xr[2 * u + 1]);
            finish();
        } else {
            int units = min(BK_UNITS, ne - ch * BK_UNITS);
#pragma unroll
            for (int u = 0; u < BK_UNITS; u++) {
                if (u >= units) break;
                a += dot8s(slot[u * 32], xs + (c * 32 + lane) * 8, lane);
                if (++c == epr) finish();
            }
        }
        __syncwarp();
        if (lane == 0 && ch + BK_SLOTS < nch) {
            fence_async_smem();
            fill(ch + BK_SLOTS);
        }
    }
}

static size_t bulk_smem_bytes(int cols) { return (size_t)8 * BK_SLOTS * BK_BYTES + (size_t)cols * sizeof(float); }

// Blocks of a kernel resident per SM at this shared memory, asked once per kernel and size. The
// opt-in to dynamic shared memory is one value per kernel for every launch, so it is set to the
// largest size the kernel has been asked for (setting it to each new size in turn would leave it
// below an earlier, larger size that is then launched again).
int resident(ctx *c, const void *fn, int threads, size_t smem) {
    size_t most = smem;
    for (int i = 0; i < c->n_occ; i++) {
        if (c->occ[i].fn != fn) continue;
        if (c->occ[i].smem == smem) return c->occ[i].blocks;
        most = c->occ[i].smem > most ? c->occ[i].smem : most;
    }
    cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)most);
    int n = 1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem) != cudaSuccess || n < 1) n = 1;
    if (c->n_occ < (int)(sizeof c->occ / sizeof *c->occ)) c->occ[c->n_occ++] = {fn, smem, n};
    return n;
}

// n <= NT rows (the rows from n on are masked; called with n == NT); F: the weight's format
template <int NT, int F>
static void gemv_pre_launch(ctx *c, const qf_mat *w, const float *x, int n, const dpre &p, const depi &e, int acc, float *y) {
    size_t smem = (size_t)n * (size_t)w->cols * sizeof(float);
    int threads = 256, sms = c->sms > 0 ? c->sms : 1;
    // one row, few weight rows (out_proj, o_proj, the router): a warp per row, a whole row of up to
    // 512 units in flight per warp, so the SMs hold twice the warps (option pw1=0: off)
    int one = NT == 1 && QF_LAB(c, pw1) && qk_units(F, (int)w->cols) <= 32 * 16 && (w->rows + 8 * PW - 1) / (8 * PW) < 2 * sms;
    void (*k)(const uint8_t *, int, int, const float *, int, dpre, depi, int, float *, int) = k_gemv_pre<NT, PW, F>;
    if constexpr (NT == 1)
        if (one) k = k_gemv_pre<1, 1, F>;
    int per_block = threads / 32 * (one ? 1 : PW);
    // no more blocks than fit at once: a second wave would pay the staging again, exposed
    int64_t need = (w->rows + per_block - 1) / per_block, cap = (int64_t)sms * resident(c, (const void *)k, threads, smem);
    int64_t rounds = (need + cap - 1) / cap, grid = (need + rounds - 1) / rounds; // equal rounds for every block
    launch(c, "k_gemv_pre", 1, k, dim3((unsigned)grid), dim3(threads), (unsigned)smem, (const uint8_t *)w->data, (int)w->rows, (int)w->cols, x, n, p, e,
           acc, y, QF_LAB(c, early));
}

// nt rows (1..16) of one pass: the kernel built for that count
template <int F>
static void gemv_pre_rows(ctx *c, const qf_mat *w, const float *x, int nt, const dpre &p, const depi &e, int acc, float *y) {
    switch (nt) { // one kernel per row count (rows below NT are masked, but only NT == nt ran on a GPU)
    case 1: gemv_pre_launch<1, F>(c, w, x, nt, p, e, acc, y); break;
    case 2: gemv_pre_launch<2, F>(c, w, x, nt, p, e, acc, y); break;
    case 3: gemv_pre_launch<3, F>(c, w, x, nt, p, e, acc, y); break;
    case 4: gemv_pre_launch<4, F>(c, w, x, nt, p, e, acc, y); break;
    case 5: gemv_pre_launch<5, F>(c, w, x, nt, p, e, acc, y); break;
    case 6: gemv_pre_launch<6, F>(c, w, x, nt, p, e, acc, y); break;
    case 7: gemv_pre_launch<7, F>(c, w, x, nt, p, e, acc, y); break;
    case 8: gemv_pre_launch<8, F>(c, w, x, nt, p, e, acc, y); break;
    case 9: gemv_pre_launch<9, F>(c, w, x, nt, p, e, acc, y); break;
    case 10: gemv_pre_launch<10, F>(c, w, x, nt, p, e, acc, y); break;
    case 11: gemv_pre_launch<11, F>(c, w, x, nt, p, e, acc, y); break;
    case 12: gemv_pre_launch<12, F>(c, w, x, nt, p, e, acc, y); break;
    case 13: gemv_pre_launch<13, F>(c, w, x, nt, p, e, acc, y); break;
    case 14: gemv_pre_launch<14, F>(c, w, x, nt, p, e, acc, y); break;
    case 15: gemv_pre_launch<15, F>(c, w, x, nt, p, e, acc, y); break;
    default: gemv_pre_launch<16, F>(c, w, x, nt, p, e, acc, y); break;
    }
}

// ---- many-row decode products on the tensor cores (tc_dense): the GEMV kernels above multiply
// every weight by each row with FMAs, so from a few rows on they are bound by instructions ----

// pre(x[t]) for row t = blockIdx.x, as bf16 parts: hi at xh[t], lo at xl[t] (NULL: one part).
__global__ void __launch_bounds__(256) k_pre_parts(const float *__restrict__ x, int cols, dpre p, __nv_bfloat16 *xh, __nv_bfloat16 *xl) {
    extern __shared__ float4 dyn[];
    __shared__ float red[PRE_MAX_HEADS];
    float *xs = (float *)dyn;
    int t = blockIdx.x;
    pdl_wait();
    pdl_launch();
    dpre pt = p;
    if (pt.g) pt.g += (int64_t)t * p.g_stride;
    stage<1>(x + (int64_t)t * cols, 1, cols, pt, xs, red);
    float sc = row_scale(p, red, 0, cols);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = xs[i] * sc;
        __nv_bfloat16 h = __float2bfloat16(v);
        xh[(int64_t)t * cols + i] = h;
        if (xl) xl[(int64_t)t * cols + i] = __float2bfloat16(v - __bfloat162float(h));
    }
}

// y[t][r] (= or +=) the epilogue of the sum of the product's splits yt[s][t][r]. With the DeltaNet
// epilogue a thread takes a channel and its rows in order: rows of one sequence (a verify's) share
// a conv state, each row's conv reading what the row before left.
__global__ void k_tc_finish(const float *__restrict__ yt, int splits, int n, int rows, depi e, int acc, float *y) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, all = (int64_t)n * rows;
    pdl_wait();
    pdl_launch();
    if (e.on) {
        if (i >= rows) return;
        for (int t = 0; t < n; t++) {
            int64_t j = (int64_t)t * rows + i;
            float v = yt[j];
            for (int s = 1; s < splits; s++) v += yt[s * all + j];
            v = epi_value(e, t, (int)i, v);
            y[j] = acc ? y[j] + v : v;
        }
        return;
    }
    if (i >= all) return;
    float v = yt[i];
    for (int s = 1; s < splits; s++) v += yt[s * all + i];
    y[i] = acc ? y[i] + v : v;
}

// dec_matmul_tc's inputs' parts and split partial sums for a step's rows: tc_splits doubles the
// splits while the tiles (64 rows) are fewer than 4 blocks an SM, so splits x rows stays under
// 8 x 64 blocks an SM, or is the rows of one split.
size_t dec_tc_scratch(ctx *c, const qf_scratch_shape *s) {
    if (c->dec_tc > QF_DEC_ROWS) return 0;
    int64_t n = QF_DEC_ROWS, cols = s->mat_cols < 8192 ? s->mat_cols : 8192, split_rows = 8 * 64 * (int64_t)(c->sms > 0 ? c->sms : 132);
    split_rows = s->mat_rows > split_rows ? s->mat_rows : split_rows;
    return 2 * align256((size_t)(n + 64) * cols * 2) + (size_t)(n * split_rows) * sizeof(float);
}

// dec_matmul on the tensor cores for n >= option dec_tc rows; 0: not taken (the GEMV kernels run).
static int dec_matmul_tc(ctx *c, const qf_mat *w, const float *x, int n, const dpre &p, const depi &e, int acc, float *y) {
    int64_t rows = w->rows, cols = w->cols;
    int splits = n >= c->dec_tc && cols <= 8192 ? tc_splits(c, w, n) : 0;
    if (!splits) return 0;
    int two = !c->bf16_single, direct = splits == 1 && !acc && !e.on;
    size_t xb = align256((size_t)(n + 64) * cols * 2), yb = direct ? 0 : (size_t)splits * n * rows * sizeof(float);
    char *s = (char *)scratch(c, &c->dtc, &c->dtc_cap, 2 * xb + yb);
    if (!s) return 0;
    __nv_bfloat16 *xh = (__nv_bfloat16 *)s, *xl = two ? (__nv_bfloat16 *)(s + xb) : NULL;
    float *yt = direct ? y : (float *)(s + 2 * xb);
    launch(c, "k_pre_parts", 1, k_pre_parts, dim3(n), dim3(256), (unsigned)(cols * sizeof(float)), x, (int)cols, p, xh, xl);
    tc_dense(c, w, xh, xl, n, splits, yt);
    if (!direct)
        launch(c, "k_tc_finish", 1, k_tc_finish, dim3((unsigned)blocks(e.on ? rows : (int64_t)n * rows, 256)), dim3(256), 0u, (const float *)yt, splits, n,
               (int)rows, e, acc, y);
    return 1;
}

void dec_matmul(qf_backend *be, const qf_mat *w, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc, float *y) {
    ctx *c = C(be);
    int q8 = w->dtype == QF_Q_I8B32;
    if ((w->dtype != QF_DT_BF16 && !q8) || !qk_unit_ok(qk_of(w->dtype), w->cols) || (uintptr_t)w->data % 16 || (uintptr_t)x % 16) {
        return dev_fail(c, "fused product needs 16-byte aligned bf16 rows of a multiple of 8 columns or int8 rows of a multiple of 256");
    }
    if (pre && (pre->kind == QF_PRE_GATED_NORM || pre->kind == QF_PRE_SIGMOID) && (pre->head < 1 || w->cols / pre->head > PRE_MAX_HEADS)) {
        return dev_fail(c, "fused product: more than %d heads per row", PRE_MAX_HEADS);
    }
    dpre p = dpre_of(pre);
    depi e = {};
    if (epi) {
        e = {1, epi->conv_dim, epi->z_dim, epi->nv, epi->conv_k, epi->conv_w, epi->dt_bias, epi->neg_A, {}};
        for (int t = 0; t < QF_DEC_ROWS; t++) e.st[t] = epi->conv_state[t];
    }
    if (!q8 && (c->bulk & gemv_bit((int)w->rows, (int)w->cols)) && n == 1 && w->cols % 256 == 0 && w->cols <= 8192) {
        size_t smem = bulk_smem_bytes((int)w->cols);
        void (*k)(const uint16_t *, int, int, const float *, dpre, depi, int, float *) = w->cols == 2048 ? k_gemv_bulk<8> : k_gemv_bulk<0>;
        int fit = resident(c, (const void *)k, 256, smem), per = fit < c->bulk_blocks ? fit : c->bulk_blocks;
        launch(c, "k_gemv_bulk", 1, k, dim3((unsigned)(c->sms * per)), dim3(256), (unsigned)smem, (const uint16_t *)w->data, (int)w->rows, (int)w->cols, x, p, e,
               acc, y);
        return;
    }
    if (n > 1 && dec_matmul_tc(c, w, x, n, p, e, acc, y)) return;
    // rows of x that fit beside the kernel's own shared memory (red: GEMV_MAX_N * PRE_MAX_HEADS floats)
    size_t room = (size_t)(c->smem_optin > 0 ? c->smem_optin : 48 * 1024) - GEMV_MAX_N * PRE_MAX_HEADS * sizeof(float) - 1024;
    int fit = (int)(room / ((size_t)w->cols * sizeof(float)));
    int cap = fit < 1 ? 1 : fit > GEMV_MAX_N ? GEMV_MAX_N : fit;
    for (int t0 = 0; t0 < n; t0 += cap) { // rows beyond what shared memory holds: another pass
        int nt = n - t0 < cap ? n - t0 : cap;
        dpre pt = p;
        if (pt.g) pt.g += (int64_t)t0 * p.g_stride;
        depi et = e;
        for (int t = 0; t < QF_DEC_ROWS; t++) et.st[t] = t0 + t < QF_DEC_ROWS ? e.st[t0 + t] : NULL;
        const float *xt = x + (int64_t)t0 * w->cols;
        float *yt = y + (int64_t)t0 * w->rows;
        if (w->dtype == QF_DT_BF16) gemv_pre_rows<QK_BF16>(c, w, xt, nt, pt, et, acc, yt);
        else gemv_pre_rows<QK_I8>(c, w, xt, nt, pt, et, acc, yt);
    }
}


// ---- greedy pick: the first index of the largest value per row ----

#define AMAX_BLOCKS 128

__device__ void better(float &bv, int &bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

// The block's best over the block's reach: every thread ends with it.
__device__ void block_best(float &bv, int &bi, float *rv, int *ri) {
    int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int o = 16; o > 0; o >>= 1) better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    __syncthreads();
    if (lane == 0) rv[warp] = bv, ri[warp] = bi;
    __syncthreads();
    for (int w = 0; w < nw; w++) better(bv, bi, rv[w], ri[w]);
}

// Grid (AMAX_BLOCKS, rows): each block its slice; the last block of a row to finish (a counter
// per row, which it resets) picks among the partials.
__global__ void k_argmax(const float *x, int cols, float *pv, int *pi, unsigned *count, int32_t *out) {
    __shared__ float rv[32];
    __shared__ int ri[32], last;
    int t = blockIdx.y, per = (cols + gridDim.x - 1) / gridDim.x, c0 = blockIdx.x * per, c1 = min(cols, c0 + per);
    const float *r = x + (int64_t)t * cols;
    pdl_wait();
    pdl_launch();
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) better(bv, bi, r[i], i);
    block_best(bv, bi, rv, ri);
    if (threadIdx.x == 0) {
        pv[t * gridDim.x + blockIdx.x] = bv, pi[t * gridDim.x + blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(&count[t], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = -INFINITY, bi = 0x7fffffff;
    for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) better(bv, bi, ((volatile float *)pv)[t * gridDim.x + i], ((volatile int *)pi)[t * gridDim.x + i]);
    block_best(bv, bi, rv, ri);
    if (threadIdx.x == 0) out[t] = bi == 0x7fffffff ? 0 : bi, count[t] = 0;
}

void dec_argmax(qf_backend *be, const float *x, int n, int cols, int32_t *out) {
    ctx *c = C(be);
    if (!c->amax || n > QF_DEC_ROWS * 8) {
        return dev_fail(c, "argmax over %d rows is not supported", n);
    }
    float *pv = (float *)c->amax;
    int *pi = (int *)(pv + QF_DEC_ROWS * 8 * AMAX_BLOCKS);
    unsigned *count = (unsigned *)(pi + QF_DEC_ROWS * 8 * AMAX_BLOCKS);
    LAUNCH_PDL(c, k_argmax, dim3(AMAX_BLOCKS, n), 256, 0, x, cols, pv, pi, count, out);
}


size_t argmax_scratch_bytes(void) { return (size_t)QF_DEC_ROWS * 8 * (AMAX_BLOCKS * 8 + 4); }

} // namespace qfc
