/* The expert store's contract, with two fake stores wrapped around a model's own:
 * - a moving store: between steps every expert moves to another buffer (the old one is filled
 *   with NaNs) and the tables' version changes; the logits must stay bit for bit those of the
 *   store that never moves, through the host path (acquire/release) and the fused decode path
 *   (table(), composed from plain ops on the CPU), and the chosen-id arrays must be written;
 * - a failing store: once armed, acquire and table fail; the step returns the store's message,
 *   the scheduler fails that request with it, and a request after the failure is served. */
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/dtype.h"
#include "base/err.h"
#include "backend/backend.h"
#include "experts/cache_policy.h"
#include "experts/plan.h"
#include "format/st_write.h"
#include "runtime/sched.h"
#include "test_util.h"
#include "backend/rules.h"

#define MODEL "tests/data/qwen35moe-tiny"
#define STEPS 12

typedef struct fake_store {
    qf_expert_store base;
    qf_expert_store *inner; /* the model's store, owned */
    int n_layers, n_experts, top_k;
    int moving, cur;        /* moving: two copies of every expert, cur the live one */
    char *mem[2];
    size_t per_expert;
    qf_expert *views[2];    /* [2][n_layers * n_experts] */
    const void **dev[2];    /* [2][n_layers][3 * n_experts] */
    int32_t *chosen;        /* [n_layers][QF_EXPERT_ID_ROWS * top_k] */
    uint64_t version;
    int fail;               /* armed: acquire and table fail */
} fake_store;

static size_t mat_bytes(const qf_mat *w) { return (size_t)(w->rows * w->cols) * qf_dtype_size(w->dtype); }

static int fake_acquire(qf_expert_store *s, int L, int e, qf_expert *out) {
    fake_store *f = (fake_store *)s;
    if (f->fail) return qf_fail(QF_EIO, "expert %d of layer %d: injected read failure", e, L);
    if (!f->moving) return f->inner->ops->acquire(f->inner, L, e, out);
    *out = f->views[f->cur][L * f->n_experts + e];
    return QF_OK;
}

static void fake_release(qf_expert_store *s, int L, int e) {
    fake_store *f = (fake_store *)s;
    if (!f->moving) f->inner->ops->release(f->inner, L, e);
}

static int fake_table(qf_expert_store *s, int L, qf_expert_table *out) {
    fake_store *f = (fake_store *)s;
    if (f->fail) return qf_fail(QF_EIO, "layer %d's experts: injected read failure", L);
    if (!f->moving) return f->inner->ops->table(f->inner, L, out);
    size_t E = (size_t)f->n_experts;
    *out = (qf_expert_table){&f->views[f->cur][L * E], f->dev[f->cur] + (size_t)L * 3 * E, f->chosen + (size_t)L * QF_EXPERT_ID_ROWS * f->top_k,
                             f->version, NULL};
    return QF_OK;
}

static void fake_destroy(qf_expert_store *s) {
    fake_store *f = (fake_store *)s;
    qf_es_destroy(f->inner);
    for (int i = 0; i < 2; i++) free(f->mem[i]), free(f->views[i]), free(f->dev[i]);
    free(f->chosen);
    free(f);
}

static const qf_expert_store_ops k_fake_ops = {fake_acquire, fake_release, NULL, fake_destroy, fake_table, NULL, NULL, NULL, NULL, NULL};

/* The same, taking wide steps too: so a long prompt runs layer by layer. */
static int fake_wide_table(qf_expert_store *s, int L, int rows, qf_expert_table *out) { return (void)rows, fake_table(s, L, out); }
static const qf_expert_store_ops k_fake_wide_ops = {fake_acquire, fake_release, NULL, fake_destroy, fake_table, NULL, fake_wide_table, NULL, NULL, NULL};

/* Copy c of every expert filled from the inner store, its views and device tables made. */
static void fill_copy(fake_store *f, int c) {
    for (int L = 0; L < f->n_layers; L++)
        for (int e = 0; e < f->n_experts; e++) {
            qf_expert x;
            f->inner->ops->acquire(f->inner, L, e, &x);
            char *at = f->mem[c] + ((size_t)L * f->n_experts + e) * f->per_expert;
            qf_mat *m[3] = {&x.gate, &x.up, &x.down};
            for (int i = 0; i < 3; i++) {
                memcpy(at, m[i]->data, mat_bytes(m[i]));
                m[i]->data = at;
                at += mat_bytes(m[i]);
            }
            f->inner->ops->release(f->inner, L, e);
            f->views[c][L * f->n_experts + e] = x;
            const void **d = f->dev[c] + (size_t)L * 3 * f->n_experts;
            d[e] = x.gate.data, d[f->n_experts + e] = x.up.data, d[2 * f->n_experts + e] = x.down.data;
        }
}

/* Every expert to the other copy; the one left is poisoned (all-ones bytes: NaN in bf16 and fp32). */
static void move_all(fake_store *f) {
    fill_copy(f, f->cur ^ 1);
    memset(f->mem[f->cur], 0xff, (size_t)f->n_layers * f->n_experts * f->per_expert);
    f->cur ^= 1;
    f->version++;
}

static fake_store *wrap(qf_model *m, int moving) {
    const qf_config *c = &m->cfg;
    fake_store *f = calloc(1, sizeof *f);
    f->base.ops = &k_fake_ops;
    f->inner = m->experts;
    f->n_layers = c->n_layers, f->n_experts = c->n_experts, f->top_k = c->n_experts_used;
    f->version = 1;
    m->experts = &f->base;
    if (!moving) return f;
    qf_expert x;
    f->inner->ops->acquire(f->inner, 0, 0, &x);
    f->per_expert = mat_bytes(&x.gate) + mat_bytes(&x.up) + mat_bytes(&x.down);
    size_t n = (size_t)f->n_layers * f->n_experts;
    for (int i = 0; i < 2; i++) {
        f->mem[i] = malloc(n * f->per_expert);
        f->views[i] = calloc(n, sizeof(qf_expert));
        f->dev[i] = calloc(3 * n, sizeof(void *));
    }
    f->chosen = malloc((size_t)f->n_layers * QF_EXPERT_ID_ROWS * f->top_k * sizeof(int32_t));
    memset(f->chosen, 0xff, (size_t)f->n_layers * QF_EXPERT_ID_ROWS * f->top_k * sizeof(int32_t));
    f->moving = 1;
    fill_copy(f, 0);
    return f;
}

/* A five-token prompt, then STEPS greedy steps: every step's logits into out [STEPS + 1][vocab].
 * f (may be NULL): a moving store whose experts move before every step. The first failure's code. */
static int greedy_steps(qf_model *m, qf_backend *be, fake_store *f, float *out) {
    int V = m->cfg.vocab;
    qf_workspace *ws = qf_workspace_create(m, 64);
    qf_state *st = qf_state_create(m, 64);
    int32_t prompt[5] = {11, 400, 23, 7, 91};
    int rc = ws && st ? qf_forward_seq(m, be, ws, st, prompt, 5, QF_LOGITS_LAST, out) : QF_ENOMEM;
    for (int s = 1; rc == QF_OK && s <= STEPS; s++) {
        if (f) move_all(f);
        int32_t tok = qt_argmax(out + (size_t)(s - 1) * V, V);
        rc = qf_forward_seq(m, be, ws, st, &tok, 1, QF_LOGITS_LAST, out + (size_t)s * V);
    }
    qf_state_free(st);
    qf_workspace_free(ws);
    return rc;
}

/* greedy_steps on MODEL, its experts moving (or not). compose: the fused decode ops as plain-op
 * chains (the path of a device backend, on the CPU). */
static void run(int moving, int compose, float *out) {
    qf_model *m;
    int rc = qf_model_load(&m, qt_path(MODEL), NULL);
    CHECK(rc == QF_OK, "%s", qf_last_error());
    if (rc) return;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    if (compose) {
        CHECK(qf_cpu_dec_compose_init(&be, qf_cpu_ops_best(), (size_t)4 << 20) == QF_OK && qf_model_to_device(m, &be, 0) == QF_OK, "%s",
              qf_last_error());
        CHECK(m->dec_ok, "the composed decode ops do not take " MODEL);
    }
    fake_store *f = moving ? wrap(m, 1) : NULL;
    CHECK(greedy_steps(m, &be, f, out) == QF_OK, "%s", qf_last_error());
    if (f && compose) { /* the decode steps wrote the ids they chose: top_k distinct experts a layer */
        int bad = 0;
        for (int L = 0; L < m->cfg.n_layers; L++)
            for (int k = 0; k < f->top_k; k++) {
                int32_t id = f->chosen[(size_t)L * QF_EXPERT_ID_ROWS * f->top_k + k];
                bad += id < 0 || id >= f->n_experts;
                for (int j = 0; j < k; j++) bad += f->chosen[(size_t)L * QF_EXPERT_ID_ROWS * f->top_k + j] == id;
            }
        CHECK(bad == 0, "%d chosen expert ids missing, out of range or repeated", bad);
    }
    qf_model_free(m);
    if (compose) qf_cpu_dec_compose_free(&be);
}

static void test_moving_store(int compose) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
    size_t n = (size_t)(STEPS + 1) * m->cfg.vocab;
    qf_model_free(m);
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float));
    run(0, compose, ref);
    run(1, compose, got);
    CHECK(memcmp(ref, got, n * sizeof(float)) == 0, "%s path: logits with experts moving between steps differ by up to %g",
          compose ? "fused decode" : "host", qt_max_abs_diff(ref, got, (int64_t)n));
    int finite = 1;
    for (size_t i = 0; i < n; i++) finite &= isfinite(got[i]) != 0;
    CHECK(finite, "non-finite logits: a stale expert pointer was read");
    free(ref), free(got);
}

/* The failing store under the scheduler: a request that hits the failure ends with the store's
 * message; disarmed, the next request runs to its length. */
static void test_failing_store(void) {
    qf_engine *e;
    qf_engine_opts eo = {.n_threads = 1, .max_batch = 64};
    int rc = qf_engine_open(&e, qt_path(MODEL), &eo);
    CHECK(rc == QF_OK, "%s", qf_last_error());
    if (rc) return;
    fake_store *f = wrap(e->model, 0);
    qf_sched *s;
    qf_sched_opts so = {.max_batch = 2, .ctx = 64, .page_tokens = 16, .prefill_chunk = 16, .max_queue = 4};
    CHECK(qf_sched_create(&s, e, &so) == QF_OK, "%s", qf_last_error());
    int32_t prompt[4] = {5, 6, 7, 8};
    for (int round = 0; round < 2; round++) {
        f->fail = round == 0;
        qf_req_params p = {.prompt = prompt, .n_prompt = 4, .max_tokens = 6, .sampling = qf_sampling_default(), .logprobs = -1, .ignore_eos = 1};
        p.sampling.temperature = 0;
        qf_req *r;
        CHECK(qf_sched_submit(s, &p, &r) == QF_OK, "%s", qf_last_error());
        qf_req_status st = {0};
        for (int i = 0; i < 2000 && st.finish == QF_FINISH_NONE; i++) {
            qf_req_poll(r, NULL, &st);
            if (st.finish == QF_FINISH_NONE) usleep(5000);
        }
        if (round == 0)
            CHECK(st.finish == QF_FINISH_ERROR && strstr(st.error, "injected read failure"), "failing store: finish %d, error '%s'", st.finish,
                  st.error);
        else CHECK(st.finish == QF_FINISH_LENGTH && st.gen_tokens == 6, "after the failure: finish %d, %d tokens, error '%s'", st.finish,
                   st.gen_tokens, st.error);
        qf_req_release(r);
    }
    qf_sched_destroy(s);
    qf_engine_close(e);
}

/* Routed ids of every MoE layer and row (the route hook), for the sparsity checks. */
typedef struct id_log {
    int n, kept_min, dropped, rows, top_k;
} id_log;
static void log_ids(void *ud, int layer, const int *ids, int rows, int top_k, const float *x, int hidden) {
    (void)layer, (void)x, (void)hidden;
    id_log *g = ud;
    for (int r = 0; r < rows; r++) {
        int kept = 0;
        for (int k = 0; k < top_k; k++) kept += ids[r * top_k + k] >= 0;
        for (int k = 0; k < top_k; k++) g->n += (k < kept) != (ids[r * top_k + k] >= 0); /* kept ones first, then -1s */
        g->kept_min = g->rows++ == 0 || kept < g->kept_min ? kept : g->kept_min;
        g->dropped += top_k - kept, g->top_k = top_k;
    }
}

/* The expert level of sparsity: the drop rule on hand-made weights; a level whose threshold no
 * weight falls under gives the dense logits bit for bit; a real level drops experts (never under
 * the minimum), and its logits differ from dense. */
static void test_sparsity_experts(void) {
    float tw[4] = {0.5f, 0.3f, 0.15f, 0.05f};
    CHECK(qf_ref_route_drop(tw, 4, 0.1f, 2) == 3 && tw[3] == 0.0f && fabsf(tw[0] - 0.5f / 0.95f) < 1e-7f && fabsf(tw[0] + tw[1] + tw[2] - 1.0f) < 1e-6f,
          "drop below 0.1: %g %g %g %g", tw[0], tw[1], tw[2], tw[3]);
    float tw2[4] = {0.4f, 0.3f, 0.2f, 0.1f};
    CHECK(qf_ref_route_drop(tw2, 4, 0.9f, 2) == 2 && tw2[2] == 0.0f && fabsf(tw2[0] - 0.4f / 0.7f) < 1e-7f, "never under min_k");
    float tw3[4] = {0.4f, 0.3f, 0.2f, 0.1f};
    CHECK(qf_ref_route_drop(tw3, 4, 0.01f, 2) == 4 && tw3[0] == 0.4f && tw3[3] == 0.1f, "nothing dropped: weights as routed");
    float *out[3] = {NULL, NULL, NULL};
    float levels[3] = {0.0f, 1e-6f, 0.6f};
    size_t n = 0;
    id_log g[3];
    memset(g, 0, sizeof g);
    for (int i = 0; i < 3; i++) {
        qf_model *m;
        if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
        n = (size_t)(STEPS + 1) * m->cfg.vocab;
        out[i] = calloc(n, sizeof(float));
        float lv[QF_MAX_LAYERS];
        for (int L = 0; L < m->cfg.n_layers; L++) lv[L] = levels[i];
        CHECK(qf_model_set_sparsity(m, lv) == QF_OK, "%s", qf_last_error());
        qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
        int V = m->cfg.vocab;
        qf_workspace *ws = qf_workspace_create(m, 64);
        qf_workspace_set_route_hook(ws, log_ids, &g[i]);
        qf_state *st = qf_state_create(m, 64);
        int32_t prompt[5] = {11, 400, 23, 7, 91};
        int rc = qf_forward_seq(m, &be, ws, st, prompt, 5, QF_LOGITS_LAST, out[i]);
        for (int s = 1; rc == QF_OK && s <= STEPS; s++) {
            int32_t tok = qt_argmax(out[i] + (size_t)(s - 1) * V, V);
            rc = qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, out[i] + (size_t)s * V);
        }
        CHECK(rc == QF_OK, "%s", qf_last_error());
        qf_state_free(st);
        qf_workspace_free(ws);
        qf_model_free(m);
    }
    CHECK(memcmp(out[0], out[1], n * sizeof(float)) == 0 && g[1].dropped == 0, "level 1e-6 differs from dense");
    CHECK(g[2].dropped > 0 && g[2].kept_min >= qf_sparsity_min_k(g[2].top_k) && g[2].n == 0, "level 0.6: %d dropped, at least %d kept a row, %d misplaced",
          g[2].dropped, g[2].kept_min, g[2].n);
    CHECK(memcmp(out[0], out[2], n * sizeof(float)) != 0, "level 0.6 gives the dense logits");
    fprintf(stderr, "sparsity 0.6 (experts): %d of %d routed experts dropped\n", g[2].dropped, g[2].rows * g[2].top_k);
    for (int i = 0; i < 3; i++) free(out[i]);
}

/* One run of test_sparsity_trunk: how = 0 the host path, 1 the same with the masked products
 * dense (no transposed copies), 2 the fused decode path (composed on the CPU). */
static void trunk_run(int how, float *out, double *zeroed) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    if (how == 2) CHECK(qf_cpu_dec_compose_init(&be, qf_cpu_ops_best(), (size_t)4 << 20) == QF_OK && qf_model_to_device(m, &be, 0) == QF_OK, "%s", qf_last_error());
    int n = m->cfg.n_layers * QF_ACT_GROUPS * QF_TRUNK_GRID;
    float *thr = malloc((size_t)n * sizeof(float)), lv[QF_MAX_LAYERS];
    for (int i = 0; i < n; i++) thr[i] = 0.1f * (float)(i % QF_TRUNK_GRID + 1);
    for (int L = 0; L < m->cfg.n_layers; L++) lv[L] = 0.6f;
    CHECK(qf_model_set_trunk_thresholds(m, thr) == QF_OK && qf_model_set_sparsity(m, lv) == QF_OK, "%s", qf_last_error());
    for (int L = 0; how == 1 && L < m->cfg.n_layers; L++) m->layers[L].in_t.data = NULL, m->layers[L].out_t.data = NULL; /* still owned by the model */
    int V = m->cfg.vocab;
    qf_workspace *ws = qf_workspace_create(m, 64);
    qf_state *st = qf_state_create(m, 64);
    int32_t prompt[5] = {11, 400, 23, 7, 91};
    int rc = ws && st ? qf_forward_seq(m, &be, ws, st, prompt, 5, QF_LOGITS_LAST, out) : QF_ENOMEM;
    for (int s = 1; rc == QF_OK && s <= STEPS; s++) {
        int32_t tok = qt_argmax(out + (size_t)(s - 1) * V, V);
        rc = qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, out + (size_t)s * V);
    }
    CHECK(rc == QF_OK, "%s", qf_last_error());
    qf_sparsity_counts c = qf_workspace_sparsity(ws);
    *zeroed = c.trunk ? (double)c.trunk_zeroed / (double)c.trunk : 0;
    qf_state_free(st), qf_workspace_free(ws), free(thr);
    qf_model_free(m);
    if (how == 2) qf_cpu_dec_compose_free(&be);
}

/* Trunk sparsity at 0.6 (experts dropped too): the mixers' products through transposed weights
 * give the dense products of the masked inputs, on the host path and on the fused decode path;
 * the prompt's logits are the dense model's, the steps' are not. */
static void test_sparsity_trunk(void) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
    size_t n = (size_t)(STEPS + 1) * m->cfg.vocab, V = (size_t)m->cfg.vocab;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    float *dense = calloc(n, sizeof(float)), *out[3];
    CHECK(greedy_steps(m, &be, NULL, dense) == QF_OK, "%s", qf_last_error());
    qf_model_free(m);
    double zeroed[3];
    for (int how = 0; how < 3; how++) out[how] = calloc(n, sizeof(float)), trunk_run(how, out[how], &zeroed[how]);
    CHECK(zeroed[0] > 0.05 && zeroed[0] < 0.95 && zeroed[1] == zeroed[0], "host path: %.3f of the mixers' inputs zeroed (dense products: %.3f)", zeroed[0],
          zeroed[1]);
    CHECK(memcmp(out[0], dense, V * sizeof(float)) == 0, "the prompt's logits moved: sparsity is for one-token steps");
    CHECK(qt_max_abs_diff(out[0] + V, dense + V, (int64_t)V) > 1e-3, "level 0.6 left the first step's logits as dense");
    double d1 = qt_max_abs_diff(out[0], out[1], (int64_t)n), d2 = qt_max_abs_diff(out[0], out[2], (int64_t)n);
    CHECK(d1 < 1e-4 && d2 < 1e-4, "transposed products vs dense products of the masked inputs: %.3g; fused decode path vs host: %.3g", d1, d2);
    fprintf(stderr, "sparsity 0.6 (trunk): %.1f%% of the mixers' inputs zeroed; sparse vs masked-dense %.2g, fused vs host %.2g\n", 100 * zeroed[0], d1, d2);
    for (int i = 0; i < 3; i++) free(out[i]);
    free(dense);
}

/* One run of test_sparsity_kv: a 1,900-token prompt, then STEPS greedy steps at level (the KV
 * level alone, from a context of 256); compose: the fused decode path (composed on the CPU). */
static int kv_run(float level, int compose, float *out) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return QF_EIO;
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    int rc = compose ? qf_cpu_dec_compose_init(&be, qf_cpu_ops_best(), (size_t)4 << 20) : QF_OK;
    if (rc == QF_OK && compose) rc = qf_model_to_device(m, &be, 0);
    float lv[QF_MAX_LAYERS];
    for (int L = 0; L < m->cfg.n_layers; L++) lv[L] = level;
    if (rc == QF_OK) rc = qf_model_set_sparsity(m, lv);
    qf_model_sparse_off(m, QF_SPARSE_EXPERTS | QF_SPARSE_TRUNK);
    m->kv_min_ctx = 256;
    int V = m->cfg.vocab, P = 1900;
    qf_workspace *ws = qf_workspace_create(m, 64);
    qf_state *st = qf_state_create(m, P + STEPS + 1);
    int32_t *prompt = malloc((size_t)P * sizeof *prompt);
    for (int i = 0; i < P; i++) prompt[i] = (int32_t)((i * 7919 + 13) % V);
    if (rc == QF_OK) rc = ws && st && prompt ? qf_forward_seq(m, &be, ws, st, prompt, P, QF_LOGITS_LAST, out) : QF_ENOMEM;
    for (int s = 1; rc == QF_OK && s <= STEPS; s++) {
        int32_t tok = qt_argmax(out + (size_t)(s - 1) * V, V);
        rc = qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, out + (size_t)s * V);
    }
    free(prompt), qf_state_free(st), qf_workspace_free(ws), qf_model_free(m);
    if (compose) qf_cpu_dec_compose_free(&be);
    return rc;
}

/* The KV level at a context of ~1,900 tokens (30 pages of 64, a budget of 16 at 0.6): the host
 * path and the fused decode path choose the same pages; a level whose budget covers every page
 * is the dense model bit for bit; 0.6 is not. */
static void test_sparsity_kv(void) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
    size_t n = (size_t)(STEPS + 1) * m->cfg.vocab;
    qf_model_free(m);
    float *dense = calloc(n, sizeof(float)), *tiny = calloc(n, sizeof(float)), *host = calloc(n, sizeof(float)), *fused = calloc(n, sizeof(float));
    CHECK(kv_run(0.0f, 0, dense) == QF_OK && kv_run(1e-6f, 0, tiny) == QF_OK && kv_run(0.6f, 0, host) == QF_OK && kv_run(0.6f, 1, fused) == QF_OK, "%s",
          qf_last_error());
    CHECK(memcmp(dense, tiny, n * sizeof(float)) == 0, "a budget of every page changed the logits");
    double d = qt_max_abs_diff(host, dense, (int64_t)n), hf = qt_max_abs_diff(host, fused, (int64_t)n);
    CHECK(d > 1e-4, "level 0.6 (16 of 30 pages) left the logits as dense");
    CHECK(hf < 1e-4, "host and fused decode paths differ by %.3g at level 0.6", hf);
    fprintf(stderr, "sparsity 0.6 (KV pages, 16 of 30): %.3g from dense; fused vs host %.2g\n", d, hf);
    free(dense), free(tiny), free(host), free(fused);
}

/* The prompts these checks run: n ids spread over the vocabulary (none when V is 0: a failed load). */
static void fill_prompt(int32_t *p, int n, int V) {
    for (int i = 0; i < n; i++) p[i] = V ? (11 + 389 * i) % V : 0;
}

/* A prompt longer than the workspace, layer by layer (a store that takes wide steps, and a prompt
 * buffer), gives the logits of running it chunk by chunk bit for bit, and the steps after it too. */
static void test_layered_prompt(void) {
    float *out[2] = {NULL, NULL};
    size_t n = 0;
    for (int layered = 0; layered < 2; layered++) {
        qf_model *m;
        if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
        int V = m->cfg.vocab;
        n = (size_t)5 * V;
        out[layered] = calloc(n, sizeof(float));
        fake_store *f = wrap(m, 0);
        if (layered) f->base.ops = &k_fake_wide_ops;
        qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
        qf_workspace *ws = qf_workspace_create(m, 24);
        CHECK(ws && qf_workspace_reserve_prompt(ws, layered ? 64 : 0) == QF_OK, "%s", qf_last_error());
        qf_state *st = qf_state_create(m, 64);
        int32_t prompt[40];
        fill_prompt(prompt, 40, V);
        int rc = qf_forward_seq(m, &be, ws, st, prompt, 40, QF_LOGITS_LAST, out[layered]);
        for (int s = 1; rc == QF_OK && s < 5; s++) {
            int32_t tok = qt_argmax(out[layered] + (size_t)(s - 1) * V, V);
            rc = qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, out[layered] + (size_t)s * V);
        }
        CHECK(rc == QF_OK && st->pos == 44, "layered %d: %s (position %d)", layered, qf_last_error(), st->pos);
        qf_state_free(st);
        qf_workspace_free(ws);
        qf_model_free(m);
    }
    CHECK(memcmp(out[0], out[1], n * sizeof(float)) == 0, "a prompt layer by layer differs from chunk by chunk by up to %g", qt_max_abs_diff(out[0], out[1], (int64_t)n));
    free(out[0]), free(out[1]);
}

/* On the host with a RAM cache of a few experts a layer: a 600-token prompt layer by layer (each
 * layer's MoE over the whole prompt) gives the chunked prompt's logits bit for bit and reads each
 * expert at most once a layer, where the chunks (64 rows) read a layer's experts again each. */
static void test_layered_reads(void) {
    float *out[2] = {NULL, NULL};
    qf_expert_stats st[2];
    int V = 0, L = 0, E = 0;
    for (int layered = 0; layered < 2; layered++) {
        qf_model *m;
        if (qf_model_load(&m, qt_path(MODEL), NULL) != QF_OK) return;
        V = m->cfg.vocab, L = m->cfg.n_layers, E = m->cfg.n_experts;
        out[layered] = calloc((size_t)V, sizeof(float));
        qf_expert_store *s;
        CHECK(qf_es_stream_create(&s, m->experts, &m->st, L, E, m->cfg.n_experts_used, (size_t)3 << 19) == QF_OK, "%s", qf_last_error());
        qf_model_use_experts(m, s);
        qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
        qf_workspace *ws = qf_workspace_create(m, 64);
        CHECK(ws && qf_workspace_reserve_prompt(ws, layered ? 1024 : 0) == QF_OK, "%s", qf_last_error());
        qf_state *sq = qf_state_create(m, 640);
        int32_t prompt[600];
        fill_prompt(prompt, 600, V);
        CHECK(qf_forward_seq(m, &be, ws, sq, prompt, 600, QF_LOGITS_LAST, out[layered]) == QF_OK && sq->pos == 600, "layered %d: %s", layered,
              qf_last_error());
        st[layered] = m->experts->stats;
        qf_state_free(sq);
        qf_workspace_free(ws);
        qf_model_free(m);
    }
    CHECK(memcmp(out[0], out[1], (size_t)V * sizeof(float)) == 0, "the host's layered prompt differs from the chunked one by up to %g",
          qt_max_abs_diff(out[0], out[1], V));
    CHECK(st[1].misses <= (uint64_t)L * E && st[1].misses < st[0].misses, "misses: %llu layered (at most %d), %llu chunked",
          (unsigned long long)st[1].misses, L * E, (unsigned long long)st[0].misses);
    fprintf(stderr, "a 600-token prompt through a 1.5 MiB expert cache: %llu misses layered, %llu chunked (%d experts in all)\n",
            (unsigned long long)st[1].misses, (unsigned long long)st[0].misses, L * E);
    free(out[0]), free(out[1]);
}

typedef struct ids_sink {
    int32_t ids[16];
    int n;
} ids_sink;

static void sink_id(void *ud, const qf_token_lp *t) {
    ids_sink *o = ud;
    if (o->n < 16) o->ids[o->n++] = t->id;
}

/* Through the scheduler: a 200-token prompt alone in its step, with a store that stages layers,
 * runs layer by layer in one step (not 13 chunks of 16) and gives the tokens the chunks give. */
static void test_sched_layered_prompt(void) {
    ids_sink out[2] = {{{0}, 0}, {{0}, 0}};
    uint64_t steps[2] = {0, 0};
    for (int layered = 0; layered < 2; layered++) {
        qf_engine *e = NULL;
        qf_engine_opts eo = {.n_threads = 2, .max_batch = 72};
        if (qf_engine_open(&e, qt_path(MODEL), &eo) != QF_OK) {
            CHECK(0, "engine: %s", qf_last_error());
            return;
        }
        fake_store *f = wrap(e->model, 0);
        if (layered) f->base.ops = &k_fake_wide_ops;
        CHECK(qf_workspace_reserve_prompt(e->ws, layered ? 256 : 0) == QF_OK, "%s", qf_last_error());
        qf_sched_opts so = {.max_batch = 1, .ctx = 256, .prefill_chunk = 16, .max_queue = 1};
        qf_sched *s = NULL;
        int32_t prompt[200];
        fill_prompt(prompt, 200, e->model->cfg.vocab);
        qf_req_params p = {.prompt = prompt, .n_prompt = 200, .max_tokens = 6, .sampling = qf_sampling_default(), .logprobs = -1, .want_ids = 1,
                           .grammar_after = -1};
        qf_req_sink sink = {NULL, sink_id, &out[layered]};
        qf_req_status st;
        CHECK(qf_sched_create(&s, e, &so) == QF_OK && qf_sched_run(s, &p, &sink, NULL, &st) == QF_OK, "layered %d: %s", layered, qf_last_error());
        qf_sched_stats ss;
        if (s) qf_sched_get_stats(s, &ss), steps[layered] = ss.steps;
        qf_sched_destroy(s);
        qf_engine_close(e);
    }
    CHECK(out[0].n == 6 && out[1].n == 6 && !memcmp(out[0].ids, out[1].ids, sizeof out[0].ids), "the layered prompt's tokens differ from the chunked one's");
    CHECK(steps[0] == 13 + 5 && steps[1] == 1 + 5, "steps: %llu chunked (want 18), %llu layered (want 6)", (unsigned long long)steps[0], (unsigned long long)steps[1]);
}

/* On a GPU (skipped without one): the bundled model's greedy steps, once straight and once with
 * the store failing at a recorded and at a replayed decode step. A failed step is abandoned
 * before any of it runs, so each, done again, continues exactly as the straight run. */
#define GPU_MODEL "models/qwen36moe-code-14m"
#define GPU_STEPS 8
static int gpu_run(const int *fail_at, float *out) {
    qf_backend be;
    if (!qf_backend_has_cuda() || qf_backend_open(&be, "cuda", NULL, NULL) != QF_OK) return 0;
    qf_model *m;
    int rc = qf_model_load(&m, qt_path(GPU_MODEL), NULL);
    if (rc == QF_OK) rc = qf_model_to_device(m, &be, 0);
    CHECK(rc == QF_OK, "%s", qf_last_error());
    if (rc != QF_OK) return qf_backend_close(&be), 0;
    CHECK(m->dec_ok, "the fused decode ops do not take " GPU_MODEL);
    fake_store *f = wrap(m, 0);
    int V = m->cfg.vocab;
    qf_workspace *ws = qf_workspace_create(m, 64);
    qf_state *st = qf_state_create(m, 64);
    int32_t prompt[5] = {11, 400, 23, 7, 91};
    CHECK(qf_forward_seq(m, &be, ws, st, prompt, 5, QF_LOGITS_LAST, out) == QF_OK, "%s", qf_last_error());
    for (int s = 1; s <= GPU_STEPS; s++) {
        int32_t tok = qt_argmax(out + (size_t)(s - 1) * V, V);
        if (s == fail_at[0] || s == fail_at[1]) {
            f->fail = 1;
            rc = qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, out + (size_t)s * V);
            CHECK(rc == QF_EIO && strstr(qf_last_error(), "injected"), "step %d with the store failing: %d, '%s'", s, rc, qf_last_error());
            f->fail = 0;
        }
        CHECK(qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, out + (size_t)s * V) == QF_OK, "step %d: %s", s, qf_last_error());
    }
    qf_state_free(st);
    qf_workspace_free(ws);
    qf_model_free(m);
    qf_backend_close(&be);
    return 1;
}

static void test_gpu_abandoned_steps(void) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(GPU_MODEL), NULL) != QF_OK) return;
    size_t n = (size_t)(GPU_STEPS + 1) * m->cfg.vocab;
    qf_model_free(m);
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float));
    int none[2] = {-1, -1}, at[2] = {2, 6}; /* step 2 is recorded as a graph, step 6 replayed */
    if (gpu_run(none, ref) && gpu_run(at, got))
        CHECK(memcmp(ref, got, n * sizeof(float)) == 0, "GPU: steps after abandoned ones differ by up to %g", qt_max_abs_diff(ref, got, (int64_t)n));
    else fprintf(stderr, "test_experts: no GPU, the abandoned-step check skipped\n");
    free(ref), free(got);
}

/* After a one-row step: each layer's chosen ids (the device wrote them) fed to the reference policy,
 * whose slot map must then be the device's. Returns the layers that differ. */
static int policy_diff(qf_model *m, qf_backend *be, qf_slot_cache *ref) {
    int E = m->cfg.n_experts, K = m->cfg.n_experts_used, bad = 0;
    int32_t ids[64];
    uint32_t *state = malloc(qf_xcache_state_bytes(E, E));
    for (int L = 0; L < m->cfg.n_layers; L++) {
        qf_expert_table t;
        m->experts->ops->table(m->experts, L, &t);
        qf_be_download(be, ids, t.chosen, (size_t)K * sizeof *ids);
        qf_slot_cache_access(&ref[L], ids, K, NULL, NULL, NULL);
        qf_slot_cache_tick(&ref[L]);
        qf_be_download(be, state, t.cache->state, qf_xcache_state_bytes(E, t.cache->n_slots));
        int differ = state[0] != ref[L].now || (int)state[1] != ref[L].used;
        for (int e = 0; e < E; e++) differ |= (int)state[QF_XC_HEAD_WORDS + e] - 1 != ref[L].slot_of[e];
        bad += differ;
    }
    free(state);
    return bad;
}

/* gpu_cached's run: the prompt (by token: the policy checked after each step against ref) and
 * GPU_STEPS greedy steps; the device slot map's departures from ref counted into *bad. */
static int cached_steps(qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st, qf_slot_cache *ref, int slots, int by_token, float *out, int *bad) {
    int V = m->cfg.vocab, rc = QF_OK;
    int32_t prompt[40];
    fill_prompt(prompt, 40, V); /* more rows than a decode step: the wide (staged) path */
    if (!by_token) rc = qf_forward_seq(m, be, ws, st, prompt, 40, QF_LOGITS_LAST, out);
    for (int i = 0; rc == QF_OK && by_token && i < 5; i++) {
        rc = qf_forward_seq(m, be, ws, st, prompt + i, 1, QF_LOGITS_LAST, out);
        if (slots) *bad += policy_diff(m, be, ref);
        if (slots && i == 0) { /* the first step fills a slot a layer at least: the log names them */
            char text[4096];
            m->experts->ops->describe(m->experts, text, sizeof text);
            int32_t first;
            qf_expert_table t;
            m->experts->ops->table(m->experts, 0, &t);
            qf_be_download(be, &first, t.chosen, sizeof first);
            char want[32];
            snprintf(want, sizeof want, "L0 e%d>s0", first);
            CHECK(strncmp(text, want, strlen(want)) == 0 && strstr(text, "copied into slots"), "%d slots: the step's loads: '%s', want '%s...'", slots, text, want);
        }
    }
    for (int t = 1; rc == QF_OK && t <= GPU_STEPS; t++) {
        int32_t tok = qt_argmax(out + (size_t)(t - 1) * V, V);
        rc = qf_forward_seq(m, be, ws, st, &tok, 1, QF_LOGITS_LAST, out + (size_t)t * V);
        if (slots && by_token) *bad += policy_diff(m, be, ref);
    }
    return rc;
}

/* On a GPU: the model at dir with its experts behind the device expert cache (slots a layer; 0:
 * all resident on the device), a prompt (by_token: fed a token a step, the policy checked after
 * each step) and GPU_STEPS greedy steps, the logits into out. 0 without a GPU. The bundled model
 * runs its decode steps through the fused ops (graphs), the fixture through the plain ones. */
static float g_host_share = -1.0f; /* gpu_cached's hybrid share (negative: no hybrid) */
static uint64_t g_host_computed;   /* and the experts its host computed */
static int g_host_fail;            /* >0: a second run's host call that many calls on fails, then a third runs */
static int gpu_cached(const char *dir, int slots, int policy, int by_token, int stage, float *out) {
    qf_backend be;
    if (!qf_backend_has_cuda() || qf_backend_open(&be, "cuda", NULL, NULL) != QF_OK) return 0;
    qf_model *m;
    int rc = qf_model_load(&m, qt_path(dir), NULL), L = 0, E = 0, K = 0, bad = 0;
    if (rc == QF_OK) rc = qf_model_to_device(m, &be, slots ? QF_TO_DEVICE_EXPERTS_HOME : 0);
    qf_expert_store *s;
    if (rc == QF_OK) L = m->cfg.n_layers, E = m->cfg.n_experts, K = m->cfg.n_experts_used;
    if (rc == QF_OK && slots && (rc = qf_es_devcache_create(&s, m->experts, &be, L, E, K)) == QF_OK) m->experts = s;
    if (rc == QF_OK && slots) rc = qf_es_devcache_set_slots(m->experts, slots, policy, stage), qf_model_dec_check(m);
    qf_pool *host = g_host_share >= 0.0f ? qf_pool_create(3) : NULL;
    if (rc == QF_OK && slots && host) rc = qf_es_devcache_set_host(m->experts, host, g_host_share);
    CHECK(rc == QF_OK && (m->dec_ok || strcmp(dir, GPU_MODEL) != 0), "%s, %d slots: %s", dir, slots, qf_last_error());
    qf_slot_cache *ref = calloc((size_t)L, sizeof *ref);
    for (int l = 0; l < L; l++) qf_slot_cache_init(&ref[l], policy, E, slots ? slots : 1, 64);
    qf_workspace *ws = qf_workspace_create(m, 24); /* the 40-token prompt in two chunks: with a cache, layer by layer */
    CHECK(ws && qf_workspace_reserve_prompt(ws, 64) == QF_OK, "%s", qf_last_error());
    qf_state *st = qf_state_create(m, 64);
    rc = rc == QF_OK ? cached_steps(m, &be, ws, st, ref, slots, by_token, out, &bad) : rc;
    if (rc == QF_OK && g_host_fail) { /* the step the host failed fails; the model runs on */
        qf_es_devcache_fail_host(m->experts, g_host_fail);
        qf_state_reset(st);
        rc = cached_steps(m, &be, ws, st, ref, slots, by_token, out, &bad);
        CHECK(rc != QF_OK && strstr(qf_last_error(), "experts on the host: a failure injected by a test"), "%s: a host call's failure: rc %d, '%s'", dir, rc,
              rc ? qf_last_error() : "");
        qf_state_reset(st);
        rc = cached_steps(m, &be, ws, st, ref, slots, by_token, out, &bad);
    }
    CHECK(rc == QF_OK, "%s, %d slots: %s", dir, slots, qf_last_error());
    CHECK(bad == 0, "%s, %d slots, %s: the device's slot map left the reference policy's %d times", dir, slots, qf_policy_name(policy), bad);
    if (host) g_host_computed = qf_es_stats(m->experts).host_computed;
    if (slots && by_token) {
        qf_expert_stats es = qf_es_stats(m->experts);
        uint64_t hits = 0, misses = 0;
        for (int l = 0; l < L; l++) hits += ref[l].hits, misses += ref[l].misses;
        CHECK(es.hits == hits && es.misses == misses, "%d slots: device counted %llu hits, %llu misses; the reference %llu, %llu", slots,
              (unsigned long long)es.hits, (unsigned long long)es.misses, (unsigned long long)hits, (unsigned long long)misses);
    }
    for (int l = 0; l < L; l++) qf_slot_cache_free(&ref[l]);
    free(ref);
    qf_state_free(st);
    qf_workspace_free(ws);
    qf_model_free(m);
    qf_backend_close(&be);
    qf_pool_destroy(host);
    return 1;
}

/* Hybrid expert execution on the GPU: with no share the device cache's own bits; with a share
 * (half, and every miss) the misses the host computes give the all-resident logits to the GPU's
 * tolerance and the same greedy tokens, and the host computed some. */
static void test_gpu_hybrid(const char *dir) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    size_t n = (size_t)(GPU_STEPS + 1) * m->cfg.vocab;
    int V = m->cfg.vocab, K = m->cfg.n_experts_used;
    qf_model_free(m);
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float));
    g_host_share = -1.0f;
    if (!gpu_cached(dir, 0, QF_POLICY_LRU, 0, 0, ref)) {
        fprintf(stderr, "test_experts: no GPU, the hybrid checks skipped\n");
        free(ref), free(got);
        return;
    }
    float shares[4] = {0.0f, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 4; i++) { /* the last: a host call of the first decode step fails, then the model runs again */
        g_host_share = shares[i], g_host_computed = 0, g_host_fail = i == 3 ? 3 : 0;
        gpu_cached(dir, K, QF_POLICY_DLFU_AD, 0, 0, got);
        int same = 1;
        for (int t = 0; t <= GPU_STEPS; t++) same &= qt_argmax(ref + (size_t)t * V, V) == qt_argmax(got + (size_t)t * V, V);
        double d = qt_max_abs_diff(ref, got, (int64_t)n);
        CHECK(same && d <= (i ? 2e-4 : 0.0) && (g_host_computed > 0) == (i > 0), "%s: hybrid, host share %.1f: logits %.3g from all resident, same tokens %d, "
              "%llu experts computed on the host", dir, shares[i], d, same, (unsigned long long)g_host_computed);
        fprintf(stderr, "%s: hybrid, host share %.1f: %llu experts on the host, logits %.3g from all resident\n", dir, shares[i],
                (unsigned long long)g_host_computed, d);
    }
    g_host_share = -1.0f, g_host_fail = 0;
    free(ref), free(got);
}

/* The device expert cache, from fewer slots than a token's experts (some read from host memory
 * where they are) to every expert, gives the all-resident logits bit for bit, prompt and decode
 * graphs alike; fed token by token, its slot map follows the reference policy step by step. */
static void test_gpu_devcache(const char *dir) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    size_t n = (size_t)(GPU_STEPS + 1) * m->cfg.vocab;
    int E = m->cfg.n_experts, K = m->cfg.n_experts_used;
    qf_model_free(m);
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float)), *ref_tok = calloc(n, sizeof(float));
    if (!gpu_cached(dir, 0, QF_POLICY_LRU, 0, 0, ref) || !gpu_cached(dir, 0, QF_POLICY_LRU, 1, 0, ref_tok)) {
        fprintf(stderr, "test_experts: no GPU, the device expert cache checks skipped\n");
        free(ref), free(got), free(ref_tok);
        return;
    }
    int slots[] = {1, K, 2 * K, E / 4, E};
    int policies[] = {QF_POLICY_LRU, QF_POLICY_DLFU, QF_POLICY_DLFU_AD};
    for (int i = 0; i < 5; i++)
        for (int p = 0; p < 3; p++)
            for (int mode = 0; mode < 3; mode++) { /* prompt at once, staged or not; by token */
                memset(got, 0, n * sizeof(float));
                gpu_cached(dir, slots[i], policies[p], mode == 2, mode == 1, got);
                const float *want = mode == 2 ? ref_tok : ref;
                CHECK(memcmp(want, got, n * sizeof(float)) == 0, "%s: GPU expert cache of %d slots (%s, %s): logits differ by up to %g", dir, slots[i],
                      qf_policy_name(policies[p]), mode == 2 ? "by token" : mode ? "prompt staged" : "prompt", qt_max_abs_diff(want, got, (int64_t)n));
            }
    free(ref), free(got), free(ref_tok);
}

/* The model at dir with its experts behind a RAM cache of budget bytes (0: resident): a prompt and
 * STEPS greedy steps, each step's logits into out; the cache's hits and misses into st. */
static int run_cached_pf(const char *dir, size_t budget, int prefetch, float *out, qf_expert_stats *st) {
    qf_model *m;
    int rc = qf_model_load(&m, qt_path(dir), NULL);
    CHECK(rc == QF_OK, "%s", qf_last_error());
    if (rc) return rc;
    qf_expert_store *s;
    if (budget && (rc = qf_es_stream_create(&s, m->experts, &m->st, m->cfg.n_layers, m->cfg.n_experts, m->cfg.n_experts_used, budget)) == QF_OK) m->experts = s;
    qf_model_set_prefetch(m, prefetch);
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    if (rc == QF_OK) rc = greedy_steps(m, &be, NULL, out);
    if (st) *st = m->experts->stats;
    qf_model_free(m);
    return rc;
}

static int run_cached(const char *dir, size_t budget, float *out, qf_expert_stats *st) { return run_cached_pf(dir, budget, 0, out, st); }

/* The RAM cache reading each row's next-layer guesses ahead: the same logits bit for bit, reads
 * ahead that later acquires use, and fewer reads on the acquires' path than without. */
static void test_expert_prefetch(const char *dir, size_t budget) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    size_t n = (size_t)(STEPS + 1) * (size_t)m->cfg.vocab;
    qf_model_free(m);
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float));
    qf_expert_stats off, on;
    CHECK(run_cached_pf(dir, budget, 0, ref, &off) == QF_OK && run_cached_pf(dir, budget, 4, got, &on) == QF_OK, "%s: %s", dir, qf_last_error());
    CHECK(memcmp(ref, got, n * sizeof(float)) == 0, "%s: logits with prefetch differ by up to %g", dir, qt_max_abs_diff(ref, got, (int64_t)n));
    CHECK(on.prefetches > 0 && on.prefetch_hits > 0 && on.prefetch_hits <= on.prefetches && on.misses < off.misses && on.acquires == off.acquires,
          "%s: %llu read ahead, %llu used; misses %llu with, %llu without", dir, (unsigned long long)on.prefetches, (unsigned long long)on.prefetch_hits,
          (unsigned long long)on.misses, (unsigned long long)off.misses);
    fprintf(stderr, "%s: prefetch of 4 guesses: misses %llu -> %llu, %llu read ahead, %llu used\n", dir, (unsigned long long)off.misses,
            (unsigned long long)on.misses, (unsigned long long)on.prefetches, (unsigned long long)on.prefetch_hits);
    free(ref), free(got);
}

/* The checkpoint unreadable mid-run (its descriptor swapped for a write-only one) while the RAM
 * cache reads ahead: the step fails with the read's error, naming the file, and nothing else
 * breaks; once readable again a new sequence gives the reference logits bit for bit (the slots
 * whose reads failed are read again, not used). */
static void test_prefetch_failure(const char *dir, size_t budget) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    size_t n = (size_t)(STEPS + 1) * (size_t)m->cfg.vocab;
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float));
    CHECK(run_cached_pf(dir, budget, 4, ref, NULL) == QF_OK, "%s", qf_last_error());
    qf_expert_store *s;
    CHECK(qf_es_stream_create(&s, m->experts, &m->st, m->cfg.n_layers, m->cfg.n_experts, m->cfg.n_experts_used, budget) == QF_OK, "%s", qf_last_error());
    qf_model_use_experts(m, s);
    qf_model_set_prefetch(m, 4);
    qf_backend be = {qf_cpu_ops_best(), NULL, NULL};
    qf_workspace *ws = qf_workspace_create(m, 64);
    qf_state *st = qf_state_create(m, 64);
    int32_t prompt[5] = {11, 400, 23, 7, 91}, tok = 5;
    CHECK(qf_forward_seq(m, &be, ws, st, prompt, 5, QF_LOGITS_LAST, got) == QF_OK, "%s", qf_last_error());
    int fd = m->st.files[0].map.fd, saved = dup(fd), wr = open("/dev/null", O_WRONLY), rc = QF_OK;
    dup2(wr, fd);
    for (int i = 0; i < 4 && rc == QF_OK; i++) rc = qf_forward_seq(m, &be, ws, st, &tok, 1, QF_LOGITS_LAST, got);
    dup2(saved, fd);
    close(saved), close(wr);
    CHECK(rc == QF_EIO && strstr(qf_last_error(), "cannot read"), "%s: a step with the checkpoint unreadable: %d, '%s'", dir, rc, qf_last_error());
    qf_state_free(st);
    qf_workspace_free(ws);
    memset(got, 0, n * sizeof(float));
    CHECK(greedy_steps(m, &be, NULL, got) == QF_OK, "%s: after the failure: %s", dir, qf_last_error());
    CHECK(memcmp(ref, got, n * sizeof(float)) == 0, "%s: logits after a failed read differ by up to %g", dir, qt_max_abs_diff(ref, got, (int64_t)n));
    qf_model_free(m);
    free(ref), free(got);
}

/* A trace of L layers x 64 tokens x top-4 of U8 ids: layer l's tokens use experts 40 + (l % 3)
 * .. 43 + (l % 3) mostly, and expert 2 once. */
static void write_trace(const char *path, int L) {
    FILE *f = fopen(path, "wb");
    qf_st_entry e = {"expert_ids", "U8", 3, {L, 64, 4}, (uint64_t)L * 64 * 4};
    CHECK(f && qf_st_write_header(f, path, &e, 1) == QF_OK, "%s", qf_last_error());
    for (int l = 0; f && l < L; l++)
        for (int t = 0; t < 64 * 4; t++) fputc(t == 5 ? 2 : 40 + l % 3 + t % 4, f);
    if (f) fclose(f);
}

/* --expert-heat: the engine's RAM cache starts with each layer's most used experts of the trace
 * (acquiring them hits, a cold one misses); a trace of other layers is refused naming the file. */
static void test_expert_heat(void) {
    const char *path = "/tmp/qflash-heat.safetensors", *bad = "/tmp/qflash-heat-bad.safetensors";
    write_trace(path, 8), write_trace(bad, 3);
    qf_engine_opts eo = {.n_threads = 1, .expert_cache = (size_t)3 << 19, .expert_heat = path};
    qf_engine *e = NULL;
    CHECK(qf_engine_open(&e, qt_path("models/qwen36moe-code-14m"), &eo) == QF_OK, "%s", qf_last_error());
    if (e) {
        qf_expert_store *s = e->model->experts;
        qf_expert x;
        int hits = 0;
        for (int l = 0; l < 8; l++)
            for (int k = 0; k < 4; k++) s->ops->acquire(s, l, 40 + l % 3 + k, &x), s->ops->release(s, l, 40 + l % 3 + k);
        hits = (int)s->stats.hits;
        s->ops->acquire(s, 0, 7, &x), s->ops->release(s, 0, 7);
        CHECK(hits == 32 && s->stats.misses == 1, "after the heat: %d of 32 hot acquires hit, %llu misses for a cold one", hits, (unsigned long long)s->stats.misses);
        qf_engine_close(e);
    }
    eo.expert_heat = bad;
    CHECK(qf_engine_open(&e, qt_path("models/qwen36moe-code-14m"), &eo) == QF_EFORMAT && strstr(qf_last_error(), bad) && strstr(qf_last_error(), "8 layers"),
          "a trace of 3 layers: %s", qf_last_error());
    unlink(path), unlink(bad);
}

/* The RAM expert cache at its minimum and at larger sizes gives the logits of the resident experts
 * bit for bit; a budget under the minimum is refused naming it. */
static void test_expert_cache(const char *dir) {
    qf_model *m;
    if (qf_model_load(&m, qt_path(dir), NULL) != QF_OK) return;
    qf_expert x;
    m->experts->ops->acquire(m->experts, 0, 0, &x);
    size_t per = (size_t)(x.gate.rows * x.gate.cols + x.up.rows * x.up.cols + x.down.rows * x.down.cols) * qf_dtype_size(x.gate.dtype);
    int L = m->cfg.n_layers, E = m->cfg.n_experts, K = m->cfg.n_experts_used, V = m->cfg.vocab;
    qf_model_free(m);
    size_t n = (size_t)(STEPS + 1) * V;
    float *ref = calloc(n, sizeof(float)), *got = calloc(n, sizeof(float));
    CHECK(run_cached(dir, 0, ref, NULL) == QF_OK, "%s", qf_last_error());
    int slots[] = {K, K + 1, E / 4, E / 2, E};
    for (int i = 0; i < 5; i++) {
        qf_expert_stats st;
        size_t budget = (size_t)(slots[i] + 1) * per * (size_t)L;
        memset(got, 0, n * sizeof(float));
        int rc = run_cached(dir, budget, got, &st);
        CHECK(rc == QF_OK && st.slots == (slots[i] < E ? slots[i] : E), "%s: %d slots: %s", dir, slots[i], qf_last_error());
        CHECK(memcmp(ref, got, n * sizeof(float)) == 0, "%s: logits with %d cached experts a layer differ by up to %g", dir, slots[i],
              qt_max_abs_diff(ref, got, (int64_t)n));
        fprintf(stderr, "%s: expert cache of %d of %d a layer: %llu hits, %llu misses\n", dir, st.slots, E, (unsigned long long)st.hits,
                (unsigned long long)st.misses);
    }
    CHECK(run_cached(dir, (size_t)K * per * (size_t)L, got, NULL) == QF_EINVAL && strstr(qf_last_error(), "are needed"), "%s: a budget under the minimum: %s",
          dir, qf_last_error());
    free(ref), free(got);
}

/* config_flash.json's sparsity fields: levels by layer from the schedule, else sparsity_level; a
 * malformed range, a level outside 0..1, overlapping ranges and unknown keys refused naming them. */
static void test_flash_schedule(void) {
    char dir[] = "/tmp/qflash-sched-XXXXXX", path[4200];
    if (!mkdtemp(dir)) return;
    snprintf(path, sizeof path, "%s/config_flash.json", dir);
    struct {
        const char *body, *error; /* NULL: loads */
    } cases[] = {
        {"{\"sparsity_level\": 0.45, \"sparsity_schedule\": [\"layer_1-10:0.3\", \"layer_11-30:0.6\", \"layer_40:1\"]}", NULL},
        {"{\"sparsity_schedule\": [\"layer_1-10:0.3\", \"layer_10-12:0.5\"]}", "overlaps sparsity_schedule[0]"},
        {"{\"sparsity_schedule\": [\"layers_1-10:0.3\"]}", "sparsity_schedule[0] must read"},
        {"{\"sparsity_schedule\": [\"layer_5-2:0.3\"]}", "sparsity_schedule[0] must read"},
        {"{\"sparsity_schedule\": [\"layer_1-2:0.3x\"]}", "sparsity_schedule[0] must read"},
        {"{\"sparsity_schedule\": [\"layer_1-2:1.5\"]}", "level 1.5"},
        {"{\"sparsity_schedule\": \"layer_1-2:0.5\"}", "must be a list"},
        {"{\"sparsity_level\": -0.1}", "\"sparsity_level\" is -0.1"},
        {"{\"sparsity_levels\": 0.3}", "unknown field \"sparsity_levels\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        FILE *f = fopen(path, "w");
        if (!f) break;
        fputs(cases[i].body, f);
        fclose(f);
        qf_flash_config c;
        int rc = qf_flash_config_load(dir, &c);
        if (cases[i].error) CHECK(rc == QF_EFORMAT && strstr(qf_last_error(), cases[i].error), "case %zu: %s", i, rc ? qf_last_error() : "loaded");
        else CHECK(rc == QF_OK && c.n_ranges == 3, "case %zu: %s", i, qf_last_error());
        if (i == 0 && rc == QF_OK) {
            float want[] = {0.3f, 0.3f, 0.6f, 0.6f, 0.45f, 1.0f}, got[] = {qf_flash_config_level(&c, 0, 0), qf_flash_config_level(&c, 9, 0),
                                                                            qf_flash_config_level(&c, 10, 0), qf_flash_config_level(&c, 29, 0),
                                                                            qf_flash_config_level(&c, 30, 0), qf_flash_config_level(&c, 39, 0)};
            for (int k = 0; k < 6; k++) CHECK(got[k] == want[k], "layer level %d: %g, want %g", k, got[k], want[k]);
        }
    }
    unlink(path);
    rmdir(dir);
}

/* config_flash.json's streaming_buffer_size (MB) gives the engine its expert cache; the flag wins;
 * a value that is not a size fails the load naming the file. */
static void test_flash_config(void) {
    char dir[] = "/tmp/qflash-flash-XXXXXX", src[4096], dst[4200], rel[256];
    if (!mkdtemp(dir)) return;
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 5; i++) {
        snprintf(rel, sizeof rel, "models/qwen36moe-code-14m/%s", files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        CHECK(realpath(qt_path(rel), src) && symlink(src, dst) == 0, "link %s", dst);
    }
    snprintf(dst, sizeof dst, "%s/config_flash.json", dir);
    const char *bodies[] = {"{\"streaming_buffer_size\": 3}", "{\"streaming_buffer_size\": \"big\"}"};
    for (int b = 0; b < 2; b++) {
        FILE *f = fopen(dst, "w");
        if (!f) break;
        fputs(bodies[b], f);
        fclose(f);
        for (int flag = 0; flag < 2; flag++) {
            qf_engine *e = NULL;
            qf_engine_opts eo = {.n_threads = 1, .expert_cache = flag ? (size_t)8 << 20 : 0};
            int rc = qf_engine_open(&e, dir, &eo);
            if (b == 0) CHECK(rc == QF_OK && e->model->experts->stats.slots == (flag ? 27 : 9), "config_flash %d, flag %d: %s, slots %d", b, flag,
                              rc ? qf_last_error() : "", rc ? -1 : e->model->experts->stats.slots);
            else CHECK(rc == QF_EFORMAT && strstr(qf_last_error(), "config_flash.json"), "a bad config_flash.json (flag %d): %s", flag, qf_last_error());
            qf_engine_close(e);
        }
    }
    FILE *good = fopen(dst, "w");
    if (good) fputs(bodies[0], good), fclose(good);
    qf_engine *e = NULL;
    qf_engine_opts big = {.n_threads = 1, .expert_cache = (size_t)1 << 50}; /* a PiB */
    CHECK(qf_engine_open(&e, dir, &big) == QF_EINVAL && strstr(qf_last_error(), "of RAM"), "a cache larger than the RAM: %s", qf_last_error());
    qf_engine_close(e);
    e = NULL;
    qf_engine_opts gpu = {.n_threads = 1, .gpu_mem = (size_t)1 << 30};
    CHECK(qf_engine_open(&e, dir, &gpu) == QF_EINVAL && strstr(qf_last_error(), "--device cuda"), "--gpu-mem on the CPU: %s", qf_last_error());
    qf_engine_close(e);
    for (int i = 0; i < 5; i++) snprintf(dst, sizeof dst, "%s/%s", dir, files[i]), unlink(dst);
    snprintf(dst, sizeof dst, "%s/config_flash.json", dir), unlink(dst);
    rmdir(dir);
}

/* Hits of a policy over a trace of n tokens of k experts each (one layer). */
static uint64_t replay_hits(int policy, const int *ids, int n, int k, int E, int slots) {
    qf_slot_cache c;
    uint64_t *next = malloc((size_t)E * sizeof *next), *nxt = malloc((size_t)n * k * sizeof *nxt);
    for (int e = 0; e < E; e++) next[e] = UINT64_MAX;
    for (int t = n - 1; t >= 0; t--) {
        for (int j = 0; j < k; j++) nxt[t * k + j] = next[ids[t * k + j]];
        for (int j = 0; j < k; j++) next[ids[t * k + j]] = (uint64_t)t;
    }
    CHECK(qf_slot_cache_init(&c, policy, E, slots, 16) == QF_OK, "%s", qf_last_error());
    int bad = 0; /* an inserted expert not held, more held than slots, an evicted one still held */
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < k; j++) next[ids[t * k + j]] = nxt[t * k + j];
        for (int j = 0; j < k; j++) {
            int ev, e = ids[t * k + j];
            if (qf_slot_cache_find(&c, e) < 0 && qf_slot_cache_insert(&c, e, &ev, next) >= 0) bad += c.slot_of[e] < 0 || (ev >= 0 && c.slot_of[ev] >= 0);
        }
        int held = 0;
        for (int e = 0; e < E; e++) held += c.slot_of[e] >= 0;
        bad += held > slots;
        qf_slot_cache_tick(&c);
    }
    CHECK(bad == 0, "%s: %d inconsistencies in its slots", qf_policy_name(policy), bad);
    uint64_t hits = c.hits;
    CHECK(c.hits + c.misses == (uint64_t)n * k, "every routing counted once");
    qf_slot_cache_free(&c);
    free(next), free(nxt);
    return hits;
}

/* The policies: LRU's hits on a hand-made trace, and on skewed random traces Belady's optimum is
 * never beaten and the decayed-frequency policies beat LRU (as on the recorded 256-expert trace). */
/* A step's ids at once: the expert a later row needs is never the victim of an earlier miss (one at
 * a time, LRU would evict 0 for 2 and then miss 0); repeats count once; fills name the slots. */
static void test_cache_access(void) {
    qf_slot_cache c;
    CHECK(qf_slot_cache_init(&c, QF_POLICY_LRU, 8, 2, 64) == QF_OK, "%s", qf_last_error());
    int32_t s1[] = {0, 1, 0}, s2[] = {2, 0, 2, 0}, fe[4], fs[4];
    CHECK(qf_slot_cache_access(&c, s1, 3, NULL, fe, fs) == 2 && fe[0] == 0 && fs[0] == 0 && fe[1] == 1 && fs[1] == 1 && c.misses == 2 && c.hits == 0,
          "step 1: the two misses fill slots 0 and 1");
    qf_slot_cache_tick(&c);
    CHECK(qf_slot_cache_access(&c, s2, 4, NULL, fe, fs) == 1 && fe[0] == 2 && fs[0] == 1 && c.hits == 1 && c.misses == 3 && c.slot_of[0] == 0 &&
              c.slot_of[1] == -1,
          "step 2: 0 hits, 2 takes 1's slot (hits %llu, misses %llu)", (unsigned long long)c.hits, (unsigned long long)c.misses);
    qf_slot_cache_free(&c);
}

static void test_cache_policies(void) {
    /* one expert a token, 2 slots: LRU hits only at token 5 (2 pushes 0 out, 0 pushes 1, 3 pushes 2);
     * Belady keeps 0 and 1 and lets 2 and 3 pass (each is needed later than both): hits at 3, 5, 6 */
    int hand[] = {0, 1, 2, 0, 3, 0, 1, 2};
    CHECK(replay_hits(QF_POLICY_LRU, hand, 8, 1, 4, 2) == 1, "LRU hits on the hand trace");
    CHECK(replay_hits(QF_POLICY_MIN, hand, 8, 1, 4, 2) == 3, "Belady hits on the hand trace");
    int n = 4000, k = 4, E = 64, *ids = malloc((size_t)n * k * sizeof *ids);
    uint64_t sum[QF_N_POLICIES] = {0};
    for (int round = 0; round < 3; round++) {
        for (int t = 0; t < n; t++)
            for (int j = 0; j < k; j++) {
                int e, again = 1;
                while (again) { /* Zipf-like popularity, distinct within a token */
                    double u = (qt_frand() + 1) / 2;
                    e = (int)(E * u * u * u) % E;
                    again = 0;
                    for (int i = 0; i < j; i++) again |= ids[t * k + i] == e;
                }
                ids[t * k + j] = e;
            }
        for (int p = 0; p < QF_N_POLICIES; p++) sum[p] += replay_hits(p, ids, n, k, E, 16);
    }
    for (int p = 0; p < QF_N_POLICIES; p++)
        CHECK(sum[QF_POLICY_MIN] >= sum[p], "%s beats Belady's optimum (%llu > %llu)", qf_policy_name(p), (unsigned long long)sum[p],
              (unsigned long long)sum[QF_POLICY_MIN]);
    CHECK(sum[QF_POLICY_DLFU] > sum[QF_POLICY_LRU], "decayed frequency %llu <= LRU %llu on a skewed trace", (unsigned long long)sum[QF_POLICY_DLFU],
          (unsigned long long)sum[QF_POLICY_LRU]);
    fprintf(stderr, "policies on skewed random traces (hits of %d): lru %llu, dlfu %llu, dlfu-admit %llu, min %llu\n", 3 * n * k,
            (unsigned long long)sum[0], (unsigned long long)sum[1], (unsigned long long)sum[2], (unsigned long long)sum[3]);
    free(ids);
}

/* The budget plan on the synthetic Qwen3.6-35B-A3B's measured parts (docs/performance.md's table:
 * context 595, trunk 4764, workspace and scratch 1234, states and KV 71 MiB; 6 MiB a bf16 expert,
 * 40 layers, 256 experts, top-8): the slots a layer and the staging of each budget, and the 9G
 * refusal naming the least budget. */
static void test_plan_table(void) {
    const size_t M = (size_t)1 << 20;
    struct {
        const char *budget;
        size_t bytes;
        int slots, stage;
        const char *refusal;
    } rows[] = {
        {"22G", (size_t)22 << 30, 53, 1, NULL},
        {"12G", (size_t)12 << 30, 23, 0, NULL},
        {"10.4G", (size_t)(10.4 * 1073741824.0), 16, 0, NULL},
        {"9G", (size_t)9 << 30, 10, 0,
         "the GPU budget leaves 2488 MiB for the expert buffer: 10 slots a layer, at least 16 (2 x top-8) are needed: 3840 MiB of buffer, "
         "a budget of at least 10.32 GiB"},
        {"80G", (size_t)80 << 30, 256, 1, NULL},
        {"22G serving", (size_t)22 << 30, 24, 1, NULL}, /* 16 sequences of 9000 tokens' states and KV (6992 MiB): staging still fits */
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        qf_plan_in in = {.budget = rows[i].bytes, .device_total = (size_t)140 << 30, .device_free = (size_t)130 << 30, .host_ram = 0,
                         .context = 595 * M, .trunk = 4764 * M, .workspace = 1234 * M, .reserve = (i == 5 ? 6992 : 71) * M, .slot_bytes = 6 * M,
                         .n_layers = 40, .n_experts = 256, .top_k = 8, .policy = QF_POLICY_DLFU_AD};
        qf_plan p;
        int rc = qf_plan_make(&in, &p);
        if (rows[i].refusal) {
            CHECK(rc == QF_EINVAL && strstr(qf_last_error(), rows[i].refusal), "%s: %s", rows[i].budget, rc == QF_OK ? "planned" : qf_last_error());
            continue;
        }
        CHECK(rc == QF_OK, "%s: %s", rows[i].budget, qf_last_error());
        CHECK(p.slots == rows[i].slots && (p.stage == 2 * 6 * 256 * M) == rows[i].stage, "%s: %d slots, staging %zu MiB; want %d, %s", rows[i].budget,
              p.slots, p.stage / M, rows[i].slots, rows[i].stage ? "2 x 1536" : "none");
        CHECK(p.buffer <= in.budget - (595 + 4764 + 1234 + 71) * M - QF_PLAN_MARGIN, "%s: the buffer %zu MiB is over what the budget leaves", rows[i].budget, p.buffer / M);
    }
    qf_plan_in big = {.budget = (size_t)200 << 30, .device_total = (size_t)140 << 30, .slot_bytes = 6 * M, .n_layers = 40, .n_experts = 256, .top_k = 8};
    qf_plan p;
    CHECK(qf_plan_make(&big, &p) == QF_EINVAL && strstr(qf_last_error(), "more than the device's 140.0 GiB"), "a budget over the device: %s", qf_last_error());
    qf_plan_in host = {.budget = (size_t)22 << 30, .device_total = (size_t)140 << 30, .host_ram = 32.0 * 1073741824.0, .slot_bytes = 6 * M,
                       .n_layers = 40, .n_experts = 256, .top_k = 8};
    CHECK(qf_plan_make(&host, &p) == QF_EINVAL && strstr(qf_last_error(), "60.0 GiB of host memory"), "experts over the host's RAM: %s", qf_last_error());
    /* 60 GiB of experts fit 72 GiB of RAM (0.9 of it: 64.8) until 6 GiB of prefix snapshots join them */
    host.host_ram = 72.0 * 1073741824.0, host.device_free = (size_t)130 << 30, host.host_reserve = (size_t)4 << 30;
    CHECK(qf_plan_make(&host, &p) == QF_OK && p.host_reserve == host.host_reserve, "experts and 4 GiB of snapshots in 72 GiB: %s", qf_last_error());
    host.host_reserve = (size_t)6 << 30;
    CHECK(qf_plan_make(&host, &p) == QF_EINVAL && strstr(qf_last_error(), "prefix snapshots up to 6.0 GiB"), "snapshots over the host's RAM: %s", qf_last_error());
    qf_plan_in tight = {.cache_bytes = 4000 * M, .device_total = (size_t)24 << 30, .device_free = 3000 * M, .slot_bytes = 6 * M, .n_layers = 40,
                        .n_experts = 256, .top_k = 8};
    CHECK(qf_plan_make(&tight, &p) == QF_EINVAL && strstr(qf_last_error(), "the device has 3000 MiB free"), "a buffer over the free memory: %s", qf_last_error());
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    test_plan_table();
    test_cache_access();
    test_cache_policies();
    test_expert_cache("tests/data/qwen35moe-tiny");
    test_expert_cache("models/qwen36moe-code-14m");
    test_expert_prefetch("models/qwen36moe-code-14m", (size_t)3 << 19);
    test_prefetch_failure("models/qwen36moe-code-14m", (size_t)3 << 19);
    test_expert_heat();
    test_flash_config();
    test_flash_schedule();
    test_moving_store(0);
    test_moving_store(1);
    test_failing_store();
    test_layered_prompt();
    test_layered_reads();
    test_sched_layered_prompt();
    test_sparsity_experts();
    test_sparsity_trunk();
    test_sparsity_kv();
    test_gpu_abandoned_steps();
    test_gpu_devcache(GPU_MODEL);
    test_gpu_devcache("tests/data/qwen35moe-tiny");
    test_gpu_hybrid(GPU_MODEL);
    return qt_finish();
}
