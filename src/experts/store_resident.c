#include <stdlib.h>

#include "base/err.h"
#include "experts/store.h"

typedef struct resident_store {
    qf_expert_store base;
    int n_layers, n_experts;
    qf_expert *experts; /* [n_layers][n_experts] */
    uint64_t version;   /* never changes: nothing moves */
} resident_store;

static int resident_acquire(qf_expert_store *s, int layer, int expert, qf_expert *out) {
    resident_store *r = (resident_store *)s;
    int rc = qf_es_check_expert(layer, expert, r->n_layers, r->n_experts);
    if (rc != QF_OK) return rc;
    *out = r->experts[(int64_t)layer * r->n_experts + expert];
    s->stats.acquires++;
    s->stats.hits++;
    return QF_OK;
}

static void resident_release(qf_expert_store *s, int layer, int expert) {
    (void)s;
    (void)layer;
    (void)expert;
}

static void resident_destroy(qf_expert_store *s) {
    resident_store *r = (resident_store *)s;
    free(r->experts);
    free(r);
}

static int resident_table(qf_expert_store *s, int layer, qf_expert_table *out) {
    resident_store *r = (resident_store *)s;
    int rc = qf_es_check_layer(layer, r->n_layers);
    if (rc != QF_OK) return rc;
    *out = (qf_expert_table){&r->experts[(int64_t)layer * r->n_experts], NULL, NULL, r->version, NULL};
    return QF_OK;
}

static const qf_expert_store_ops k_resident_ops = {
    .acquire = resident_acquire,
    .release = resident_release,
    .prefetch = NULL,
    .destroy = resident_destroy,
    .table = resident_table,
};

qf_expert_store *qf_es_resident_create(int n_layers, int n_experts, qf_expert *experts) {
    resident_store *r = calloc(1, sizeof *r);
    if (!r) {
        free(experts);
        return NULL;
    }
    r->base.ops = &k_resident_ops;
    r->n_layers = n_layers;
    r->n_experts = n_experts;
    r->experts = experts;
    r->version = 1;
    return &r->base;
}
