/* Buffered expert streaming, set up at load: on the CPU a fixed RAM pool in front of the checkpoint
 * (store_stream.c); on a GPU a fixed pool of expert slots in device memory in front of the experts
 * pinned in host memory (store_devcache.c), sized from the device budget part by part, and warmed
 * up so that every buffer a step needs exists before the first request. */
#include "runtime/engine_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#define GIB 1073741824.0

int qf_load_flash_config(const char *dir, qf_flash_config *fc) {
    if (dir) return qf_flash_config_load(dir, fc); /* read even when flags win: a malformed file fails the load */
    memset(fc, 0, sizeof *fc);
    fc->sparsity_level = -1;
    return QF_OK;
}

size_t qf_load_cache_bytes(const qf_flash_config *fc, const qf_engine_opts *o) {
    return o->expert_cache ? o->expert_cache : o->gpu_mem ? 0 : fc->buffer_bytes;
}

/* Layer L's sparsity level: the flag, else the file's schedule. */
static float level_of(const qf_flash_config *fc, const qf_engine_opts *o, int L) { return o->sparsity_given ? o->sparsity_level : qf_flash_config_level(fc, L, 0.0f); }

int qf_load_sparse_wanted(const qf_flash_config *fc, const qf_engine_opts *o, int n_layers) {
    for (int L = 0; L < n_layers; L++)
        if (level_of(fc, o, L) > 0.0f) return 1;
    return 0;
}

int qf_load_sparsity(qf_engine *e, const qf_flash_config *fc, const char *dir, const qf_engine_opts *o) {
    float levels[QF_MAX_LAYERS];
    int from_file = 0, rc;
    for (int L = 0; L < e->model->cfg.n_layers; L++) {
        levels[L] = level_of(fc, o, L);
        from_file |= !o->sparsity_given && levels[L] > 0;
    }
    if (from_file && e->on_gpu && !e->model->dec_ok) { /* the file's schedule where it cannot run: dense, and said so */
        snprintf(e->notice, sizeof e->notice, "config_flash.json's sparsity needs the fused decode steps, which this model does not run: dense (exact)");
        return QF_OK;
    }
    if (fc->trunk_layers && fc->trunk_layers != e->model->cfg.n_layers)
        return qf_fail(QF_EFORMAT, "%s/config_flash.json: trunk_thresholds has %d layers; the model has %d", dir, fc->trunk_layers, e->model->cfg.n_layers);
    if (fc->trunk_layers && (rc = qf_model_set_trunk_thresholds(e->model, &fc->trunk[0][0][0])) != QF_OK) return rc;
    if (fc->kv_min_ctx) e->model->kv_min_ctx = fc->kv_min_ctx;
    return qf_model_set_sparsity(e->model, levels);
}

static double host_ram(void) { return (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE); }

int qf_load_experts_cpu(qf_engine *e, size_t bytes) {
    if (!bytes || !e->model->experts) return QF_OK;
    double ram = host_ram();
    if (ram > 0 && (double)bytes > ram)
        return qf_fail(QF_EINVAL, "an expert cache of %.1f GiB is more than this machine's %.1f GiB of RAM", (double)bytes / GIB, ram / GIB);
    const qf_config *c = &e->model->cfg;
    qf_expert_store *s;
    int rc = qf_es_stream_create(&s, e->model->experts, &e->model->st, c->n_layers, c->n_experts, c->n_experts_used, bytes);
    if (rc == QF_OK) qf_model_use_experts(e->model, s);
    return rc;
}

/* Layer L's experts by their uses in the trace t (U8 or I32 [layers][tokens][top_k]), most used
 * first, ties to the lower id. */
static void hottest(const qf_st_tensor *t, int L, int E, int *order, uint64_t *uses) {
    size_t per = (size_t)t->shape[1] * (size_t)t->shape[2], at = (size_t)L * per;
    memset(uses, 0, (size_t)E * sizeof *uses);
    for (size_t i = 0; i < per; i++) {
        int e = t->dtype == QF_DT_U8 ? ((const uint8_t *)t->data)[at + i] : ((const int32_t *)t->data)[at + i];
        if (e >= 0 && e < E) uses[e]++;
    }
    for (int e = 0; e < E; e++) order[e] = e;
    for (int i = 1; i < E; i++) /* insertion sort: E is at most a few hundred */
        for (int j = i; j > 0 && uses[order[j]] > uses[order[j - 1]]; j--) {
            int x = order[j];
            order[j] = order[j - 1], order[j - 1] = x;
        }
}

int qf_load_expert_heat(qf_engine *e, const char *path) {
    qf_expert_store *s = e->model->experts;
    const qf_config *c = &e->model->cfg;
    if (!s || !s->stats.slots) return qf_fail(QF_EINVAL, "--expert-heat fills an expert cache's slots: it needs --expert-cache (or --gpu-mem on a GPU)");
    qf_st_set st;
    int rc = qf_st_open(&st, path);
    if (rc != QF_OK) return rc;
    const qf_st_tensor *t = qf_st_find(&st, "expert_ids");
    if (!t || t->ndim != 3 || (t->dtype != QF_DT_U8 && t->dtype != QF_DT_I32) || t->shape[0] != c->n_layers)
        rc = qf_fail(QF_EFORMAT, "%s: no expert_ids tensor of U8 or I32 [%d layers][tokens][top_k] (qflash route-record writes one)", path, c->n_layers);
    int *order = malloc((size_t)c->n_experts * sizeof *order);
    uint64_t *uses = malloc((size_t)c->n_experts * sizeof *uses);
    if (rc == QF_OK && (!order || !uses)) rc = qf_fail(QF_ENOMEM, "out of memory");
    for (int L = 0; rc == QF_OK && L < c->n_layers; L++) {
        hottest(t, L, c->n_experts, order, uses);
        int n = 0;
        while (n < s->stats.slots && n < c->n_experts && uses[order[n]]) n++;
        if (s->ops->fill) {
            rc = s->ops->fill(s, L, order, n);
            continue;
        }
        for (int i = 0; rc == QF_OK && i < n; i++) {
            qf_expert x; /* a free slot admits it: the slots fill in order of heat */
            if ((rc = s->ops->acquire(s, L, order[i], &x)) == QF_OK) s->ops->release(s, L, order[i]);
        }
    }
    free(order), free(uses);
    qf_st_close(&st);
    s->stats.acquires = s->stats.hits = s->stats.misses = 0; /* the counts are the requests' */
    return rc;
}

/* Device bytes of what the caller adds after load: its states and KV pages. */
static size_t reserve_bytes(const qf_model *m, const qf_engine_opts *o) {
    int seqs = o->reserve_seqs > 0 ? o->reserve_seqs : 1, tokens = o->reserve_tokens > 0 ? o->reserve_tokens : 4096;
    size_t kv = o->reserve_kv_bytes ? o->reserve_kv_bytes : (size_t)((tokens + 15) / 16 + seqs) * qf_kv_pool_page_bytes(m, 16);
    return (size_t)seqs * qf_state_bytes(m) + kv;
}

int qf_load_scratch(qf_engine *e, int sparse, size_t *bytes) {
    qf_scratch_shape sh;
    qf_model_scratch_shape(e->model, e->ws, sparse, &sh);
    *bytes = e->be.ops->scratch_bytes ? e->be.ops->scratch_bytes(&e->be, &sh) : 0;
    return e->be.ops->scratch_reserve ? e->be.ops->scratch_reserve(&e->be, &sh) : QF_OK;
}

/* A one-token prompt and a few decode steps on a state of its own, so the step graph is recorded
 * with the cache's kernels before any request (the scratch is reserved already). */
static int warm_up(qf_engine *e) {
    qf_state *st = qf_state_create(e->model, 8);
    int32_t tok[2] = {0, 0};
    int rc = st ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for the warm-up");
    if (rc == QF_OK) rc = qf_forward_seq(e->model, &e->be, e->ws, st, tok, 1, QF_LOGITS_LAST, e->logits);
    for (int i = 0; i < 3 && rc == QF_OK; i++) { /* eager, recorded, replayed */
        qf_seq_step step = {st, tok, 1, QF_LOGITS_TOP1, NULL, tok + 1, 0, 0, NULL, NULL, NULL};
        rc = qf_forward(e->model, &e->be, e->ws, &step, 1);
    }
    if (rc == QF_OK) rc = qf_be_sync(&e->be);
    qf_state_free(st);
    return rc;
}

/* Hybrid expert execution on n host threads: the split that balances the host against the link
 * for the measured costs (h host experts of m misses: fixed + h x host = (m - h) x link, so
 * h = m x link / (link + host) - fixed / (link + host)). */
static int hybrid(qf_engine *e, qf_expert_store *s, int n) {
    qf_plan *p = &e->plan;
    if (!(e->host_pool = qf_pool_create(n))) return qf_fail(QF_ENOMEM, "cannot start %d host expert threads", n);
    qf_pool_set_spin(e->host_pool, 5000); /* a decode step's layers call a fraction of a millisecond apart: no wake-up each */
    int rc = qf_es_devcache_set_host(s, e->host_pool, 0.0f);
    if (rc == QF_OK) rc = qf_es_devcache_measure(s, &p->host_ms, &p->host_fixed_ms, &p->link_ms);
    if (rc != QF_OK) return rc;
    p->host_threads = n, p->host_share = (float)(p->link_ms / (p->link_ms + p->host_ms));
    p->host_fixed = (float)(p->host_fixed_ms / (p->link_ms + p->host_ms));
    qf_es_devcache_host_share(s, p->host_share, p->host_fixed);
    return QF_OK;
}

/* The experts pinned at home, the workspace and the ops' scratch by arithmetic and reserved, the
 * plan made from them and the measured context and trunk; the buffer gets what the budget leaves,
 * and one warm-up records the step graph. */
int qf_load_experts_gpu(qf_engine *e, const qf_engine_opts *o, size_t cache_bytes, size_t free_start, size_t free_trunk, size_t sparse_bytes) {
    qf_model *m = e->model;
    const qf_config *c = &m->cfg;
    int policy = e->expert_policy;
    qf_expert x0;
    int rc = m->experts->ops->acquire(m->experts, 0, 0, &x0);
    if (rc != QF_OK) return rc;
    m->experts->ops->release(m->experts, 0, 0);
    size_t free_now = 0, total = 0;
    e->be.ops->mem_info(&e->be, &free_now, &total);
    qf_plan_in in = {.budget = o->gpu_mem, .cache_bytes = cache_bytes, .device_total = total, .host_ram = host_ram(), .host_reserve = o->reserve_host_bytes, .slot_bytes = qf_es_slot_bytes(&x0),
                     .n_layers = c->n_layers, .n_experts = c->n_experts, .top_k = c->n_experts_used, .policy = policy};
    qf_expert_store *s;
    if ((rc = qf_es_devcache_create(&s, m->experts, &e->be, c->n_layers, c->n_experts, c->n_experts_used)) != QF_OK) return rc;
    qf_model_use_experts(m, s);
    size_t scratch = 0;
    if ((rc = qf_workspace_reserve_prompt(e->ws, o->max_prompt > 0 ? o->max_prompt : 8192)) != QF_OK) return rc;
    if ((rc = qf_load_scratch(e, sparse_bytes > 0, &scratch)) != QF_OK) return rc;
    e->be.ops->mem_info(&e->be, &free_now, &total);
    in.context = total - free_start, in.trunk = free_start - free_trunk, in.workspace = qf_workspace_bytes(e->ws) + scratch;
    in.reserve = reserve_bytes(m, o), in.sparse = sparse_bytes, in.device_free = free_now;
    qf_plan *p = &e->plan;
    if ((rc = qf_plan_make(&in, p)) != QF_OK) return rc;
    if ((rc = qf_es_devcache_set_slots(s, p->slots, policy, p->stage > 0)) != QF_OK) return rc;
    /* by default the cores less 4: the caller's thread, the device's host-node thread, the server's */
    int threads = o->expert_threads >= 0 ? o->expert_threads : qf_cpu_count() - 4;
    if (threads > 0 && (rc = hybrid(e, s, threads)) != QF_OK) return rc;
    if ((rc = warm_up(e)) != QF_OK) return rc;
    e->be.ops->mem_info(&e->be, &free_now, &total);
    p->used_after_warmup = total - free_now;
    return QF_OK;
}
