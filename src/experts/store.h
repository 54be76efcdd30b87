/* The expert store: how model code reaches routed-expert weights.
 *
 * Contract: acquire() makes expert (layer, e) usable by the backend and fills views valid until
 * the matching release(). A store may block in acquire (a streaming store loads the expert), and
 * may use prefetch() hints (optional, NULL = none). The resident store below keeps every expert
 * in place (views into the mmap'd checkpoint); a streaming store replaces it without any change
 * to the model code. */
#ifndef QF_EXPERTS_STORE_H
#define QF_EXPERTS_STORE_H

#include <stdint.h>

#include "backend/ops.h"

typedef struct qf_expert_stats {
    uint64_t acquires, hits, misses, bytes_loaded;
} qf_expert_stats;

typedef struct qf_expert_store qf_expert_store;

typedef struct qf_expert_store_ops {
    int (*acquire)(qf_expert_store *s, int layer, int expert, qf_expert *out);
    void (*release)(qf_expert_store *s, int layer, int expert);
    void (*prefetch)(qf_expert_store *s, int layer, const int *experts, int n); /* optional */
    void (*destroy)(qf_expert_store *s);
    /* All E experts of a layer at once, for backends that route on the device (optional). */
    const qf_expert *(*table)(qf_expert_store *s, int layer);
} qf_expert_store_ops;

struct qf_expert_store {
    const qf_expert_store_ops *ops;
    qf_expert_stats stats;
};

/* All experts resident: the views set here are returned as they are. NULL on allocation failure. */
qf_expert_store *qf_es_resident_create(int n_layers, int n_experts);
void qf_es_resident_set(qf_expert_store *s, int layer, int expert, const qf_expert *e);

static inline void qf_es_destroy(qf_expert_store *s) {
    if (s) s->ops->destroy(s);
}

#endif
