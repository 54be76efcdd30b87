/* qflash route-record: a model's routing on real text (the host path), written as a trace that
 * route-replay reads: expert_ids [layers][tokens][top_k], best first, in a safetensors file. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mapfile.h"
#include "cli.h"
#include "backend/rules.h"

#define GUESSES 16

typedef struct rec {
    int L, T, K, at; /* at: tokens of the current chunk before this one */
    int32_t *ids;    /* [L][T][K] */
    int32_t *guess;  /* [L][T][GUESSES]: layer L's router on the residual that entered layer L-1's MoE (-1 for layer 0) */
    const qf_model *m;
    float *y, *logits;
} rec;

/* The next layer's router on this layer's MoE input: what a prefetcher could know one layer ahead. */
static void guess_next(rec *r, int layer, const float *x, int rows, int hidden) {
    if (layer + 1 >= r->L) return;
    const qf_layer_w *w = &r->m->layers[layer + 1];
    qf_backend be = {&qf_cpu_ops_ref, NULL, NULL};
    int E = r->m->cfg.n_experts, ti[GUESSES];
    float tw[GUESSES];
    for (int i = 0; i < rows && r->at + i < r->T; i++) {
        be.ops->rmsnorm(&be, x + (size_t)i * hidden, hidden, w->ffn_norm, 1, hidden, r->m->cfg.norm_eps, r->y, hidden);
        be.ops->matmul(&be, &w->router, r->y, 1, r->logits);
        qf_ref_route(r->logits, E, GUESSES, ti, tw);
        memcpy(r->guess + ((size_t)(layer + 1) * r->T + r->at + i) * GUESSES, ti, sizeof ti);
    }
}

static void on_route(void *ud, int layer, const int *ids, int rows, int top_k, const float *x, int hidden) {
    rec *r = ud;
    for (int i = 0; i < rows && r->at + i < r->T; i++)
        for (int k = 0; k < top_k && k < r->K; k++) r->ids[((size_t)layer * r->T + r->at + i) * r->K + k] = ids[i * top_k + k];
    guess_next(r, layer, x, rows, hidden);
}

static int write_trace(const char *path, const rec *r, const char *source) {
    size_t bytes = (size_t)r->L * r->T * r->K * sizeof(int32_t), gbytes = (size_t)r->L * r->T * GUESSES * sizeof(int32_t);
    json_t *h = json_pack("{s:{s:s,s:[i,i,i],s:[i,I]},s:{s:s,s:[i,i,i],s:[I,I]},s:{s:s}}", "expert_ids", "dtype", "I32", "shape", r->L, r->T, r->K,
                          "data_offsets", 0, (json_int_t)bytes, "guess_ids", "dtype", "I32", "shape", r->L, r->T, GUESSES, "data_offsets",
                          (json_int_t)bytes, (json_int_t)(bytes + gbytes), "__metadata__", "source", source);
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
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(text, 1, n, f) == n && fwrite("        ", 1, pad, f) == pad && fwrite(r->ids, 1, bytes, f) == bytes &&
             fwrite(r->guess, 1, gbytes, f) == gbytes;
    ok &= fclose(f) == 0;
    free(text);
    return ok ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
}

int cmd_route_record(int argc, char **argv, qf_backend_opts *bo) {
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
    qf_engine_opts eo;
    cli_engine_init(&eo, bo);
    int n = 0, rc = cli_open_engine(&e, dir, threads, &eo);
    if (rc != QF_OK) return 1;
    const qf_config *c = &e->model->cfg;
    if (c->arch != QF_ARCH_QWEN35_MOE || !e->tok) rc = qf_fail(QF_EINVAL, "%s: a MoE model with a tokenizer is needed", dir);
    if (rc == QF_OK) rc = qf_read_file(text_path, &text, &len);
    if (rc == QF_OK) rc = qf_tok_encode(e->tok, text, len, &toks, &n);
    rec r = {c->n_layers, n < max_tokens ? n : max_tokens, c->n_experts_used, 0, NULL, NULL, e->model, NULL, NULL};
    if (rc == QF_OK) {
        r.ids = calloc((size_t)r.L * r.T * r.K, sizeof *r.ids), r.guess = malloc((size_t)r.L * r.T * GUESSES * sizeof *r.guess);
        r.y = malloc((size_t)c->hidden * sizeof *r.y), r.logits = malloc((size_t)c->n_experts * sizeof *r.logits);
        if (!r.ids || !r.guess || !r.y || !r.logits || c->n_experts < GUESSES) rc = qf_fail(QF_ENOMEM, "out of memory (or fewer than %d experts)", GUESSES);
        for (size_t i = 0; rc == QF_OK && i < (size_t)r.L * r.T * GUESSES; i++) r.guess[i] = -1;
    }
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
    free(r.ids), free(r.guess), free(r.y), free(r.logits), free(toks), free(text);
    qf_engine_close(e);
    return rc == QF_OK ? 0 : 1;
}
