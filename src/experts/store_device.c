/* Every routed expert copied once into the backend's memory: a layer's E experts in one
 * allocation (gate, up, down of each expert one after another), the layer's pointer table beside
 * them for kernels that route on the device, and an array where those kernels write the ids they
 * chose. Nothing moves after creation, so every table keeps version 1. */
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "base/err.h"
#include "experts/store.h"

typedef struct dev_layer {
    void *mem;         /* the layer's expert weights, backend memory */
    const void **tab;  /* [3][E] pointers, backend memory */
    int32_t *chosen;   /* [QF_EXPERT_ID_ROWS][top_k], backend memory */
    qf_expert *views;  /* [E] host array */
} dev_layer;

typedef struct device_store {
    qf_expert_store base;
    qf_backend *be;
    int n_layers, n_experts;
    dev_layer *layers;
} device_store;

static size_t mat_bytes(const qf_mat *w) { return qf_mat_packed_bytes(w); }
static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

static int device_acquire(qf_expert_store *s, int layer, int expert, qf_expert *out) {
    device_store *d = (device_store *)s;
    int rc = qf_es_check_expert(layer, expert, d->n_layers, d->n_experts);
    if (rc != QF_OK) return rc;
    *out = d->layers[layer].views[expert];
    s->stats.acquires++;
    s->stats.hits++;
    return QF_OK;
}

static void device_release(qf_expert_store *s, int layer, int expert) { (void)s, (void)layer, (void)expert; }

static int device_table(qf_expert_store *s, int layer, qf_expert_table *out) {
    device_store *d = (device_store *)s;
    int rc = qf_es_check_layer(layer, d->n_layers);
    if (rc != QF_OK) return rc;
    dev_layer *l = &d->layers[layer];
    *out = (qf_expert_table){l->views, l->tab, l->chosen, 1, NULL};
    return QF_OK;
}

static void device_destroy(qf_expert_store *s) {
    device_store *d = (device_store *)s;
    for (int L = 0; d->layers && L < d->n_layers; L++) {
        dev_layer *l = &d->layers[L];
        qf_be_free(d->be, l->mem), qf_be_free(d->be, (void *)l->tab), qf_be_free(d->be, l->chosen);
        free(l->views);
    }
    free(d->layers);
    free(d);
}

static const qf_expert_store_ops k_device_ops = {
    .acquire = device_acquire,
    .release = device_release,
    .prefetch = NULL,
    .destroy = device_destroy,
    .table = device_table,
};

/* One expert's three matrices from src into the layer's memory at *at; views re-pointed. */
static int copy_expert(device_store *d, qf_expert_store *src, int L, int e, size_t *at) {
    qf_expert x;
    int rc = src->ops->acquire(src, L, e, &x);
    if (rc != QF_OK) return rc;
    dev_layer *l = &d->layers[L];
    qf_mat *m[3] = {&x.gate, &x.up, &x.down};
    for (int i = 0; i < 3; i++) {
        *m[i] = qf_es_put_mat(d->be, (char *)l->mem + *at, m[i]);
        *at += align256(mat_bytes(m[i]));
    }
    src->ops->release(src, L, e);
    l->views[e] = x;
    return QF_OK;
}

static int make_layer(device_store *d, qf_expert_store *src, int L, int top_k) {
    int E = d->n_experts;
    qf_expert first;
    int rc = src->ops->acquire(src, L, 0, &first);
    if (rc != QF_OK) return rc;
    src->ops->release(src, L, 0);
    size_t per = align256(mat_bytes(&first.gate)) + align256(mat_bytes(&first.up)) + align256(mat_bytes(&first.down)), at = 0;
    dev_layer *l = &d->layers[L];
    l->views = calloc((size_t)E, sizeof *l->views);
    l->mem = qf_be_alloc(d->be, per * (size_t)E);
    l->tab = qf_be_alloc(d->be, 3 * (size_t)E * sizeof(void *));
    l->chosen = qf_be_alloc(d->be, (size_t)QF_EXPERT_ID_ROWS * (size_t)top_k * sizeof(int32_t));
    const void **host = malloc(3 * (size_t)E * sizeof(void *));
    if (!l->views || !l->mem || !l->tab || !l->chosen || !host) {
        free(host);
        return qf_fail(QF_ENOMEM, "out of memory for the %d experts of layer %d (%zu bytes)", E, L, per * (size_t)E);
    }
    for (int e = 0; e < E && rc == QF_OK; e++) {
        rc = copy_expert(d, src, L, e, &at);
        if (rc == QF_OK && at > per * (size_t)(e + 1)) rc = qf_fail(QF_EFORMAT, "expert %d of layer %d is larger than expert 0", e, L);
    }
    for (int e = 0; e < E && rc == QF_OK; e++)
        host[e] = l->views[e].gate.data, host[E + e] = l->views[e].up.data, host[2 * E + e] = l->views[e].down.data;
    if (rc == QF_OK) qf_be_upload(d->be, (void *)l->tab, host, 3 * (size_t)E * sizeof(void *));
    free(host);
    return rc;
}

int qf_es_device_create(qf_expert_store **out, qf_expert_store *src, qf_backend *be, int n_layers, int n_experts, int top_k) {
    *out = NULL;
    device_store *d = calloc(1, sizeof *d);
    if (!d || !(d->layers = calloc((size_t)n_layers, sizeof *d->layers))) {
        free(d);
        return qf_fail(QF_ENOMEM, "out of memory");
    }
    d->base.ops = &k_device_ops;
    d->be = be, d->n_layers = n_layers, d->n_experts = n_experts;
    int rc = QF_OK;
    for (int L = 0; L < n_layers && rc == QF_OK; L++) rc = make_layer(d, src, L, top_k);
    if (rc == QF_OK) rc = qf_be_sync(be);
    if (rc != QF_OK) {
        device_destroy(&d->base); /* cleanup leaves the error message as it is */
        return rc;
    }
    *out = &d->base;
    return QF_OK;
}
