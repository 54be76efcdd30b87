/* Buffered expert streaming, set up at load: on the CPU a fixed RAM pool in front of the checkpoint
 * (store_stream.c); on a GPU a fixed pool of expert slots in device memory in front of the experts
 * pinned in host memory (store_devcache.c), sized from the device budget part by part, and warmed
 * up so that every buffer a step needs exists before the first request. */
#include "runtime/flash.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "experts/cache_policy.h"

#define MIB 1048576.0
#define GIB 1073741824.0

int qf_flash_config_read(const char *dir, qf_flash_config *fc) {
    if (dir) return qf_flash_config_load(dir, fc); /* read even when flags win: a malformed file fails the load */
    memset(fc, 0, sizeof *fc);
    fc->sparsity_level = -1;
    return QF_OK;
}

size_t qf_flash_wanted(const qf_flash_config *fc, const qf_engine_opts *o) {
    return o->expert_cache ? o->expert_cache : o->gpu_mem ? 0 : fc->buffer_bytes;
}

/* Layer L's sparsity level: the flag, else the file's schedule. */
static float level_of(const qf_flash_config *fc, const qf_engine_opts *o, int L) { return o->sparsity_given ? o->sparsity_level : qf_flash_config_level(fc, L, 0.0f); }

int qf_flash_sparse_wanted(const qf_flash_config *fc, const qf_engine_opts *o, int n_layers) {
    for (int L = 0; L < n_layers; L++)
        if (level_of(fc, o, L) > 0.0f) return 1;
    return 0;
}

int qf_flash_sparsity(qf_engine *e, const qf_flash_config *fc, const char *dir, const qf_engine_opts *o) {
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

int qf_flash_cpu(qf_engine *e, size_t bytes) {
    if (!bytes || !e->model->experts) return QF_OK;
    double ram = host_ram();
    if (ram > 0 && (double)bytes > ram)
        return qf_fail(QF_EINVAL, "an expert cache of %.1f GiB is more than this machine's %.1f GiB of RAM", (double)bytes / GIB, ram / GIB);
    const qf_config *c = &e->model->cfg;
    qf_expert_store *s;
    int rc = qf_es_stream_create(&s, e->model->experts, &e->model->st, c->n_layers, c->n_experts, c->n_experts_used, bytes);
    if (rc == QF_OK) e->model->experts = s;
    return rc;
}

/* Device bytes of what the caller adds after load: its states and KV pages. */
static size_t reserve_bytes(const qf_model *m, const qf_engine_opts *o) {
    int seqs = o->reserve_seqs > 0 ? o->reserve_seqs : 1, tokens = o->reserve_tokens > 0 ? o->reserve_tokens : 4096;
    size_t kv = o->reserve_kv_bytes ? o->reserve_kv_bytes : (size_t)((tokens + 15) / 16 + seqs) * qf_kv_pool_page_bytes(m, 16);
    return (size_t)seqs * qf_state_bytes(m) + kv;
}

/* Runs a prompt of the workspace's rows (prompt: 1) and a few decode steps on a state of its own,
 * so the ops' scratch and the step graph exist before any request (memory stays flat after load). */
static int warm_up(qf_engine *e, int prompt) {
    int R = prompt ? qf_workspace_rows(e->ws) : 1;
    qf_state *st = qf_state_create(e->model, R + 4);
    int32_t *tok = calloc((size_t)R + 1, sizeof *tok);
    int rc = st && tok ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for the warm-up");
    if (rc == QF_OK) rc = qf_forward_seq(e->model, &e->be, e->ws, st, tok, R, QF_LOGITS_LAST, e->logits);
    for (int i = 0; i < 3 && rc == QF_OK; i++) { /* eager, recorded, replayed */
        qf_seq_step step = {st, tok, 1, QF_LOGITS_TOP1, NULL, tok + 1, 0, 0, NULL, NULL, NULL};
        rc = qf_forward(e->model, &e->be, e->ws, &step, 1);
    }
    if (rc == QF_OK) rc = qf_be_sync(&e->be);
    qf_state_free(st);
    free(tok);
    return rc;
}

static int policy_of(const char *name) {
    if (!name) return QF_POLICY_DLFU_AD;
    int p = qf_policy_parse(name);
    return p == QF_POLICY_MIN ? -1 : p;
}

/* The plan's buffer from the budget (or the flag), checked against the minimum and the device. */
static int plan_buffer(qf_flash_plan *p, const qf_engine_opts *o, size_t cache_bytes, size_t free_now, int top_k) {
    size_t fixed = p->context + p->trunk + p->workspace + p->reserve + p->sparse + p->margin;
    if (cache_bytes) p->buffer = cache_bytes;
    else p->buffer = p->budget > fixed ? p->budget - fixed : 0;
    size_t per_layer = p->slot_bytes * (size_t)p->n_layers, stage = 2 * p->slot_bytes * (size_t)p->n_experts;
    /* prompt chunks stage whole layers when that leaves the decode slots twice their minimum */
    p->stage = p->buffer >= stage + per_layer * (size_t)(4 * top_k) ? stage : 0;
    p->slots = (int)((p->buffer - p->stage) / per_layer);
    if (p->slots > p->n_experts) p->slots = p->n_experts, p->buffer = per_layer * (size_t)p->n_experts + p->stage;
    int least = 2 * top_k; /* a token's experts and as many again: below that every step evicts what the next one needs */
    if (p->slots < least)
        return qf_fail(QF_EINVAL,
                       "%s leaves %.0f MiB for the expert buffer: %d slots a layer, at least %d (2 x top-%d) are needed: %.0f MiB of buffer, "
                       "a budget of at least %.2f GiB (context %.0f, trunk %.0f, workspace and scratch %.0f, states and KV %.0f, sparsity's "
                       "transposed weights %.0f, margin %.0f MiB)",
                       cache_bytes ? "--expert-cache" : "the GPU budget", (double)p->buffer / MIB, p->slots, least, top_k,
                       (double)(per_layer * (size_t)least) / MIB, (double)(fixed + per_layer * (size_t)least) / GIB, (double)p->context / MIB,
                       (double)p->trunk / MIB, (double)p->workspace / MIB, (double)p->reserve / MIB, (double)p->sparse / MIB, (double)p->margin / MIB);
    size_t need = p->buffer + p->reserve + p->sparse + p->margin;
    if (need > free_now)
        return qf_fail(QF_EINVAL, "the expert buffer (%.0f MiB) with states, KV and scratch needs %.0f MiB; the device has %.0f MiB free", (double)p->buffer / MIB,
                       (double)need / MIB, (double)free_now / MIB);
    (void)o;
    return QF_OK;
}

/* The experts pinned at home and the model warmed up without slots, the memory everything else
 * takes is measured, and the expert buffer gets what the budget leaves. */
int qf_flash_gpu(qf_engine *e, const qf_engine_opts *o, size_t cache_bytes, size_t free_start, size_t free_trunk, size_t sparse_bytes) {
    qf_model *m = e->model;
    const qf_config *c = &m->cfg;
    qf_flash_plan *p = &e->plan;
    int policy = policy_of(o->expert_policy);
    if (policy < 0) return qf_fail(QF_EINVAL, "unknown expert cache policy '%s' (lru, dlfu, dlfu-admit)", o->expert_policy);
    qf_expert x0;
    int rc = m->experts->ops->acquire(m->experts, 0, 0, &x0);
    if (rc != QF_OK) return rc;
    m->experts->ops->release(m->experts, 0, 0);
    size_t free_now = 0, total = 0;
    e->be.ops->mem_info(&e->be, &free_now, &total);
    *p = (qf_flash_plan){.active = 1, .budget = o->gpu_mem, .device_total = total, .slot_bytes = qf_es_slot_bytes(&x0), .n_experts = c->n_experts,
                         .n_layers = c->n_layers, .policy = policy};
    p->host_experts = p->slot_bytes * (size_t)c->n_experts * (size_t)c->n_layers;
    double ram = host_ram();
    if (ram > 0 && (double)p->host_experts > 0.9 * ram)
        return qf_fail(QF_EINVAL, "the routed experts take %.1f GiB of host memory to stream from; this machine has %.1f GiB of RAM",
                       (double)p->host_experts / GIB, ram / GIB);
    if (p->budget > total)
        return qf_fail(QF_EINVAL, "--gpu-mem %.1f GiB is more than the device's %.1f GiB", (double)p->budget / GIB, (double)total / GIB);
    qf_expert_store *s;
    if ((rc = qf_es_devcache_create(&s, m->experts, &e->be, c->n_layers, c->n_experts, c->n_experts_used)) != QF_OK) return rc;
    m->experts = s;
    qf_model_dec_check(m);
    if ((rc = qf_workspace_reserve_prompt(e->ws, o->max_prompt > 0 ? o->max_prompt : 8192)) != QF_OK) return rc;
    if ((rc = warm_up(e, 1)) != QF_OK) return rc;
    e->be.ops->mem_info(&e->be, &free_now, &total);
    p->context = total - free_start, p->trunk = free_start - free_trunk, p->workspace = free_trunk - free_now;
    p->reserve = reserve_bytes(m, o), p->sparse = sparse_bytes, p->margin = (size_t)64 << 20;
    if ((rc = plan_buffer(p, o, cache_bytes, free_now, c->n_experts_used)) != QF_OK) return rc;
    if ((rc = qf_es_devcache_set_slots(s, p->slots, policy, p->stage > 0)) != QF_OK) return rc;
    if ((rc = warm_up(e, 0)) != QF_OK) return rc; /* the step graph again, with the cache's kernels */
    e->be.ops->mem_info(&e->be, &free_now, &total);
    p->used_after_warmup = total - free_now;
    return QF_OK;
}

void qf_flash_print(FILE *f, const qf_flash_plan *p) {
    if (!p->active) return;
    fprintf(f, "expert streaming plan (MiB): context %.0f, trunk %.0f, workspace and scratch %.0f (measured after a warm-up), states and KV %.0f (reserved), "
               "margin %.0f, expert buffer %.0f",
            (double)p->context / MIB, (double)p->trunk / MIB, (double)p->workspace / MIB, (double)p->reserve / MIB, (double)p->margin / MIB,
            (double)p->buffer / MIB);
    if (p->sparse) fprintf(f, ", sparsity's transposed weights %.0f", (double)p->sparse / MIB);
    if (p->budget) fprintf(f, " of a budget of %.0f", (double)p->budget / MIB);
    fprintf(f, "\n  %d of %d experts a layer in device slots (%.1f%% resident, %s), the rest read from %.1f GiB of pinned host memory; ",
            p->slots, p->n_experts, 100.0 * p->slots / p->n_experts, qf_policy_name(p->policy), (double)p->host_experts / GIB);
    if (p->stage) fprintf(f, "prompt chunks stage whole layers (2 x %.0f MiB of the buffer); ", (double)p->stage / 2 / MIB);
    fprintf(f, "device memory in use after warm-up %.0f MiB of %.0f\n", (double)p->used_after_warmup / MIB, (double)p->device_total / MIB);
}
