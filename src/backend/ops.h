/* The backend ops table: the only way model code touches weights or runs compute.
 *
 * Contract for every op: activations are fp32, row-major, caller-owned; weights are qf_mat views
 * (bf16, f16, f32 or a quantised format, as stored). Ops never allocate. A backend may run ops asynchronously only if
 * it also implements sync (the CPU backends are synchronous). The CPU "ref" table is the plain,
 * never-optimised oracle; every faster table is tested against it op by op (tests/test_ops.c). */
#ifndef QF_BACKEND_OPS_H
#define QF_BACKEND_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/pool.h"
#include "base/quant.h"
#include "backend/xcache.h"

/* A 2-D weight [rows][cols] used as y = x . W^T (PyTorch [out, in]). */
typedef struct qf_mat {
    int dtype; /* QF_DT_BF16, QF_DT_F16, QF_DT_F32 or a quantised format (base/quant.h) */
    const void *data;
    int64_t rows, cols;
    /* F8_E4M3: the [ceil(rows/128)][ceil(cols/128)] fp32 block scales (NULL otherwise). In
     * backend memory they always follow the e4m3 bytes at qf_mat_scale_off, so a kernel handed only
     * the data pointer (an expert table) finds them. */
    const float *scales;
} qf_mat;

/* Bytes of one of the weight's rows, and of all of them (its scales excluded). */
static inline size_t qf_mat_row_bytes(const qf_mat *w) {
    return qf_is_quant(w->dtype) ? qf_q_row_bytes(w->dtype, w->cols) : (size_t)w->cols * qf_dtype_size(w->dtype);
}
static inline size_t qf_mat_bytes(const qf_mat *w) { return (size_t)w->rows * qf_mat_row_bytes(w); }
static inline size_t qf_mat_scale_bytes(const qf_mat *w) {
    return w->dtype == QF_DT_F8_E4M3 ? (size_t)((w->rows + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK * ((w->cols + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK)) * 4 : 0;
}
static inline size_t qf_mat_scale_off(const qf_mat *w) { return (qf_mat_bytes(w) + 255) & ~(size_t)255; }
/* A self-contained copy: the rows, then the scales (if any) at qf_mat_scale_off. */
static inline size_t qf_mat_packed_bytes(const qf_mat *w) { return qf_mat_scale_bytes(w) ? qf_mat_scale_off(w) + qf_mat_scale_bytes(w) : qf_mat_bytes(w); }

/* Gated DeltaNet core for one sequence of T tokens (docs/model-spec.md §5.4-5.6). q/k/v point into the
 * conv output rows (row stride `stride` floats): q = [nk][dk], k = [nk][dk], v = [nv][dv].
 * v-head h reads k-head h / (nv / nk). beta and g are [T][nv] (beta already sigmoid, g <= 0).
 * S is the recurrent state [nv][dk][dv], updated in place. out is [T][nv][dv]. */
typedef struct qf_gdn_args {
    const float *q, *k, *v;
    int stride;
    const float *beta, *g;
    float *S;
    float *out;
    int T, nk, nv, dk, dv;
} qf_gdn_args;

/* One layer's view of a paged KV cache: pages of page_tokens tokens from a shared pool. Token j's
 * key for kv-head h starts at base + pages[j / page_tokens] * page_stride + k_off
 * + ((j % page_tokens) * nkv + h) * hd (values at v_off). A page's key summary (sparsity's KV
 * level) is at s_off: the per-channel minimum of its keys [nkv][hd], then the maximum [nkv][hd]. */
typedef struct qf_kv_view {
    float *base;
    const int32_t *pages;
    int page_tokens;
    size_t page_stride, k_off, v_off, s_off;
} qf_kv_view;

static inline float *qf_kv_row(const qf_kv_view *v, int j, int nkv, int hd, int h, int is_v) {
    size_t page = (size_t)v->pages[j / v->page_tokens];
    return v->base + page * v->page_stride + (is_v ? v->v_off : v->k_off) +
           ((size_t)(j % v->page_tokens) * (size_t)nkv + (size_t)h) * (size_t)hd;
}

/* Causal attention for one sequence: T queries at positions pos0..pos0+T-1, each seeing keys
 * 0..its own position. Query head h of token t: q + t*q_stride + h*q_hstride;
 * kv: the cache, already holding the new keys. out: [T][nh][hd]. */
typedef struct qf_attn_args {
    const float *q;
    int q_stride, q_hstride;
    qf_kv_view kv;
    float *out;
    int T, pos0, nh, nkv, hd;
    float scale;
    /* optional scratch (scratch_floats floats) a backend may use to split long key ranges across
     * threads when there are few queries (decode); NULL: no split */
    float *scratch;
    size_t scratch_floats;
} qf_attn_args;

/* One routed expert's weights. */
typedef struct qf_expert {
    qf_mat gate, up; /* [ffn][hidden] */
    qf_mat down;     /* [hidden][ffn] */
} qf_expert;

/* The routed experts of one MoE layer for N rows, routing included: softmax over the router
 * logits, top-k, renormalised weights, and out[r] = sum_k w_k * down_k(silu(gate_k x) * up_k x).
 * experts: the layer's E experts (a host array; the views point at the backend's memory).
 * table: the same pointers in the backend's memory, [gate[E] | up[E] | down[E]], as the expert
 * store keeps them for kernels that route on the device (required by a device; the CPU reads
 * experts). chosen (may be NULL): where
 * the op writes the expert ids it chose for the first chosen_rows rows ([row][top_k], backend
 * memory), for the store's statistics and eviction. */
typedef struct qf_moe_args {
    const qf_expert *experts;
    int n_experts, top_k, N, hidden, ffn;
    const float *router_logits; /* [N][E] */
    const float *x;             /* [N][hidden] */
    float *out;                 /* [N][hidden], overwritten */
    const void *const *table;
    int32_t *chosen;
    int chosen_rows;
    const qf_xcache *cache; /* NULL: every expert stays where table points */
} qf_moe_args;

typedef struct qf_backend qf_backend;

/* ---- Fused decode ops (optional; NULL in the CPU tables). A decode step has one token per
 * sequence and at most QF_DEC_ROWS sequences: row t of every array below is sequence t. Each op is
 * defined by the composition of plain ops its comment names, which is its reference
 * (tests/test_cuda.c compares the two). ---- */
#define QF_DEC_ROWS 64
#define QF_GRAPH_ROWS 16 /* rows up to which the plain ops of a step may be recorded (a device's library
                          * products past them are not kernels it launches) */

enum { QF_PRE_NONE = 0, QF_PRE_RMSNORM, QF_PRE_GATED_NORM, QF_PRE_SIGMOID };

/* What a fused product does to each input row before multiplying:
 * RMSNORM:    rmsnorm(x) * w                                   (w: [cols])
 * GATED_NORM: per head of `head`: rmsnorm(x_h) * w * silu(g_h)  (w: [head]; g row t at g + t*g_stride,
 *             head h at + h*g_hstride)
 * SIGMOID:    per head: x_h * sigmoid(g_h)                     (g laid out as for GATED_NORM) */
typedef struct qf_pre {
    int kind;
    const float *w, *g;
    int g_stride, g_hstride, head;
    float eps;
} qf_pre;

/* in_proj product of a Gated DeltaNet layer whose rows are [qkv conv channels | z | b | a]
 * (docs/model-spec.md §5), followed by what each row needs: conv_silu with the row's conv state for the
 * channels, gdn_gates for b and a. So y[t] = [conv out | z | beta | g]. */
typedef struct qf_gdn_epi {
    int conv_dim, z_dim, nv, conv_k;
    const float *conv_w, *dt_bias, *neg_A;
    float *conv_state[QF_DEC_ROWS];
} qf_gdn_epi;

/* The delta rule for one token per row (gdn with T = 1) reading the output of a qf_gdn_epi
 * product: row t at mixed + t*stride; S[t] its recurrent state; out [n][nv*dv]. chain: the rows
 * are one sequence's consecutive tokens (every S[t] the same state), stepped in order. */
typedef struct qf_gdn_dec {
    const float *mixed;
    int stride, n, nk, nv, dk, dv;
    float *S[QF_DEC_ROWS];
    float *out;
    int chain;
} qf_gdn_dec;

/* Attention of one new token per row from the fused q|gate, k, v product (row t at
 * qkv + t*stride; q head h at h*2*hd, k at k_off, v at v_off): rmsnorm of q and k heads with
 * q_norm/k_norm, rope at pos[t], kv_store into kv[t], attention over pos[t] + 1 keys. */
typedef struct qf_attn_dec {
    const float *qkv;
    int stride, k_off, v_off, n, nh, nkv, hd, rot;
    const float *q_norm, *k_norm, *inv_freq;
    float eps, scale;
    qf_kv_view kv[QF_DEC_ROWS];
    int pos[QF_DEC_ROWS];
    float *out; /* [n][nh*hd] */
    /* 0: the keys are 0..pos[t]; else kv[t] is a view of n_keys[t] keys (a choice of pages whose
     * last holds the new token, at n_keys[t] - 1): rope still at pos[t] */
    int n_keys[QF_DEC_ROWS];
} qf_attn_dec;

/* The MoE block of one row per sequence, added to the residual stream: xn = rmsnorm(x) * norm_w;
 * x += moe(router logits, xn) + sigmoid(sh_logit) * sh_down(silu(sh_g) * sh_u). The router
 * logits, sh_g, sh_u and sh_logit come from one product (row t at rl + t*rl_stride; sh_g at
 * + n_experts, sh_u at + n_experts + sh_ffn, sh_logit at + n_experts + 2*sh_ffn). */
typedef struct qf_moe_dec {
    const qf_expert *experts;
    int n_experts, top_k, n, hidden, ffn, sh_ffn;
    const float *norm_w;
    float eps;
    const float *rl;
    int rl_stride;
    const qf_mat *sh_down;
    float *x;
    const void *const *table; /* as qf_moe_args' */
    int32_t *chosen;          /* as qf_moe_args' ([n][top_k]; may be NULL) */
    const qf_xcache *cache;   /* as qf_moe_args' */
    /* sparsity's expert rule (qf_ref_route_drop) per row: tau 0 keeps every chosen expert; a
     * dropped one is not computed (nor loaded by a cache), its chosen entry -1 */
    float drop_tau[QF_DEC_ROWS];
    int min_k;
} qf_moe_dec;

/* The experts the fused MoE decode op takes: bf16 rows of a multiple of 8, or int8 / int4 / fp8
 * rows of whole 16-byte units at 16-byte aligned starts (hidden and width multiples of 256; fp8:
 * of 16), for hidden and width up to 4096 and 1024 and a shared expert up to 512 wide (quantised). */
static inline int qf_moe_dec_fits(int dtype, int64_t hidden, int64_t ffn, int64_t sh_ffn) {
    if (dtype == QF_DT_BF16) return hidden % 8 == 0 && ffn % 8 == 0;
    if (hidden > 4096 || ffn > 1024 || sh_ffn > 512) return 0;
    if (dtype == QF_DT_F8_E4M3) return hidden % 16 == 0 && ffn % 16 == 0;
    return (dtype == QF_DT_Q8_B32 || dtype == QF_DT_Q4_B32) && hidden % 256 == 0 && ffn % 256 == 0;
}

/* One row's token draw (runtime/sampler.h's rule, which the host sampler also follows): the
 * penalties (the repetition rule on every listed id when repetition != 1, then minus sub[i]),
 * then the first largest (temperature 0) or a draw with the uniform number u in [0, 1) among the
 * best top_k (0 or >= vocab: every token) of logits / temperature, cut by min_p and top_p, each
 * with weight exp(v - max) in double, walked best first (ties: the lower id first); with every
 * token kept (top_k, top_p and min_p off) the best QF_DRAW_SORTED first, then the rest in id order
 * (the same distribution, without sorting the vocabulary). */
typedef struct qf_draw {
    int on; /* 0: the row is not drawn (its out entry is left as it is) */
    float temperature, top_p, min_p, repetition;
    int top_k;
    int n_pen;
    const int32_t *pen_ids; /* host memory: the ids with a count (the prompt's too) */
    const float *pen_sub;   /* what each loses after the repetition rule (presence + frequency x generated count; 0: none) */
    double u;
} qf_draw;
#define QF_DRAW_MAX_K 1024 /* the largest top_k a device draw takes (above: the host draws) */
#define QF_DRAW_SORTED 256 /* see above */

typedef struct qf_dec_ops {
    /* y[n][w.rows] = W . pre(x), or += with accumulate; epi (may be NULL) as qf_gdn_epi says */
    void (*matmul)(qf_backend *be, const qf_mat *w, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi,
                   int accumulate, float *y);
    void (*gdn)(qf_backend *be, const qf_gdn_dec *a);
    void (*attention)(qf_backend *be, const qf_attn_dec *a);
    void (*moe)(qf_backend *be, const qf_moe_dec *a);
    /* out[r] = the index of the largest of x[r][0..cols) (the lowest on ties), rows of cols floats */
    void (*argmax)(qf_backend *be, const float *x, int n, int cols, int32_t *out);
    /* Optional (NULL, or 0 returned when not taken): gdn(g), then g->out = gn(g->out) in place
     * (gn a GATED_NORM over heads of g->dv), as one: what w_out's product then reads without a pre. 1: done. */
    int (*gdn_gn)(qf_backend *be, const qf_gdn_dec *g, const qf_pre *gn);
    /* Optional (NULL, or 0 returned when not taken): attention(a), then each output head times the
     * sigmoid of its gate (q|gate layout: head h's gate at qkv + t*stride + h*2*hd + hd), as one:
     * what o_proj then reads without a pre. 1: done. */
    int (*attn_gate)(qf_backend *be, const qf_attn_dec *a);
    /* Optional: matmul of a masked input through the transposed weight: y[t] (= or +=)
     * W . mask_t(pre(x[t])), epi as matmul's, where mask_t zeroes the entries of magnitude below
     * thr[t] (a host array; 0: none) and wt = W^T as matmul_cols reads it. Only the columns of W
     * some row keeps are read (sparsity's trunk level). */
    void (*matmul_sparse)(qf_backend *be, const qf_mat *wt, const float *x, int n, const qf_pre *pre, const qf_gdn_epi *epi, int acc,
                          const float *thr, float *y);
    /* Optional: what sparsity skipped in these ops since the backend started (after the queued
     * ops): out[0] trunk input entries masked by matmul_sparse, [1] of them zeroed, [2] routed
     * experts (row, rank) chosen under a drop rule, [3] of them dropped. */
    void (*sparse_counts)(qf_backend *be, uint64_t out[4]);
    /* Optional: sparsity's KV-page choice before attention (a's rows at pos[t], n_keys unused):
     * each row's query heads normalised and rotated as attention does them, each of its pages
     * 0..n_pages[t]-1 scored by qf_ref_page_score from its summary (the last page: none needed),
     * and qf_ref_page_select's choice of budget[t] pages (0: the row has none to make) written as
     * the row's physical page ids, ascending, to sel[t] (backend memory): the page table of a view
     * of them. */
    void (*page_select)(qf_backend *be, const qf_attn_dec *a, const int *n_pages, const int *budget, int32_t *const *sel);
    /* Optional: out[r] = row r's draw (d[r]; rows without `on` untouched) from logits (rows of
     * cols floats, backend memory; the penalties are applied in place). The draw walks the same
     * candidates in the same order with the same u as the host sampler, so it picks the same id,
     * save a sum rounded differently at a boundary; where top-p or min-p keeps more than
     * QF_DRAW_MAX_K tokens of a top_k-off row (a flat distribution) the kept tokens are walked in
     * id order instead: the same distribution, another id for the same u. */
    void (*draw)(qf_backend *be, float *logits, int n, int cols, const qf_draw *d, int32_t *out);
} qf_dec_ops;


/* The largest shapes a forward asks of a backend's ops, from which a device sizes its scratch once
 * (at load, before any step) instead of growing it as steps arrive. */
typedef struct qf_scratch_shape {
    int rows;                      /* rows of a many-row op (the workspace's) */
    int tokens;                    /* ids one embedding takes (a layered prompt's at most) */
    int hidden, expert_ffn, n_experts, top_k;
    int n_heads, n_kv_heads, head_dim;
    int gdn_heads, gdn_dk, gdn_dv; /* DeltaNet value heads and dims (0: none) */
    int64_t mat_cols, mat_rows;    /* the widest input and output of the trunk's products (lm_head's too) */
    int64_t sparse_out;            /* outputs of sparsity's transposed products (0: sparsity off) */
} qf_scratch_shape;

typedef struct qf_ops {
    const char *name;
    /* y[n][w.rows] = x[n][w.cols] . W^T */
    void (*matmul)(qf_backend *be, const qf_mat *w, const float *x, int n, float *y);
    /* y[n][wt.cols] = x[n][wt.rows] . wt, where wt = W^T ([in][out]: W's columns as rows): only
     * the rows of wt whose entry of x is nonzero in some row of x are read, so a sparse input
     * costs its nonzeros (sparsity's trunk level). matmul(W, x) but for the order of the sums. */
    void (*matmul_cols)(qf_backend *be, const qf_mat *wt, const float *x, int n, float *y);
    /* y[i] = row i of emb for ids[i] (ids already range-checked by the caller) */
    void (*embed)(qf_backend *be, const qf_mat *emb, const int32_t *ids, int n, float *y);
    /* per row: y = x * rsqrt(mean(x^2) + eps) * w (w may be NULL = 1); rows are x_stride and
     * y_stride floats apart; x == y allowed. */
    void (*rmsnorm)(qf_backend *be, const float *x, int x_stride, const float *w, int n_rows, int dim,
                    float eps, float *y, int y_stride);
    /* NeoX rotate-half RoPE on the first rot dims of each head: token t's head h starts at
     * x + t*stride + h*head_stride; position pos0+t; inv_freq[rot/2]. In place. */
    void (*rope)(qf_backend *be, float *x, int stride, int head_stride, int T, int n_heads, int rot,
                 int pos0, const float *inv_freq);
    /* Causal depthwise conv over T rows of C channels (x row stride x_stride) with carried state
     * [K-1][C] (oldest first, updated), weights w[C][K]; y[T][C] = silu(conv). */
    void (*conv_silu)(qf_backend *be, const float *x, int x_stride, int T, int C, int K,
                      const float *w, float *state, float *y);
    void (*gdn)(qf_backend *be, const qf_gdn_args *a);
    void (*attention)(qf_backend *be, const qf_attn_args *a);
    /* writes T tokens' keys and values (rows of nkv*hd) into the cache at positions pos0.. */
    void (*kv_store)(qf_backend *be, const qf_kv_view *kv, const float *k, const float *v, int T, int pos0, int nkv, int hd);
    /* the key summaries of the full pages p0..p1-1 (qf_ref_page_summary per kv head) */
    void (*kv_summarize)(qf_backend *be, const qf_kv_view *kv, int p0, int p1, int nkv, int hd);
    /* y[n][d] = silu(g) * u, with g/u rows g_stride/u_stride apart */
    void (*swiglu)(qf_backend *be, const float *g, const float *u, int stride, int n, int d, float *y);
    /* x[i] *= sigmoid(g[i]) for n rows of d (row strides x_stride, g_stride) */
    void (*sigmoid_mul)(qf_backend *be, float *x, int x_stride, const float *g, int g_stride, int n, int d);
    /* y[i] += a[i] * s (s may be NULL = 1) over n floats */
    void (*axpy)(qf_backend *be, float *y, const float *a, float s, int64_t n);
    /* DeltaNet gates over n rows of nv heads, in place: b = sigmoid(b), a = neg_A * softplus(a + dt_bias) */
    void (*gdn_gates)(qf_backend *be, float *b, float *a, const float *dt_bias, const float *neg_A, int n, int nv);
    /* y[r] += sigmoid(g[r]) * x[r] for n rows of d (the shared expert's gate) */
    void (*sigmoid_scale_add)(qf_backend *be, float *y, const float *x, const float *g, int n, int d);

    /* Optional (NULL in the CPU tables, which route on the host through the expert store). */
    void (*moe)(qf_backend *be, const qf_moe_args *a);
    const qf_dec_ops *dec;

    /* Memory of a device backend (all NULL on the CPU: host memory is used directly). Ops may run
     * asynchronously; download waits for them. */
    void *(*alloc)(qf_backend *be, size_t bytes); /* zero-filled; NULL when out of memory */
    void (*free)(qf_backend *be, void *p);
    void (*upload)(qf_backend *be, void *dst, const void *src, size_t bytes);
    void (*download)(qf_backend *be, void *dst, const void *src, size_t bytes);
    void (*zero)(qf_backend *be, void *p, size_t bytes);
    /* Optional: brackets one forward step of a given shape (key; 0: not to be recorded) and row
     * count, so a device can record it once and replay it (CUDA graphs): decode steps through the
     * qf_dec_ops of up to QF_DEC_ROWS rows, other steps of up to QF_GRAPH_ROWS. step_end returns
     * an error if any op of the step failed (the step's results are then not to be used); abandon:
     * the caller failed the step part-way, so whatever the device holds back of it is dropped. */
    void (*step_begin)(qf_backend *be, uint64_t key, int rows);
    int (*step_end)(qf_backend *be, int abandon);
    /* Optional: waits for every queued op; returns the first failure since the last step ended. */
    int (*sync)(qf_backend *be);
    /* Optional: host memory the device may read directly (pinned, mapped at the same address);
     * pin_alloc is zero-filled, NULL when out of memory. */
    int (*pin)(qf_backend *be, void *p, size_t bytes);
    void (*unpin)(qf_backend *be, void *p);
    void *(*pin_alloc)(qf_backend *be, size_t bytes);
    void (*pin_free)(qf_backend *be, void *p);
    /* Optional: the device's free and total memory, bytes. */
    void (*mem_info)(qf_backend *be, size_t *free_bytes, size_t *total_bytes);
    /* Optional: n copies from pinned host memory into backend memory on a copy engine beside the
     * ops, started after every op queued so far; stage_wait(buf) makes the ops queued after it
     * wait for the copies staged into buffer buf (0 or 1) until then. Never inside a recorded step. */
    void (*stage)(qf_backend *be, int buf, int n, void *const *dst, const void *const *src, const size_t *bytes);
    void (*stage_wait)(qf_backend *be, int buf);
    /* Optional: the scratch the ops take at most for shapes up to s: scratch_bytes is the
     * arithmetic alone (the load's plan), scratch_reserve allocates it (then no op grows a buffer
     * for shapes within s), scratch_grown counts the buffers an op grew since (0: the bound held). */
    size_t (*scratch_bytes)(qf_backend *be, const qf_scratch_shape *s);
    int (*scratch_reserve)(qf_backend *be, const qf_scratch_shape *s);
    int (*scratch_grown)(qf_backend *be);
    /* Backend memory to backend memory, in order with the ops (NULL: host memory, memcpy). */
    void (*copy)(qf_backend *be, void *dst, const void *src, size_t bytes);
    /* Optional: pinned host memory (pin) into backend memory by the device's own reads, the way
     * kernels read it in place, in order with the ops: the link's rate for those reads, which a
     * copy engine's (upload) need not match. */
    void (*read_pinned)(qf_backend *be, void *dst, const void *src, size_t bytes);
} qf_ops;

struct qf_backend {
    const qf_ops *ops;
    qf_pool *pool; /* may be NULL: single-threaded */
    void *dev;     /* a device backend's context */
};

/* Host-or-device helpers: plain libc when the table has no memory functions. */
void *qf_be_alloc(qf_backend *be, size_t bytes);
void qf_be_free(qf_backend *be, void *p);
void qf_be_upload(qf_backend *be, void *dst, const void *src, size_t bytes);
void qf_be_download(qf_backend *be, void *dst, const void *src, size_t bytes);
void qf_be_zero(qf_backend *be, void *p, size_t bytes);
void qf_be_copy(qf_backend *be, void *dst, const void *src, size_t bytes);
/* Host memory the device copies to and from at the link's rate (pinned where the backend pins),
 * zero-filled; NULL when out of memory. */
void *qf_be_host_alloc(qf_backend *be, size_t bytes);
void qf_be_host_free(qf_backend *be, void *p);
/* Waits for the backend's queued ops; QF_OK, or the failure of one of them. */
int qf_be_sync(qf_backend *be);

/* The gated delta rule (the gdn op) in chunks of C tokens, the WY form (backend/cpu/gdn_chunked.c):
 * the reference a chunked device kernel follows. scratch: qf_gdn_chunked_floats(dk, dv, C) floats. */
size_t qf_gdn_chunked_floats(int dk, int dv, int C);
void qf_gdn_chunked(const qf_gdn_args *a, int C, float *scratch);

/* CPU tables. qf_cpu_ops_best() picks AVX-512, AVX2/FMA or scalar at run time. */
extern const qf_ops qf_cpu_ops_ref;
const qf_ops *qf_cpu_ops_best(void);
/* For tests: base with the fused decode ops written as the chains of base's ops that define them
 * (backend/cpu/dec_compose.c), so forward.c's decode path runs on the CPU. Owns scratch_floats of
 * scratch (enough for QF_DEC_ROWS rows of the widest product and its output); be->dev holds it. */
int qf_cpu_dec_compose_init(qf_backend *be, const qf_ops *base, size_t scratch_floats);
void qf_cpu_dec_compose_free(qf_backend *be);
/* For tests: the SIMD tables this CPU supports (NULL when not supported). */
const qf_ops *qf_cpu_ops_avx2(void);
const qf_ops *qf_cpu_ops_avx512(void);

#endif
