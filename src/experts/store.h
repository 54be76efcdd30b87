/* The expert store: where every routed expert lives, and how model code reaches it.
 *
 * Contract: acquire() makes expert (layer, e) usable by the backend and fills views valid until
 * the matching release(). A store may block in acquire (a streaming store loads the expert), and
 * may use prefetch() hints (optional, NULL = none). For backends that route on the device,
 * table() gives a layer's whole table at once: host views of all E experts, the same pointers in
 * the backend's memory, a device array where the kernels write the ids they chose, and a version
 * that changes whenever any entry changes, so a table cached by version is never stale. A store
 * that moves an expert updates both tables before the step that uses it and bumps the version.
 *
 * Stores: resident (every expert where the checkpoint put it: views into the mmap'd file) and
 * device (store_device.c: every expert copied once into the backend's memory). A streaming store
 * replaces them without any change to the model code. */
#ifndef QF_EXPERTS_STORE_H
#define QF_EXPERTS_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend/ops.h"
#include "base/err.h"
#include "base/pool.h"
#include "format/safetensors.h"

typedef struct qf_expert_stats {
    uint64_t acquires, hits, misses, bytes_loaded;
    uint64_t prefetches, prefetch_hits, prefetch_waits; /* experts read ahead; of them used before leaving; acquires that waited for one */
    uint64_t host_computed; /* misses computed on the host where they live (hybrid execution), not moved */
    int slots;         /* a cache's slots per layer (0: every expert resident) */
    size_t pool_bytes; /* its memory */
} qf_expert_stats;

/* Rows of expert ids a layer's `chosen` array holds: one decode step's (QF_DEC_ROWS sequences). */
#define QF_EXPERT_ID_ROWS QF_DEC_ROWS

typedef struct qf_expert_table {
    const qf_expert *experts; /* [E] host array of views (into backend memory) */
    const void *const *dev;   /* [3][E] gate, up, down pointers in backend memory; NULL: none kept */
    int32_t *chosen;          /* [QF_EXPERT_ID_ROWS][top_k] in backend memory; NULL: none kept */
    uint64_t version;         /* changes whenever experts or dev change */
    const qf_xcache *cache;   /* a device expert cache the backend resolves before reading dev; NULL: none */
} qf_expert_table;

typedef struct qf_expert_store qf_expert_store;

typedef struct qf_expert_store_ops {
    int (*acquire)(qf_expert_store *s, int layer, int expert, qf_expert *out);
    void (*release)(qf_expert_store *s, int layer, int expert);
    void (*prefetch)(qf_expert_store *s, int layer, const int *experts, int n); /* optional */
    void (*destroy)(qf_expert_store *s);
    /* The layer's table (above); an error when the store cannot make it usable (a failed load). */
    int (*table)(qf_expert_store *s, int layer, qf_expert_table *out);
    /* Optional: a forward step begins (ages the cache's counts). */
    void (*step)(qf_expert_store *s);
    /* Optional: the layer's table for a step of `rows` rows the backend never records (more than
     * QF_DEC_ROWS: a prompt chunk, which routes to most experts): the store may stage the whole
     * layer's experts into backend memory for it, and the next layer's meanwhile. */
    int (*wide_table)(qf_expert_store *s, int layer, int rows, qf_expert_table *out);
    /* Optional: what the last step loaded, as text ("L3 e17>s4 e201>s9 ..., slots a layer in use"),
     * at most cap bytes (for --verbose logs; never while a step is being recorded). */
    void (*describe)(qf_expert_store *s, char *buf, size_t cap);
    /* Optional: brings stats up to date where a device counts (qf_es_stats calls it; never while
     * a step is being recorded). */
    void (*refresh)(qf_expert_store *s);
    /* Optional: layer L's slots hold experts[0..n) from here (n at most the slots; each as if used
     * once), whatever they held; between steps. Without it a store fills by acquiring them. */
    int (*fill)(qf_expert_store *s, int layer, const int *experts, int n);
} qf_expert_store_ops;

struct qf_expert_store {
    const qf_expert_store_ops *ops;
    qf_expert_stats stats;
};

/* Every expert where its views point (into the mapped checkpoint); no device table. Takes
 * ownership of experts ([n_layers][n_experts], malloc'd; freed even on failure). NULL when out of
 * memory. */
qf_expert_store *qf_es_resident_create(int n_layers, int n_experts, qf_expert *experts);

/* Every expert of src copied once into be's memory (libc memory for a backend without its own),
 * each layer's experts in one allocation, with the device tables and chosen-id arrays (top_k ids a
 * row). src is read through acquire/release and may be destroyed afterwards. */
int qf_es_device_create(qf_expert_store **out, qf_expert_store *src, qf_backend *be, int n_layers, int n_experts, int top_k);

/* A RAM expert cache of budget bytes in front of src (store_stream.c), reading misses from file's
 * files (NULL: copying from where the views point): each layer gets the slots
 * its share holds, one of them a scratch slot; the policy is decayed frequency with admission.
 * QF_EINVAL naming the minimum when budget holds fewer than top_k slots a layer besides the
 * scratch one. Takes src on success. */
int qf_es_stream_create(qf_expert_store **out, qf_expert_store *src, const qf_st_set *file, int n_layers, int n_experts, int top_k, size_t budget);
/* Slots a layer gets from budget (scratch slot excluded). */
int qf_es_stream_slots(size_t budget, size_t per_expert, int n_layers);

/* The routed experts in host memory the device reads (store_devcache.c): pinned where src's views
 * point, or copied once into pinned memory when they cannot be; every table points home until
 * set_slots gives each layer `slots` slots in be's memory in front of them (ops.h qf_xcache),
 * resolved by the device with policy (lru, dlfu or dlfu-admit of cache_policy.h). Once; on
 * failure the store stays without slots. create takes src on success. */
int qf_es_devcache_create(qf_expert_store **out, qf_expert_store *src, qf_backend *be, int n_layers, int n_experts, int top_k);
int qf_es_devcache_set_slots(qf_expert_store *s, int slots, int policy, int stage);
/* stage: two buffers of a whole layer's experts for prompt chunks (wide_table), copied over the
 * link a layer ahead of their use; 0: prompt chunks resolve through the slots like decode steps. */
/* Hybrid expert execution (backend/xcache.h): after set_slots, a decode step's declined misses,
 * up to share of its misses, are computed on pool's threads from their home views (host_moe.h)
 * beside the device's kernels. host_share changes the share (0: every miss over the link) and the
 * host call's fixed cost, in experts, taken off each step's count (ceil(share x misses - fixed)). */
int qf_es_devcache_set_host(qf_expert_store *s, qf_pool *pool, float share);
void qf_es_devcache_host_share(qf_expert_store *s, float share, float fixed);
/* Test hook: the host call `calls` calls from now fails (its step's error names the layer and the
 * failure), as a host thread's fault would; 0: none. */
void qf_es_devcache_fail_host(qf_expert_store *s, int calls);
/* The split's cost model, measured: milliseconds an expert takes on the host (one row, pool's
 * threads) beyond a call's fixed milliseconds (a call of one expert against one of top-k), and
 * over the link (its bytes copied from home). */
int qf_es_devcache_measure(qf_expert_store *s, double *host_ms, double *host_fixed_ms, double *link_ms);
/* Bytes of one expert's slot: its three matrices, each 256-byte aligned. */
size_t qf_es_slot_bytes(const qf_expert *x);

/* Copies m into memory at dst (backend memory with be, host memory with be NULL) as a
 * self-contained copy (ops.h qf_mat_packed_bytes: its rows, then its block scales if it has
 * them); returns the view of the copy. */
static inline qf_mat qf_es_put_mat(qf_backend *be, void *dst, const qf_mat *m) {
    qf_mat v = *m;
    char *d = (char *)dst;
    if (be) qf_be_upload(be, d, m->data, qf_mat_bytes(m));
    else memcpy(d, m->data, qf_mat_bytes(m));
    if (m->scales && be) qf_be_upload(be, d + qf_mat_scale_off(m), m->scales, qf_mat_scale_bytes(m));
    else if (m->scales) memcpy(d + qf_mat_scale_off(m), m->scales, qf_mat_scale_bytes(m));
    v.data = d;
    v.scales = m->scales ? (const float *)(d + qf_mat_scale_off(m)) : NULL;
    return v;
}

/* The store's counters, brought up to date first where a device keeps them. */
static inline qf_expert_stats qf_es_stats(qf_expert_store *s) {
    if (s->ops->refresh) s->ops->refresh(s);
    return s->stats;
}

/* For the stores: QF_OK when the ids name one of n_layers x n_experts, else QF_EINVAL saying so. */
static inline int qf_es_check_expert(int layer, int expert, int n_layers, int n_experts) {
    if (layer < 0 || layer >= n_layers || expert < 0 || expert >= n_experts)
        return qf_fail(QF_EINVAL, "expert %d of layer %d does not exist", expert, layer);
    return QF_OK;
}
static inline int qf_es_check_layer(int layer, int n_layers) {
    return layer >= 0 && layer < n_layers ? QF_OK : qf_fail(QF_EINVAL, "layer %d has no experts", layer);
}

static inline void qf_es_destroy(qf_expert_store *s) {
    if (s) s->ops->destroy(s);
}

#endif
