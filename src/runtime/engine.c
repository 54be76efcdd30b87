#include "runtime/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/timer.h"
#include "backend/backend.h"
#include "base/utf8.h"
#include "runtime/engine_int.h"

/* The backend named by opts->device; on a device the weights are copied there (generated ones
 * dropped from host memory once there), except the routed experts when they are to stream. */
static int use_device(qf_engine *e, const qf_engine_opts *opts, int stream, size_t *free_start, size_t *free_trunk) {
    int rc = qf_backend_open(&e->be, opts->device, e->pool, opts->backend);
    if (rc != QF_OK) return rc;
    e->on_gpu = qf_backend_is_device(&e->be);
    if (!e->on_gpu) return QF_OK;
    size_t total;
    if (stream && e->be.ops->mem_info) e->be.ops->mem_info(&e->be, free_start, &total);
    rc = qf_model_to_device(e->model, &e->be, stream ? QF_TO_DEVICE_EXPERTS_HOME : opts->synth ? QF_TO_DEVICE_DROP_HOST : 0);
    if (stream && e->be.ops->mem_info) e->be.ops->mem_info(&e->be, free_trunk, &total);
    return rc;
}

int qf_engine_open(qf_engine **out, const char *dir, const qf_engine_opts *opts) {
    *out = NULL;
    double t0 = qf_now();
    qf_engine *e = calloc(1, sizeof *e);
    if (!e) return qf_fail(QF_ENOMEM, "out of memory");
    qf_load_opts lo = {opts->diag, opts->progress, opts->progress_ud};
    int rc = opts->synth ? qf_model_synthetic(&e->model, opts->synth, &lo) : qf_model_load(&e->model, dir, &lo);
    char tj[4096];
    snprintf(tj, sizeof tj, "%s/tokenizer.json", dir ? dir : "");
    if (rc == QF_OK && dir && access(tj, R_OK) == 0) rc = qf_tok_load(&e->tok, dir);
    if (rc == QF_OK && e->tok && qf_tok_vocab_size(e->tok) > e->model->cfg.vocab)
        rc = qf_fail(QF_EFORMAT, "%s: the tokenizer has %d tokens, more than the model's vocab_size %d", tj, qf_tok_vocab_size(e->tok), e->model->cfg.vocab);
    size_t cache = 0, free_start = 0, free_trunk = 0;
    qf_flash_config *fc = malloc(sizeof *fc); /* large: its thresholds' table */
    if (rc == QF_OK) rc = fc ? qf_load_flash_config(dir, fc) : qf_fail(QF_ENOMEM, "out of memory");
    if (rc == QF_OK) cache = qf_load_cache_bytes(fc, opts);
    int stream = rc == QF_OK && (cache || opts->gpu_mem) && e->model->experts;
    if (rc == QF_OK) {
        e->pool = qf_pool_create(opts->n_threads > 0 ? opts->n_threads : qf_cpu_count());
        rc = use_device(e, opts, stream, &free_start, &free_trunk);
        if (rc == QF_OK && !e->on_gpu && opts->gpu_mem) rc = qf_fail(QF_EINVAL, "--gpu-mem is a device budget: it needs --device cuda");
        if (rc == QF_OK && !e->on_gpu) rc = qf_load_experts_cpu(e, cache);
    }
    if (rc == QF_OK) {
        e->ws = qf_workspace_create(e->model, opts->max_batch > 0 ? opts->max_batch : 512);
        e->logits = malloc((size_t)e->model->cfg.vocab * sizeof(float));
        e->text_cap = 3 * (e->tok ? qf_tok_max_piece_len(e->tok) : 0) + 8;
        e->text = malloc(e->text_cap);
        if (!e->pool || !e->ws || !e->logits || !e->text) rc = qf_fail(QF_ENOMEM, "out of memory (engine buffers)");
    }
    size_t sparse = rc == QF_OK && qf_load_sparse_wanted(fc, opts, e->model->cfg.n_layers) ? qf_model_sparsity_bytes(e->model) : 0;
    if (rc == QF_OK && e->on_gpu && stream) rc = qf_load_experts_gpu(e, opts, cache, free_start, free_trunk, sparse);
    if (rc == QF_OK) rc = qf_load_sparsity(e, fc, dir, opts);
    if (rc == QF_OK && opts->draft > 0) rc = qf_spec_open(e, opts->draft);
    /* on a GPU the drafts read half the bytes of lm_head (an int8 copy; output unchanged) */
    if (rc == QF_OK && opts->draft > 0 && e->on_gpu) rc = qf_mtp_lm_head_int8(e->model);
    free(fc);
    if (rc != QF_OK) {
        qf_engine_close(e); /* cleanup never touches the error message */
        return rc;
    }
    e->load_seconds = qf_now() - t0;
    *out = e;
    return QF_OK;
}

const qf_config *qf_engine_config(const qf_engine *e) { return &e->model->cfg; }
int qf_engine_sparsity_ready(const qf_engine *e) { return qf_model_sparsity_ready(e->model); }
const qf_expert_stats *qf_engine_expert_stats(const qf_engine *e) { return e->model->experts ? &e->model->experts->stats : NULL; }

void qf_engine_close(qf_engine *e) {
    if (!e) return;
    qf_spec_close(e);
    free(e->logits);
    free(e->text);
    qf_workspace_free(e->ws);
    qf_model_free(e->model); /* device buffers go back before the device context does */
    e->model = NULL;
    qf_backend_close(&e->be);
    qf_pool_destroy(e->pool);
    qf_tok_free(e->tok);
    qf_model_free(e->model);
    free(e);
}

int qf_engine_is_eos(const qf_engine *e, int32_t tok) {
    const qf_config *c = &e->model->cfg;
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == tok) return 1;
    return 0;
}

/* Text of one token through the stream decoder; special tokens pass verbatim. */
static size_t token_text(qf_engine *e, qf_utf8_stream *us, int32_t tok) {
    size_t len = 0;
    const char *p = e->tok ? qf_tok_piece(e->tok, tok, &len) : NULL;
    return p ? qf_utf8_stream_push(us, p, len, e->text, e->text_cap) : 0;
}

int qf_engine_emit(qf_emitter *em, const qf_state *st, int pos, int32_t tok) {
    em->stats->gen_tokens++;
    if (qf_engine_is_eos(em->e, tok)) {
        em->stats->stopped_by_eos = 1;
        return 2;
    }
    qf_sampler_accept(em->req->sampler, tok, 1);
    size_t len = token_text(em->e, &em->us, tok);
    int stop = em->req->on_token && em->req->on_token(em->req->ud, tok, em->e->text, len);
    em->n++;
    return stop || em->n == em->req->max_tokens || pos + 1 >= st->max_ctx ? 1 : 0;
}

void qf_engine_emit_end(qf_emitter *em) {
    size_t tail = qf_utf8_stream_flush(&em->us, em->e->text, em->e->text_cap);
    if (tail && em->req->on_token) em->req->on_token(em->req->ud, -1, em->e->text, tail);
}

double qf_engine_prompt_done(const qf_gen_request *req, qf_gen_stats *stats, double t0) {
    for (int i = 0; i < req->n_prompt; i++) qf_sampler_accept(req->sampler, req->prompt[i], 0);
    double t1 = qf_now();
    stats->prompt_tokens = req->n_prompt;
    stats->prompt_seconds = t1 - t0;
    return t1;
}

int qf_engine_generate(qf_engine *e, qf_state *st, const qf_gen_request *req, qf_gen_stats *stats) {
    memset(stats, 0, sizeof *stats);
    if (req->n_prompt < 1) return qf_fail(QF_EINVAL, "empty prompt");
    if (st->pos + req->n_prompt + 1 > st->max_ctx)
        return qf_fail(QF_EINVAL, "prompt of %d tokens (+%d cached) does not fit the context of %d", req->n_prompt, st->pos, st->max_ctx);
    if (qf_spec_takes(e, st, req)) return qf_spec_generate(e, st, req, stats);
    double t0 = qf_now();
    int rc = qf_forward_seq(e->model, &e->be, e->ws, st, req->prompt, req->n_prompt, QF_LOGITS_LAST, e->logits);
    if (rc != QF_OK) return rc;
    double t1 = qf_engine_prompt_done(req, stats, t0);
    qf_emitter em = {.e = e, .req = req, .stats = stats};
    /* later picks are made where the logits are: greedy without penalties (QF_LOGITS_TOP1), or a
     * draw where the backend draws (QF_LOGITS_DRAW; -1: it left the logits to the host) */
    int greedy = qf_sampler_is_greedy(req->sampler), picked = 0;
    int draws = !greedy && e->be.ops->dec && e->be.ops->dec->draw && qf_sampler_can_draw(req->sampler);
    int32_t pick = 0;
    qf_draw d = {0};
    while (em.n < req->max_tokens) {
        int32_t tok = picked && pick >= 0 ? pick : picked ? qf_sampler_sample_u(req->sampler, e->logits, d.u) : qf_sampler_sample(req->sampler, e->logits);
        int how = qf_engine_emit(&em, st, st->pos, tok);
        if (how == 2) break;
        if (how == 1) {
            /* the last token is fed too, so the state holds everything generated */
            rc = qf_forward_seq(e->model, &e->be, e->ws, st, &tok, 1, QF_LOGITS_NONE, NULL);
            break;
        }
        if (greedy || draws) {
            if (draws) qf_sampler_draw_desc(req->sampler, &d);
            qf_seq_step step = {st, &tok, 1, draws ? QF_LOGITS_DRAW : QF_LOGITS_TOP1, e->logits, &pick, 0, 0, NULL, NULL, &d};
            rc = qf_forward(e->model, &e->be, e->ws, &step, 1);
            picked = 1;
        } else {
            rc = qf_forward_seq(e->model, &e->be, e->ws, st, &tok, 1, QF_LOGITS_LAST, e->logits);
        }
        if (rc != QF_OK) break;
    }
    qf_engine_emit_end(&em);
    stats->gen_seconds = qf_now() - t1;
    return rc;
}
