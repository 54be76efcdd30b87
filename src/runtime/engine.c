#include "runtime/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/timer.h"
#include "backend/backend.h"
#include "experts/cache_policy.h"
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

/* --draft: the model has an MTP head that runs where the model does (on a GPU, with the experts
 * resident there), and a forward holds a token and its drafts. */
static int check_drafts(qf_engine *e, int draft) {
    const qf_model *m = e->model;
    if (draft > QF_MAX_DRAFT) return qf_fail(QF_EINVAL, "--draft %d: at most %d", draft, QF_MAX_DRAFT);
    if (!m->mtp) return qf_fail(QF_EINVAL, "--draft needs a model with an MTP head (mtp_num_hidden_layers and mtp.* tensors)");
    if (m->dev && !m->mtp->dev) return qf_fail(QF_EUNSUPPORTED, "--draft on a GPU needs the experts resident there (not streamed: no --gpu-mem or --expert-cache)");
    if (qf_workspace_rows(e->ws) < draft + 1) return qf_fail(QF_EINVAL, "--draft %d needs forwards of at least %d rows", draft, draft + 1);
    e->draft = e->max_draft = draft;
    return QF_OK;
}

/* --expert-policy, parsed here alone (a replay-only policy is no device's). */
static int policy_of(const char *name, int *out) {
    int p = name ? qf_policy_parse(name) : QF_POLICY_DLFU_AD;
    if (p < 0 || p == QF_POLICY_MIN) return qf_fail(QF_EINVAL, "--expert-policy takes lru, dlfu or dlfu-admit, not '%s'", name);
    *out = p;
    return QF_OK;
}

int qf_engine_open(qf_engine **out, const char *dir, const qf_engine_opts *opts) {
    *out = NULL;
    double t0 = qf_now();
    int policy, rc0 = policy_of(opts->expert_policy, &policy);
    if (rc0 != QF_OK) return rc0;
    qf_engine *e = calloc(1, sizeof *e);
    if (!e) return qf_fail(QF_ENOMEM, "out of memory");
    e->expert_policy = policy;
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
        if (rc == QF_OK && !e->on_gpu && cache) qf_model_set_prefetch(e->model, opts->expert_prefetch);
        if (rc == QF_OK && !e->on_gpu && opts->expert_heat) rc = qf_load_expert_heat(e, opts->expert_heat);
    }
    if (rc == QF_OK) {
        e->ws = qf_workspace_create(e->model, opts->max_batch > 0 ? opts->max_batch : 512);
        e->logits = malloc((size_t)e->model->cfg.vocab * sizeof(float));
        e->text_cap = 3 * (e->tok ? qf_tok_max_piece_len(e->tok) : 0) + 8;
        if (!e->pool || !e->ws || !e->logits) rc = qf_fail(QF_ENOMEM, "out of memory (engine buffers)");
    }
    /* a RAM expert cache: a long prompt's MoE runs over the whole prompt a layer at a time */
    if (rc == QF_OK && !e->on_gpu && stream) rc = qf_workspace_reserve_prompt(e->ws, opts->max_prompt > 0 ? opts->max_prompt : 8192);
    size_t sparse = rc == QF_OK && qf_load_sparse_wanted(fc, opts, e->model->cfg.n_layers) ? qf_model_sparsity_bytes(e->model) : 0;
    size_t scratch;
    if (rc == QF_OK && e->on_gpu && stream) rc = qf_load_experts_gpu(e, opts, cache, free_start, free_trunk, sparse);
    else if (rc == QF_OK && e->on_gpu) rc = qf_load_scratch(e, sparse > 0, &scratch);
    if (rc == QF_OK && e->on_gpu && opts->expert_heat) rc = qf_load_expert_heat(e, opts->expert_heat); /* the device slots exist from here */
    if (rc == QF_OK) rc = qf_load_sparsity(e, fc, dir, opts);
    if (rc == QF_OK && opts->draft > 0) rc = check_drafts(e, opts->draft);
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
void qf_engine_set_draft(qf_engine *e, int draft) { e->draft = draft < 0 ? 0 : draft > e->max_draft ? e->max_draft : draft; }
int qf_engine_drafts(const qf_engine *e) { return e->draft; }
int qf_engine_sparsity_ready(const qf_engine *e) { return qf_model_sparsity_ready(e->model); }
const qf_expert_stats *qf_engine_expert_stats(const qf_engine *e) { return e->model->experts ? &e->model->experts->stats : NULL; }

void qf_engine_close(qf_engine *e) {
    if (!e) return;
    free(e->logits);
    qf_workspace_free(e->ws);
    qf_model_free(e->model); /* device buffers go back before the device context does */
    e->model = NULL;
    qf_backend_close(&e->be);
    qf_pool_destroy(e->pool), qf_pool_destroy(e->host_pool); /* after the model: its store runs on host_pool */
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
