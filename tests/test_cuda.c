/* Every CUDA op against the CPU reference op on random inputs of Qwen3.6-35B-A3B's real shapes,
 * plus the kernel bandwidth of the decode GEMV and the expert GEMV. Needs a GPU: without one
 * (or in a build without CUDA) it exits 77, which CTest reports as skipped. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/ops_cuda.h"
#include "base/dtype.h"
#include "base/numeric.h"
#include "base/quant.h"
#include "runtime/sampler.h"
#include "base/timer.h"
#include "experts/store.h"
#include "test_util.h"
#include "backend/rules.h"

static qf_backend gpu, ref = {&qf_cpu_ops_ref, NULL, NULL};
static qf_cuda_opts g_opts; /* the options the backend under test was made with */

static void *up(const void *h, size_t bytes) {
    void *d = gpu.ops->alloc(&gpu, bytes);
    gpu.ops->upload(&gpu, d, h, bytes);
    return d;
}

static float *up_f(const float *h, size_t n) { return up(h, n * sizeof(float)); }

/* Compares the device array with the host reference; the error is relative to the largest value. */
static double cmp(const float *dev, const float *want, size_t n) {
    float *got = malloc(n * sizeof *got);
    gpu.ops->download(&gpu, got, dev, n * sizeof *got);
    double e = qt_rel_err(got, want, n);
    free(got);
    return e;
}

static qf_mat bf16_mat(int64_t rows, int64_t cols, void **host) {
    uint16_t *p = malloc((size_t)(rows * cols) * 2);
    for (int64_t i = 0; i < rows * cols; i++) p[i] = qf_f32_to_bf16(qt_frand() * 0.05f);
    *host = p;
    return (qf_mat){QF_DT_BF16, p, rows, cols, NULL};
}

static int trunk_fmt = QF_DT_BF16; /* the trunk's format in the fused product tests */

/* A random trunk weight in trunk_fmt: bf16, or int8 rows (one scale a block of 32) as qflash
 * quantize --trunk int8 makes them from the same values. */
static qf_mat trunk_mat(int64_t rows, int64_t cols, void **host) {
    qf_mat w = bf16_mat(rows, cols, host);
    if (trunk_fmt == QF_DT_BF16) return w;
    size_t rb = qf_q_row_bytes(trunk_fmt, cols);
    float *row = malloc((size_t)cols * sizeof *row);
    uint8_t *q = malloc((size_t)rows * rb);
    const uint16_t *b = *host;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) row[c] = qf_bf16_to_f32(b[r * cols + c]);
        qf_q_quantize_row(trunk_fmt, row, cols, q + (size_t)r * rb);
    }
    free(row), free(*host);
    *host = q;
    return (qf_mat){trunk_fmt, q, rows, cols, NULL};
}

static void report(const char *op, const char *shape, double err, double tol) {
    fprintf(stderr, "  %-18s %-40s rel err %.2e\n", op, shape, err);
    CHECK(err < tol, "%s %s: rel err %.3g >= %.3g", op, shape, err, tol);
}

static void test_matmul(int64_t rows, int64_t cols, int n, double tol) {
    void *hw;
    qf_mat w = bf16_mat(rows, cols, &hw);
    float *x = qt_rnd((size_t)n * cols, 1.0f), *y = malloc((size_t)n * rows * 4);
    ref.ops->matmul(&ref, &w, x, n, y);
    qf_mat dw = w;
    dw.data = up(hw, (size_t)(rows * cols) * 2);
    float *dx = up_f(x, (size_t)n * cols), *dy = gpu.ops->alloc(&gpu, (size_t)n * rows * 4);
    gpu.ops->matmul(&gpu, &dw, dx, n, dy);
    char s[64];
    snprintf(s, sizeof s, "bf16 [%lld x %lld] n=%d", (long long)rows, (long long)cols, n);
    report("matmul", s, cmp(dy, y, (size_t)n * rows), tol);
    gpu.ops->free(&gpu, (void *)dw.data), gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dy);
    free(hw), free(x), free(y);
}

static void test_small_ops(void) {
    int H = 2048, T = 5, V = 1000;
    void *he;
    qf_mat emb = bf16_mat(V, H, &he);
    int32_t ids[5] = {3, 999, 0, 500, 3};
    float *y = malloc((size_t)T * H * 4);
    ref.ops->embed(&ref, &emb, ids, T, y);
    qf_mat de = emb;
    de.data = up(he, (size_t)V * H * 2);
    float *dy = gpu.ops->alloc(&gpu, (size_t)T * H * 4);
    gpu.ops->embed(&gpu, &de, ids, T, dy);
    report("embed", "bf16 [1000 x 2048], 5 ids", cmp(dy, y, (size_t)T * H), 1e-6);

    float *x = qt_rnd((size_t)T * H, 2.0f), *w = qt_rnd(H, 1.0f), *dx = up_f(x, (size_t)T * H), *dw = up_f(w, H);
    ref.ops->rmsnorm(&ref, x, H, w, T, H, 1e-6f, y, H);
    gpu.ops->rmsnorm(&gpu, dx, H, dw, T, H, 1e-6f, dy, H);
    report("rmsnorm", "5 x 2048", cmp(dy, y, (size_t)T * H), 1e-5);

    /* RoPE on q heads laid out [query | gate] per head, as the attention layer has them */
    int nh = 16, hd = 256, qs = nh * 2 * hd;
    float *q = qt_rnd((size_t)T * qs, 1.0f), *inv = malloc(32 * 4);
    for (int i = 0; i < 32; i++) inv[i] = 1.0f / powf(1e7f, (float)(2 * i) / 64.0f);
    float *dq = up_f(q, (size_t)T * qs), *dinv = up_f(inv, 32);
    ref.ops->rope(&ref, q, qs, 2 * hd, T, nh, 64, 1234, inv);
    gpu.ops->rope(&gpu, dq, qs, 2 * hd, T, nh, 64, 1234, dinv);
    report("rope", "5 tokens x 16 heads, rot 64, pos 1234", cmp(dq, q, (size_t)T * qs), 1e-5);

    float *g = qt_rnd((size_t)T * 512, 3.0f), *u = qt_rnd((size_t)T * 512, 1.0f), *dg = up_f(g, (size_t)T * 512), *du = up_f(u, (size_t)T * 512);
    ref.ops->swiglu(&ref, g, u, 512, T, 512, y);
    gpu.ops->swiglu(&gpu, dg, du, 512, T, 512, dy);
    report("swiglu", "5 x 512", cmp(dy, y, (size_t)T * 512), 1e-6);
    ref.ops->sigmoid_mul(&ref, u, 512, g, 512, T, 256);
    gpu.ops->sigmoid_mul(&gpu, du, 512, dg, 512, T, 256);
    report("sigmoid_mul", "5 x 256 of 512-wide rows", cmp(du, u, (size_t)T * 512), 1e-6);
    ref.ops->axpy(&ref, u, g, 0.5f, (int64_t)T * 512);
    gpu.ops->axpy(&gpu, du, dg, 0.5f, (int64_t)T * 512);
    report("axpy", "2560", cmp(du, u, (size_t)T * 512), 1e-6);
    float *b = qt_rnd((size_t)T * 32, 4.0f), *a = qt_rnd((size_t)T * 32, 4.0f), *dtb = qt_rnd(32, 1.0f), *na = qt_rnd(32, 1.0f);
    float *db = up_f(b, (size_t)T * 32), *da = up_f(a, (size_t)T * 32), *ddtb = up_f(dtb, 32), *dna = up_f(na, 32);
    ref.ops->gdn_gates(&ref, b, a, dtb, na, T, 32);
    gpu.ops->gdn_gates(&gpu, db, da, ddtb, dna, T, 32);
    report("gdn_gates beta", "5 x 32", cmp(db, b, (size_t)T * 32), 1e-6);
    report("gdn_gates g", "5 x 32", cmp(da, a, (size_t)T * 32), 1e-6);
    float *sg = qt_rnd(T, 3.0f), *dsg = up_f(sg, T);
    ref.ops->sigmoid_scale_add(&ref, u, g, sg, T, 512);
    gpu.ops->sigmoid_scale_add(&gpu, du, dg, dsg, T, 512);
    report("sigmoid_scale_add", "5 x 512", cmp(du, u, (size_t)T * 512), 1e-6);
    free(he), free(y), free(x), free(w), free(q), free(inv), free(g), free(u), free(b), free(a), free(dtb), free(na), free(sg);
    void *d[] = {(void *)de.data, dy, dx, dw, dq, dinv, dg, du, db, da, ddtb, dna, dsg};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

static void test_conv_gdn(int T) {
    int C = 8192, K = 4, nk = 16, nv = 32, dk = 128, dv = 128, qk = nk * dk;
    float *x = qt_rnd((size_t)T * C, 1.0f), *w = qt_rnd((size_t)C * K, 0.5f), *st = qt_rnd((size_t)(K - 1) * C, 1.0f), *y = malloc((size_t)T * C * 4);
    float *dx = up_f(x, (size_t)T * C), *dw = up_f(w, (size_t)C * K), *dst = up_f(st, (size_t)(K - 1) * C), *dy = gpu.ops->alloc(&gpu, (size_t)T * C * 4);
    ref.ops->conv_silu(&ref, x, C, T, C, K, w, st, y);
    gpu.ops->conv_silu(&gpu, dx, C, T, C, K, dw, dst, dy);
    char s[64];
    snprintf(s, sizeof s, "%d tokens x 8192 channels, K 4", T);
    report("conv_silu", s, cmp(dy, y, (size_t)T * C), 1e-5);
    report("conv_silu state", s, cmp(dst, st, (size_t)(K - 1) * C), 1e-6);
    float *beta = malloc((size_t)T * nv * 4), *g = malloc((size_t)T * nv * 4), *S = qt_rnd((size_t)nv * dk * dv, 0.1f), *o = malloc((size_t)T * nv * dv * 4);
    for (int i = 0; i < T * nv; i++) beta[i] = 0.5f + 0.4f * qt_frand(), g[i] = -0.3f + 0.25f * qt_frand();
    float *dbeta = up_f(beta, (size_t)T * nv), *dg = up_f(g, (size_t)T * nv), *dS = up_f(S, (size_t)nv * dk * dv), *dout = gpu.ops->alloc(&gpu, (size_t)T * nv * dv * 4);
    qf_gdn_args a = {y, y + qk, y + 2 * qk, C, beta, g, S, o, T, nk, nv, dk, dv};
    ref.ops->gdn(&ref, &a);
    qf_gdn_args b = {dy, dy + qk, dy + 2 * qk, C, dbeta, dg, dS, dout, T, nk, nv, dk, dv};
    gpu.ops->gdn(&gpu, &b);
    snprintf(s, sizeof s, "%d tokens, 16/32 heads of 128", T);
    report("gdn out", s, cmp(dout, o, (size_t)T * nv * dv), 1e-4);
    report("gdn state", s, cmp(dS, S, (size_t)nv * dk * dv), 1e-4);
    if (T == 256 || T == 600) { /* a prefill chunk's recurrence (the state keeps advancing: timing only) */
        int reps = 20;
        qf_be_sync(&gpu);
        double t0 = qf_now();
        for (int i = 0; i < reps; i++) gpu.ops->gdn(&gpu, &b);
        qf_be_sync(&gpu);
        fprintf(stderr, "  gdn %d tokens, 16/32 heads of 128: %.1f us per call\n", T, (qf_now() - t0) / reps * 1e6);
    }
    free(x), free(w), free(st), free(y), free(beta), free(g), free(S), free(o);
    void *d[] = {dx, dw, dst, dy, dbeta, dg, dS, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* Paged cache with scrambled pages; the new keys written by kv_store on both sides. */
/* The attention op for T queries at pos0 with nh/nkv heads of hd against the CPU reference; from
 * 8 queries the tiled kernel takes it (attn_tile_cuda.cu) unless option att_tile=0. bench:
 * the time per call (20 calls) and the rate in fp32 multiply-adds (q.k and p.v over the causal keys). */
static void test_attention_shape(int T, int pos0, int nh, int nkv, int hd, int check, int bench) {
    int pt = 16, ctx = pos0 + T, np = (ctx + pt - 1) / pt + 3, qs = nh * 2 * hd;
    size_t layer = (size_t)pt * nkv * hd, stride = 2 * layer;
    float *pool = qt_rnd((size_t)np * stride, 1.0f), *q = qt_rnd((size_t)T * qs, 1.0f), *k = qt_rnd((size_t)T * nkv * hd, 1.0f), *v = qt_rnd((size_t)T * nkv * hd, 1.0f);
    int32_t *pages = malloc((size_t)np * 4);
    for (int i = 0; i < np; i++) pages[i] = (i * 7 + 3) % np;
    float *dpool = up_f(pool, (size_t)np * stride), *dq = up_f(q, (size_t)T * qs), *dk = up_f(k, (size_t)T * nkv * hd), *dv = up_f(v, (size_t)T * nkv * hd);
    int32_t *dpages = up(pages, (size_t)np * 4);
    float *o = malloc((size_t)T * nh * hd * 4), *dout = gpu.ops->alloc(&gpu, (size_t)T * nh * hd * 4), scale = 1.0f / sqrtf((float)hd);
    qf_attn_args a = {q, qs, 2 * hd, {pool, pages, pt, stride, 0, layer, 0}, o, T, pos0, nh, nkv, hd, scale, NULL, 0};
    ref.ops->kv_store(&ref, &a.kv, k, v, T, pos0, nkv, hd);
    if (check) ref.ops->attention(&ref, &a); /* the plain reference takes seconds at thousands of keys */
    qf_attn_args b = {dq, qs, 2 * hd, {dpool, dpages, pt, stride, 0, layer, 0}, dout, T, pos0, nh, nkv, hd, scale, NULL, 0};
    gpu.ops->kv_store(&gpu, &b.kv, dk, dv, T, pos0, nkv, hd);
    gpu.ops->attention(&gpu, &b);
    char s[80];
    snprintf(s, sizeof s, "%d queries at %d, %d/%d heads of %d", T, pos0, nh, nkv, hd);
    report("kv_store", s, cmp(dpool, pool, (size_t)np * stride), 1e-7);
    /* from 8 queries the tiles' products run on the tensor cores unless switched off: operands kept
     * to ~16 bits (bf16 hi + lo parts), the tolerance of the prompt's other such products */
    int parts = T >= 8 && hd % 16 == 0 && g_opts.att_tile && g_opts.att_tc;
    if (check) report("attention (paged)", s, cmp(dout, o, (size_t)T * nh * hd), parts ? 1e-4 : 1e-5);
    if (bench) {
        int reps = 20;
        qf_be_sync(&gpu);
        double t0 = qf_now();
        for (int i = 0; i < reps; i++) gpu.ops->attention(&gpu, &b);
        qf_be_sync(&gpu);
        double dt = (qf_now() - t0) / reps, fma = 2.0 * nh * hd * ((double)T * pos0 + (double)T * (T + 1) / 2);
        fprintf(stderr, "  attention %s: %.1f us per call, %.2f T fp32 FMA/s\n", s, dt * 1e6, fma / dt / 1e12);
    }
    free(pool), free(q), free(k), free(v), free(pages), free(o);
    void *d[] = {dpool, dq, dk, dv, dpages, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

static void test_attention(int T, int pos0) { test_attention_shape(T, pos0, 16, 2, 256, 1, 0); }

/* The prompt attention's shapes: the release's (16/2 heads of 256) at a first 256-query chunk,
 * 16 queries past 4000 keys, a partial tile; the bundled model's and the fixtures' head layouts, a
 * group of 3; timed at the first and the last 256-query chunk of an 8K prompt. */
static void prefill_attention_checks(void) {
    test_attention_shape(256, 0, 16, 2, 256, 1, 1);
    test_attention_shape(16, 4000, 16, 2, 256, 1, 0);
    test_attention_shape(37, 300, 16, 2, 256, 1, 0);
    test_attention_shape(100, 20, 4, 2, 64, 1, 0);
    test_attention_shape(64, 5, 4, 1, 32, 1, 0);
    test_attention_shape(50, 70, 12, 4, 128, 1, 0);
    test_attention_shape(256, 7936, 16, 2, 256, 0, 1);
}

/* E random bf16 experts (gate, up: I x H; down: H x I), as host views and device copies. */
typedef struct test_experts {
    void *hgu, *hd;
    char *dgu, *ddn;
    qf_expert *host, *dev;
    const void *const *tab; /* [3][E] the device pointers, as an expert store keeps them */
} test_experts;

static int moe_fmt = QF_DT_BF16; /* the experts' format in the MoE tests */

/* A random weight in fmt: the host view (owned: *host, and *sc for fp8's scales) and its packed
 * device copy. */
static qf_mat q_mat(int fmt, int64_t rows, int64_t cols, void **host, float **sc, qf_mat *dev) {
    float *w = qt_rnd((size_t)(rows * cols), 1.0f);
    qf_mat m = {fmt, NULL, rows, cols, NULL};
    uint8_t *q = malloc(qf_mat_bytes(&m));
    *sc = NULL;
    if (fmt == QF_Q_FP8B128) {
        int64_t bc = (cols + 127) / 128;
        float *s = calloc((size_t)((rows + 127) / 128 * bc), sizeof *s);
        for (int64_t i = 0; i < rows * cols; i++) s[i / cols / 128 * bc + i % cols / 128] = fmaxf(s[i / cols / 128 * bc + i % cols / 128], fabsf(w[i]) / 448.0f);
        for (int64_t i = 0; i < rows * cols; i++) q[i] = qf_f32_to_fp8(w[i] / s[i / cols / 128 * bc + i % cols / 128]);
        *sc = s;
    } else {
        for (int64_t r = 0; r < rows; r++) qf_q_quantize_row(fmt, w + r * cols, cols, q + (size_t)r * qf_q_row_bytes(fmt, cols));
    }
    free(w);
    m.data = q, m.scales = *sc, *host = q;
    *dev = qf_es_put_mat(&gpu, gpu.ops->alloc(&gpu, qf_mat_packed_bytes(&m)), &m);
    return m;
}

/* The product of a quantised weight against qf_q_matmul_ref (the generic kernel, any n). */
static void test_matmul_q(int fmt, int64_t rows, int64_t cols, int n) {
    void *hq;
    float *sc;
    qf_mat d, w = q_mat(fmt, rows, cols, &hq, &sc, &d);
    float *x = qt_rnd((size_t)n * cols, 1.0f), *want = malloc((size_t)n * rows * 4), *dx = up_f(x, (size_t)n * cols), *dy = gpu.ops->alloc(&gpu, (size_t)n * rows * 4);
    qf_q_matmul_ref(fmt, w.data, sc, rows, cols, x, n, want);
    gpu.ops->matmul(&gpu, &d, dx, n, dy);
    char s[80];
    snprintf(s, sizeof s, "%s %lld x %lld, n=%d", qf_qfmt_name(fmt), (long long)rows, (long long)cols, n);
    report("matmul (quantised)", s, cmp(dy, want, (size_t)n * rows), 1e-5);
    free(hq), free(sc), free(x), free(want);
    gpu.ops->free(&gpu, (void *)d.data), gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dy);
}

/* The device table of x's experts: gate[E] | up[E] | down[E]. */
static void table_experts(test_experts *x, int E) {
    const void **h = malloc(3 * (size_t)E * sizeof *h);
    for (int e = 0; e < E; e++) h[e] = x->dev[e].gate.data, h[E + e] = x->dev[e].up.data, h[2 * E + e] = x->dev[e].down.data;
    void *d = gpu.ops->alloc(&gpu, 3 * (size_t)E * sizeof *h);
    gpu.ops->upload(&gpu, d, h, 3 * (size_t)E * sizeof *h);
    x->tab = d;
    free(h);
}

static test_experts expert_views(int E, int I, int H) {
    test_experts x;
    if (moe_fmt != QF_DT_BF16) { /* each matrix its own host block and device copy */
        x.hgu = x.hd = NULL, x.dgu = x.ddn = NULL;
        x.host = malloc((size_t)E * sizeof *x.host), x.dev = malloc((size_t)E * sizeof *x.dev);
        for (int e = 0; e < E; e++) {
            qf_mat *hm[3] = {&x.host[e].gate, &x.host[e].up, &x.host[e].down}, *dm[3] = {&x.dev[e].gate, &x.dev[e].up, &x.dev[e].down};
            for (int i = 0; i < 3; i++) {
                void *h;
                float *sc;
                *hm[i] = q_mat(moe_fmt, i < 2 ? I : H, i < 2 ? H : I, &h, &sc, dm[i]);
            }
        }
        return x;
    }
    bf16_mat((int64_t)E * 2 * I, H, &x.hgu), bf16_mat((int64_t)E * H, I, &x.hd);
    x.host = malloc((size_t)E * sizeof *x.host), x.dev = malloc((size_t)E * sizeof *x.dev);
    x.dgu = up(x.hgu, (size_t)E * 2 * I * H * 2), x.ddn = up(x.hd, (size_t)E * H * I * 2);
    for (int e = 0; e < E; e++) {
        size_t og = (size_t)e * 2 * I * H * 2, ou = og + (size_t)I * H * 2, od = (size_t)e * H * I * 2;
        x.host[e] = (qf_expert){{QF_DT_BF16, (char *)x.hgu + og, I, H, NULL}, {QF_DT_BF16, (char *)x.hgu + ou, I, H, NULL}, {QF_DT_BF16, (char *)x.hd + od, H, I, NULL}};
        x.dev[e] = (qf_expert){{QF_DT_BF16, x.dgu + og, I, H, NULL}, {QF_DT_BF16, x.dgu + ou, I, H, NULL}, {QF_DT_BF16, x.ddn + od, H, I, NULL}};
    }
    return x;
}

static test_experts make_experts(int E, int I, int H) {
    test_experts x = expert_views(E, I, H);
    table_experts(&x, E);
    return x;
}

static void free_experts(test_experts *x, int E) {
    gpu.ops->free(&gpu, (void *)x->tab);
    for (int e = 0; !x->hgu && e < E; e++) {
        const qf_mat *hm[3] = {&x->host[e].gate, &x->host[e].up, &x->host[e].down}, *dm[3] = {&x->dev[e].gate, &x->dev[e].up, &x->dev[e].down};
        for (int i = 0; i < 3; i++) free((void *)hm[i]->data), free((void *)hm[i]->scales), gpu.ops->free(&gpu, (void *)dm[i]->data);
    }
    free(x->hgu), free(x->hd), free(x->host), free(x->dev);
    gpu.ops->free(&gpu, x->dgu), gpu.ops->free(&gpu, x->ddn);
}

/* acc += sum_k w[k] * down(silu(gate x) * up x) over the chosen experts, with the reference ops;
 * g, u, h: I floats of scratch, y: H. */
static void ref_experts(const qf_expert *ex, const int *ti, const float *w, int K, const float *x, int I, int H, float *g, float *u, float *h,
                        float *y, float *acc) {
    for (int k = 0; k < K; k++) {
        ref.ops->matmul(&ref, &ex[ti[k]].gate, x, 1, g);
        ref.ops->matmul(&ref, &ex[ti[k]].up, x, 1, u);
        ref.ops->swiglu(&ref, g, u, I, 1, I, h);
        ref.ops->matmul(&ref, &ex[ti[k]].down, h, 1, y);
        ref.ops->axpy(&ref, acc, y, w[k], H);
    }
}

/* The device MoE op (N rows, E experts top-K, hidden H, expert width I) against routing + expert
 * MLPs done with the reference ops; from 96 rows (option mg_min) it groups the rows by expert
 * (moe_grouped) unless option mg=0. bench: the time per call (200 calls); check 0: timing alone (the reference
 * takes ~20 ms a row at the real shape). */
static void test_moe_shape(int N, int E, int K, int H, int I, int check, int bench) {
    test_experts ex = make_experts(E, I, H);
    qf_expert *host = ex.host, *dev = ex.dev;
    float *rl = qt_rnd((size_t)N * E, 2.0f), *x = qt_rnd((size_t)N * H, 1.0f), *want = calloc((size_t)N * H, 4);
    float *gb = malloc((size_t)I * 4), *ub = malloc((size_t)I * 4), *hb = malloc((size_t)I * 4), *yb = malloc((size_t)H * 4);
    for (int r = 0; check && r < N; r++) {
        float w[64];
        int ti[64];
        qf_ref_route(rl + (size_t)r * E, E, K, ti, w);
        ref_experts(host, ti, w, K, x + (size_t)r * H, I, H, gb, ub, hb, yb, want + (size_t)r * H);
    }
    float *drl = up_f(rl, (size_t)N * E), *dx = up_f(x, (size_t)N * H), *dout = gpu.ops->alloc(&gpu, (size_t)N * H * 4);
    qf_moe_args a = {dev, E, K, N, H, I, drl, dx, dout, ex.tab, NULL, 0, NULL};
    gpu.ops->moe(&gpu, &a);
    char s[80];
    snprintf(s, sizeof s, "%d rows, %d experts top-%d, %d/%d, %s", N, E, K, H, I, qf_dtype_name(moe_fmt));
    if (check) report("moe (route+experts)", s, cmp(dout, want, (size_t)N * H), 1e-4);
    if (check) { /* twice on one backend: the grouping's scratch and counts start over each call */
        gpu.ops->moe(&gpu, &a);
        report("moe again", s, cmp(dout, want, (size_t)N * H), 1e-4);
    }
    if (bench) { /* K experts x 3 matrices of I x H bf16 per row, and the distinct experts' bytes */
        int reps = 200, used = 0;
        char *seen = calloc((size_t)E, 1);
        for (int r = 0; r < N; r++) {
            float w[64];
            int ti[64];
            qf_ref_route(rl + (size_t)r * E, E, K, ti, w);
            for (int k = 0; k < K; k++) used += !seen[ti[k]], seen[ti[k]] = 1;
        }
        free(seen);
        qf_be_sync(&gpu);
        double t0 = qf_now();
        for (int i = 0; i < reps; i++) gpu.ops->moe(&gpu, &a);
        qf_be_sync(&gpu);
        double per = (double)(qf_mat_bytes(&host[0].gate) + qf_mat_bytes(&host[0].up) + qf_mat_bytes(&host[0].down));
        double dt = (qf_now() - t0) / reps, bytes = (double)N * K * per, once = (double)used * per;
        fprintf(stderr, "  moe N=%d: %.1f us per call, %.0f GB/s of expert weights per row (%.0f%% of 4300 GB/s copy); %d experts used, "
                "%.0f GB/s of their bytes read once (%.0f%%)\n", N, dt * 1e6, bytes / dt / 1e9, 100 * bytes / dt / 4.3e12, used,
                once / dt / 1e9, 100 * once / dt / 4.3e12);
    }
    free_experts(&ex, E);
    free(rl), free(x), free(want), free(gb), free(ub), free(hb), free(yb);
    void *d[] = {drl, dx, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* ---- the fused decode ops (ops.h qf_dec_ops), each against the chain of reference ops it
 * replaces, n rows = n sequences of one token ---- */

static float *copy_f(const float *x, size_t n) {
    float *y = malloc(n * sizeof *y);
    memcpy(y, x, n * sizeof *y);
    return y;
}

/* pre kinds on a [rows x cols] product; heads of `head` (GATED_NORM, SIGMOID); acc: y += */
/* Trunk sparsity in test_dec_matmul / test_dec_gdn_proj: the share of each row's pre(x) entries
 * its threshold zeroes (the last of several rows keeps all), through matmul_sparse (0: off). */
static float sparse_share;

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Each row's threshold at sparse_share of its |entries|, and xp masked by it. */
static void sparse_mask(float *xp, int n, int64_t cols, float *thr) {
    float *v = malloc((size_t)cols * 4);
    for (int t = 0; t < n; t++) {
        for (int64_t i = 0; i < cols; i++) v[i] = fabsf(xp[t * cols + i]);
        qsort(v, (size_t)cols, 4, cmp_f);
        /* midway across the widest gap near the share: rounding cannot move an entry across it */
        int64_t k = (int64_t)(sparse_share * (float)cols), best = k;
        for (int64_t j = k - 16 > 1 ? k - 16 : 1; j < k + 16 && j < cols; j++)
            if (v[j] - v[j - 1] > v[best] - v[best - 1]) best = j;
        thr[t] = n > 1 && t == n - 1 ? 0.0f : 0.5f * (v[best] + v[best - 1]);
        for (int64_t i = 0; i < cols; i++)
            if (fabsf(xp[t * cols + i]) < thr[t]) xp[t * cols + i] = 0.0f;
    }
    free(v);
}

/* W^T of bf16 W [rows][cols] in device memory. */
static qf_mat up_transposed(const void *hw, int64_t rows, int64_t cols) {
    uint16_t *t = malloc((size_t)(rows * cols) * 2);
    const uint16_t *w = hw;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) t[c * rows + r] = w[r * cols + c];
    qf_mat m = {QF_DT_BF16, up(t, (size_t)(rows * cols) * 2), cols, rows, NULL};
    free(t);
    return m;
}

/* A decode product's tolerance: the GEMV kernels' fp32 sums, or from option dec_tc rows the
 * tensor cores' with activations as two bf16 parts (~16 bits of each, as the prompt products). */
static double dec_tol(int n) { return n > 1 && n >= g_opts.dec_tc && !sparse_share ? 5e-5 : 1e-5; }

static void test_dec_matmul(int kind, int64_t rows, int64_t cols, int head, int n, int acc) {
    void *hw;
    qf_mat w = trunk_mat(rows, cols, &hw);
    int nh = (int)(cols / head), gs = kind == QF_PRE_SIGMOID ? 2 * (int)cols : (int)cols, ghs = kind == QF_PRE_SIGMOID ? 2 * head : head;
    float *x = qt_rnd((size_t)n * cols, 2.0f), *nw = qt_rnd((size_t)cols, 1.0f), *g = qt_rnd((size_t)n * gs, 3.0f);
    float *y0 = qt_rnd((size_t)n * rows, 1.0f), *want = copy_f(y0, (size_t)n * rows), *xp = copy_f(x, (size_t)n * cols);
    float *tmp = malloc((size_t)n * rows * 4);
    if (kind == QF_PRE_RMSNORM) ref.ops->rmsnorm(&ref, x, (int)cols, nw, n, (int)cols, 1e-6f, xp, (int)cols);
    for (int t = 0; t < n && kind == QF_PRE_GATED_NORM; t++) { /* rmsnorm per head, then silu(g) * that */
        ref.ops->rmsnorm(&ref, x + t * cols, head, nw, nh, head, 1e-6f, xp + t * cols, head);
        ref.ops->swiglu(&ref, g + (size_t)t * gs, xp + t * cols, head, nh, head, xp + t * cols);
    }
    for (int t = 0; t < n && kind == QF_PRE_SIGMOID; t++) ref.ops->sigmoid_mul(&ref, xp + t * cols, head, g + (size_t)t * gs + head, ghs, nh, head);
    float thr[QF_DEC_ROWS];
    if (sparse_share > 0) sparse_mask(xp, n, cols, thr);
    ref.ops->matmul(&ref, &w, xp, n, tmp);
    for (size_t i = 0; i < (size_t)n * rows; i++) want[i] = acc ? want[i] + tmp[i] : tmp[i];
    qf_mat dw = w;
    dw.data = up(hw, qf_mat_bytes(&w));
    float *dx = up_f(x, (size_t)n * cols), *dnw = up_f(nw, (size_t)cols), *dg = up_f(g, (size_t)n * gs), *dy = up_f(y0, (size_t)n * rows);
    qf_pre pre = {kind, dnw, kind == QF_PRE_SIGMOID ? dg + head : dg, gs, ghs, head, 1e-6f};
    qf_mat wt = sparse_share > 0 ? up_transposed(hw, rows, cols) : dw;
    if (sparse_share > 0) gpu.ops->dec->matmul_sparse(&gpu, &wt, dx, n, &pre, NULL, acc, thr, dy);
    else gpu.ops->dec->matmul(&gpu, &dw, dx, n, &pre, NULL, acc, dy);
    const char *names[] = {"none", "rmsnorm", "gated norm", "sigmoid gate"};
    char s[96];
    snprintf(s, sizeof s, "%s [%lld x %lld] n=%d%s", names[kind], (long long)rows, (long long)cols, n, acc ? " +=" : "");
    report(sparse_share > 0 ? "dec matmul sparse" : trunk_fmt == QF_DT_BF16 ? "dec matmul" : "dec matmul int8", s, cmp(dy, want, (size_t)n * rows), dec_tol(n));
    if (sparse_share > 0) gpu.ops->free(&gpu, (void *)wt.data);
    free(hw), free(x), free(nw), free(g), free(y0), free(want), free(xp), free(tmp);
    void *d[] = {(void *)dw.data, dx, dnw, dg, dy};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* The DeltaNet in_proj with its epilogue: conv with each row's state, z, beta, decay gate. */
static void test_dec_gdn_proj(int n) {
    int H = 2048, cd = 8192, nv = 32, zd = nv * 128, K = 4, rows = cd + zd + 2 * nv;
    void *hw;
    qf_mat w = trunk_mat(rows, H, &hw);
    float *x = qt_rnd((size_t)n * H, 2.0f), *nw = qt_rnd(H, 1.0f), *cw = qt_rnd((size_t)cd * K, 0.5f), *dtb = qt_rnd(nv, 1.0f), *na = qt_rnd(nv, 1.0f);
    float *st = qt_rnd((size_t)n * (K - 1) * cd, 1.0f), *want_st = copy_f(st, (size_t)n * (K - 1) * cd);
    float *xn = malloc((size_t)n * H * 4), *mixed = malloc((size_t)n * rows * 4), *want = malloc((size_t)n * rows * 4);
    ref.ops->rmsnorm(&ref, x, H, nw, n, H, 1e-6f, xn, H);
    float thr[QF_DEC_ROWS];
    if (sparse_share > 0) sparse_mask(xn, n, H, thr);
    ref.ops->matmul(&ref, &w, xn, n, mixed);
    for (int t = 0; t < n; t++) {
        float *m = mixed + (size_t)t * rows, *o = want + (size_t)t * rows;
        ref.ops->conv_silu(&ref, m, cd, 1, cd, K, cw, want_st + (size_t)t * (K - 1) * cd, o);
        memcpy(o + cd, m + cd, (size_t)(zd + 2 * nv) * 4);
        ref.ops->gdn_gates(&ref, o + cd + zd, o + cd + zd + nv, dtb, na, 1, nv);
    }
    qf_mat dw = w;
    dw.data = up(hw, qf_mat_bytes(&w));
    float *dx = up_f(x, (size_t)n * H), *dnw = up_f(nw, H), *dcw = up_f(cw, (size_t)cd * K), *ddtb = up_f(dtb, nv), *dna = up_f(na, nv);
    float *dst = up_f(st, (size_t)n * (K - 1) * cd), *dy = gpu.ops->alloc(&gpu, (size_t)n * rows * 4);
    qf_pre pre = {QF_PRE_RMSNORM, dnw, NULL, 0, 0, 0, 1e-6f};
    qf_gdn_epi e = {cd, zd, nv, K, dcw, ddtb, dna, {0}};
    for (int t = 0; t < n; t++) e.conv_state[t] = dst + (size_t)t * (K - 1) * cd;
    qf_mat wt = sparse_share > 0 ? up_transposed(hw, rows, H) : dw;
    if (sparse_share > 0) gpu.ops->dec->matmul_sparse(&gpu, &wt, dx, n, &pre, &e, 0, thr, dy), gpu.ops->free(&gpu, (void *)wt.data);
    else gpu.ops->dec->matmul(&gpu, &dw, dx, n, &pre, &e, 0, dy);
    char s[64];
    snprintf(s, sizeof s, "[%d x 2048] n=%d%s%s", rows, n, sparse_share > 0 ? " sparse" : "", trunk_fmt == QF_DT_BF16 ? "" : " int8");
    report("dec in_proj+conv", s, cmp(dy, want, (size_t)n * rows), dec_tol(n));
    report("dec conv states", s, cmp(dst, want_st, (size_t)n * (K - 1) * cd), dec_tol(n)); /* raw products, as the matmul tolerance */
    free(hw), free(x), free(nw), free(cw), free(dtb), free(na), free(st), free(want_st), free(xn), free(mixed), free(want);
    void *d[] = {(void *)dw.data, dx, dnw, dcw, ddtb, dna, dst, dy};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* n rows of a DeltaNet in_proj's output, stride floats each: random, with each row's beta (at
 * gates) in (0, 1) and decay g (at gates + nv) below 0, as its epilogue makes them. */
static float *gdn_mixed_rnd(int n, int stride, int gates, int nv) {
    float *mixed = qt_rnd((size_t)n * stride, 1.0f);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nv; h++) {
            float *r = mixed + (size_t)t * stride + gates;
            r[h] = 0.5f + 0.4f * qt_frand(), r[nv + h] = -0.3f + 0.25f * qt_frand();
        }
    return mixed;
}

static void test_dec_gdn(int n, int nk, int nv, int dk, int dv) {
    int qk = nk * dk, cd = 2 * qk + nv * dv, stride = cd + nv * dv + 2 * nv + 5; /* a stride wider than the row, as in_proj's */
    float *mixed = gdn_mixed_rnd(n, stride, cd + nv * dv, nv), *S = qt_rnd((size_t)n * nv * dk * dv, 0.1f), *out = malloc((size_t)n * nv * dv * 4);
    float *dm = up_f(mixed, (size_t)n * stride), *dS = up_f(S, (size_t)n * nv * dk * dv), *dout = gpu.ops->alloc(&gpu, (size_t)n * nv * dv * 4);
    for (int t = 0; t < n; t++) {
        const float *r = mixed + (size_t)t * stride;
        qf_gdn_args a = {r, r + qk, r + 2 * qk, stride, r + cd + nv * dv, r + cd + nv * dv + nv, S + (size_t)t * nv * dk * dv, out + (size_t)t * nv * dv, 1, nk, nv, dk, dv};
        ref.ops->gdn(&ref, &a);
    }
    qf_gdn_dec g = {dm, stride, n, nk, nv, dk, dv, {0}, dout, 0};
    for (int t = 0; t < n; t++) g.S[t] = dS + (size_t)t * nv * dk * dv;
    gpu.ops->dec->gdn(&gpu, &g);
    char s[64];
    snprintf(s, sizeof s, "n=%d, %d/%d heads of %d/%d", n, nk, nv, dk, dv);
    report("dec gdn out", s, cmp(dout, out, (size_t)n * nv * dv), 1e-4);
    report("dec gdn state", s, cmp(dS, S, (size_t)n * nv * dk * dv), 1e-4);
    free(mixed), free(S), free(out);
    gpu.ops->free(&gpu, dm), gpu.ops->free(&gpu, dS), gpu.ops->free(&gpu, dout);
}

/* A device array of n floats, downloaded into a new host array. */
static float *down_f(const float *d, size_t n) {
    float *h = malloc(n * sizeof *h);
    gpu.ops->download(&gpu, h, d, n * sizeof *h);
    return h;
}

/* The product of a random bf16 [H x cols] with pre(x_pre) (n rows) and with x_plain (no pre) must
 * be the same bits: a fused op that applied the pre itself (op's output x_plain) left the
 * product's input as it was. */
static void check_same_product(const char *op, const char *s, int H, int cols, int n, const float *x_pre, const qf_pre *pre, const float *x_plain) {
    void *hw;
    qf_mat w = bf16_mat(H, cols, &hw);
    w.data = up(hw, (size_t)H * cols * 2);
    float *y1 = gpu.ops->alloc(&gpu, (size_t)n * H * 4), *y2 = gpu.ops->alloc(&gpu, (size_t)n * H * 4);
    gpu.ops->dec->matmul(&gpu, &w, x_pre, n, pre, NULL, 0, y1);
    gpu.ops->dec->matmul(&gpu, &w, x_plain, n, NULL, NULL, 0, y2);
    float *h1 = down_f(y1, (size_t)n * H), *h2 = down_f(y2, (size_t)n * H);
    int same = memcmp(h1, h2, (size_t)n * H * 4) == 0;
    CHECK(same, "%s %s: the product of its output differs from the product with the pre", op, s);
    fprintf(stderr, "  %-18s %-40s %s\n", op, s, same ? "bit for bit" : "DIFFERS");
    free(hw), free(h1), free(h2);
    gpu.ops->free(&gpu, (void *)w.data), gpu.ops->free(&gpu, y1), gpu.ops->free(&gpu, y2);
}

/* gdn_gn (the step with out_proj's gated norm applied to its output; option gdn_gn=1): the normed
 * output and state against the CPU, and out_proj's product from it (no pre) bit for bit against the
 * product with the gated pre from the plain step's output. */
static void test_dec_gdn_gn(int nk, int nv, int dk, int dv) {
    int qk = nk * dk, cd = 2 * qk + nv * dv, stride = cd + nv * dv + 2 * nv + 5, H = 2048;
    float *mixed = gdn_mixed_rnd(1, stride, cd + nv * dv, nv), *S = qt_rnd((size_t)nv * dk * dv, 0.1f), *out = malloc((size_t)nv * dv * 4), *gw = qt_rnd(dv, 1.0f);
    float *dm = up_f(mixed, (size_t)stride), *dS = up_f(S, (size_t)nv * dk * dv), *dS2 = up_f(S, (size_t)nv * dk * dv), *dw = up_f(gw, dv);
    float *dout = gpu.ops->alloc(&gpu, (size_t)nv * dv * 4), *dout2 = gpu.ops->alloc(&gpu, (size_t)nv * dv * 4);
    qf_gdn_args a = {mixed, mixed + qk, mixed + 2 * qk, stride, mixed + cd + nv * dv, mixed + cd + nv * dv + nv, S, out, 1, nk, nv, dk, dv};
    ref.ops->gdn(&ref, &a);
    /* the gated norm, as out_proj's pre (and test_dec_matmul's reference): rmsnorm per head, then silu(z) * that */
    ref.ops->rmsnorm(&ref, out, dv, gw, nv, dv, 1e-6f, out, dv);
    ref.ops->swiglu(&ref, mixed + cd, out, dv, nv, dv, out);
    qf_gdn_dec g = {dm, stride, 1, nk, nv, dk, dv, {dS}, dout, 0}, g2 = g;
    g2.S[0] = dS2, g2.out = dout2;
    qf_pre gn = {QF_PRE_GATED_NORM, dw, dm + cd, stride, dv, dv, 1e-6f};
    int done = gpu.ops->dec->gdn_gn && gpu.ops->dec->gdn_gn(&gpu, &g, &gn);
    CHECK(done, "gdn_gn did not take %d/%d heads of %d/%d", nk, nv, dk, dv);
    char s[64];
    snprintf(s, sizeof s, "%d/%d heads of %d/%d", nk, nv, dk, dv);
    report("dec gdn_gn out", s, cmp(dout, out, (size_t)nv * dv), 1e-4);
    report("dec gdn_gn state", s, cmp(dS, S, (size_t)nv * dk * dv), 1e-4);
    gpu.ops->dec->gdn(&gpu, &g2);
    check_same_product("dec gdn_gn+out", s, H, nv * dv, 1, dout2, &gn, dout);
    free(mixed), free(S), free(out), free(gw);
    void *d[] = {dm, dS, dS2, dw, dout, dout2};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* A chain (a verify's rows: one sequence's n consecutive tokens, one state): gdn and gdn_gn step
 * the rows in order (gdn_gn in one launch), against the CPU's steps one after another; and each
 * row's output bit for bit the one-row launches' on a copy of the state. */
static void test_dec_gdn_chain(int n, int nk, int nv, int dk, int dv) {
    int qk = nk * dk, cd = 2 * qk + nv * dv, stride = cd + nv * dv + 2 * nv + 5, sz = nv * dk * dv;
    float *mixed = gdn_mixed_rnd(n, stride, cd + nv * dv, nv), *S = qt_rnd((size_t)sz, 0.1f), *out = malloc((size_t)n * nv * dv * 4), *gw = qt_rnd(dv, 1.0f);
    float *dm = up_f(mixed, (size_t)n * stride), *dS = up_f(S, sz), *dS1 = up_f(S, sz), *dw = up_f(gw, dv);
    float *dout = gpu.ops->alloc(&gpu, (size_t)n * nv * dv * 4), *dout1 = gpu.ops->alloc(&gpu, (size_t)n * nv * dv * 4);
    for (int t = 0; t < n; t++) {
        float *r = mixed + (size_t)t * stride, *o = out + (size_t)t * nv * dv;
        qf_gdn_args a = {r, r + qk, r + 2 * qk, stride, r + cd + nv * dv, r + cd + nv * dv + nv, S, o, 1, nk, nv, dk, dv};
        ref.ops->gdn(&ref, &a);
        ref.ops->rmsnorm(&ref, o, dv, gw, nv, dv, 1e-6f, o, dv);
        ref.ops->swiglu(&ref, r + cd, o, dv, nv, dv, o);
    }
    qf_gdn_dec g = {dm, stride, n, nk, nv, dk, dv, {0}, dout, 1};
    for (int t = 0; t < n; t++) g.S[t] = dS;
    qf_pre gn = {QF_PRE_GATED_NORM, dw, dm + cd, stride, dv, dv, 1e-6f};
    int done = gpu.ops->dec->gdn_gn && gpu.ops->dec->gdn_gn(&gpu, &g, &gn);
    CHECK(done, "gdn_gn did not take a chain of %d", n);
    char s[64];
    snprintf(s, sizeof s, "chain of %d, %d/%d heads of %d/%d", n, nk, nv, dk, dv);
    report("dec gdn_gn chain", s, cmp(dout, out, (size_t)n * nv * dv), 1e-4);
    report("dec gdn_gn chain state", s, cmp(dS, S, (size_t)sz), 1e-4);
    for (int t = 0; t < n; t++) { /* the rows one launch each */
        qf_gdn_dec r = {dm + (size_t)t * stride, stride, 1, nk, nv, dk, dv, {dS1}, dout1 + (size_t)t * nv * dv, 0};
        qf_pre rn = gn;
        rn.g = gn.g + (size_t)t * stride;
        gpu.ops->dec->gdn_gn(&gpu, &r, &rn);
    }
    float *a1 = malloc((size_t)n * nv * dv * 4), *a2 = malloc((size_t)n * nv * dv * 4);
    gpu.ops->download(&gpu, a1, dout, (size_t)n * nv * dv * 4), gpu.ops->download(&gpu, a2, dout1, (size_t)n * nv * dv * 4);
    CHECK(!memcmp(a1, a2, (size_t)n * nv * dv * 4), "%s: the chain's outputs are not the one-row launches' bits", s);
    free(a1), free(a2), free(mixed), free(S), free(out), free(gw);
    void *d[] = {dm, dS, dS1, dw, dout, dout1};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* attn_gate (option att_gate) on the inputs of a (the kv pool holds the new keys already:
 * they are written again, the same): the gated output against the CPU's (out times the sigmoid of
 * the gate), and o_proj's product from it (no pre) bit for bit against the product of the plain
 * output with the SIGMOID pre, as the layer ran before. Taken only where the backend takes it. */
static void dec_attention_gated(const qf_attn_dec *a, const float *qkv, float *out, const char *s) {
    int n = a->n, nh = a->nh, hd = a->hd, H = 64, cols = nh * hd;
    qf_attn_dec b = *a;
    float *plain = a->out, *dgated = gpu.ops->alloc(&gpu, (size_t)n * cols * 4);
    b.out = dgated;
    if (!gpu.ops->dec->attn_gate(&gpu, &b)) {
        fprintf(stderr, "  %-18s %-40s not taken\n", "dec attn_gate", s);
        gpu.ops->free(&gpu, dgated);
        return;
    }
    for (int t = 0; t < n; t++) ref.ops->sigmoid_mul(&ref, out + (size_t)t * cols, hd, qkv + (size_t)t * a->stride + hd, 2 * hd, nh, hd);
    report("dec attn_gate", s, cmp(dgated, out, (size_t)n * cols), 1e-5);
    qf_pre gate = {QF_PRE_SIGMOID, NULL, a->qkv + hd, a->stride, 2 * hd, hd, 0.0f};
    check_same_product("dec attn_gate+o", s, H, cols, n, plain, &gate, dgated);
    gpu.ops->free(&gpu, dgated);
}

/* Rows at different positions, each with its own scrambled pages in one pool. */
static void test_dec_attention(int n, int nh, int nkv, int hd, int rot, const int *pos) {
    int pt = 16, stride = nh * 2 * hd + 2 * nkv * hd, koff = nh * 2 * hd, voff = koff + nkv * hd, per = 0;
    for (int t = 0; t < n; t++) per = (pos[t] + 1 + pt - 1) / pt > per ? (pos[t] + pt) / pt : per;
    int np = n * per + 2;
    size_t layer = (size_t)pt * nkv * hd, pstride = 2 * layer;
    float *pool = qt_rnd((size_t)np * pstride, 1.0f), *qkv = qt_rnd((size_t)n * stride, 1.0f), *qn = qt_rnd(hd, 1.0f), *kn = qt_rnd(hd, 1.0f);
    float *inv = malloc((size_t)(rot / 2) * 4), *out = malloc((size_t)n * nh * hd * 4), *qw = malloc((size_t)nh * 2 * hd * 4), *kw = malloc((size_t)nkv * hd * 4);
    for (int i = 0; i < rot / 2; i++) inv[i] = 1.0f / powf(1e7f, (float)(2 * i) / (float)rot);
    int32_t *pages = malloc((size_t)np * 4);
    for (int i = 0; i < np; i++) pages[i] = (i * 7 + 3) % np;
    float *dpool = up_f(pool, (size_t)np * pstride), *dqkv = up_f(qkv, (size_t)n * stride), *dqn = up_f(qn, hd), *dkn = up_f(kn, hd), *dinv = up_f(inv, rot / 2);
    int32_t *dpages = up(pages, (size_t)np * 4);
    float *dout = gpu.ops->alloc(&gpu, (size_t)n * nh * hd * 4), scale = 1.0f / sqrtf((float)hd);
    qf_attn_dec a = {dqkv, stride, koff, voff, n, nh, nkv, hd, rot, dqn, dkn, dinv, 1e-6f, scale, {{0}}, {0}, dout, {0}};
    for (int t = 0; t < n; t++) {
        const float *r = qkv + (size_t)t * stride;
        memcpy(qw, r, (size_t)nh * 2 * hd * 4), memcpy(kw, r + koff, (size_t)nkv * hd * 4);
        ref.ops->rmsnorm(&ref, qw, 2 * hd, qn, nh, hd, 1e-6f, qw, 2 * hd);
        ref.ops->rmsnorm(&ref, kw, hd, kn, nkv, hd, 1e-6f, kw, hd);
        ref.ops->rope(&ref, qw, nh * 2 * hd, 2 * hd, 1, nh, rot, pos[t], inv);
        ref.ops->rope(&ref, kw, nkv * hd, hd, 1, nkv, rot, pos[t], inv);
        qf_kv_view kv = {pool, pages + t * per, pt, pstride, 0, layer, 0};
        ref.ops->kv_store(&ref, &kv, kw, r + voff, 1, pos[t], nkv, hd);
        qf_attn_args at = {qw, nh * 2 * hd, 2 * hd, kv, out + (size_t)t * nh * hd, 1, pos[t], nh, nkv, hd, scale, NULL, 0};
        ref.ops->attention(&ref, &at);
        a.kv[t] = (qf_kv_view){dpool, dpages + t * per, pt, pstride, 0, layer, 0}, a.pos[t] = pos[t];
    }
    gpu.ops->dec->attention(&gpu, &a);
    char s[80];
    snprintf(s, sizeof s, "n=%d at %d.., %d/%d heads of %d, rot %d", n, pos[0], nh, nkv, hd, rot);
    report("dec attention", s, cmp(dout, out, (size_t)n * nh * hd), 1e-5);
    report("dec attention kv", s, cmp(dpool, pool, (size_t)np * pstride), 1e-6);
    if (gpu.ops->dec->attn_gate) dec_attention_gated(&a, qkv, out, s);
    free(pool), free(qkv), free(qn), free(kn), free(inv), free(out), free(qw), free(kw), free(pages);
    void *d[] = {dpool, dqkv, dqn, dkn, dinv, dpages, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* Routing, top-k experts and the shared expert, added to x, against the reference ops. ties:
 * router logits on a coarse grid, so equal logits straddle the top-k boundary and the lower
 * index must win (the CPU's order). */
static float moe_drop_tau; /* sparsity's expert rule in test_dec_moe (0: off) */

static void test_dec_moe(int n, int E, int K, int H, int I, int S, int bench, int ties) {
    void *hsd;
    qf_mat sd = bf16_mat(H, S, &hsd);
    test_experts ex = make_experts(E, I, H);
    qf_expert *host = ex.host, *dev = ex.dev;
    int rs = E + 2 * S + 1 + 3; /* the ffn_in product's row, padded as a wider stride */
    float *rl = qt_rnd((size_t)n * rs, 2.0f), *x = qt_rnd((size_t)n * H, 1.0f), *nw = qt_rnd(H, 1.0f), *want = copy_f(x, (size_t)n * H);
    float *xn = malloc((size_t)H * 4), *gb = malloc((size_t)I * 4), *ub = malloc((size_t)I * 4), *hb = malloc((size_t)(I > S ? I : S) * 4);
    float *yb = malloc((size_t)H * 4), *acc = malloc((size_t)H * 4);
    for (int t = 0; ties && t < n; t++)
        for (int e = 0; e < E; e++) rl[(size_t)t * rs + e] = floorf(rl[(size_t)t * rs + e] * 2.0f) * 0.5f;
    for (int t = 0; t < n; t++) {
        const float *l = rl + (size_t)t * rs;
        float w[64];
        int ti[64];
        ref.ops->rmsnorm(&ref, x + (size_t)t * H, H, nw, 1, H, 1e-6f, xn, H);
        qf_ref_route(l, E, K, ti, w);
        int kept = moe_drop_tau > 0.0f ? qf_ref_route_drop(w, K, moe_drop_tau, (K + 1) / 2) : K;
        memset(acc, 0, (size_t)H * 4);
        ref_experts(host, ti, w, kept, xn, I, H, gb, ub, hb, yb, acc);
        ref.ops->swiglu(&ref, l + E, l + E + S, S, 1, S, hb);
        ref.ops->matmul(&ref, &sd, hb, 1, yb);
        ref.ops->sigmoid_scale_add(&ref, acc, yb, l + E + 2 * S, 1, H);
        ref.ops->axpy(&ref, want + (size_t)t * H, acc, 1.0f, H);
    }
    qf_mat dsd = sd;
    dsd.data = up(hsd, (size_t)H * S * 2);
    float *drl = up_f(rl, (size_t)n * rs), *dx = up_f(x, (size_t)n * H), *dnw = up_f(nw, H);
    int32_t *dchosen = gpu.ops->alloc(&gpu, (size_t)n * K * sizeof(int32_t)), *chosen = malloc((size_t)n * K * sizeof(int32_t));
    qf_moe_dec a = {dev, E, K, n, H, I, S, dnw, 1e-6f, drl, rs, &dsd, dx, ex.tab, dchosen, NULL, {0}, (K + 1) / 2};
    for (int t = 0; t < n; t++) a.drop_tau[t] = moe_drop_tau;
    gpu.ops->dec->moe(&gpu, &a);
    char s[80];
    snprintf(s, sizeof s, "n=%d, %d experts top-%d, %d/%d, shared %d%s%s, %s", n, E, K, H, I, S, ties ? ", tied logits" : "", moe_drop_tau > 0 ? ", drop" : "",
             qf_dtype_name(moe_fmt));
    report("dec moe", s, cmp(dx, want, (size_t)n * H), 1e-5);
    /* the ids the kernels chose, as the expert store reads them: the reference's, in rank order */
    gpu.ops->download(&gpu, chosen, dchosen, (size_t)n * K * sizeof(int32_t));
    int bad_ids = 0;
    for (int t = 0; t < n; t++) {
        int ti[64];
        float w[64];
        qf_ref_route(rl + (size_t)t * rs, E, K, ti, w);
        int kept = moe_drop_tau > 0.0f ? qf_ref_route_drop(w, K, moe_drop_tau, (K + 1) / 2) : K;
        for (int k = 0; k < K; k++) bad_ids += chosen[t * K + k] != (k < kept ? ti[k] : -1);
    }
    CHECK(bad_ids == 0, "dec moe %s: %d chosen expert ids differ from the reference routing", s, bad_ids);
    gpu.ops->free(&gpu, dchosen), free(chosen);
    if (bench) { /* per row: K experts x 3 matrices + the shared down */
        int reps = 200;
        qf_be_sync(&gpu);
        double t0 = qf_now();
        for (int i = 0; i < reps; i++) gpu.ops->dec->moe(&gpu, &a);
        qf_be_sync(&gpu);
        double per = (double)(qf_mat_bytes(&host[0].gate) + qf_mat_bytes(&host[0].up) + qf_mat_bytes(&host[0].down));
        double dt = (qf_now() - t0) / reps, bytes = (double)n * (K * per + (double)H * S * 2);
        fprintf(stderr, "  dec moe n=%d: %.1f us per call, %.0f GB/s of expert weights (%.0f%% of 4300 GB/s copy)\n", n, dt * 1e6, bytes / dt / 1e9,
                100 * bytes / dt / 4.3e12);
    }
    free_experts(&ex, E);
    free(hsd), free(rl), free(x), free(nw), free(want), free(xn), free(gb), free(ub), free(hb), free(yb), free(acc);
    void *d[] = {(void *)dsd.data, drl, dx, dnw};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

static void test_dec_argmax(int n, int cols) {
    float *x = qt_rnd((size_t)n * cols, 5.0f);
    int32_t want[QF_DEC_ROWS], got[QF_DEC_ROWS];
    for (int t = 0; t < n; t++) {
        float *r = x + (size_t)t * cols;
        int a = (t * 7919) % cols, b = (a + cols / 2 + t) % cols; /* a tie between two planted maxima */
        r[a] = r[b] = 9.0f;
        want[t] = a < b ? a : b;
    }
    float *dx = up_f(x, (size_t)n * cols);
    int32_t *dout = gpu.ops->alloc(&gpu, QF_DEC_ROWS * 4);
    for (int rep = 0; rep < 2; rep++) { /* twice: the per-row counters must have reset */
        gpu.ops->dec->argmax(&gpu, dx, n, cols, dout);
        gpu.ops->download(&gpu, got, dout, (size_t)n * 4);
        for (int t = 0; t < n; t++) CHECK(got[t] == want[t], "argmax row %d (pass %d): %d, want %d", t, rep, got[t], want[t]);
    }
    fprintf(stderr, "  %-18s %d rows of %d, planted ties: %s\n", "dec argmax", n, cols, memcmp(got, want, (size_t)n * 4) ? "WRONG" : "ok");
    free(x);
    gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dout);
}

/* The device's draw (ops.h qf_draw) against the host sampler with the same uniform numbers: rows of
 * a few likely tokens over a Gaussian tail, each sampler with its own seed and a history of 12
 * tokens (penalties), 32 rows a setting: the same ids, save (settings whose normaliser sums the
 * whole vocabulary, in another order) one of them; timed. */
/* Near-Gaussian (the sum of three uniforms: mean 0, variance 1). */
static float nrand(void) { return qt_frand() + qt_frand() + qt_frand(); }

static void test_dec_draw(int V) {
    enum { R = 32 };
    const qf_sampling set[] = {
        {0.0f, 0, 1.0f, 0.0f, 1.3f, 0.0f, 0.0f, 1},    /* greedy after a repetition penalty */
        {0.7f, 20, 0.8f, 0.0f, 1.0f, 0.0f, 0.0f, 2},   /* Qwen's recommended */
        {1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 3},    /* temperature alone (the API's default) */
        {0.6f, 0, 0.95f, 0.0f, 1.0f, 0.0f, 0.0f, 4},   /* top-p with top-k off */
        {1.0f, 50, 1.0f, 0.1f, 1.1f, 0.5f, 0.3f, 5},   /* min-p and every penalty */
        {1.2f, QF_DRAW_MAX_K, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 6},
    };
    float *x = malloc((size_t)R * V * 4), *host = malloc((size_t)V * 4);
    float *dx = gpu.ops->alloc(&gpu, (size_t)R * V * 4);
    int32_t *dout = gpu.ops->alloc(&gpu, R * 4), got[R];
    /* the likely tokens' lead grows with the vocabulary, so the tail's share of the mass stays
     * about what it is at 4096 (at 248k and a lead of 6 the tail would hold most of it, and top-p
     * 0.95 would keep more than QF_DRAW_MAX_K tokens: the flat walk, test_dec_draw_flat's case) */
    const float lift = 6.0f + logf((float)V / 4096.0f);
    for (size_t k = 0; k < sizeof set / sizeof *set; k++) {
        qf_sampler *a[R], *b[R];
        qf_draw d[R];
        for (int t = 0; t < R; t++) {
            float *r = x + (size_t)t * V;
            for (int i = 0; i < V; i++) r[i] = nrand();
            for (int j = 0; j < 6; j++) r[(t * 7919 + j * 104729) % V] = lift + 0.5f * (float)j;
            qf_sampling p = set[k];
            p.seed = set[k].seed * 1000 + (uint64_t)t;
            a[t] = qf_sampler_create(V, &p), b[t] = qf_sampler_create(V, &p);
            for (int j = 0; j < 12; j++) {
                int32_t tok = (t * 7919 + (j % 4) * 104729) % V; /* some likely ones, some twice */
                qf_sampler_accept(a[t], tok, j >= 4), qf_sampler_accept(b[t], tok, j >= 4);
            }
            CHECK(qf_sampler_draw_desc(a[t], &d[t]), "draw_desc refused setting %zu", k);
        }
        gpu.ops->upload(&gpu, dx, x, (size_t)R * V * 4);
        qf_be_sync(&gpu);
        double t0 = qf_now();
        gpu.ops->dec->draw(&gpu, dx, R, V, d, dout);
        gpu.ops->download(&gpu, got, dout, R * 4);
        double dt = qf_now() - t0;
        int mism = 0;
        for (int t = 0; t < R; t++) {
            memcpy(host, x + (size_t)t * V, (size_t)V * 4);
            mism += got[t] != qf_sampler_sample_u(b[t], host, d[t].u);
            qf_sampler_free(a[t]), qf_sampler_free(b[t]);
        }
        int whole = set[k].temperature > 0.0f && set[k].top_k == 0;
        CHECK(qf_be_sync(&gpu) == QF_OK && mism <= whole, "draw setting %zu, vocab %d: %d of %d ids differ from the host sampler's", k, V, mism, R);
        fprintf(stderr, "  %-18s setting %zu, %d rows of %d: %d differ from the host's, %.0f us\n", "dec draw", k, R, V, mism, dt * 1e6);
    }
    free(x), free(host);
    gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dout);
}

/* A flat row (top-k off, top-p keeping more than QF_DRAW_MAX_K tokens): walked in id order on the
 * device, so only the distribution is the host's: 19,200 draws, each of the 6 likeliest tokens
 * at its probability under the rule within 5 sigma. */
static void test_dec_draw_flat(void) {
    enum { V = 4096, R = 64, ROUNDS = 300 };
    float *x = malloc((size_t)R * V * 4);
    for (int i = 0; i < V; i++) x[i] = nrand();
    for (int j = 0; j < 6; j++) x[j * 601] = 4.0f + 0.2f * (float)j;
    for (int t = 1; t < R; t++) memcpy(x + (size_t)t * V, x, (size_t)V * 4);
    qf_sampling p = {1.5f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 11};
    /* the rule's probabilities: every token sorted, top-p's prefix, each w / total */
    double w[V], mx = -1e30, sum = 0, cum = 0, total = 0, prob[6];
    int ord[V];
    for (int i = 0; i < V; i++) w[i] = (double)(x[i] / p.temperature), ord[i] = i, mx = w[i] > mx ? w[i] : mx;
    for (int i = 0; i < V; i++) w[i] = exp(w[i] - mx), sum += w[i];
    for (int i = 1; i < V; i++) /* insertion sort by weight, descending (ties: lower id) */
        for (int j = i; j > 0 && (w[ord[j]] > w[ord[j - 1]] || (w[ord[j]] == w[ord[j - 1]] && ord[j] < ord[j - 1])); j--) {
            int tmp = ord[j];
            ord[j] = ord[j - 1], ord[j - 1] = tmp;
        }
    int kept = V;
    for (int i = 0; i < V; i++)
        if ((cum += w[ord[i]] / sum) >= p.top_p) {
            kept = i + 1;
            break;
        }
    for (int i = 0; i < kept; i++) total += w[ord[i]];
    for (int j = 0; j < 6; j++) prob[j] = w[j * 601] / total;
    float *dx = gpu.ops->alloc(&gpu, (size_t)R * V * 4);
    int32_t *dout = gpu.ops->alloc(&gpu, R * 4), got[R];
    qf_sampler *smp = qf_sampler_create(V, &p);
    qf_draw d[R];
    long hits[6] = {0}, n = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (int t = 0; t < R; t++) qf_sampler_draw_desc(smp, &d[t]);
        gpu.ops->upload(&gpu, dx, x, (size_t)R * V * 4);
        gpu.ops->dec->draw(&gpu, dx, R, V, d, dout);
        gpu.ops->download(&gpu, got, dout, R * 4);
        for (int t = 0; t < R; t++, n++)
            for (int j = 0; j < 6; j++) hits[j] += got[t] == j * 601;
    }
    int bad = 0;
    for (int j = 0; j < 6; j++) {
        double e = prob[j] * (double)n, sd = sqrt(e * (1 - prob[j]));
        bad += fabs((double)hits[j] - e) > 5 * sd;
    }
    CHECK(kept > QF_DRAW_MAX_K && bad == 0, "flat draw: %d tokens kept, %d of the 6 likeliest off their probability", kept, bad);
    fprintf(stderr, "  %-18s %d of %d tokens kept, %ld draws: the likeliest at %ld against %.0f expected\n", "dec draw (flat)", kept, V, n, hits[5], prob[5] * (double)n);
    qf_sampler_free(smp);
    free(x);
    gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dout);
}

/* Bandwidth of the fused products at the 35B's decode shapes. */
static void bench_dec_matmul(int64_t rows, int64_t cols, int n) {
    void *hw;
    qf_mat w = trunk_mat(rows, cols, &hw);
    w.data = up(hw, qf_mat_bytes(&w));
    free(hw);
    float *x = qt_rnd((size_t)n * cols, 1.0f), *nw = qt_rnd((size_t)cols, 1.0f), *dx = up_f(x, (size_t)n * cols), *dnw = up_f(nw, (size_t)cols);
    float *dy = gpu.ops->alloc(&gpu, (size_t)n * rows * 4);
    qf_pre pre = {QF_PRE_RMSNORM, dnw, NULL, 0, 0, 0, 1e-6f};
    gpu.ops->dec->matmul(&gpu, &w, dx, n, &pre, NULL, 0, dy);
    qf_be_sync(&gpu);
    int reps = 50;
    double t0 = qf_now();
    for (int i = 0; i < reps; i++) gpu.ops->dec->matmul(&gpu, &w, dx, n, &pre, NULL, 0, dy);
    qf_be_sync(&gpu);
    double dt = (qf_now() - t0) / reps, bytes = (double)qf_mat_bytes(&w);
    fprintf(stderr, "  dec matmul %s (rmsnorm) [%lld x %lld] n=%d: %.1f us, %.0f GB/s (%.0f%% of 4300 GB/s copy)\n", qf_dtype_name(trunk_fmt), (long long)rows, (long long)cols, n,
            dt * 1e6, bytes / dt / 1e9, 100 * bytes / dt / 4.3e12);
    gpu.ops->free(&gpu, (void *)w.data), gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dnw), gpu.ops->free(&gpu, dy);
    free(x), free(nw);
}

/* Decode GEMV bandwidth on a matrix far larger than L2. */
static void bench_gemv(int64_t rows, int64_t cols, int n) {
    void *hw;
    qf_mat w = bf16_mat(rows, cols, &hw);
    w.data = up(hw, (size_t)(rows * cols) * 2);
    free(hw);
    float *x = qt_rnd((size_t)n * cols, 1.0f), *dx = up_f(x, (size_t)n * cols), *dy = gpu.ops->alloc(&gpu, (size_t)n * rows * 4);
    gpu.ops->matmul(&gpu, &w, dx, n, dy);
    qf_be_sync(&gpu);
    int reps = 20;
    double t0 = qf_now();
    for (int i = 0; i < reps; i++) gpu.ops->matmul(&gpu, &w, dx, n, dy);
    qf_be_sync(&gpu);
    double dt = (qf_now() - t0) / reps, bytes = (double)rows * cols * 2;
    fprintf(stderr, "  gemv bf16 [%lld x %lld] n=%d: %.1f us, %.0f GB/s (%.0f%% of 4300 GB/s copy)\n", (long long)rows, (long long)cols, n,
            dt * 1e6, bytes / dt / 1e9, 100 * bytes / dt / 4.3e12);
    gpu.ops->free(&gpu, (void *)w.data), gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dy);
    free(x);
}

/* The fused decode ops at the real shapes for n rows. */
static void dec_row_checks(int n) {
    test_dec_matmul(QF_PRE_NONE, 2048, 2048, 1, n, 0);
    test_dec_matmul(QF_PRE_RMSNORM, 1281, 2048, 1, n, 0);
    test_dec_matmul(QF_PRE_GATED_NORM, 2048, 4096, 128, n, 1);
    test_dec_matmul(QF_PRE_SIGMOID, 2048, 4096, 256, n, 1);
    test_dec_gdn_proj(n);
    test_dec_gdn(n, 16, 32, 128, 128);
    test_dec_moe(n, 256, 8, 2048, 512, 512, n == 1 || n >= 16, 0);
    test_dec_argmax(n, 248320);
}

static int restart_with(const char *assignment);
static void set_opt(const char *assignment);

/* From option dec_tc (5) rows the products run on the tensor cores; 64 rows: the most a decode
 * step takes. Then the GEMV kernels at many rows, and the tensor cores at 2. */
static void dec_rows_checks(void) {
    const int dec_rows[] = {1, 3, 8, 16, 24, 64};
    for (int i = 0; i < (int)(sizeof dec_rows / sizeof *dec_rows); i++) dec_row_checks(dec_rows[i]);
    if (restart_with("dec_tc=65")) dec_row_checks(16), dec_row_checks(64);
    if (restart_with("dec_tc=2")) dec_row_checks(2);
    set_opt("dec_tc=5");
}

/* A backend made again with one more option set (the checks after it run on that backend). A lab
 * option (a variant that lost, or a winner turned off) is set only in a lab build
 * (-DQFLASH_LAB=ON): elsewhere its checks are skipped, the variant not being in the binary. */
static int lab_skipped;
static int restart_with(const char *assignment) {
    if (qf_cuda_opt_is_lab(assignment) && !QF_CUDA_LAB_BUILD) {
        if (!lab_skipped++) fprintf(stderr, "lab options' checks skipped (%s, ...): build with -DQFLASH_LAB=ON to run them\n", assignment);
        return 0;
    }
    qf_cuda_backend_free(&gpu);
    int ok = qf_cuda_opts_set(&g_opts, assignment) == QF_OK && qf_cuda_backend_init(&gpu, 0, &g_opts) == QF_OK;
    CHECK(ok, "the CUDA backend did not start again with %s: %s", assignment, qf_last_error());
    if (ok) fprintf(stderr, "with %s:\n", assignment);
    return ok;
}

/* One option back to its default (the backend is made again by the next restart_with). */
static void set_opt(const char *assignment) {
    if (qf_cuda_opt_is_lab(assignment) && !QF_CUDA_LAB_BUILD) return;
    CHECK(qf_cuda_opts_set(&g_opts, assignment) == QF_OK, "%s", qf_last_error());
}

/* One-row products fed by bulk copies (option bulk=15: every kind, sm_90): every one-row shape of a step
 * (in_proj with its epilogue, out_proj, o_proj, ffn_in, lm_head), a shape that is no whole row
 * per slot (512 and 4096 columns), rows fewer than the warps, and one block per SM. */
static void bulk_checks(void) {
    if (!restart_with("bulk=15")) return;
    dec_row_checks(1);
    test_dec_matmul(QF_PRE_RMSNORM, 2048, 512, 1, 1, 1);
    test_dec_matmul(QF_PRE_NONE, 100, 2048, 1, 1, 1);
    test_dec_matmul(QF_PRE_GATED_NORM, 128, 256, 32, 1, 1);
    test_dec_matmul(QF_PRE_RMSNORM, 248320 / 8, 2048, 1, 1, 0);
    bench_dec_matmul(12352, 2048, 1);
    bench_dec_matmul(248320, 2048, 1);
    if (restart_with("bulk_blocks=1")) {
        test_dec_gdn_proj(1);
        test_dec_matmul(QF_PRE_GATED_NORM, 2048, 4096, 128, 1, 1);
        bench_dec_matmul(12352, 2048, 1);
    }
    set_opt("bulk_blocks=2");
    set_opt("bulk=8");
}

/* The one-row MoE at the shapes its routings must agree on: the real one (timed, tied logits and
 * not; twice in a row: the grid counts back at zero), the fixtures', E not a multiple of 32 (padded),
 * and the most experts and the largest top-k routed (route_sort's fallback to route_pairs). */
static void routing_checks(void) {
    test_dec_moe(1, 256, 8, 2048, 512, 512, 1, 1);
    test_dec_moe(1, 256, 8, 2048, 512, 512, 0, 0);
    test_dec_moe(1, 64, 4, 192, 32, 192, 0, 1);
    test_dec_moe(1, 64, 4, 192, 32, 192, 0, 0);
    test_dec_moe(1, 8, 2, 128, 64, 64, 0, 0);
    test_dec_moe(1, 250, 8, 256, 64, 64, 0, 1);
    test_dec_moe(1, 512, 32, 256, 64, 64, 0, 1);
}

/* Sparsity's KV level for rows at pos (pages of 64, a budget of `budget` pages): the device's
 * summaries and page choices are the reference's exactly, and attention through a view of the
 * chosen pages (the new key stored in the last, rope at its real position) is the reference's
 * attention over the same view. */
static void test_dec_page_select(int n, const int *pos, int budget) {
    int nh = 16, nkv = 2, hd = 256, rot = 64, pt = 64, stride = nh * 2 * hd + 2 * nkv * hd, koff = nh * 2 * hd, voff = koff + nkv * hd, per = 0;
    for (int t = 0; t < n; t++) per = pos[t] / pt + 1 > per ? pos[t] / pt + 1 : per;
    int np = n * per;
    size_t layer = (size_t)pt * nkv * hd, pstride = 2 * layer + 2 * (size_t)nkv * hd;
    float *pool = qt_rnd((size_t)np * pstride, 1.0f), *qkv = qt_rnd((size_t)n * stride, 1.0f), *qn = qt_rnd(hd, 1.0f), *kn = qt_rnd(hd, 1.0f);
    float *inv = malloc((size_t)(rot / 2) * 4), *out = malloc((size_t)n * nh * hd * 4), *qw = malloc((size_t)nh * 2 * hd * 4), *kw = malloc((size_t)nkv * hd * 4);
    float *score = malloc((size_t)per * 4), *got_out = malloc((size_t)n * nh * hd * 4), *got_pool = malloc((size_t)np * pstride * 4);
    for (int i = 0; i < rot / 2; i++) inv[i] = 1.0f / powf(1e7f, (float)(2 * i) / (float)rot);
    int32_t *pages = malloc((size_t)np * 4), *want = malloc((size_t)np * 4), *got = malloc((size_t)np * 4);
    for (int i = 0; i < np; i++) pages[i] = (i * 7 + 3) % np;
    float *dpool = up_f(pool, (size_t)np * pstride), *dqkv = up_f(qkv, (size_t)n * stride), *dqn = up_f(qn, hd), *dkn = up_f(kn, hd), *dinv = up_f(inv, rot / 2);
    int32_t *dpages = up(pages, (size_t)np * 4), *dsel = gpu.ops->alloc(&gpu, (size_t)np * 4);
    float *dout = gpu.ops->alloc(&gpu, (size_t)n * nh * hd * 4), scale = 1.0f / sqrtf((float)hd);
    qf_attn_dec a = {dqkv, stride, koff, voff, n, nh, nkv, hd, rot, dqn, dkn, dinv, 1e-6f, scale, {{0}}, {0}, dout, {0}};
    int n_pages[QF_DEC_ROWS], budgets[QF_DEC_ROWS], bad_sel = 0;
    int32_t *sel[QF_DEC_ROWS];
    for (int t = 0; t < n; t++) {
        int npt = pos[t] / pt + 1;
        qf_kv_view kv = {pool, pages + t * per, pt, pstride, 0, layer, 2 * layer};
        a.kv[t] = (qf_kv_view){dpool, dpages + t * per, pt, pstride, 0, layer, 2 * layer}, a.pos[t] = pos[t];
        ref.ops->kv_summarize(&ref, &kv, 0, npt - 1, nkv, hd);
        gpu.ops->kv_summarize(&gpu, &a.kv[t], 0, npt - 1, nkv, hd);
        n_pages[t] = npt, budgets[t] = budget, sel[t] = dsel + t * per;
        const float *r = qkv + (size_t)t * stride;
        memcpy(qw, r, (size_t)nh * 2 * hd * 4);
        ref.ops->rmsnorm(&ref, qw, 2 * hd, qn, nh, hd, 1e-6f, qw, 2 * hd);
        ref.ops->rope(&ref, qw, nh * 2 * hd, 2 * hd, 1, nh, rot, pos[t], inv);
        for (int p = 0; p < npt - 1; p++) {
            const float *sum = pool + (size_t)pages[t * per + p] * pstride + 2 * layer;
            score[p] = qf_ref_page_score(qw, nh, 2 * hd, nkv, sum, sum + (size_t)nkv * hd, hd);
        }
        score[npt - 1] = 0.0f;
        int m = qf_ref_page_select(score, npt, budget, want + t * per);
        for (int i = 0; i < m; i++) want[t * per + i] = pages[t * per + want[t * per + i]];
        /* the reference attention through the view of the chosen pages */
        memcpy(kw, r + koff, (size_t)nkv * hd * 4);
        ref.ops->rmsnorm(&ref, kw, hd, kn, nkv, hd, 1e-6f, kw, hd);
        ref.ops->rope(&ref, kw, nkv * hd, hd, 1, nkv, rot, pos[t], inv);
        kv.pages = want + t * per;
        int at = (m - 1) * pt + pos[t] % pt;
        ref.ops->kv_store(&ref, &kv, kw, r + voff, 1, at, nkv, hd);
        qf_attn_args at_args = {qw, nh * 2 * hd, 2 * hd, kv, out + (size_t)t * nh * hd, 1, at, nh, nkv, hd, scale, NULL, 0};
        ref.ops->attention(&ref, &at_args);
    }
    gpu.ops->dec->page_select(&gpu, &a, n_pages, budgets, sel);
    gpu.ops->download(&gpu, got, dsel, (size_t)np * 4);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < budget; i++) bad_sel += got[t * per + i] != want[t * per + i];
    char s[80];
    snprintf(s, sizeof s, "n=%d at %d.., %d of %d pages", n, pos[0], budget, pos[0] / pt + 1);
    CHECK(bad_sel == 0, "dec page_select %s: %d chosen pages differ from the reference", s, bad_sel);
    for (int t = 0; t < n; t++) a.kv[t].pages = sel[t], a.n_keys[t] = (budget - 1) * pt + pos[t] % pt + 1;
    gpu.ops->dec->attention(&gpu, &a);
    report("dec attention (chosen pages)", s, cmp(dout, out, (size_t)n * nh * hd), 1e-5);
    report("dec attention kv+summary", s, cmp(dpool, pool, (size_t)np * pstride), 1e-6);
    free(pool), free(qkv), free(qn), free(kn), free(inv), free(out), free(qw), free(kw), free(score), free(got_out), free(got_pool), free(pages), free(want), free(got);
    void *d[] = {dpool, dqkv, dqn, dkn, dinv, dpages, dsel, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* Sparsity in the fused decode ops: experts dropped by the expert rule (one-kernel and two-kernel
 * MoE), and the trunk's masked products through transposed weights at the real shapes (in_proj
 * with its epilogue, q/k/v, out_proj and o_proj with their pres, += into the residual), one row and
 * several (the last keeping every entry). */
static void sparsity_checks(void) {
    const float taus[] = {0.3f / 8, 0.7f / 8};
    for (int i = 0; i < 2; i++) {
        moe_drop_tau = taus[i];
        test_dec_moe(1, 256, 8, 2048, 512, 512, 0, 0);
        test_dec_moe(3, 256, 8, 2048, 512, 512, 0, 0);
        test_dec_moe(1, 64, 4, 192, 32, 192, 0, 1);
    }
    moe_drop_tau = 0;
    const float shares[] = {0.25f, 0.5f};
    for (int i = 0; i < 2; i++) {
        sparse_share = shares[i];
        for (int n = 1; n <= 3; n += 2) {
            test_dec_gdn_proj(n);
            test_dec_matmul(QF_PRE_RMSNORM, 9216, 2048, 1, n, 0);
            test_dec_matmul(QF_PRE_NONE, 2048, 4096, 1, n, 1);
            test_dec_matmul(QF_PRE_GATED_NORM, 2048, 4096, 128, n, 1);
            test_dec_matmul(QF_PRE_SIGMOID, 2048, 4096, 256, n, 1);
        }
        test_dec_matmul(QF_PRE_RMSNORM, 100, 192, 1, 2, 0);
    }
    sparse_share = 0;
    const int at[3] = {3000, 5000, 130};
    test_dec_page_select(1, at, 16);
    test_dec_page_select(2, at, 20);
    test_dec_page_select(1, at + 1, 3);
}

/* The MoE op grouped by expert (on a backend whose option mg_min lets 16 rows take it):
 * checked at 16 and 64 rows of the real shape, 300 rows of 16 experts (several passes an expert),
 * the MoE fixture's shape and the bundled model's (expert width 32: the cp.async form declines it,
 * the register form takes it); timed at 128 and 512 rows. */
static void grouped_moe_checks(void) {
    test_moe_shape(16, 256, 8, 2048, 512, 1, 1);
    test_moe_shape(64, 256, 8, 2048, 512, 1, 1);
    test_moe_shape(128, 256, 8, 2048, 512, 0, 1);
    test_moe_shape(512, 256, 8, 2048, 512, 0, 1);
    test_moe_shape(300, 16, 4, 256, 64, 1, 0);   /* ~75 rows an expert: passes of 64 (k_mg_cp's TL 4), the second partial */
    test_moe_shape(256, 64, 8, 2048, 512, 1, 0); /* ~32 an expert at the real widths: passes of 64 */
    test_moe_shape(20, 8, 2, 128, 64, 1, 0);
    test_moe_shape(40, 64, 4, 192, 32, 1, 0);
}

/* The decode attention at its shapes: rows at different positions, short contexts (keys within
 * those loaded before the wait; twice: the per-head counts back at zero), long ones (keys past
 * them), several rows, small heads. */
static void dec_attention_checks(void) {
    int p1[1] = {700}, p3[3] = {0, 95, 4001}, p2[2] = {17, 40}, p4[1] = {150}, p5[1] = {8000};
    test_dec_attention(1, 16, 2, 256, 64, p4);
    test_dec_attention(1, 16, 2, 256, 64, p4);
    test_dec_attention(1, 16, 2, 256, 64, p5);
    test_dec_attention(1, 16, 2, 256, 64, p1);
    test_dec_attention(3, 16, 2, 256, 64, p3);
    test_dec_attention(2, 4, 2, 64, 16, p2);
    test_dec_attention(2, 8, 2, 32, 8, p2);
    int p6[1] = {110};
    test_dec_attention(1, 4, 2, 32, 8, p6); /* the tiny fixture's heads past its first pages */
}

/* The decode attention's other forms (the default: one kernel with the gate, ATT1 and ATT_GATE):
 * the gate applied by the combine kernel after the two-kernel attention (ATT1=0), neither
 * (ATT_GATE=0 too: o_proj applies it), and the one kernel with the plain combine (COMB=0). */
static void att_checks(void) {
    const char *sets[] = {"att1=0", "att_gate=0", "comb=0"};
    for (int k = 0; k < 3; k++) {
        if (k == 2) set_opt("att1=1"), set_opt("att_gate=1"); /* the one kernel with the plain combine */
        if (restart_with(sets[k])) dec_attention_checks();
    }
    set_opt("att1=1"), set_opt("att_gate=1"), set_opt("comb=1");
}

/* The one-row MoE as two kernels (moe1=0), the one-kernel MoE's other routing (route=2) and its
 * expert table read from memory (moe_pf=0) with both routings (routing_checks), the decode
 * attention's other forms (att_checks), and the register in_proj (bulk=0). */
static void switch_checks(void) {
    if (restart_with("moe1=0")) {
        test_dec_moe(1, 256, 8, 2048, 512, 512, 1, 0);
        test_dec_moe(1, 64, 4, 192, 32, 192, 0, 1);
    }
    set_opt("moe1=1");
    /* the one-kernel MoE's other routings (1 route_fixed, 0 route_block, 2 route_pairs; route_sort,
     * the sorting networks, is the default; route_pairs and route_sort read the expert table from
     * shared memory by default), and the table read from memory (MOE_PF=0, with route_sort and
     * with route_pairs): the same choice, order and weights */
    if (restart_with("route=2")) routing_checks();
    set_opt("route=3");
    if (restart_with("moe_pf=0")) routing_checks();
    if (restart_with("route=2")) routing_checks();
    set_opt("route=3");
    set_opt("moe_pf=1");
    att_checks();
    if (restart_with("bulk=0")) { /* one-row in_proj in the register kernel (the default before, and off sm_90) */
        test_dec_gdn_proj(1);
        test_dec_matmul(QF_PRE_RMSNORM, 12352, 2048, 1, 1, 0);
    }
    set_opt("bulk=8");
}

/* A kernel that cannot take its input fails the step, with a message, once: through sync and
 * through a step's bracket (eager here: a new step key), and the next step is clean. */
/* Quantised weights (int8, int4, fp8): the generic product at the expert and trunk shapes and odd
 * ones; the MoE op and the fused decode MoE with quantised experts against the reference ops
 * (which dequantise exactly); bench: the fused decode MoE's time and bandwidth at the release's shape. */
/* Prompt-sized MoE ops with quantised experts: grouped by expert, the weights decoded into the
 * tensor-core stages (from 96 rows), against the reference; with bench, their time beside bf16's. */
static void quant_grouped_checks(int bench) {
    int fmts[3] = {QF_Q_I8B32, QF_Q_I4B32, QF_Q_FP8B128};
    for (int f = 0; f < 3; f++) {
        moe_fmt = fmts[f];
        test_moe_shape(128, 256, 8, 2048, 512, 1, bench);
        test_moe_shape(200, 16, 4, 256, 256, 1, 0); /* passes of 32 slots, several an expert */
        if (bench) test_moe_shape(512, 256, 8, 2048, 512, 0, 1);
    }
    moe_fmt = QF_DT_BF16;
    if (bench) test_moe_shape(512, 256, 8, 2048, 512, 0, 1);
}

/* The fused decode products with an int8 trunk (qflash quantize --trunk int8) at the release's
 * shapes (DeltaNet in_proj with its epilogue, ffn_in, out_proj, o_proj, attention q|gate/k/v) for
 * 1, 2 rows (GEMV), 5, 16 and 64 (the tensor cores, the rows decoded into their stages), and the
 * GEMV kernels at 16 and 64 (passes of 16), against the reference ops on the same int8 rows;
 * bench: their time beside bf16's. */
static void trunk_checks(int bench) {
    trunk_fmt = QF_Q_I8B32;
    const int ns[] = {1, 2, 5, 16, 64};
    for (size_t i = 0; i < sizeof ns / sizeof *ns; i++) {
        test_dec_gdn_proj(ns[i]);
        test_dec_matmul(QF_PRE_RMSNORM, 1281, 2048, 1, ns[i], 0);
        test_dec_matmul(QF_PRE_GATED_NORM, 2048, 4096, 128, ns[i], 1);
        test_dec_matmul(QF_PRE_SIGMOID, 2048, 4096, 256, ns[i], 1);
    }
    test_dec_matmul(QF_PRE_RMSNORM, 9216, 2048, 1, 1, 0);
    test_dec_matmul(QF_PRE_NONE, 100, 256, 1, 3, 1); /* one unit a lane at most */
    if (restart_with("dec_tc=65")) { /* the GEMV kernels at many rows */
        test_dec_gdn_proj(16), test_dec_gdn_proj(64);
        test_dec_matmul(QF_PRE_GATED_NORM, 2048, 4096, 128, 64, 1);
    }
    restart_with("dec_tc=5");
    for (int f = 0; bench && f < 2; f++, trunk_fmt = QF_DT_BF16) {
        bench_dec_matmul(12352, 2048, 1);
        bench_dec_matmul(1281, 2048, 1);
        bench_dec_matmul(2048, 4096, 1);
        bench_dec_matmul(12352, 2048, 8);
    }
    trunk_fmt = QF_DT_BF16;
}

static void quant_checks(int bench) {
    int fmts[3] = {QF_Q_I8B32, QF_Q_I4B32, QF_Q_FP8B128};
    for (int f = 0; f < 3; f++) {
        test_matmul_q(fmts[f], 512, 2048, 1);
        test_matmul_q(fmts[f], 2048, 512, 3);
        test_matmul_q(fmts[f], 4096, 2048, 20);
        test_matmul_q(fmts[f], 96, fmts[f] == QF_Q_FP8B128 ? 200 : 160, 2);
        moe_fmt = fmts[f];
        test_moe_shape(1, 256, 8, 2048, 512, 1, 0);
        test_moe_shape(5, 64, 8, 2048, 512, 1, 0);
        test_moe_shape(7, 16, 4, 192, 32, 1, 0); /* the bundled model's widths: not whole units */
        test_dec_moe(1, 256, 8, 2048, 512, 512, bench, 0);
        test_dec_moe(4, 256, 8, 2048, 512, 512, bench, 0);
        test_dec_moe(16, 256, 8, 2048, 512, 512, bench, 0);
        test_dec_moe(3, 64, 4, 256, 256, 128, 0, 1); /* one unit a lane, tied logits */
    }
    quant_grouped_checks(bench);
    trunk_checks(bench);
    moe_fmt = QF_DT_BF16;
    if (bench) test_dec_moe(1, 256, 8, 2048, 512, 512, 1, 0); /* bf16 beside them, same run */
}

static void test_device_errors(void) {
    float *dx = gpu.ops->alloc(&gpu, 64 * sizeof(float)), *dy = gpu.ops->alloc(&gpu, 64 * sizeof(float));
    qf_mat f32 = {QF_DT_F32, dx, 8, 8, NULL}; /* the fused products take bf16 rows only */
    gpu.ops->dec->matmul(&gpu, &f32, dx, 1, NULL, NULL, 0, dy);
    int rc = qf_be_sync(&gpu);
    CHECK(rc == QF_EDEVICE && strstr(qf_last_error(), "fused product"), "sync after a refused product: %d, '%s'", rc, qf_last_error());
    CHECK(qf_be_sync(&gpu) == QF_OK, "a failure is reported once");
    gpu.ops->step_begin(&gpu, 0x5eed, 1);
    gpu.ops->dec->matmul(&gpu, &f32, dx, 1, NULL, NULL, 0, dy);
    rc = gpu.ops->step_end(&gpu, 0);
    CHECK(rc == QF_EDEVICE && strstr(qf_last_error(), "fused product"), "step with a refused product: %d, '%s'", rc, qf_last_error());
    gpu.ops->step_begin(&gpu, 0x5eee, 1);
    CHECK(gpu.ops->step_end(&gpu, 0) == QF_OK, "the step after a failed one: %s", qf_last_error());
    gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dy);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    qf_cuda_opts_default(&g_opts);
    if (!qf_cuda_available() || qf_cuda_backend_init(&gpu, 0, &g_opts) != QF_OK) {
        fprintf(stderr, "test_cuda: skipped (%s)\n", qf_cuda_available() ? qf_last_error() : "no CUDA in this build");
        return 77;
    }
    fprintf(stderr, "test_cuda on %s\n", qf_cuda_device_name(&gpu));
    test_device_errors();
    test_matmul(2048, 2048, 1, 1e-5);
    test_matmul(512, 2048, 3, 1e-5);
    test_matmul(4096, 2048, 8, 1e-5);
    test_matmul(2048, 4096, 1, 1e-5);
    test_matmul(248320 / 8, 2048, 2, 1e-5);
    test_matmul(2048, 2048, 64, 1e-4); /* cuBLAS, activations as two bf16 parts (precision fp32: GEMV, exact) */
    test_matmul(8192, 2048, 300, 1e-4);
    /* QFLASH_TEST_QUICK (a device call that wants a part): 1 the prompt ops alone, 2 the many-row MoE
     * alone, 3 the rest (the decode kernels), 4 sparsity's kernels alone, 5 quantised weights alone, 6 the
     * one-row MoE of quantised experts, 7 their prompt-sized MoE, 8 the decode ops at 1..64 rows alone,
     * 9 the fused products of an int8 trunk alone, with their time, 10 the draw alone */
    const char *quick = getenv("QFLASH_TEST_QUICK");
    int part = quick ? atoi(quick) : 0;
    if (part == 10) {
        test_dec_draw(248320);
        test_dec_draw(4096);
        test_dec_draw_flat();
        qf_cuda_backend_free(&gpu);
        return qt_finish();
    }
    if (part == 9) {
        trunk_checks(1);
        qf_cuda_backend_free(&gpu);
        return qt_finish();
    }
    if (part == 8) {
        dec_rows_checks();
        qf_cuda_backend_free(&gpu);
        return qt_finish();
    }
    if (part == 7) { /* quantised experts in prompt-sized MoE ops alone */
        quant_grouped_checks(1);
        qf_cuda_backend_free(&gpu);
        return qt_finish();
    }
    if (part == 5 || part == 6) { /* quantised weights alone (6: the one-row fused MoE alone, with its time) */
        for (int f = 0; part == 6 && f < 3; f++) {
            moe_fmt = (int[]){QF_Q_I8B32, QF_Q_I4B32, QF_Q_FP8B128}[f];
            test_dec_moe(1, 256, 8, 2048, 512, 512, 1, 0);
            test_dec_moe(2, 256, 8, 2048, 512, 512, 1, 0);
        }
        if (part == 5) quant_checks(1);
        qf_cuda_backend_free(&gpu);
        return qt_finish();
    }
    if (part == 4) {
        sparsity_checks();
        qf_cuda_backend_free(&gpu);
        return qt_finish();
    }
    if (part != 2 && part != 3) {
        test_small_ops();
        test_conv_gdn(1);
        test_conv_gdn(7);
        test_conv_gdn(43);  /* one partial chunk of the chunked rule */
        test_conv_gdn(256); /* four whole chunks */
        test_conv_gdn(600); /* two launch pairs (8 chunks, then 2, the last partial) */
        if (restart_with("gdn_chunk_min=1")) test_conv_gdn(1), test_conv_gdn(7); /* chunks of 1 and 7 tokens */
        set_opt("gdn_chunk_min=32");
        /* the token-serial kernels (k_gdn_cols and its switches, k_gdn) */
        if (restart_with("gdn_chunk=0")) test_conv_gdn(43), test_conv_gdn(256);
        if (restart_with("gdn_seq=1")) test_conv_gdn(256); /* k_gdn, a block per head */
        set_opt("gdn_seq=0");
        const char *lpcs[] = {"gdn_plpc=1", "gdn_plpc=2", "gdn_plpc=8"}; /* k_gdn_cols with other lanes a column than the default 4 */
        for (int i = 0; i < 3; i++)
            if (restart_with(lpcs[i])) test_conv_gdn(43), test_conv_gdn(256);
        set_opt("gdn_plpc=4");
        if (restart_with("gdn_cp=0")) test_conv_gdn(43), test_conv_gdn(256); /* inputs by plain loads, a round at a time */
        set_opt("gdn_cp=1");
        set_opt("gdn_chunk=1");
        test_attention(1, 700);
        test_attention(1, 8000);
        test_attention(9, 0);
        test_attention(40, 100);
        prefill_attention_checks();
        if (restart_with("att_tc=0")) prefill_attention_checks(); /* the tiles' products as fp32 FMAs */
        set_opt("att_tc=1");
        if (restart_with("att_tile=0")) prefill_attention_checks(); /* k_attn_part, a block per (token, head) */
        set_opt("att_tile=1");
    }
    if (part == 1) return qt_finish();
    if (part != 3) {
        test_moe_shape(1, 256, 8, 2048, 512, 1, 1); /* one GEMV per (row, expert) */
        test_moe_shape(4, 256, 8, 2048, 512, 1, 1);
        test_moe_shape(16, 256, 8, 2048, 512, 1, 1);
        test_moe_shape(64, 256, 8, 2048, 512, 1, 1);
        test_moe_shape(128, 256, 8, 2048, 512, 0, 1); /* timing alone; from 96 rows grouped by expert */
        test_moe_shape(512, 256, 8, 2048, 512, 0, 1);  /* a prefill chunk */
        test_moe_shape(2048, 256, 8, 2048, 512, 0, 1); /* a 2048-token chunk: passes of 64 slots */
        test_moe_shape(300, 16, 4, 256, 64, 1, 0);     /* ~75 rows an expert: two passes of 64 */
        test_moe_shape(256, 64, 8, 2048, 512, 1, 0);   /* ~32 an expert at the real widths: one pass of 64 */
        if (restart_with("mg_p64=0")) { /* passes of 32 slots at every size */
            test_moe_shape(300, 16, 4, 256, 64, 1, 0);
            test_moe_shape(256, 64, 8, 2048, 512, 1, 0);
            test_moe_shape(2048, 256, 8, 2048, 512, 0, 1);
        }
        set_opt("mg_p64=1");
        if (restart_with("mg_min=16")) grouped_moe_checks(); /* grouped at fewer rows */
        if (restart_with("mg_cp=0")) grouped_moe_checks(); /* the register-form products, MG_MIN still 16 */
        set_opt("mg_cp=1");
        set_opt("mg_min=-1");
        if (restart_with("mg=0")) { /* the GEMV path at many rows */
            test_moe_shape(300, 16, 4, 256, 64, 1, 0);
            test_moe_shape(128, 256, 8, 2048, 512, 0, 1);
            test_moe_shape(512, 256, 8, 2048, 512, 0, 1);
        }
        set_opt("mg=1");
    }
    if (part == 2) return qt_finish();
    dec_rows_checks();
    test_dec_draw(248320);
    test_dec_draw_flat();
    test_dec_gdn_gn(16, 32, 128, 128); /* the step with out_proj's gated norm (the default one-row step); twice in a row */
    test_dec_gdn_chain(4, 16, 32, 128, 128);
    test_dec_gdn_gn(16, 32, 128, 128);
    test_dec_matmul(QF_PRE_GATED_NORM, 128, 96, 32, 3, 1); /* the fixtures' small heads */
    test_dec_gdn(3, 4, 8, 32, 32);
    test_dec_moe(3, 64, 4, 192, 32, 192, 0, 0);
    test_dec_moe(2, 256, 8, 2048, 512, 512, 0, 1);
    test_dec_moe(3, 64, 4, 192, 32, 192, 0, 1);
    /* one row: the one-kernel MoE (its grid count must be back at zero after each launch, or the
     * next launch's down rows would read gate/up rows not yet written), at the fixtures' shapes */
    routing_checks();
    sparsity_checks();
    quant_checks(0);
    dec_attention_checks();
    bench_dec_matmul(12352, 2048, 1); /* the DeltaNet in_proj */
    bench_dec_matmul(248320, 2048, 1);
    bench_gemv(248320, 2048, 1); /* the lm_head */
    bench_gemv(8192, 2048, 1);
    bench_gemv(248320, 2048, 4);
    switch_checks();
    bulk_checks();
    qf_cuda_backend_free(&gpu);
    return qt_finish();
}
