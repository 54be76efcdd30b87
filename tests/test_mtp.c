/* The MTP head of the bundled model (tests/data/mtp, trained for it, with float64 references):
 * loaded as a second shard, its logits for the last 8 pairs of 4 prompts against the reference,
 * and a chained draft equal to the same pairs fed one by one. */
#define _DEFAULT_SOURCE /* realpath */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/ops.h"
#include "base/mapfile.h"
#include "model/model.h"
#include "model/ref_forward.h"
#include "runtime/engine.h"
#include "runtime/sched.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

static char dir[256];

/* Adds every tensor name of the file at path to map, as stored in file. */
static void index_file(json_t *map, const char *path, const char *file) {
    qf_st_set s = {0};
    CHECK(qf_st_open(&s, path) == QF_OK, "%s: %s", path, qf_last_error());
    for (int i = 0; i < s.n_tensors; i++) json_object_set_new(map, s.tensors[i].name, json_string(file));
    qf_st_close(&s);
}

/* The bundled model with the head as a second shard: its config with mtp_num_hidden_layers 1, the
 * two files linked, an index naming both. */
static int make_dir(void) {
    snprintf(dir, sizeof dir, "/tmp/qflash-mtp-XXXXXX");
    if (!mkdtemp(dir)) return 0;
    char a[4096], b[600];
    json_t *cfg = json_load_file(qt_path("models/qwen36moe-code-14m/config.json"), 0, NULL);
    json_t *tc = json_object_get(cfg, "text_config");
    json_object_set_new(tc ? tc : cfg, "mtp_num_hidden_layers", json_integer(1));
    snprintf(a, sizeof a, "%s/config.json", dir);
    int ok = cfg && json_dump_file(cfg, a, JSON_INDENT(2)) == 0;
    json_decref(cfg);
    const char *files[2][2] = {{"models/qwen36moe-code-14m/model.safetensors", "model-00001-of-00002.safetensors"},
                               {"tests/data/mtp/qwen36moe-code-14m.mtp.safetensors", "model-00002-of-00002.safetensors"}};
    json_t *map = json_object();
    for (int i = 0; i < 2; i++) {
        if (!realpath(qt_path(files[i][0]), a)) return 0; /* the links live elsewhere */
        snprintf(b, sizeof b, "%s/%s", dir, files[i][1]);
        ok = ok && symlink(a, b) == 0;
        index_file(map, a, files[i][1]);
    }
    json_t *idx = json_pack("{s:{},s:o}", "metadata", "weight_map", map);
    snprintf(a, sizeof a, "%s/model.safetensors.index.json", dir);
    ok = ok && json_dump_file(idx, a, 0) == 0;
    json_decref(idx);
    return ok;
}

/* The model's final-normed hidden states of a prompt (its MTP inputs), all rows at once. */
static int hidden_of(const qf_model *m, qf_backend *be, qf_workspace *ws, const int32_t *ids, int T, float *h) {
    qf_state *st = qf_state_create(m, T + 8);
    qf_seq_step s = {st, ids, T, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, h, NULL};
    int rc = st ? qf_forward(m, be, ws, &s, 1) : QF_ENOMEM;
    qf_state_free(st);
    return rc;
}

static void test_reference(const qf_model *m, qf_backend *be) {
    qf_st_set ref = {0};
    CHECK(qf_st_open(&ref, qt_path("tests/data/mtp/qwen36moe-code-14m.mtp_reference.safetensors")) == QF_OK, "reference: %s", qf_last_error());
    int H = m->cfg.hidden, V = m->cfg.vocab;
    qf_workspace *ws = qf_workspace_create(m, 512);
    qf_mtp_run *run = qf_mtp_run_create(m, 512, 600);
    CHECK(ws && run, "workspace and MTP run");
    for (int p = 0; ws && run && p < 4; p++) {
        char name[64];
        snprintf(name, sizeof name, "p%d.input_ids", p);
        const qf_st_tensor *ti = qf_st_find(&ref, name);
        int T = ti ? (int)ti->n_elem : 0;
        int32_t *ids = malloc((size_t)T * sizeof *ids);
        for (int i = 0; i < T; i++) ids[i] = (int32_t)((const int64_t *)ti->data)[i];
        int64_t nw, rows;
        snprintf(name, sizeof name, "p%d.mtp_logits_tail", p);
        const float *want = qt_ref_f32(&ref, name, &nw, &rows);
        float *h = malloc((size_t)T * H * sizeof *h), *lg = malloc((size_t)(T - 1) * V * sizeof *lg);
        CHECK(hidden_of(m, be, ws, ids, T, h) == QF_OK, "p%d main forward: %s", p, qf_last_error());
        qf_mtp_run_reset(run);
        CHECK(qf_mtp_step(m, be, run, ids + 1, h, T - 1, QF_LOGITS_ALL, lg, NULL, NULL) == QF_OK, "p%d MTP: %s", p, qf_last_error());
        const float *got = lg + (size_t)(T - 1 - rows) * V;
        double err = qt_rel_err(got, want, (size_t)nw);
        int same = 1;
        for (int r = 0; r < rows; r++) same &= qt_argmax(got + (size_t)r * V, V) == qt_argmax(want + (size_t)r * V, V);
        CHECK(err < 1e-4, "p%d (%d tokens): MTP logits of the last %lld pairs off the float64 reference by %.3g", p, T, (long long)rows, err);
        CHECK(same, "p%d: a greedy MTP draft differs from the reference's", p);
        fprintf(stderr, "  p%d: %d tokens, MTP logits of the last %lld pairs within %.2e of the reference\n", p, T, (long long)rows, err);
        if (p < 2) { /* the readable reference forward's head: the float64 reference's logits, and the fast head's */
            float *slow = malloc((size_t)(T - 1) * V * sizeof *slow);
            CHECK(qf_model_ref_mtp(m, ids, T, slow) == QF_OK, "p%d reference MTP: %s", p, qf_last_error());
            double e_ref = qt_rel_err(slow + (size_t)(T - 1 - rows) * V, want, (size_t)nw), e_fast = qt_rel_err(lg, slow, (size_t)(T - 1) * V);
            CHECK(e_ref < 1e-4 && e_fast < 1e-4, "p%d: the reference forward's MTP logits are %.3g from the float64 reference, the fast head %.3g from them", p, e_ref, e_fast);
            fprintf(stderr, "  p%d: the reference forward's MTP logits within %.2e of the float64 reference, the fast head within %.2e of them\n", p, e_ref, e_fast);
            free(slow);
        }
        free(ids), free(h), free(lg);
    }
    qf_workspace_free(ws);
    qf_mtp_run_free(run);
    qf_st_close(&ref);
}

static void test_speculative(const int32_t *ids);

/* One greedy step of the model: feed tok at st's position, its hidden state into h, the pick. */
static int32_t greedy_step(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st, int32_t tok, float *h, float *lg) {
    qf_seq_step s = {st, &tok, 1, QF_LOGITS_LAST, lg, NULL, 0, 0, NULL, h, NULL};
    return qf_forward(m, be, ws, &s, 1) == QF_OK ? qt_argmax(lg, m->cfg.vocab) : -1;
}

/* Draft acceptance as the reference measured it: 8 prompts of 64 held-out tokens (consecutive
 * windows of heldout.txt), 96 greedy tokens each; at every position with 3 tokens after it, 3
 * chained greedy drafts from the true pairs before it, counted while they equal the greedy text. */
static void test_acceptance(const qf_model *m, qf_backend *be, int with_spec) {
    qf_tokenizer *tok = NULL;
    char *text = NULL;
    int32_t *ids = NULL;
    int n = 0, H = m->cfg.hidden, V = m->cfg.vocab, hist[4] = {0}, P = 64, G = 96;
    CHECK(qf_tok_load(&tok, qt_path("models/qwen36moe-code-14m")) == QF_OK, "tokenizer: %s", qf_last_error());
    CHECK(qf_read_file(qt_path("models/qwen36moe-code-14m/heldout.txt"), &text, NULL) == QF_OK, "heldout.txt");
    int ok_in = tok && text && qf_tok_encode(tok, text, strlen(text), &ids, &n) == QF_OK && n >= 8 * P;
    CHECK(ok_in, "held-out tokens");
    if (!ok_in) return;
    qf_workspace *ws = qf_workspace_create(m, P);
    qf_mtp_run *run = qf_mtp_run_create(m, P, P + G + 8);
    qf_state *st = qf_state_create(m, P + G + 8);
    float *h = malloc((size_t)(P + G) * H * sizeof *h), *lg = malloc((size_t)P * V * sizeof *lg), *mo = malloc((size_t)H * sizeof *mo);
    int32_t *seq = malloc((size_t)(P + G) * sizeof *seq);
    for (int p = 0; p < 8; p++) {
        qf_state_reset(st), qf_mtp_run_reset(run);
        memcpy(seq, ids + (size_t)p * P, (size_t)P * sizeof *seq);
        qf_seq_step s = {st, seq, P, QF_LOGITS_LAST, lg, NULL, 0, 0, NULL, h, NULL};
        CHECK(qf_forward(m, be, ws, &s, 1) == QF_OK, "prompt %d", p);
        seq[P] = qt_argmax(lg, V);
        for (int j = 1; j < G; j++) seq[P + j] = greedy_step(m, be, ws, st, seq[P + j - 1], h + (size_t)(P + j - 1) * H, lg);
        CHECK(qf_mtp_step(m, be, run, seq + 1, h, P - 1, QF_LOGITS_NONE, NULL, NULL, NULL) == QF_OK, "MTP prompt pairs"); /* t = 0 .. P - 2 */
        for (int j = 0; j + 3 < G; j++) { /* drafts from main position q = P - 1 + j: the pair (seq[q + 1], h[q]) first */
            int q = P - 1 + j, k = 0, ok = 1;
            int32_t d = seq[q + 1];
            const float *hin = h + (size_t)q * H;
            for (int i = 0; i < 3; i++) {
                ok &= qf_mtp_step(m, be, run, &d, hin, 1, QF_LOGITS_LAST, lg, NULL, mo) == QF_OK;
                d = qt_argmax(lg, V), hin = mo;
                if (k == i && d == seq[q + 2 + i]) k++;
            }
            CHECK(ok, "MTP drafts");
            hist[k]++;
            qf_mtp_truncate(run, q + 1); /* keep the first pair, made of true values */
        }
    }
    /* The reference's 8 prompts are not named beyond "64 held-out tokens": these are the first 8
     * windows. Its figures: 88/103/88/465, the first draft accepted at 88.2%, 2.25 of 3 on average.
     * A wrong pairing (h one position off, the head's output not chained) drops both far below. */
    int pos = 8 * (G - 3);
    double first = (double)(hist[1] + hist[2] + hist[3]) / pos, mean = (hist[1] + 2.0 * hist[2] + 3.0 * hist[3]) / pos;
    fprintf(stderr, "  draft acceptance, 3 chained: %d/%d/%d/%d positions accepting 0/1/2/3 (reference 88/103/88/465); first draft %.1f%% (88.2%%), %.2f of 3 (2.25)\n",
            hist[0], hist[1], hist[2], hist[3], 100 * first, mean);
    CHECK(fabs(first - 0.882) < 0.03 && fabs(mean - 2.25) < 0.15, "draft acceptance %.3f first, %.2f of 3, against the reference's 0.882 and 2.25", first, mean);
    free(h), free(lg), free(mo), free(seq), free(text);
    qf_state_free(st), qf_mtp_run_free(run), qf_workspace_free(ws), qf_tok_free(tok);
    if (with_spec) test_speculative(ids);
    free(ids);
}

typedef struct ids_out {
    int32_t ids[256];
    int n;
} ids_out;

static void on_id(void *ud, const qf_token_lp *t) {
    ids_out *o = ud;
    if (o->n < 256) o->ids[o->n++] = t->id;
}

/* Greedy generation through the scheduler with 1, 2 and 3 drafts a step against none: the same
 * ids after a plain end, a stop among accepted drafts (a token budget), and the context's end. */
static void test_speculative(const int32_t *ids) {
    qf_engine *e[4] = {0};
    for (int d = 0; d < 4; d++) {
        qf_engine_opts o = {.n_threads = 2, .max_batch = 64, .draft = d};
        CHECK(qf_engine_open(&e[d], dir, &o) == QF_OK, "engine with --draft %d: %s", d, qf_last_error());
        if (!e[d]) return;
    }
    struct { int prompt, max, ctx; } c[] = {{32, 80, 512}, {20, 17, 512}, {48, 200, 48 + 30}, {7, 1, 512}};
    uint64_t steps = 0;
    for (int k = 0; k < 4; k++)
        for (int w = 0; w < 3; w++) {
            ids_out out[4];
            for (int d = 0; d < 4; d++) {
                qf_sched_opts so = {.max_batch = 1, .ctx = c[k].ctx, .prefill_chunk = 32, .max_queue = 1};
                qf_sched *s = NULL;
                memset(&out[d], 0, sizeof out[d]);
                qf_req_params p = {.prompt = ids + 97 * w + 13 * k, .n_prompt = c[k].prompt, .max_tokens = c[k].max, .sampling = qf_sampling_default(),
                                   .logprobs = -1, .want_ids = 1, .grammar_after = -1};
                qf_req_sink sink = {NULL, on_id, &out[d]};
                qf_req_status st;
                CHECK(qf_sched_create(&s, e[d], &so) == QF_OK && qf_sched_run(s, &p, &sink, NULL, &st) == QF_OK, "generate: %s", qf_last_error());
                qf_sched_stats ss;
                if (s) qf_sched_get_stats(s, &ss), steps += ss.spec_steps;
                qf_sched_destroy(s);
            }
            for (int d = 1; d < 4; d++) {
                int same = out[d].n == out[0].n && !memcmp(out[d].ids, out[0].ids, (size_t)out[0].n * sizeof(int32_t));
                CHECK(same, "case %d window %d, --draft %d: %d ids against %d without drafts, or others", k, w, d, out[d].n, out[0].n);
            }
        }
    CHECK(steps > 0, "no speculative step ran");
    for (int d = 0; d < 4; d++) qf_engine_close(e[d]);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    if (!make_dir()) {
        CHECK(0, "cannot make the model directory %s", dir);
        return qt_finish();
    }
    qf_model *m = NULL;
    CHECK(qf_model_load(&m, dir, NULL) == QF_OK, "load %s: %s", dir, qf_last_error());
    CHECK(m && m->mtp && m->mtp_fc.data, "the MTP head is bound");
    qf_pool *pool = qf_pool_create(qf_cpu_count() > 1 ? qf_cpu_count() : 2);
    qf_backend be = {qf_cpu_ops_best(), pool, NULL};
    if (m && m->mtp) test_reference(m, &be), test_acceptance(m, &be, 1);
    qf_model_free(m);
    /* the same acceptance through the CPU's composed fused decode ops: the model's steps and the
     * head's one-pair drafts take the decode path (as on a GPU) */
    m = NULL;
    qf_backend cb = {qf_cpu_ops_best(), pool, NULL};
    CHECK(qf_model_load(&m, dir, NULL) == QF_OK && qf_cpu_dec_compose_init(&cb, qf_cpu_ops_best(), (size_t)4 << 20) == QF_OK &&
              qf_model_to_device(m, &cb, 0) == QF_OK, "%s", qf_last_error());
    CHECK(m && m->dec_ok && m->mtp && m->mtp->dec_ok, "the model and its head take the composed decode ops");
    if (m && m->mtp && m->mtp->dec_ok) fprintf(stderr, "composed decode ops:\n"), test_acceptance(m, &cb, 0);
    /* the drafts from an int8 copy of lm_head (as on a GPU): the copy made from the device's rows,
     * the acceptance as good (bundled: 77/101/75/491 against 77/102/74/491 with bf16) */
    CHECK(m && qf_mtp_lm_head_int8(m) == QF_OK && m->mtp->lm_head.dtype == QF_Q_I8B32 && m->lm_head.dtype == QF_DT_BF16, "int8 lm_head for the drafts: %s",
          qf_last_error());
    if (m && m->mtp) fprintf(stderr, "composed decode ops, drafts from an int8 lm_head:\n"), test_acceptance(m, &cb, 0);
    qf_model_free(m);
    qf_cpu_dec_compose_free(&cb);
    qf_pool_destroy(pool);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return qt_finish();
}
