/* The whole model against the Hugging Face float64 references (shared/README.md): prefill logits,
 * greedy ids and their logits, per-layer hidden states, for the two random fixtures and the
 * trained bundled model, through the reference ops and the fastest ops of this CPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/ops_cuda.h"
#include "model/model.h"
#include "model/ref_forward.h"
#include "runtime/sampler.h"
#include "test_util.h"

#define TOL_LOGITS 1e-3
#define TOL_HIDDEN 1e-3
/* The CUDA default path feeds prefill activations to the tensor cores as two bf16 parts: a looser
 * tolerance, and a greedy id may differ only where the reference's top-2 gap is within the error. */
#define TOL_GPU_BF16 5e-2

static int g_gpu, g_lenient;
static double g_tol = TOL_LOGITS;

static double ref_gap(const float *l, int V) {
    int a = qt_argmax(l, V);
    float second = -INFINITY;
    for (int i = 0; i < V; i++)
        if (i != a && l[i] > second) second = l[i];
    return (double)l[a] - second;
}

typedef struct hidden_check {
    const qf_st_set *ref;
    double worst;
    int seen;
} hidden_check;

static void on_hidden(void *ud, int index, const float *h, int rows, int hidden) {
    hidden_check *hc = ud;
    char name[64];
    snprintf(name, sizeof name, "p0.hidden.%d", index);
    int64_t n;
    const float *want = qt_ref_f32(hc->ref, name, &n, NULL);
    CHECK(n == (int64_t)rows * hidden, "%s: %lld values, got %d rows", name, (long long)n, rows);
    double d = qt_max_abs_diff(h, want, n);
    if (d > hc->worst) hc->worst = d;
    CHECK(d < TOL_HIDDEN, "%s max abs diff %.3g", name, d);
    hc->seen++;
}

/* Prompt logits (all or the stored tail), then greedy steps checked id by id. */
static void check_prompt(const qf_model *m, qf_backend *be, qf_workspace *ws, const qf_st_set *ref, const char *p,
                         const char *logits_name, double *worst) {
    char name[64];
    int64_t n_in, n_gen, n_ref, ref_rows;
    int V = m->cfg.vocab;
    snprintf(name, sizeof name, "%s.input_ids", p);
    const int32_t *ids = qt_ref_i32(ref, name, &n_in);
    snprintf(name, sizeof name, "%s.gen_ids", p);
    const int32_t *gen = qt_ref_i32(ref, name, &n_gen);
    snprintf(name, sizeof name, "%s.%s", p, logits_name);
    const float *want = qt_ref_f32(ref, name, &n_ref, &ref_rows);
    snprintf(name, sizeof name, "%s.gen_logits", p);
    const float *want_gen = qt_ref_f32(ref, name, NULL, NULL);

    qf_state *st = qf_state_create(m, (int)(n_in + n_gen + 1));
    float *logits = malloc((size_t)n_in * V * sizeof(float));
    CHECK(qf_forward_seq(m, be, ws, st, ids, (int)n_in, QF_LOGITS_ALL, logits) == QF_OK, "%s", qf_last_error());
    double d = qt_max_abs_diff(logits + (n_in - ref_rows) * V, want, n_ref);
    *worst = d > *worst ? d : *worst;
    CHECK(d < g_tol, "%s prompt logits max abs diff %.3g", p, d);
    int next = qt_argmax(logits + (n_in - 1) * V, V), mismatches = 0, near_ties = 0;
    double gd = 0;
    for (int i = 0; i < n_gen; i++) {
        const float *ref_row = i == 0 ? want + (ref_rows - 1) * V : want_gen + (int64_t)i * V;
        if (next != gen[i] && g_lenient && ref_gap(ref_row, V) < 2 * (d > gd ? d : gd)) near_ties++;
        else if (next != gen[i]) mismatches++;
        int32_t tok = gen[i]; /* teacher-force the reference path so one flip is reported once */
        if (i + 1 == n_gen) break;
        CHECK(qf_forward_seq(m, be, ws, st, &tok, 1, QF_LOGITS_LAST, logits) == QF_OK, "%s", qf_last_error());
        double e = qt_max_abs_diff(logits, want_gen + (int64_t)(i + 1) * V, V);
        gd = e > gd ? e : gd;
        next = qt_argmax(logits, V);
    }
    *worst = gd > *worst ? gd : *worst;
    CHECK(mismatches == 0, "%s: %d of %lld greedy ids differ", p, mismatches, (long long)n_gen);
    CHECK(gd < g_tol, "%s generation logits max abs diff %.3g", p, gd);
    if (near_ties) fprintf(stderr, "%s: %d greedy ids differ where the reference's top-2 gap is within the error\n", p, near_ties);
    free(logits);
    qf_state_free(st);
}

/* compose: forward.c's decode path through the fused decode ops written as plain-op chains */
/* On a device: the ops' scratch reserved for the workspace's shapes (as the engine's load does), so
 * that check_scratch can ask that no op grew it: the bound's arithmetic held for these steps. */
static void reserve_scratch(const qf_model *m, qf_backend *be, const qf_workspace *ws) {
    if (!be->ops->scratch_reserve) return;
    qf_scratch_shape sh;
    qf_model_scratch_shape(m, ws, 0, &sh);
    CHECK(be->ops->scratch_reserve(be, &sh) == QF_OK, "%s", qf_last_error());
}

static void check_scratch(const char *dir, qf_backend *be) {
    if (!be->ops->scratch_grown) return;
    int grown = be->ops->scratch_grown(be);
    CHECK(grown == 0, "%s: the ops grew %d scratch buffers past the bound reserved for the workspace's shapes", dir, grown);
    fprintf(stderr, "%s: no scratch grown past the reserved bound\n", dir);
}

static void run_model(const char *dir, const char *logits_name, int n_prompts, const qf_ops *ops, int hidden, int compose) {
    qf_model *m;
    int rc = qf_model_load(&m, qt_path(dir), NULL);
    CHECK(rc == QF_OK, "load %s: %s", dir, qf_last_error());
    if (rc) return;
    char refpath[4096];
    snprintf(refpath, sizeof refpath, "%s/reference.safetensors", qt_path(dir));
    qf_st_set ref;
    CHECK(qf_st_open(&ref, refpath) == QF_OK, "%s", qf_last_error());
    qf_pool *pool = qf_pool_create(qf_cpu_count());
    qf_backend be = {ops, pool, NULL};
    if (g_gpu) {
        qf_cuda_opts o;
        qf_cuda_opts_default(&o);
        o.precision = g_lenient ? QF_PREC_BF16X2 : QF_PREC_FP32;
        CHECK(qf_cuda_backend_init(&be, 0, &o) == QF_OK && qf_model_to_device(m, &be, 0) == QF_OK, "%s", qf_last_error());
        ops = be.ops;
    }
    if (compose) {
        CHECK(qf_cpu_dec_compose_init(&be, ops, (size_t)4 << 20) == QF_OK && qf_model_to_device(m, &be, 0) == QF_OK, "%s", qf_last_error());
        CHECK(m->dec_ok, "%s: the fused decode ops do not take this model", dir);
    }
    /* a small workspace on purpose: prompts longer than 64 rows run in chunks */
    qf_workspace *ws = qf_workspace_create(m, 64);
    reserve_scratch(m, &be, ws);
    double worst = 0;
    if (hidden) {
        hidden_check hc = {&ref, 0, 0};
        int64_t n;
        const int32_t *ids = qt_ref_i32(&ref, "p0.input_ids", &n);
        qf_state *st = qf_state_create(m, 64);
        qf_workspace_set_hook(ws, on_hidden, &hc);
        CHECK(qf_forward_seq(m, &be, ws, st, ids, (int)n, QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
        qf_workspace_set_hook(ws, NULL, NULL);
        CHECK(hc.seen == m->cfg.n_layers + 1, "saw %d hidden states", hc.seen);
        fprintf(stderr, "%s [%s]: p0 hidden states max abs diff %.3g\n", dir, ops->name, hc.worst);
        qf_state_free(st);
    }
    for (int p = 0; p < n_prompts; p++) {
        char pn[16];
        snprintf(pn, sizeof pn, "p%d", p);
        check_prompt(m, &be, ws, &ref, pn, logits_name, &worst);
    }
    fprintf(stderr, "%s [%s%s%s]: largest logits error over %d prompts: %.3g\n", dir, ops->name, g_gpu && !g_lenient ? ", fp32" : "",
            compose ? ", decode through composed fused ops" : "", n_prompts, worst);
    check_scratch(dir, &be);
    qf_workspace_free(ws);
    qf_pool_destroy(pool);
    qf_st_close(&ref);
    qf_model_free(m);
    if (g_gpu) qf_cuda_backend_free(&be);
    if (compose) qf_cpu_dec_compose_free(&be);
}

/* The readable reference forward (model/ref_forward.c) against the Hugging Face references (the
 * stored rows of each prompt, all of its first `tokens`), and the fast forward against it on the
 * same tokens, every row: the yardstick and what it measures agree. */
static void check_ref_forward(const char *dir, const char *logits_name, int n_prompts, int tokens) {
    qf_model *m, *fm; /* the reference's weights stay in host memory; fm is the one the fast forward runs (on the GPU: a copy there) */
    CHECK(qf_model_load(&m, qt_path(dir), NULL) == QF_OK && qf_model_load(&fm, qt_path(dir), NULL) == QF_OK, "load %s: %s", dir, qf_last_error());
    char refpath[4096];
    snprintf(refpath, sizeof refpath, "%s/reference.safetensors", qt_path(dir));
    qf_st_set ref;
    CHECK(qf_st_open(&ref, refpath) == QF_OK, "%s", qf_last_error());
    qf_pool *pool = qf_pool_create(qf_cpu_count());
    qf_backend be = {qf_cpu_ops_best(), pool, NULL};
    if (g_gpu) {
        qf_cuda_opts o;
        qf_cuda_opts_default(&o);
        o.precision = QF_PREC_FP32;
        CHECK(qf_cuda_backend_init(&be, 0, &o) == QF_OK && qf_model_to_device(fm, &be, 0) == QF_OK, "%s", qf_last_error());
    }
    qf_workspace *ws = qf_workspace_create(fm, 64);
    int V = m->cfg.vocab;
    double vs_hf = 0, vs_fast = 0, tol = g_gpu ? 2 * TOL_LOGITS : TOL_LOGITS;
    for (int p = 0; p < n_prompts; p++) {
        char name[64];
        int64_t n_in, n_ref, ref_rows;
        snprintf(name, sizeof name, "p%d.input_ids", p);
        const int32_t *ids = qt_ref_i32(&ref, name, &n_in);
        snprintf(name, sizeof name, "p%d.%s", p, logits_name);
        const float *want = qt_ref_f32(&ref, name, &n_ref, &ref_rows);
        int T = tokens > 0 && tokens < n_in ? tokens : (int)n_in;
        float *slow = malloc((size_t)T * V * sizeof(float)), *fast = malloc((size_t)T * V * sizeof(float));
        qf_state *st = qf_state_create(fm, T + 1);
        CHECK(qf_model_ref_forward(m, ids, T, slow) == QF_OK, "%s p%d: %s", dir, p, qf_last_error());
        CHECK(qf_forward_seq(fm, &be, ws, st, ids, T, QF_LOGITS_ALL, fast) == QF_OK, "%s", qf_last_error());
        double d = qt_max_abs_diff(fast, slow, (int64_t)T * V);
        vs_fast = d > vs_fast ? d : vs_fast;
        CHECK(d < tol, "%s p%d: the fast forward%s is %.3g from the reference forward", dir, p, g_gpu ? " (GPU, fp32)" : "", d);
        if (T == n_in) { /* the whole prompt: its stored rows are HF's */
            double h = qt_max_abs_diff(slow + (T - ref_rows) * V, want, n_ref);
            vs_hf = h > vs_hf ? h : vs_hf;
            CHECK(h < TOL_LOGITS, "%s p%d: the reference forward is %.3g from HF's logits", dir, p, h);
        }
        qf_state_free(st);
        free(slow), free(fast);
    }
    fprintf(stderr, "%s: the reference forward within %.3g of HF's logits, the fast forward%s within %.3g of it\n", dir, vs_hf, g_gpu ? " (GPU, fp32)" : "", vs_fast);
    qf_workspace_free(ws);
    qf_pool_destroy(pool);
    qf_st_close(&ref);
    qf_model_free(fm);
    qf_model_free(m);
    if (g_gpu) qf_cuda_backend_free(&be);
}

/* Two sequences in one batched forward (one prefilling, one decoding), their KV pages interleaved
 * in one small shared pool, give bit for bit the logits each gives alone: the batch shares
 * projections, never state, and the server's exactness rests on this. */
static void check_batching(const char *dir) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    qf_workspace *ws = qf_workspace_create(m, 64);
    int V = m->cfg.vocab;
    int32_t a[12] = {5, 17, 300, 42, 9, 1000, 77, 3, 8, 250, 11, 600}, b[5] = {1500, 2, 2, 700, 31};
    qf_kv_pool *pool = qf_kv_pool_create(m, 4, 5);
    qf_state *sa = qf_state_create_paged(m, pool, 32), *sb = qf_state_create_paged(m, pool, 32), *ra = qf_state_create(m, 32), *rb = qf_state_create(m, 32);
    float *la = malloc((size_t)V * 4 * 12), *lb = malloc((size_t)V * 4), *wa = malloc((size_t)V * 4 * 12), *wb = malloc((size_t)V * 4);
    /* sequence b first gets 4 tokens alone, then its 5th token rides along with all of a */
    CHECK(qf_forward_seq(m, &be, ws, sb, b, 4, QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
    qf_seq_step steps[2] = {{sa, a, 12, QF_LOGITS_ALL, la, NULL, 0, 0, NULL, NULL, NULL}, {sb, b + 4, 1, QF_LOGITS_LAST, lb, NULL, 0, 0, NULL, NULL, NULL}};
    CHECK(qf_forward(m, &be, ws, steps, 2) == QF_OK, "%s", qf_last_error());
    CHECK(qf_forward_seq(m, &be, ws, ra, a, 12, QF_LOGITS_ALL, wa) == QF_OK, "%s", qf_last_error());
    /* b alone decodes its 5th token as a one-row step, as a lone stream does */
    CHECK(qf_forward_seq(m, &be, ws, rb, b, 4, QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
    CHECK(qf_forward_seq(m, &be, ws, rb, b + 4, 1, QF_LOGITS_LAST, wb) == QF_OK, "%s", qf_last_error());
    double da = qt_max_abs_diff(la, wa, (int64_t)V * 12), db = qt_max_abs_diff(lb, wb, V);
    CHECK(da == 0 && db == 0, "%s batched vs alone: %.3g / %.3g", dir, da, db);
    int32_t bad = V;
    qf_seq_step oob = {sa, &bad, 1, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, NULL, NULL};
    CHECK(qf_forward(m, &be, ws, &oob, 1) == QF_EINVAL && sa->pos == 12, "out-of-range token accepted");
    /* a holds 3 pages and b 2: the pool is empty, so a 13th token of a must fail and change nothing */
    int32_t more = 5;
    qf_seq_step full = {sa, &more, 1, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, NULL, NULL};
    CHECK(qf_kv_pool_free_pages(pool) == 0 && qf_forward(m, &be, ws, &full, 1) == QF_ENOMEM && sa->pos == 12,
          "%s: full KV pool not reported (%d free)", dir, qf_kv_pool_free_pages(pool));
    qf_state_reset(sb);
    CHECK(qf_kv_pool_free_pages(pool) == 2 && qf_forward(m, &be, ws, &full, 1) == QF_OK, "reset did not return pages");
    free(la), free(lb), free(wa), free(wb);
    qf_state_free(sa), qf_state_free(sb), qf_state_free(ra), qf_state_free(rb);
    CHECK(qf_kv_pool_free_pages(pool) == 5, "freed states kept pages");
    qf_kv_pool_free(pool);
    qf_workspace_free(ws);
    qf_model_free(m);
}

/* QF_LOGITS_TOP1 returns the id the logits of LAST would give (the first index of the largest),
 * for a prefilling sequence and a decoding one in one batch, with one sequence asking LAST. */
static void check_top1(const char *dir) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    qf_workspace *ws = qf_workspace_create(m, 64);
    int V = m->cfg.vocab;
    int32_t a[6] = {5, 17, 300, 42, 9, 1000}, b[3] = {1500, 2, 700}, ia = -1, ib = -1;
    qf_state *sa = qf_state_create(m, 16), *sb = qf_state_create(m, 16), *sc = qf_state_create(m, 16), *ra = qf_state_create(m, 16),
             *rb = qf_state_create(m, 16);
    float *wa = malloc((size_t)V * 4), *wb = malloc((size_t)V * 4), *lc = malloc((size_t)V * 4);
    CHECK(qf_forward_seq(m, &be, ws, sb, b, 2, QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
    qf_seq_step steps[3] = {{sa, a, 6, QF_LOGITS_TOP1, NULL, &ia, 0, 0, NULL, NULL, NULL}, {sb, b + 2, 1, QF_LOGITS_TOP1, NULL, &ib, 0, 0, NULL, NULL, NULL}, {sc, b, 3, QF_LOGITS_LAST, lc, NULL, 0, 0, NULL, NULL, NULL}};
    CHECK(qf_forward(m, &be, ws, steps, 3) == QF_OK, "%s", qf_last_error());
    CHECK(qf_forward_seq(m, &be, ws, ra, a, 6, QF_LOGITS_LAST, wa) == QF_OK, "%s", qf_last_error());
    CHECK(qf_forward_seq(m, &be, ws, rb, b, 3, QF_LOGITS_LAST, wb) == QF_OK, "%s", qf_last_error());
    CHECK(ia == qt_argmax(wa, V) && ib == qt_argmax(wb, V), "%s: TOP1 picks %d %d, LAST logits give %d %d", dir, ia, ib, qt_argmax(wa, V),
          qt_argmax(wb, V));
    CHECK(qt_max_abs_diff(lc, wb, V) == 0, "%s: LAST beside TOP1 rows changed", dir);
    free(wa), free(wb), free(lc);
    qf_state_free(sa), qf_state_free(sb), qf_state_free(sc), qf_state_free(ra), qf_state_free(rb);
    qf_workspace_free(ws);
    qf_model_free(m);
}

/* A backend with fused decode ops for m: the GPU's, or the CPU's composed ones (CI). 1: ready. */
static int dec_backend_open(qf_backend *be, qf_model *m, int gpu) {
    qf_cuda_opts o; /* the defaults, or QFLASH_CUDA_OPTS's (tools/gpu-check.sh chain turns kernels off one by one) */
    qf_cuda_opts_default(&o);
    int ok = gpu ? qf_cuda_opts_from_env(&o) == QF_OK && qf_cuda_backend_init(be, 0, &o) == QF_OK
                 : qf_cpu_dec_compose_init(be, qf_cpu_ops_best(), (size_t)4 << 20) == QF_OK;
    return ok && qf_model_to_device(m, be, 0) == QF_OK;
}

static void dec_backend_close(qf_backend *be, int gpu) {
    if (gpu) qf_cuda_backend_free(be);
    else qf_cpu_dec_compose_free(be);
}

/* The n tokens fed to st one a step: each step's logits (V floats a row) and, where hidden is
 * given, its hidden state (H floats a row). */
static void one_a_step(qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st, const int32_t *tok, int n, float *logits, float *hidden) {
    int V = m->cfg.vocab, H = m->cfg.hidden;
    for (int i = 0; i < n; i++) {
        qf_seq_step u = {st, tok + i, 1, QF_LOGITS_LAST, logits + (size_t)i * V, NULL, 0, 0, NULL, hidden ? hidden + (size_t)i * H : NULL, NULL};
        CHECK(qf_forward(m, be, ws, &u, 1) == QF_OK, "%s", qf_last_error());
    }
}

/* Verifies through the fused decode ops (sequences of several tokens wanting every logit: their
 * rows chained through their states in waves, model.h QF_DEC_CHAIN), a 4-row and a 2-row one
 * beside a one-token sequence: each row's logits and hidden state as the same tokens fed one a
 * step, and the states left the same (the next step's logits equal). On the CPU's composed ops
 * (CI) or the GPU. */
static void check_chain(const char *dir, int gpu) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    CHECK(dec_backend_open(&be, m, gpu) && m->dec_ok, "%s: %s", dir, qf_last_error());
    qf_workspace *ws = qf_workspace_create(m, 64);
    reserve_scratch(m, &be, ws);
    int V = m->cfg.vocab, H = m->cfg.hidden, D = 4, E = 2;
    int32_t p[6] = {5, 17, 300, 42, 9, 1000}, d[4] = {77, 1500, 2, 700}, one = 33;
    qf_state *st[6]; /* chained 4, chained 2, the one-token row; their twins fed one a step */
    for (int i = 0; i < 6; i++) st[i] = qf_state_create(m, 32);
    size_t LV = (size_t)V * 4, LH = (size_t)H * 4;
    float *la = malloc(D * LV), *lb = malloc(D * LV), *ha = malloc(D * LH), *hb = malloc(D * LH), *le = malloc(E * LV), *lf = malloc(E * LV);
    float *lc = malloc(LV), *ld = malloc(LV), *ea = malloc(3 * LV), *eb = malloc(3 * LV);
    for (int i = 0; i < 6; i++) p[i] %= V;
    for (int i = 0; i < 4; i++) d[i] %= V;
    for (int i = 0; i < 6; i++) CHECK(qf_forward_seq(m, &be, ws, st[i], p, 6 - (i % 3 == 1), QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
    qf_seq_step v[3] = {{st[2], &one, 1, QF_LOGITS_LAST, lc, NULL, 0, 0, NULL, NULL, NULL},
                        {st[0], d, D, QF_LOGITS_ALL, la, NULL, 0, 0, NULL, ha, NULL},
                        {st[1], d + 1, E, QF_LOGITS_ALL, le, NULL, 0, 0, NULL, NULL, NULL}};
    CHECK(qf_forward(m, &be, ws, v, 3) == QF_OK, "%s", qf_last_error());
    one_a_step(m, &be, ws, st[3], d, D, lb, hb);
    one_a_step(m, &be, ws, st[4], d + 1, E, lf, NULL);
    one_a_step(m, &be, ws, st[5], &one, 1, ld, NULL);
    for (int i = 0; i < 3; i++) { /* the states after: one more step each */
        one_a_step(m, &be, ws, st[i], &one, 1, ea + (size_t)i * V, NULL);
        one_a_step(m, &be, ws, st[i + 3], &one, 1, eb + (size_t)i * V, NULL);
        CHECK(st[i]->pos == st[i + 3]->pos, "%s: positions %d and %d", dir, st[i]->pos, st[i + 3]->pos);
    }
    double dl = qt_max_abs_diff(la, lb, (size_t)D * V), dh = qt_max_abs_diff(ha, hb, (size_t)D * H), de = qt_max_abs_diff(le, lf, (size_t)E * V);
    double dc = qt_max_abs_diff(lc, ld, V), dn = qt_max_abs_diff(ea, eb, (size_t)3 * V);
    /* This step holds 7 rows, past the GPU's tensor-core threshold (option dec_tc, 5), so there
     * its products take two bf16 parts on the tensor cores while one token a step takes the GEMV
     * kernels: the same to their rounding, as any sequence batched with 4 or more others, and the
     * same picks (check_chain_alone asks the bits below the threshold). The CPU's composed ops
     * take every row alike: the same bits. */
    double tol = gpu ? 2e-4 : 0.0;
    int same_top = 1;
    for (int i = 0; i < D; i++) same_top &= qt_argmax(la + (size_t)i * V, V) == qt_argmax(lb + (size_t)i * V, V);
    for (int i = 0; i < E; i++) same_top &= qt_argmax(le + (size_t)i * V, V) == qt_argmax(lf + (size_t)i * V, V);
    CHECK(dl <= tol && dh <= tol && de <= tol && dc <= tol && dn <= tol && same_top,
          "%s: chained verifies against one token a step: logits %.3g / %.3g, hidden %.3g, the row beside them %.3g, the steps after %.3g (%s %g), "
          "same top tokens %d",
          dir, dl, de, dh, dc, dn, gpu ? "at most" : "want", tol, same_top);
    fprintf(stderr, "%s [%s]: a %d-row and a %d-row verify beside a decode row: logits, hidden states and the states after as one token a step (largest "
            "difference %.3g)\n", dir, gpu ? "cuda" : "composed", D, E, fmax(fmax(dl, dh), fmax(fmax(de, dc), dn)));
    check_scratch(dir, &be);
    free(la), free(lb), free(ha), free(hb), free(le), free(lf), free(lc), free(ld), free(ea), free(eb);
    for (int i = 0; i < 6; i++) qf_state_free(st[i]);
    qf_workspace_free(ws);
    qf_model_free(m);
    dec_backend_close(&be, gpu);
}

/* One sequence alone verifying 3 drafts (4 rows, under the GPU's tensor-core threshold): every
 * row's logits and hidden state, and the state after, the bits of the same tokens one a step. */
static void check_chain_alone(const char *dir, int gpu) {
    enum { D = 4 };
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    CHECK(dec_backend_open(&be, m, gpu) && m->dec_ok, "%s: %s", dir, qf_last_error());
    qf_workspace *ws = qf_workspace_create(m, 64);
    int V = m->cfg.vocab, H = m->cfg.hidden;
    int32_t p[5] = {5, 17, 300, 42, 9}, d[D] = {77, 1500, 2, 700}, one = 33;
    for (int i = 0; i < 5; i++) p[i] %= V;
    for (int i = 0; i < D; i++) d[i] %= V;
    qf_state *a = qf_state_create(m, 32), *b = qf_state_create(m, 32);
    float *la = malloc((size_t)(D + 1) * V * 4), *lb = malloc((size_t)(D + 1) * V * 4), *ha = malloc((size_t)D * H * 4), *hb = malloc((size_t)D * H * 4);
    CHECK(qf_forward_seq(m, &be, ws, a, p, 5, QF_LOGITS_NONE, NULL) == QF_OK && qf_forward_seq(m, &be, ws, b, p, 5, QF_LOGITS_NONE, NULL) == QF_OK, "%s",
          qf_last_error());
    qf_seq_step v = {a, d, D, QF_LOGITS_ALL, la, NULL, 0, 0, NULL, ha, NULL};
    CHECK(qf_forward(m, &be, ws, &v, 1) == QF_OK, "%s", qf_last_error());
    one_a_step(m, &be, ws, b, d, D, lb, hb);
    one_a_step(m, &be, ws, a, &one, 1, la + (size_t)D * V, NULL); /* the states after */
    one_a_step(m, &be, ws, b, &one, 1, lb + (size_t)D * V, NULL);
    double dl = qt_max_abs_diff(la, lb, (size_t)(D + 1) * V), dh = qt_max_abs_diff(ha, hb, (size_t)D * H);
    CHECK(dl == 0 && dh == 0, "%s: a verify of %d rows alone against one token a step: logits (and the step after) %.3g, hidden %.3g", dir, D, dl, dh);
    if (dl == 0 && dh == 0)
        fprintf(stderr, "%s [%s]: a %d-row verify alone: logits, hidden states and the state after as one token a step, bit for bit\n", dir,
                gpu ? "cuda" : "composed", D);
    free(la), free(lb), free(ha), free(hb);
    qf_state_free(a), qf_state_free(b);
    qf_workspace_free(ws);
    qf_model_free(m);
    dec_backend_close(&be, gpu);
}

/* QF_LOGITS_DRAW on a backend with the draw op (the CPU's composed fused ops, or the GPU's): a
 * prompt-path step (a prefilling sequence drawing beside a TOP1 and a LAST one) and a decode step
 * (rows drawing beside NONE and TOP1 rows) pick, for each drawing row, what the host sampler picks
 * from the same logits with the same uniform number (its twin sampler, same seed and history). */
static void check_draw(const char *dir, int gpu) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    qf_pool *pool = qf_pool_create(2);
    qf_backend be = {qf_cpu_ops_best(), pool, NULL};
    int ok = dec_backend_open(&be, m, gpu);
    CHECK(ok, "%s", qf_last_error());
    qf_workspace *ws = qf_workspace_create(m, 64);
    int V = m->cfg.vocab, mism = 0, draws = 0;
    qf_sampling sp[3] = {{0.8f, 20, 0.9f, 0.0f, 1.1f, 0.3f, 0.2f, 7}, {1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 8}, {0.7f, 0, 0.8f, 0.05f, 1.0f, 0.0f, 0.0f, 9}};
    float *lg = malloc((size_t)V * 4 * 6), *ref = malloc((size_t)V * 4);
    for (int round = 0; round < 8 && ok; round++) {
        qf_state *st[6], *tw[6];
        qf_sampler *smp[3], *twin[3];
        qf_draw d[3];
        int32_t toks[6][8], pick[6] = {0};
        for (int i = 0; i < 6; i++) {
            st[i] = qf_state_create(m, 32), tw[i] = qf_state_create(m, 32);
            for (int k = 0; k < 8; k++) toks[i][k] = (int32_t)((round * 131 + i * 17 + k * 7) % V);
        }
        for (int i = 0; i < 3; i++) {
            smp[i] = qf_sampler_create(V, &sp[i]), twin[i] = qf_sampler_create(V, &sp[i]);
            for (int k = 0; k < 5; k++) qf_sampler_accept(smp[i], toks[i][k], k > 2), qf_sampler_accept(twin[i], toks[i][k], k > 2);
            qf_sampler_draw_desc(smp[i], &d[i]);
        }
        /* the prompt path: sequence 0 prefills 6 tokens and draws, 3 picks greedily, 4 wants LAST */
        qf_seq_step a[3] = {{st[0], toks[0], 6, QF_LOGITS_DRAW, lg, &pick[0], 0, 0, NULL, NULL, &d[0]},
                            {st[3], toks[3], 2, QF_LOGITS_TOP1, NULL, &pick[3], 0, 0, NULL, NULL, NULL},
                            {st[4], toks[4], 3, QF_LOGITS_LAST, lg + V, NULL, 0, 0, NULL, NULL, NULL}};
        CHECK(qf_forward(m, &be, ws, a, 3) == QF_OK, "%s", qf_last_error());
        /* the decode path: 1 and 2 prefill first, then one token each beside 5 (NONE) and 3 (TOP1) */
        for (int i = 1; i < 3; i++) CHECK(qf_forward_seq(m, &be, ws, st[i], toks[i], 5, QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
        CHECK(qf_forward_seq(m, &be, ws, st[5], toks[5], 5, QF_LOGITS_NONE, NULL) == QF_OK, "%s", qf_last_error());
        qf_seq_step b[4] = {{st[1], toks[1] + 5, 1, QF_LOGITS_DRAW, lg + 2 * V, &pick[1], 0, 0, NULL, NULL, &d[1]},
                            {st[5], toks[5] + 5, 1, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, NULL, NULL},
                            {st[2], toks[2] + 5, 1, QF_LOGITS_DRAW, lg + 3 * V, &pick[2], 0, 0, NULL, NULL, &d[2]},
                            {st[3], toks[3] + 2, 1, QF_LOGITS_TOP1, NULL, &pick[3], 0, 0, NULL, NULL, NULL}};
        CHECK(qf_forward(m, &be, ws, b, 4) == QF_OK, "%s", qf_last_error());
        const int n_in[3] = {6, 6, 6};
        for (int i = 0; i < 3; i++) { /* the twin: the same tokens plainly, LAST logits, the host's pick with the same number */
            CHECK(qf_forward_seq(m, &be, ws, tw[i], toks[i], n_in[i], QF_LOGITS_LAST, ref) == QF_OK, "%s", qf_last_error());
            int32_t want = qf_sampler_sample_u(twin[i], ref, d[i].u);
            mism += pick[i] != want, draws++;
            if (pick[i] != want) fprintf(stderr, "  draw: round %d row %d picked %d, the host %d\n", round, i, pick[i], want);
        }
        for (int i = 0; i < 6; i++) qf_state_free(st[i]), qf_state_free(tw[i]);
        for (int i = 0; i < 3; i++) qf_sampler_free(smp[i]), qf_sampler_free(twin[i]);
    }
    CHECK(mism == 0, "%s: %d of %d device draws differ from the host sampler's", dir, mism, draws);
    fprintf(stderr, "%s [%s]: %d draws (prompt and decode steps) as the host sampler's\n", dir, gpu ? "cuda" : "composed", draws);
    free(lg), free(ref);
    qf_workspace_free(ws);
    qf_model_free(m);
    dec_backend_close(&be, gpu);
    qf_pool_destroy(pool);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    const char *dev = getenv("QFLASH_TEST_DEVICE");
    if (dev && strcmp(dev, "cuda-chain") == 0) { /* the chain checks alone (tools/gpu-check.sh chain, once per kernel option) */
        check_chain("models/qwen36moe-code-14m", 1);
        check_chain_alone("models/qwen36moe-code-14m", 1);
        return qt_finish();
    }
    if (dev && strcmp(dev, "cuda") == 0) { /* the same references on the GPU (run by hand there), in both precisions */
        for (g_lenient = 1; g_lenient >= 0; g_lenient--) {
            g_gpu = 1, g_tol = g_lenient ? TOL_GPU_BF16 : TOL_LOGITS;
            run_model("tests/data/qwen35moe-tiny", "logits", 4, NULL, 0, 0);
            run_model("tests/data/qwen35-tiny", "logits", 4, NULL, 0, 0);
            run_model("models/qwen36moe-code-14m", "logits_tail", 5, NULL, 0, 0);
        }
        g_gpu = 1, g_lenient = 0;
        check_ref_forward("tests/data/qwen35moe-tiny", "logits", 4, 0);
        check_ref_forward("models/qwen36moe-code-14m", "logits_tail", 2, 24);
        check_draw("models/qwen36moe-code-14m", 1);
        check_chain("models/qwen36moe-code-14m", 1);
        check_chain_alone("models/qwen36moe-code-14m", 1);
        return qt_finish();
    }
    const qf_ops *tables[2] = {&qf_cpu_ops_ref, qf_cpu_ops_best()};
    for (int i = 0; i < 2; i++) {
        if (i == 1 && tables[1] == tables[0]) break;
        run_model("tests/data/qwen35moe-tiny", "logits", 4, tables[i], 1, 0);
        run_model("tests/data/qwen35-tiny", "logits", 4, tables[i], 1, 0);
    }
    run_model("models/qwen36moe-code-14m", "logits_tail", 5, qf_cpu_ops_best(), 0, 0);
    check_ref_forward("tests/data/qwen35moe-tiny", "logits", 4, 0);
    check_ref_forward("tests/data/qwen35-tiny", "logits", 4, 0);
    check_ref_forward("models/qwen36moe-code-14m", "logits_tail", 2, 24);
    /* the decode path (one token per step through the fused ops) against the same references */
    run_model("tests/data/qwen35moe-tiny", "logits", 4, &qf_cpu_ops_ref, 0, 1);
    run_model("models/qwen36moe-code-14m", "logits_tail", 5, qf_cpu_ops_best(), 0, 1);
    check_batching("tests/data/qwen35moe-tiny");
    check_batching("tests/data/qwen35-tiny");
    check_top1("tests/data/qwen35moe-tiny");
    check_draw("tests/data/qwen35moe-tiny", 0);
    check_draw("models/qwen36moe-code-14m", 0);
    check_chain("tests/data/qwen35moe-tiny", 0);
    check_chain("models/qwen36moe-code-14m", 0);
    check_chain_alone("tests/data/qwen35moe-tiny", 0);
    check_chain_alone("models/qwen36moe-code-14m", 0);
    return qt_finish();
}
