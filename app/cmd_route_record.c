/* qflash route-record: a model's routing on real text (the host path), written as a trace that
 * route-replay reads: expert_ids [layers][tokens][top_k], best first, in a safetensors file. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mapfile.h"
#include "cli.h"

typedef struct rec {
    int L, T, K, at; /* at: tokens of the current chunk before this one */
    int32_t *ids;    /* [L][T][K] */
} rec;

static void on_route(void *ud, int layer, const int *ids, int rows, int top_k) {
    rec *r = ud;
    for (int i = 0; i < rows && r->at + i < r->T; i++)
        for (int k = 0; k < top_k && k < r->K; k++) r->ids[((size_t)layer * r->T + r->at + i) * r->K + k] = ids[i * top_k + k];
}

static int write_trace(const char *path, const rec *r, const char *source) {
    size_t bytes = (size_t)r->L * r->T * r->K * sizeof(int32_t);
    json_t *h = json_pack("{s:{s:s,s:[i,i,i],s:[i,I]},s:{s:s}}", "expert_ids", "dtype", "I32", "shape", r->L, r->T, r->K, "data_offsets", 0,
                          (json_int_t)bytes, "__metadata__", "source", source);
    char *text = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    FILE *f = fopen(path, "wb");
    if (!text || !f) {
        free(text);
        if (f) fclose(f);
        return qf_fail(QF_EIO, "cannot write %s", path);
    }
    size_t n = strlen(text), pad = (8 - n % 8) % 8;
    uint64_t hl = n + pad;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(hl >> (8 * i));
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(text, 1, n, f) == n && fwrite("        ", 1, pad, f) == pad && fwrite(r->ids, 1, bytes, f) == bytes;
    ok &= fclose(f) == 0;
    free(text);
    return ok ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
}

int cmd_route_record(int argc, char **argv) {
    const char *dir = NULL, *text_path = NULL, *out = NULL;
    int max_tokens = 16384, threads = 0;
    cli_args a = {argc, 1, argv, 0};
    for (; a.i < argc && !a.bad; a.i++) {
        if (cli_is(&a, "-m", "--model")) dir = cli_value(&a);
        else if (cli_is(&a, "-f", "--file")) text_path = cli_value(&a);
        else if (cli_is(&a, "-o", "--out")) out = cli_value(&a);
        else if (cli_is(&a, "-n", "--tokens")) max_tokens = cli_int(&a, 1, 1 << 24);
        else if (cli_is(&a, "-t", "--threads")) threads = cli_int(&a, 1, 1024);
        else {
            fprintf(stderr, "error: unknown option '%s' for route-record\n", argv[a.i]);
            a.bad = 1;
        }
    }
    if (a.bad || !dir || !text_path || !out) {
        fprintf(stderr, "usage: qflash route-record -m DIR -f TEXT -o TRACE.safetensors [-n TOKENS] [-t THREADS]\n");
        return 2;
    }
    qf_engine *e;
    char *text = NULL;
    size_t len = 0;
    int32_t *toks = NULL;
    int n = 0, rc = cli_open_engine(&e, dir, threads);
    if (rc != QF_OK) return 1;
    const qf_config *c = &e->model->cfg;
    if (c->arch != QF_ARCH_QWEN35_MOE || !e->tok) rc = qf_fail(QF_EINVAL, "%s: a MoE model with a tokenizer is needed", dir);
    if (rc == QF_OK) rc = qf_read_file(text_path, &text, &len);
    if (rc == QF_OK) rc = qf_tok_encode(e->tok, text, len, &toks, &n);
    rec r = {c->n_layers, n < max_tokens ? n : max_tokens, c->n_experts_used, 0, NULL};
    if (rc == QF_OK && !(r.ids = calloc((size_t)r.L * r.T * r.K, sizeof *r.ids))) rc = qf_fail(QF_ENOMEM, "out of memory");
    qf_state *st = rc == QF_OK ? qf_state_create(e->model, r.T + 1) : NULL;
    if (rc == QF_OK && !st) rc = qf_fail(QF_ENOMEM, "out of memory");
    qf_workspace_set_route_hook(e->ws, on_route, &r);
    for (int at = 0; rc == QF_OK && at < r.T; at += 256) { /* one sequence, in chunks the engine's workspace holds */
        int cnt = r.T - at < 256 ? r.T - at : 256;
        r.at = at;
        rc = qf_forward_seq(e->model, &e->be, e->ws, st, toks + at, cnt, QF_LOGITS_NONE, NULL);
    }
    if (rc == QF_OK) rc = write_trace(out, &r, dir);
    if (rc == QF_OK) fprintf(stderr, "%s: %d layers x %d tokens x top-%d of %d experts\n", out, r.L, r.T, r.K, c->n_experts);
    else fprintf(stderr, "error: %s\n", qf_last_error());
    qf_state_free(st);
    free(r.ids), free(toks), free(text);
    qf_engine_close(e);
    return rc == QF_OK ? 0 : 1;
}
