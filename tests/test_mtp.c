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
#include "model/model.h"
#include "test_util.h"

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
    qf_seq_step s = {st, ids, T, QF_LOGITS_NONE, NULL, NULL, 0, 0, NULL, h};
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
        CHECK(qf_mtp_step(m, be, run, ids + 1, h, T - 1, QF_LOGITS_ALL, lg, NULL) == QF_OK, "p%d MTP: %s", p, qf_last_error());
        const float *got = lg + (size_t)(T - 1 - rows) * V;
        double err = qt_rel_err(got, want, (size_t)nw);
        int same = 1;
        for (int r = 0; r < rows; r++) same &= qt_argmax(got + (size_t)r * V, V) == qt_argmax(want + (size_t)r * V, V);
        CHECK(err < 1e-4, "p%d (%d tokens): MTP logits of the last %lld pairs off the float64 reference by %.3g", p, T, (long long)rows, err);
        CHECK(same, "p%d: a greedy MTP draft differs from the reference's", p);
        fprintf(stderr, "  p%d: %d tokens, MTP logits of the last %lld pairs within %.2e of the reference\n", p, T, (long long)rows, err);
        free(ids), free(h), free(lg);
    }
    qf_workspace_free(ws);
    qf_mtp_run_free(run);
    qf_st_close(&ref);
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
    if (m && m->mtp) test_reference(m, &be);
    qf_model_free(m);
    qf_pool_destroy(pool);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return qt_finish();
}
