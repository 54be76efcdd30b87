/* Every CUDA op against the CPU reference op on random inputs of Qwen3.6-35B-A3B's real shapes,
 * plus the kernel bandwidth of the decode GEMV and the expert GEMV. Needs a GPU: without one
 * (or in a build without CUDA) it exits 77, which CTest reports as skipped. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/ops_cuda.h"
#include "base/dtype.h"
#include "base/numeric.h"
#include "base/timer.h"
#include "test_util.h"

static qf_backend gpu, ref = {&qf_cpu_ops_ref, NULL, NULL};

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
    return (qf_mat){QF_DT_BF16, p, rows, cols};
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
    free(x), free(w), free(st), free(y), free(beta), free(g), free(S), free(o);
    void *d[] = {dx, dw, dst, dy, dbeta, dg, dS, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* Paged cache with scrambled pages; the new keys written by kv_store on both sides. */
static void test_attention(int T, int pos0) {
    int nh = 16, nkv = 2, hd = 256, pt = 16, ctx = pos0 + T, np = (ctx + pt - 1) / pt + 3, qs = nh * 2 * hd;
    size_t layer = (size_t)pt * nkv * hd, stride = 2 * layer;
    float *pool = qt_rnd((size_t)np * stride, 1.0f), *q = qt_rnd((size_t)T * qs, 1.0f), *k = qt_rnd((size_t)T * nkv * hd, 1.0f), *v = qt_rnd((size_t)T * nkv * hd, 1.0f);
    int32_t *pages = malloc((size_t)np * 4);
    for (int i = 0; i < np; i++) pages[i] = (i * 7 + 3) % np;
    float *dpool = up_f(pool, (size_t)np * stride), *dq = up_f(q, (size_t)T * qs), *dk = up_f(k, (size_t)T * nkv * hd), *dv = up_f(v, (size_t)T * nkv * hd);
    int32_t *dpages = up(pages, (size_t)np * 4);
    float *o = malloc((size_t)T * nh * hd * 4), *dout = gpu.ops->alloc(&gpu, (size_t)T * nh * hd * 4);
    qf_attn_args a = {q, qs, 2 * hd, {pool, pages, pt, stride, 0, layer}, o, T, pos0, nh, nkv, hd, 1.0f / 16.0f, NULL, 0};
    ref.ops->kv_store(&ref, &a.kv, k, v, T, pos0, nkv, hd);
    ref.ops->attention(&ref, &a);
    qf_attn_args b = {dq, qs, 2 * hd, {dpool, dpages, pt, stride, 0, layer}, dout, T, pos0, nh, nkv, hd, 1.0f / 16.0f, NULL, 0};
    gpu.ops->kv_store(&gpu, &b.kv, dk, dv, T, pos0, nkv, hd);
    gpu.ops->attention(&gpu, &b);
    char s[64];
    snprintf(s, sizeof s, "%d queries at %d, 16/2 heads of 256", T, pos0);
    report("kv_store", s, cmp(dpool, pool, (size_t)np * stride), 1e-7);
    report("attention (paged)", s, cmp(dout, o, (size_t)T * nh * hd), 1e-5);
    free(pool), free(q), free(k), free(v), free(pages), free(o);
    void *d[] = {dpool, dq, dk, dv, dpages, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* The device MoE op against routing + expert MLPs done with the reference ops. */
static void test_moe(int N, int bench) {
    int E = 256, K = 8, H = 2048, I = 512;
    void *hgu, *hd;
    bf16_mat((int64_t)E * 2 * I, H, &hgu), bf16_mat((int64_t)E * H, I, &hd);
    qf_expert *host = malloc((size_t)E * sizeof *host), *dev = malloc((size_t)E * sizeof *dev);
    char *dgu = up(hgu, (size_t)E * 2 * I * H * 2), *ddn = up(hd, (size_t)E * H * I * 2);
    for (int e = 0; e < E; e++) {
        size_t og = (size_t)e * 2 * I * H * 2, ou = og + (size_t)I * H * 2, od = (size_t)e * H * I * 2;
        host[e] = (qf_expert){{QF_DT_BF16, (char *)hgu + og, I, H}, {QF_DT_BF16, (char *)hgu + ou, I, H}, {QF_DT_BF16, (char *)hd + od, H, I}};
        dev[e] = (qf_expert){{QF_DT_BF16, dgu + og, I, H}, {QF_DT_BF16, dgu + ou, I, H}, {QF_DT_BF16, ddn + od, H, I}};
    }
    float *rl = qt_rnd((size_t)N * E, 2.0f), *x = qt_rnd((size_t)N * H, 1.0f), *want = calloc((size_t)N * H, 4);
    float *gb = malloc((size_t)I * 4), *ub = malloc((size_t)I * 4), *hb = malloc((size_t)I * 4), *yb = malloc((size_t)H * 4);
    for (int r = 0; r < N; r++) {
        const float *l = rl + (size_t)r * E;
        float mx = l[0], sum = 0, w[8], ts = 0;
        int ti[8];
        for (int e = 1; e < E; e++) mx = fmaxf(mx, l[e]);
        for (int e = 0; e < E; e++) sum += expf(l[e] - mx);
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= ti[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ti[k] = best, w[k] = expf(l[best] - mx) / sum, ts += w[k];
        }
        for (int k = 0; k < K; k++) {
            ref.ops->matmul(&ref, &host[ti[k]].gate, x + (size_t)r * H, 1, gb);
            ref.ops->matmul(&ref, &host[ti[k]].up, x + (size_t)r * H, 1, ub);
            ref.ops->swiglu(&ref, gb, ub, I, 1, I, hb);
            ref.ops->matmul(&ref, &host[ti[k]].down, hb, 1, yb);
            ref.ops->axpy(&ref, want + (size_t)r * H, yb, w[k] / ts, H);
        }
    }
    float *drl = up_f(rl, (size_t)N * E), *dx = up_f(x, (size_t)N * H), *dout = gpu.ops->alloc(&gpu, (size_t)N * H * 4);
    qf_moe_args a = {dev, E, K, N, H, I, drl, dx, dout};
    gpu.ops->moe(&gpu, &a);
    char s[64];
    snprintf(s, sizeof s, "%d rows, 256 experts top-8, 2048/512", N);
    report("moe (route+experts)", s, cmp(dout, want, (size_t)N * H), 1e-4);
    if (bench) { /* 8 experts x 3 matrices of 512 x 2048 bf16 per row read */
        int reps = 200;
        qf_cuda_sync(&gpu);
        double t0 = qf_now();
        for (int i = 0; i < reps; i++) gpu.ops->moe(&gpu, &a);
        qf_cuda_sync(&gpu);
        double dt = (qf_now() - t0) / reps, bytes = (double)N * K * 3 * I * H * 2;
        fprintf(stderr, "  moe N=%d: %.1f us per call, %.0f GB/s of expert weights (%.0f%% of 4300 GB/s copy)\n", N, dt * 1e6, bytes / dt / 1e9,
                100 * bytes / dt / 4.3e12);
    }
    free(hgu), free(hd), free(host), free(dev), free(rl), free(x), free(want), free(gb), free(ub), free(hb), free(yb);
    void *d[] = {dgu, ddn, drl, dx, dout};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++) gpu.ops->free(&gpu, d[i]);
}

/* Decode GEMV bandwidth on a matrix far larger than L2. */
static void bench_gemv(int64_t rows, int64_t cols, int n) {
    void *hw;
    qf_mat w = bf16_mat(rows, cols, &hw);
    w.data = up(hw, (size_t)(rows * cols) * 2);
    free(hw);
    float *x = qt_rnd((size_t)n * cols, 1.0f), *dx = up_f(x, (size_t)n * cols), *dy = gpu.ops->alloc(&gpu, (size_t)n * rows * 4);
    gpu.ops->matmul(&gpu, &w, dx, n, dy);
    qf_cuda_sync(&gpu);
    int reps = 20;
    double t0 = qf_now();
    for (int i = 0; i < reps; i++) gpu.ops->matmul(&gpu, &w, dx, n, dy);
    qf_cuda_sync(&gpu);
    double dt = (qf_now() - t0) / reps, bytes = (double)rows * cols * 2;
    fprintf(stderr, "  gemv bf16 [%lld x %lld] n=%d: %.1f us, %.0f GB/s (%.0f%% of 4300 GB/s copy)\n", (long long)rows, (long long)cols, n,
            dt * 1e6, bytes / dt / 1e9, 100 * bytes / dt / 4.3e12);
    gpu.ops->free(&gpu, (void *)w.data), gpu.ops->free(&gpu, dx), gpu.ops->free(&gpu, dy);
    free(x);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    if (!qf_cuda_available() || qf_cuda_backend_init(&gpu, 0) != QF_OK) {
        fprintf(stderr, "test_cuda: skipped (%s)\n", qf_cuda_available() ? qf_last_error() : "no CUDA in this build");
        return 77;
    }
    fprintf(stderr, "test_cuda on %s\n", qf_cuda_device_name(&gpu));
    test_matmul(2048, 2048, 1, 1e-5);
    test_matmul(512, 2048, 3, 1e-5);
    test_matmul(4096, 2048, 8, 1e-5);
    test_matmul(2048, 4096, 1, 1e-5);
    test_matmul(248320 / 8, 2048, 2, 1e-5);
    test_matmul(2048, 2048, 64, 1e-4); /* cuBLAS, activations as two bf16 parts (QFLASH_CUDA_FP32=1: GEMV, exact) */
    test_matmul(8192, 2048, 300, 1e-4);
    test_small_ops();
    test_conv_gdn(1);
    test_conv_gdn(7);
    test_attention(1, 700);
    test_attention(1, 8000);
    test_attention(9, 0);
    test_attention(40, 100);
    test_moe(1, 1);
    test_moe(4, 1);
    test_moe(16, 1);
    bench_gemv(248320, 2048, 1); /* the lm_head */
    bench_gemv(8192, 2048, 1);
    bench_gemv(248320, 2048, 4);
    qf_cuda_backend_free(&gpu);
    return qt_finish();
}
