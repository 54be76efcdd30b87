/* A fixed RAM pool of expert slots in front of the checkpoint (the CPU's expert cache): each
 * layer owns slots_per_layer slots plus one scratch slot; an expert that misses is read from the
 * checkpoint file (pread, not through the mapping, so its pages never enter this process) into the
 * slot the policy frees (cache_policy.c), or into the scratch slot when the policy does not admit
 * it. The process holds the pool, not the experts it has read; the pool is allocated once.
 *
 * prefetch() hands a reader thread the experts a step will likely use next (the next layer's
 * router guesses): each goes into the slot the policy frees while the model computes, and an
 * acquire of it waits only if its read is still running. The store is otherwise used by one
 * thread (the one running the model); the lock orders it with the reader. */
#include <pthread.h>
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
    uint8_t *loading;  /* [slots] prefetch reads queued or running into the slot */
    uint8_t *fetched;  /* [slots] holds a prefetched expert not yet used */
    uint8_t *bad;      /* [slots] its last read failed: the next acquire reads it again */
} stream_layer;

#define PF_QUEUE 256
typedef struct pf_job {
    int L, e, slot;
} pf_job;

typedef struct stream_store {
    qf_expert_store base;
    qf_expert_store *src; /* where the experts are (views into the mapped checkpoint); owned */
    qf_expert *home;      /* [n_layers][n_experts] src's views, taken once: the reader never calls src */
    const qf_st_set *file; /* the checkpoint the views map: misses are read from it (NULL: copied) */
    int n_layers, n_experts, slots;
    size_t per_expert;
    stream_layer *layers;
    char *pool;
    pthread_mutex_t mu;
    pthread_cond_t more, done; /* jobs queued; a job finished */
    pthread_t reader;
    int reader_on, stop, q_head, q_n;
    pf_job q[PF_QUEUE];
} stream_store;

/* The rows only: an FP8 expert's scales stay where the loader put them (host memory). */
static size_t mat_bytes(const qf_mat *w) { return qf_mat_bytes(w); }

/* Expert e of layer L read into slot s's memory; *x its view there. No shared state touched. */
static int read_expert(stream_store *s, int L, int e, int slot, qf_expert *x) {
    int rc = QF_OK;
    *x = s->home[(size_t)L * s->n_experts + e];
    char *at = s->layers[L].slots + (size_t)slot * s->per_expert;
    qf_mat *m[3] = {&x->gate, &x->up, &x->down};
    for (int i = 0; i < 3 && rc == QF_OK; i++) {
        size_t n = mat_bytes(m[i]);
        rc = qf_st_read(s->file, m[i]->data, at, n);
        m[i]->data = at;
        at += n;
    }
    return rc;
}

/* Waits (the lock held) until no prefetch read is writing slot `slot` of l. */
static void wait_slot(stream_store *s, stream_layer *l, int slot) {
    while (slot < s->slots && l->loading[slot]) {
        s->base.stats.prefetch_waits++;
        pthread_cond_wait(&s->done, &s->mu);
    }
}

static void *reader_main(void *arg) {
    stream_store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->q_n && !s->stop) pthread_cond_wait(&s->more, &s->mu);
        if (!s->q_n) break;
        pf_job j = s->q[s->q_head];
        s->q_head = (s->q_head + 1) % PF_QUEUE, s->q_n--;
        pthread_mutex_unlock(&s->mu);
        qf_expert x;
        int rc = read_expert(s, j.L, j.e, j.slot, &x);
        pthread_mutex_lock(&s->mu);
        stream_layer *l = &s->layers[j.L];
        if (l->cache.slot_of[j.e] == j.slot) { /* not evicted by a later prefetch meanwhile */
            l->views[j.slot] = x, l->bad[j.slot] = rc != QF_OK, l->fetched[j.slot] = rc == QF_OK;
            s->base.stats.prefetches += rc == QF_OK;
            s->base.stats.bytes_loaded += rc == QF_OK ? s->per_expert : 0;
        }
        l->loading[j.slot]--;
        pthread_cond_broadcast(&s->done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static int stream_acquire(qf_expert_store *st, int L, int e, qf_expert *out) {
    stream_store *s = (stream_store *)st;
    int rc = qf_es_check_expert(L, e, s->n_layers, s->n_experts);
    if (rc != QF_OK) return rc;
    stream_layer *l = &s->layers[L];
    pthread_mutex_lock(&s->mu);
    st->stats.acquires++;
    int slot = qf_slot_cache_find(&l->cache, e);
    if (slot >= 0) wait_slot(s, l, slot);
    int hit = slot >= 0 && !l->bad[slot];
    if (hit) {
        st->stats.hits++;
        st->stats.prefetch_hits += l->fetched[slot];
        l->fetched[slot] = 0;
    } else {
        int evicted;
        if (slot < 0) slot = qf_slot_cache_insert(&l->cache, e, &evicted, NULL);
        if (slot < 0) slot = s->slots; /* not admitted: the scratch slot, for this use only */
        wait_slot(s, l, slot);         /* a victim's prefetch still writing it */
        pthread_mutex_unlock(&s->mu);
        qf_expert x;
        rc = read_expert(s, L, e, slot, &x); /* no prefetch targets this layer while it runs */
        pthread_mutex_lock(&s->mu);
        if (slot < s->slots) l->bad[slot] = rc != QF_OK, l->fetched[slot] = 0;
        if (rc == QF_OK) l->views[slot] = x, st->stats.misses++, st->stats.bytes_loaded += s->per_expert;
    }
    if (rc == QF_OK) *out = l->views[slot];
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* The experts ids[0..n) of layer L read ahead into the slots the policy frees (those held, and
 * those the queue has no room for, skipped); never the layer a step is in. */
static void stream_prefetch(qf_expert_store *st, int L, const int *ids, int n) {
    stream_store *s = (stream_store *)st;
    if (L < 0 || L >= s->n_layers || !s->reader_on) return;
    stream_layer *l = &s->layers[L];
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n && s->q_n < PF_QUEUE; i++) {
        int e = ids[i];
        if (e < 0 || e >= s->n_experts || l->cache.slot_of[e] >= 0 || !qf_slot_cache_prefetch(&l->cache, e, NULL)) continue;
        int slot = l->cache.slot_of[e];
        l->loading[slot]++, l->fetched[slot] = 0, l->bad[slot] = 0;
        s->q[(s->q_head + s->q_n++) % PF_QUEUE] = (pf_job){L, e, slot};
    }
    pthread_cond_signal(&s->more);
    pthread_mutex_unlock(&s->mu);
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
    if (s->reader_on) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_signal(&s->more);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->reader, NULL); /* after the queued reads: none writes a freed slot */
    }
    pthread_mutex_destroy(&s->mu), pthread_cond_destroy(&s->more), pthread_cond_destroy(&s->done);
    for (int L = 0; s->layers && L < s->n_layers; L++) {
        qf_slot_cache_free(&s->layers[L].cache);
        free(s->layers[L].views), free(s->layers[L].loading), free(s->layers[L].fetched), free(s->layers[L].bad);
    }
    free(s->layers);
    free(s->pool);
    free(s->home);
    qf_es_destroy(s->src);
    free(s);
}

static const qf_expert_store_ops k_stream_ops = {
    .acquire = stream_acquire,
    .release = stream_release,
    .prefetch = stream_prefetch,
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
    pthread_mutex_init(&s->mu, NULL), pthread_cond_init(&s->more, NULL), pthread_cond_init(&s->done, NULL);
    s->n_layers = n_layers, s->n_experts = n_experts, s->slots = slots, s->per_expert = per;
    s->layers = calloc((size_t)n_layers, sizeof *s->layers);
    s->pool = malloc((size_t)(slots + 1) * per * (size_t)n_layers);
    rc = s->layers && s->pool ? QF_OK : qf_fail(QF_ENOMEM, "out of memory for an expert cache of %zu bytes", (size_t)(slots + 1) * per * (size_t)n_layers);
    for (int L = 0; rc == QF_OK && L < n_layers; L++) {
        stream_layer *l = &s->layers[L];
        l->slots = s->pool + (size_t)L * (size_t)(slots + 1) * per;
        l->views = calloc((size_t)slots + 1, sizeof *l->views);
        l->loading = calloc((size_t)slots, 1), l->fetched = calloc((size_t)slots, 1), l->bad = calloc((size_t)slots, 1);
        rc = l->views && l->loading && l->fetched && l->bad ? qf_slot_cache_init(&l->cache, QF_POLICY_DLFU_AD, n_experts, slots, 64) : qf_fail(QF_ENOMEM, "out of memory");
    }
    s->home = rc == QF_OK ? malloc((size_t)n_layers * n_experts * sizeof *s->home) : NULL;
    if (rc == QF_OK && !s->home) rc = qf_fail(QF_ENOMEM, "out of memory");
    for (int i = 0; rc == QF_OK && i < n_layers * n_experts; i++) {
        rc = src->ops->acquire(src, i / n_experts, i % n_experts, &s->home[i]); /* views that stay valid: the checkpoint is mapped */
        if (rc == QF_OK) src->ops->release(src, i / n_experts, i % n_experts);
    }
    if (rc != QF_OK) {
        s->src = NULL; /* the caller keeps src on failure */
        stream_destroy(&s->base);
        return rc;
    }
    s->src = src;
    s->reader_on = pthread_create(&s->reader, NULL, reader_main, s) == 0; /* without it, prefetch() does nothing */
    s->base.stats.slots = slots, s->base.stats.pool_bytes = (size_t)(slots + 1) * per * (size_t)n_layers;
    *out = &s->base;
    return QF_OK;
}
