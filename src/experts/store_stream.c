/* A fixed RAM pool of expert slots in front of the checkpoint (the CPU's expert cache): each
 * layer owns slots_per_layer slots plus one scratch slot; an expert that misses is read from the
 * checkpoint file (pread, not through the mapping, so its pages never enter this process) into the
 * slot the policy frees (cache_policy.c), or into the scratch slot when the policy does not admit
 * it. The process holds the pool, not the experts it has read; the pool is allocated once. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "base/err.h"
#include "experts/cache_policy.h"
#include "experts/store.h"
#include "format/safetensors.h"

typedef struct stream_layer {
    qf_slot_cache cache;
    char *slots;       /* (slots + 1) x per_expert bytes; the last is the scratch slot */
    qf_expert *views;  /* [slots + 1] the views of what each slot holds */
} stream_layer;

typedef struct stream_store {
    qf_expert_store base;
    qf_expert_store *src; /* where the experts are (views into the mapped checkpoint); owned */
    const qf_st_set *file; /* the checkpoint the views map: misses are read from it (NULL: copied) */
    int n_layers, n_experts, slots;
    size_t per_expert;
    stream_layer *layers;
    char *pool;
} stream_store;

/* The rows only: an FP8 expert's scales stay where the loader put them (host memory). */
static size_t mat_bytes(const qf_mat *w) { return qf_mat_bytes(w); }

/* Expert e of layer L copied into slot s. */
static int load(stream_store *s, int L, int e, int slot) {
    qf_expert x;
    int rc = s->src->ops->acquire(s->src, L, e, &x);
    if (rc != QF_OK) return rc;
    stream_layer *l = &s->layers[L];
    char *at = l->slots + (size_t)slot * s->per_expert;
    qf_mat *m[3] = {&x.gate, &x.up, &x.down};
    for (int i = 0; i < 3 && rc == QF_OK; i++) {
        size_t n = mat_bytes(m[i]);
        rc = qf_st_read(s->file, m[i]->data, at, n);
        m[i]->data = at;
        at += n;
    }
    s->src->ops->release(s->src, L, e);
    if (rc != QF_OK) return rc;
    l->views[slot] = x;
    s->base.stats.misses++;
    s->base.stats.bytes_loaded += s->per_expert;
    return QF_OK;
}

static int stream_acquire(qf_expert_store *st, int L, int e, qf_expert *out) {
    stream_store *s = (stream_store *)st;
    int rc = qf_es_check_expert(L, e, s->n_layers, s->n_experts);
    if (rc != QF_OK) return rc;
    stream_layer *l = &s->layers[L];
    st->stats.acquires++;
    int slot = qf_slot_cache_find(&l->cache, e);
    if (slot >= 0) {
        st->stats.hits++;
    } else {
        int evicted;
        slot = qf_slot_cache_insert(&l->cache, e, &evicted, NULL);
        if (slot < 0) slot = s->slots; /* not admitted: the scratch slot, for this use only */
        rc = load(s, L, e, slot);
        if (rc != QF_OK) {
            if (slot < s->slots) l->cache.slot_of[e] = -1, l->cache.expert_in[slot] = -1;
            return rc;
        }
    }
    *out = l->views[slot];
    return QF_OK;
}

static void stream_release(qf_expert_store *st, int L, int e) { (void)st, (void)L, (void)e; }

static void stream_step(qf_expert_store *st) {
    stream_store *s = (stream_store *)st;
    for (int L = 0; L < s->n_layers; L++) qf_slot_cache_tick(&s->layers[L].cache);
}

static int stream_table(qf_expert_store *st, int L, qf_expert_table *out) {
    (void)st, (void)L, (void)out;
    return qf_fail(QF_EUNSUPPORTED, "the RAM expert cache serves the CPU path; a device routes over a device store");
}

static void stream_destroy(qf_expert_store *st) {
    stream_store *s = (stream_store *)st;
    for (int L = 0; s->layers && L < s->n_layers; L++) {
        qf_slot_cache_free(&s->layers[L].cache);
        free(s->layers[L].views);
    }
    free(s->layers);
    free(s->pool);
    qf_es_destroy(s->src);
    free(s);
}

static const qf_expert_store_ops k_stream_ops = {
    .acquire = stream_acquire,
    .release = stream_release,
    .prefetch = NULL,
    .destroy = stream_destroy,
    .table = stream_table,
    .step = stream_step,
};

int qf_es_stream_slots(size_t budget, size_t per_expert, int n_layers) {
    size_t per_layer = budget / ((size_t)n_layers * (per_expert ? per_expert : 1));
    return per_layer > 1 ? (int)(per_layer - 1) : 0; /* one of each layer's share is its scratch slot */
}

int qf_es_stream_create(qf_expert_store **out, qf_expert_store *src, const qf_st_set *file, int n_layers, int n_experts, int top_k, size_t budget) {
    *out = NULL;
    qf_expert x;
    int rc = src->ops->acquire(src, 0, 0, &x);
    if (rc != QF_OK) return rc;
    src->ops->release(src, 0, 0);
    size_t per = mat_bytes(&x.gate) + mat_bytes(&x.up) + mat_bytes(&x.down);
    int slots = qf_es_stream_slots(budget, per, n_layers), least = top_k;
    if (slots > n_experts) slots = n_experts;
    if (slots < least)
        return qf_fail(QF_EINVAL, "an expert cache of %.1f MiB holds %d experts a layer; at least %d (one token's top-%d, and a scratch slot: %.1f MiB) are needed",
                       (double)budget / 1048576.0, slots, least, top_k, (double)((size_t)(least + 1) * per * (size_t)n_layers) / 1048576.0);
    stream_store *s = calloc(1, sizeof *s);
    if (!s) return qf_fail(QF_ENOMEM, "out of memory");
    s->base.ops = &k_stream_ops;
    s->file = file;
    s->n_layers = n_layers, s->n_experts = n_experts, s->slots = slots, s->per_expert = per;
    s->layers = calloc((size_t)n_layers, sizeof *s->layers);
    s->pool = malloc((size_t)(slots + 1) * per * (size_t)n_layers);
    rc = s->layers && s->pool ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for an expert cache of %zu bytes", (size_t)(slots + 1) * per * (size_t)n_layers);
    for (int L = 0; rc == QF_OK && L < n_layers; L++) {
        stream_layer *l = &s->layers[L];
        l->slots = s->pool + (size_t)L * (size_t)(slots + 1) * per;
        l->views = calloc((size_t)slots + 1, sizeof *l->views);
        rc = l->views ? qf_slot_cache_init(&l->cache, QF_POLICY_DLFU_AD, n_experts, slots, 64) : qf_fail(QF_ENOMEM, "out of memory");
    }
    if (rc != QF_OK) {
        s->src = NULL; /* the caller keeps src on failure */
        stream_destroy(&s->base);
        return rc;
    }
    s->src = src;
    s->base.stats.slots = slots, s->base.stats.pool_bytes = (size_t)(slots + 1) * per * (size_t)n_layers;
    *out = &s->base;
    return QF_OK;
}
