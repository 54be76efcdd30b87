/* Every SIMD ops table against the reference ops on random data, at the real Qwen3.6-35B-A3B
 * shapes (hidden 2048, GDN 16/32 heads of 128, attention 16/2 heads of 256) and odd sizes that
 * exercise the scalar tails. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "base/numeric.h"
#include "base/quant.h"
#include "backend/ops.h"
#include "test_util.h"
#include "backend/rules.h"

static qf_mat make_mat(int dtype, int64_t rows, int64_t cols, void **store) {
    size_t n = (size_t)(rows * cols);
    void *p = malloc(n * qf_dtype_size(dtype));
    for (size_t i = 0; i < n; i++) {
        float v = qt_frand();
        if (dtype == QF_DT_F32) ((float *)p)[i] = v;
        else if (dtype == QF_DT_BF16) ((uint16_t *)p)[i] = qf_f32_to_bf16(v);
        else { /* f16 via a value exactly representable: multiples of 2^-10 in (-1, 1) */
            int q = (int)(v * 1024.0f);
            float f = (float)q / 1024.0f;
            uint16_t h = 0;
            if (q != 0) {
                int e = 0;
                float a = fabsf(f);
                while (a < 1.0f) a *= 2.0f, e--;
                h = (uint16_t)((f < 0 ? 0x8000 : 0) | ((e + 15) << 10) | ((int)((a - 1.0f) * 1024.0f) & 0x3ff));
            }
            ((uint16_t *)p)[i] = h;
        }
    }
    *store = p;
    return (qf_mat){dtype, p, rows, cols, NULL};
}

static void test_matmul(qf_backend *fast, qf_backend *ref) {
    int dtypes[3] = {QF_DT_BF16, QF_DT_F16, QF_DT_F32};
    int64_t shapes[][2] = {{96, 192}, {512, 2048}, {37, 131}, {1, 2048}};
    int ns[] = {1, 2, 3, 70};
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 4; s++)
            for (int k = 0; k < 4; k++) {
                void *store;
                qf_mat w = make_mat(dtypes[d], shapes[s][0], shapes[s][1], &store);
                float *x = qt_rnd((size_t)ns[k] * w.cols, 1.0f), *y0 = calloc((size_t)ns[k] * w.rows, 4), *y1 = calloc((size_t)ns[k] * w.rows, 4);
                ref->ops->matmul(ref, &w, x, ns[k], y0);
                fast->ops->matmul(fast, &w, x, ns[k], y1);
                double e = qt_rel_err(y1, y0, (size_t)ns[k] * w.rows);
                CHECK(e < 1e-5, "%s matmul %s [%lld x %lld] n=%d: rel err %.3g", fast->ops->name, qf_dtype_name(dtypes[d]),
                      (long long)w.rows, (long long)w.cols, ns[k], e);
                /* each token alone gives bit for bit what it gives in the batch (the server's exactness) */
                int same = 1;
                for (int t = 0; t < ns[k] && same; t += 1 + t / 3) {
                    fast->ops->matmul(fast, &w, x + (size_t)t * w.cols, 1, y0);
                    same = memcmp(y0, y1 + (size_t)t * w.rows, (size_t)w.rows * 4) == 0;
                }
                CHECK(same, "%s matmul %s [%lld x %lld] n=%d: a token alone differs from the batch", fast->ops->name,
                      qf_dtype_name(dtypes[d]), (long long)w.rows, (long long)w.cols, ns[k]);
                free(store), free(x), free(y0), free(y1);
            }
}

/* A random weight quantised to fmt (fp8: scales of its 128 x 128 blocks' largest |w| / 448). */
static qf_mat make_qmat(int fmt, int64_t rows, int64_t cols, void **store, float **scales) {
    float *w = qt_rnd((size_t)(rows * cols), 1.0f);
    qf_mat m = {fmt, NULL, rows, cols, NULL};
    uint8_t *q = malloc(qf_mat_bytes(&m));
    *scales = NULL;
    if (fmt == QF_Q_FP8B128) {
        int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
        float *sc = calloc((size_t)(br * bc), sizeof *sc);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) sc[r / 128 * bc + c / 128] = fmaxf(sc[r / 128 * bc + c / 128], fabsf(w[r * cols + c]) / 448.0f);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) q[r * cols + c] = qf_f32_to_fp8(w[r * cols + c] / sc[r / 128 * bc + c / 128]);
        *scales = sc;
    } else {
        for (int64_t r = 0; r < rows; r++) qf_q_quantize_row(fmt, w + r * cols, cols, q + (size_t)r * qf_q_row_bytes(fmt, cols));
    }
    free(w);
    m.data = q, m.scales = *scales;
    *store = q;
    return m;
}

/* Every quantised product against the oracle (dequantise, then multiply: qf_q_matmul_ref), at the
 * expert shapes, a trunk shape and odd ones (fp8 blocks cut short; rows of one block). */
static void test_matmul_quant(qf_backend *be) {
    int fmts[3] = {QF_Q_I8B32, QF_Q_I4B32, QF_Q_FP8B128};
    int64_t shapes[][2] = {{512, 2048}, {2048, 512}, {40, 4096}, {200, 136}, {3, 32}};
    int ns[] = {1, 3, 9};
    for (int f = 0; f < 3; f++)
        for (int s = 0; s < 5; s++)
            for (int k = 0; k < 3; k++) {
                void *store;
                float *sc;
                int64_t cols = fmts[f] != QF_Q_FP8B128 && shapes[s][1] % 32 ? shapes[s][1] + 24 : shapes[s][1]; /* int rows: whole blocks */
                qf_mat w = make_qmat(fmts[f], shapes[s][0], cols, &store, &sc);
                float *x = qt_rnd((size_t)ns[k] * w.cols, 1.0f), *y0 = calloc((size_t)ns[k] * w.rows, 4), *y1 = calloc((size_t)ns[k] * w.rows, 4);
                CHECK(qf_q_matmul_ref(fmts[f], w.data, sc, w.rows, w.cols, x, ns[k], y0) == QF_OK, "oracle");
                be->ops->matmul(be, &w, x, ns[k], y1);
                double e = qt_rel_err(y1, y0, (size_t)ns[k] * w.rows);
                CHECK(e < 1e-5, "%s matmul %s [%lld x %lld] n=%d: rel err %.3g against the oracle", be->ops->name, qf_qfmt_name(fmts[f]),
                      (long long)w.rows, (long long)w.cols, ns[k], e);
                int same = 1;
                for (int t = 0; t < ns[k] && same; t += 2) {
                    be->ops->matmul(be, &w, x + (size_t)t * w.cols, 1, y0);
                    same = memcmp(y0, y1 + (size_t)t * w.rows, (size_t)w.rows * 4) == 0;
                }
                CHECK(same, "%s matmul %s [%lld x %lld] n=%d: a token alone differs from the batch", be->ops->name, qf_qfmt_name(fmts[f]),
                      (long long)w.rows, (long long)w.cols, ns[k]);
                free(store), free(sc), free(x), free(y0), free(y1);
            }
}

/* W^T of w (same dtype) into a new buffer. */
static qf_mat transposed(const qf_mat *w, void **store) {
    size_t es = qf_dtype_size(w->dtype);
    char *t = malloc((size_t)(w->rows * w->cols) * es);
    for (int64_t r = 0; r < w->rows; r++)
        for (int64_t c = 0; c < w->cols; c++) memcpy(t + (size_t)(c * w->rows + r) * es, (const char *)w->data + (size_t)(r * w->cols + c) * es, es);
    *store = t;
    return (qf_mat){w->dtype, t, w->cols, w->rows, NULL};
}

/* The transposed product of a sparse input against the dense product of the same input: the
 * reference bit for bit, a SIMD table to rounding; at the mixers' shapes (in_proj 2048 -> 12352,
 * out_proj 4096 -> 2048), rows sharing few kept columns, and an all-zero input. */
static void test_matmul_cols(qf_backend *be, qf_backend *ref) {
    int dtypes[2] = {QF_DT_BF16, QF_DT_F32};
    int64_t shapes[][2] = {{12352, 2048}, {2048, 4096}, {37, 131}};
    int ns[] = {1, 3};
    float zero_share[] = {0.5f, 0.9f, 1.0f};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 3; s++)
            for (int k = 0; k < 2; k++)
                for (int z = 0; z < 3; z++) {
                    if (s < 2 && (d > 0 || z == 1 || k > 0)) continue; /* the large shapes once: the reference is slow */
                    void *store, *tstore;
                    qf_mat w = make_mat(dtypes[d], shapes[s][0], shapes[s][1], &store), wt = transposed(&w, &tstore);
                    float *x = qt_rnd((size_t)ns[k] * w.cols, 1.0f), *y0 = calloc((size_t)ns[k] * w.rows, 4), *y1 = calloc((size_t)ns[k] * w.rows, 4);
                    for (size_t i = 0; i < (size_t)ns[k] * w.cols; i++)
                        if (qt_frand() * 0.5f + 0.5f < zero_share[z]) x[i] = 0.0f;
                    ref->ops->matmul(ref, &w, x, ns[k], y0);
                    be->ops->matmul_cols(be, &wt, x, ns[k], y1);
                    double e = qt_rel_err(y1, y0, (size_t)ns[k] * w.rows);
                    int exact = be->ops == ref->ops;
                    CHECK(exact ? memcmp(y0, y1, (size_t)ns[k] * w.rows * 4) == 0 : e < 1e-5, "%s matmul_cols %s [%lld x %lld] n=%d, %.0f%% zeros: rel err %.3g",
                          be->ops->name, qf_dtype_name(dtypes[d]), (long long)w.rows, (long long)w.cols, ns[k], 100.0 * zero_share[z], e);
                    free(store), free(tstore), free(x), free(y0), free(y1);
                }
}

static void test_rmsnorm(qf_backend *fast, qf_backend *ref) {
    int dims[] = {2048, 128, 37};
    for (int i = 0; i < 3; i++) {
        int d = dims[i], rows = 5;
        float *x = qt_rnd((size_t)rows * d * 2, 3.0f), *w = qt_rnd((size_t)d, 1.0f), *y0 = calloc((size_t)rows * d * 2, 4), *y1 = calloc((size_t)rows * d * 2, 4);
        ref->ops->rmsnorm(ref, x, 2 * d, w, rows, d, 1e-6f, y0, d);
        fast->ops->rmsnorm(fast, x, 2 * d, w, rows, d, 1e-6f, y1, d);
        CHECK(qt_rel_err(y1, y0, (size_t)rows * d) < 1e-6, "%s rmsnorm dim %d", fast->ops->name, d);
        free(x), free(w), free(y0), free(y1);
    }
}

/* Random delta-rule inputs of T tokens (decays -|N| * decay_scale, beta in 0.5..1), with a second
 * copy of the state and output for the implementation under test: args() gives the reference's
 * view, S1 and o1 the other's. */
typedef struct gdn_case {
    float *qkv, *beta, *g, *S0, *S1, *o0, *o1;
    int nk, nv, dk, dv, T, stride;
    size_t ns, no;
} gdn_case;

static gdn_case gdn_case_new(int nk, int nv, int dk, int dv, int T, float decay_scale) {
    gdn_case c = {.nk = nk, .nv = nv, .dk = dk, .dv = dv, .T = T, .stride = 2 * nk * dk + nv * dv};
    c.ns = (size_t)nv * dk * dv, c.no = (size_t)T * nv * dv;
    c.qkv = qt_rnd((size_t)T * c.stride, 1.0f), c.beta = qt_rnd((size_t)T * nv, 0.5f), c.g = qt_rnd((size_t)T * nv, decay_scale);
    for (int i = 0; i < T * nv; i++) c.beta[i] = 0.5f + c.beta[i], c.g[i] = -fabsf(c.g[i]);
    c.S0 = qt_rnd(c.ns, 0.1f), c.S1 = malloc(c.ns * 4), c.o0 = calloc(c.no, 4), c.o1 = calloc(c.no, 4);
    memcpy(c.S1, c.S0, c.ns * 4);
    return c;
}

static qf_gdn_args gdn_case_args(const gdn_case *c, float *S, float *out) {
    const float *q = c->qkv, *k = q + c->nk * c->dk, *v = k + c->nk * c->dk;
    return (qf_gdn_args){q, k, v, c->stride, c->beta, c->g, S, out, c->T, c->nk, c->nv, c->dk, c->dv};
}

static void gdn_case_free(gdn_case *c) { free(c->qkv), free(c->beta), free(c->g), free(c->S0), free(c->S1), free(c->o0), free(c->o1); }

static void test_gdn(qf_backend *fast, qf_backend *ref, int nk, int nv, int dk, int dv, int T) {
    gdn_case c = gdn_case_new(nk, nv, dk, dv, T, 1.0f);
    qf_gdn_args a = gdn_case_args(&c, c.S0, c.o0), b = gdn_case_args(&c, c.S1, c.o1);
    ref->ops->gdn(ref, &a);
    fast->ops->gdn(fast, &b);
    CHECK(qt_rel_err(c.o1, c.o0, c.no) < 1e-5, "%s gdn out (nk %d nv %d dk %d)", fast->ops->name, nk, nv, dk);
    CHECK(qt_rel_err(c.S1, c.S0, c.ns) < 1e-5, "%s gdn state", fast->ops->name);
    gdn_case_free(&c);
}

/* The chunked form against the token-by-token rule: T tokens in chunks of C (a partial last chunk
 * where C does not divide T), several chunks carrying the state, strong and weak decays. */
static void test_gdn_chunked(qf_backend *ref, int nk, int nv, int dk, int dv, int T, int C, float decay_scale) {
    gdn_case c = gdn_case_new(nk, nv, dk, dv, T, decay_scale);
    float *scratch = malloc(qf_gdn_chunked_floats(dk, dv, C) * sizeof(float));
    qf_gdn_args a = gdn_case_args(&c, c.S0, c.o0), b = gdn_case_args(&c, c.S1, c.o1);
    ref->ops->gdn(ref, &a);
    qf_gdn_chunked(&b, C, scratch);
    double eo = qt_rel_err(c.o1, c.o0, c.no), es = qt_rel_err(c.S1, c.S0, c.ns);
    fprintf(stderr, "chunked gdn T %d C %d dk %d dv %d decay %.1f: out %.2e, state %.2e\n", T, C, dk, dv, decay_scale, eo, es);
    CHECK(eo < 2e-5, "chunked gdn out: T %d C %d dk %d dv %d decay %.2f: rel err %.2e", T, C, dk, dv, decay_scale, eo);
    CHECK(es < 2e-5, "chunked gdn state: T %d C %d dk %d dv %d decay %.2f: rel err %.2e", T, C, dk, dv, decay_scale, es);
    gdn_case_free(&c);
    free(scratch);
}

/* The cache is paged with its pages in scrambled order, as a shared pool hands them out. */
static void test_attention(qf_backend *fast, qf_backend *ref, int nh, int nkv, int hd, int T, int pos0) {
    int ctx = pos0 + T, qs = nh * 2 * hd, pt = 16, np = (ctx + pt - 1) / pt + 3;
    size_t layer = (size_t)pt * nkv * hd, stride = 3 * layer; /* pages hold 1.5 layers' worth: k at 0, v at 2 */
    float *q = qt_rnd((size_t)T * qs, 1.0f), *pool = qt_rnd((size_t)np * stride, 1.0f);
    float *k = qt_rnd((size_t)T * nkv * hd, 1.0f), *v = qt_rnd((size_t)T * nkv * hd, 1.0f);
    int32_t *pages = malloc((size_t)np * sizeof *pages);
    for (int i = 0; i < np; i++) pages[i] = (i * 7 + 3) % np; /* np is never a multiple of 7 here */
    float *o0 = calloc((size_t)T * nh * hd, 4), *o1 = calloc((size_t)T * nh * hd, 4);
    size_t scratch_n = (size_t)T * nh * 16 * (hd + 2);
    float *scratch = malloc(scratch_n * sizeof(float));
    qf_attn_args a = {q, qs, 2 * hd, {pool, pages, pt, stride, 0, 2 * layer, 0}, o0, T, pos0, nh, nkv, hd, 1.0f / sqrtf((float)hd),
                      scratch, scratch_n}; /* the fast ops may split long key ranges into it */
    ref->ops->kv_store(ref, &a.kv, k, v, T, pos0, nkv, hd);
    CHECK(qf_kv_row(&a.kv, pos0 + T - 1, nkv, hd, nkv - 1, 1)[hd - 1] == v[(size_t)T * nkv * hd - 1], "kv_store misplaced a value");
    ref->ops->attention(ref, &a);
    a.out = o1;
    fast->ops->attention(fast, &a);
    CHECK(qt_rel_err(o1, o0, (size_t)T * nh * hd) < 1e-5, "%s attention nh %d hd %d T %d pos0 %d", fast->ops->name, nh, hd, T, pos0);
    free(q), free(pool), free(k), free(v), free(pages), free(o0), free(o1), free(scratch);
}

/* Ops the SIMD tables take from the reference must still agree (guards a future override). */
static void test_elementwise(qf_backend *fast, qf_backend *ref) {
    int n = 3, d = 67, K = 4, C = 70;
    float *g = qt_rnd((size_t)n * d, 4), *u = qt_rnd((size_t)n * d, 4), *y0 = calloc((size_t)n * d, 4), *y1 = calloc((size_t)n * d, 4);
    ref->ops->swiglu(ref, g, u, d, n, d, y0);
    fast->ops->swiglu(fast, g, u, d, n, d, y1);
    CHECK(qt_rel_err(y1, y0, (size_t)n * d) < 1e-6, "%s swiglu", fast->ops->name);
    float *x = qt_rnd((size_t)5 * C, 1), *w = qt_rnd((size_t)C * K, 1), *s0 = qt_rnd((size_t)(K - 1) * C, 1), *s1 = malloc((size_t)(K - 1) * C * 4);
    float *c0 = calloc((size_t)5 * C, 4), *c1 = calloc((size_t)5 * C, 4);
    memcpy(s1, s0, (size_t)(K - 1) * C * 4);
    ref->ops->conv_silu(ref, x, C, 5, C, K, w, s0, c0);
    fast->ops->conv_silu(fast, x, C, 5, C, K, w, s1, c1);
    CHECK(qt_rel_err(c1, c0, (size_t)5 * C) < 1e-6 && qt_rel_err(s1, s0, (size_t)(K - 1) * C) == 0, "%s conv_silu", fast->ops->name);
    free(g), free(u), free(y0), free(y1), free(x), free(w), free(s0), free(s1), free(c0), free(c1);
}

/* The conv carried across calls equals one call over the whole sequence. */
static void test_conv_carry(void) {
    int C = 8, K = 4, T = 6;
    float *x = qt_rnd((size_t)T * C, 1), *w = qt_rnd((size_t)C * K, 1), *s_one = calloc((size_t)(K - 1) * C, 4), *s_two = calloc((size_t)(K - 1) * C, 4);
    float *y_one = calloc((size_t)T * C, 4), *y_two = calloc((size_t)T * C, 4);
    qf_backend ref = {&qf_cpu_ops_ref, NULL, NULL};
    ref.ops->conv_silu(&ref, x, C, T, C, K, w, s_one, y_one);
    ref.ops->conv_silu(&ref, x, C, 2, C, K, w, s_two, y_two);
    ref.ops->conv_silu(&ref, x + 2 * C, C, 1, C, K, w, s_two, y_two + 2 * C);
    ref.ops->conv_silu(&ref, x + 3 * C, C, 3, C, K, w, s_two, y_two + 3 * C);
    CHECK(qt_max_abs_diff(y_one, y_two, T * C) < 1e-6 && qt_max_abs_diff(s_one, s_two, (K - 1) * C) == 0, "conv state carry");
    free(x), free(w), free(s_one), free(s_two), free(y_one), free(y_two);
}

/* Quest's page rule: a page's bound is never under a key's score in it, and the selection is what
 * sorting every middle page by bound (then index) and keeping the first budget - 2, with the first
 * and last pages, gives. Random keys in pages of 16, including pages of equal bounds. */
static int cmp_bound_desc(const void *a, const void *b, void *ctx) {
    const float *bd = ctx;
    int x = *(const int *)a, y = *(const int *)b;
    return bd[x] != bd[y] ? (bd[x] < bd[y]) - (bd[x] > bd[y]) : (x > y) - (x < y);
}
static int cmp_int(const void *a, const void *b) { return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b); }

/* Quest's rule for a token's 4 query heads over 2 kv heads: no key scores above its page's score
 * for any head; the choice is the first and last pages and the highest scores (ties to the lower
 * page) by a sort; the summaries kv_summarize makes in a paged layout are the reference's. */
static void test_page_select(void) {
    enum { P = 40, PT = 16, hd = 64, NH = 4, NKV = 2 };
    int bad_bound = 0, bad_sel = 0;
    size_t pf = (size_t)PT * NKV * hd; /* a page's keys */
    float *keys = malloc((size_t)P * pf * sizeof(float)), *kmin = malloc((size_t)P * NKV * hd * sizeof(float)), *kmax = malloc((size_t)P * NKV * hd * sizeof(float));
    float q[NH * hd], bd[P];
    int32_t got[P];
    int idx[P], want[P];
    for (int round = 0; round < 20; round++) {
        for (size_t i = 0; i < (size_t)P * pf; i++) keys[i] = qt_frand();
        if (round % 2) { /* pages 5 and 7 the same, and above the rest: with one middle place, 5 wins the tie */
            for (size_t i = 0; i < pf; i++) keys[5 * pf + i] *= 4.0f;
            memcpy(keys + 7 * pf, keys + 5 * pf, pf * sizeof(float));
        }
        for (int c = 0; c < NH * hd; c++) q[c] = qt_frand();
        for (int p = 0; p < P; p++) {
            float *mn = kmin + (size_t)p * NKV * hd, *mx = kmax + (size_t)p * NKV * hd;
            for (int g = 0; g < NKV; g++) qf_ref_page_summary(keys + p * pf + (size_t)g * hd, PT, NKV * hd, hd, mn + g * hd, mx + g * hd);
            bd[p] = qf_ref_page_score(q, NH, hd, NKV, mn, mx, hd);
            for (int h = 0; h < NH; h++)
                for (int t = 0; t < PT; t++) {
                    float dot = 0;
                    for (int c = 0; c < hd; c++) dot += q[h * hd + c] * keys[p * pf + ((size_t)t * NKV + h / (NH / NKV)) * hd + c];
                    bad_bound += dot > bd[p] + 1e-4f;
                }
        }
        int budget = round % 2 ? 3 : 3 + round;
        int n = qf_ref_page_select(bd, P, budget, got);
        for (int p = 1; p < P - 1; p++) idx[p - 1] = p;
        qsort_r(idx, (size_t)P - 2, sizeof *idx, cmp_bound_desc, bd);
        int m = 0;
        want[m++] = 0;
        for (int i = 0; i < budget - 2; i++) want[m++] = idx[i];
        want[m++] = P - 1;
        qsort(want, (size_t)m, sizeof *want, cmp_int);
        bad_sel += n != m;
        for (int i = 0; i < m && n == m; i++) bad_sel += got[i] != want[i];
    }
    CHECK(bad_bound == 0, "%d keys score above their page's score", bad_bound);
    CHECK(bad_sel == 0, "page selection differs from sorting by score in %d places", bad_sel);
    int32_t all[4];
    CHECK(qf_ref_page_select(bd, 4, 10, all) == 4 && all[3] == 3, "a budget above the pages takes them all");
    /* kv_summarize over a paged layout (pages out of order, values and a summary after the keys) */
    size_t stride = 2 * pf + 2 * NKV * hd;
    float *pool = qt_rnd((size_t)P * stride, 1.0f);
    int32_t pages[P];
    for (int i = 0; i < P; i++) pages[i] = (i * 7 + 3) % P;
    qf_kv_view kv = {pool, pages, PT, stride, 0, pf, 2 * pf};
    qf_backend be = {&qf_cpu_ops_ref, NULL, NULL};
    be.ops->kv_summarize(&be, &kv, 2, 9, NKV, hd);
    int bad_sum = 0;
    for (int p = 2; p < 9; p++)
        for (int g = 0; g < NKV; g++) {
            float mn[hd], mx[hd];
            const float *page = pool + (size_t)pages[p] * stride;
            qf_ref_page_summary(page + (size_t)g * hd, PT, NKV * hd, hd, mn, mx);
            bad_sum += memcmp(mn, page + 2 * pf + (size_t)g * hd, sizeof mn) != 0 || memcmp(mx, page + 2 * pf + (size_t)(NKV + g) * hd, sizeof mx) != 0;
        }
    CHECK(bad_sum == 0, "kv_summarize: %d page summaries differ from the reference", bad_sum);
    free(keys), free(kmin), free(kmax), free(pool);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    qf_pool *pool = qf_pool_create(qf_cpu_count() > 1 ? qf_cpu_count() : 2);
    qf_backend ref = {&qf_cpu_ops_ref, NULL, NULL};
    const qf_ops *tables[2] = {qf_cpu_ops_avx2(), qf_cpu_ops_avx512()};
    int tested = 0;
    for (int t = 0; t < 2; t++) {
        if (!tables[t]) {
            fprintf(stderr, "%s not supported by this CPU: skipped\n", t ? "AVX-512" : "AVX2");
            continue;
        }
        qf_backend fast = {tables[t], pool, NULL};
        test_matmul(&fast, &ref);
        test_matmul_cols(&fast, &ref);
        test_matmul_quant(&fast);
        test_rmsnorm(&fast, &ref);
        test_gdn(&fast, &ref, 16, 32, 128, 128, 4);
        test_gdn(&fast, &ref, 2, 4, 32, 32, 9);
        test_gdn(&fast, &ref, 1, 3, 20, 13, 3);
        test_attention(&fast, &ref, 16, 2, 256, 3, 300);
        test_attention(&fast, &ref, 4, 2, 64, 70, 0);
        test_attention(&fast, &ref, 3, 1, 20, 1, 129);
        test_attention(&fast, &ref, 16, 2, 256, 1, 3000); /* decode at 3000 keys: split over keys */
        test_attention(&fast, &ref, 4, 2, 64, 2, 700);
        test_attention(&fast, &ref, 2, 1, 64, 1, 3000); /* 2 (query, head) pairs: split 4 ways over the keys */
        test_attention(&fast, &ref, 4, 2, 64, 1, 1000);
        test_elementwise(&fast, &ref);
        tested++;
    }
    test_conv_carry();
    test_page_select();
    test_matmul_cols(&ref, &ref);
    test_matmul_quant(&ref);
    test_gdn_chunked(&ref, 2, 4, 32, 32, 9, 64, 1.0f);     /* one partial chunk */
    test_gdn_chunked(&ref, 2, 4, 32, 32, 100, 16, 1.0f);   /* 7 chunks, the last partial */
    test_gdn_chunked(&ref, 1, 3, 20, 13, 50, 8, 0.1f);     /* odd widths, weak decay */
    test_gdn_chunked(&ref, 4, 8, 128, 128, 150, 64, 0.3f); /* the release's head width, 64-token chunks */
    test_gdn_chunked(&ref, 1, 2, 64, 64, 128, 64, 3.0f);   /* strong decay: e^(G_t - G_s) down to ~e^-190 */
    CHECK(tested > 0 || !qf_cpu_ops_avx2(), "no SIMD table tested");
    fprintf(stderr, "SIMD tables tested: %d; best on this CPU: %s\n", tested, qf_cpu_ops_best()->name);
    qf_pool_destroy(pool);
    return qt_finish();
}
