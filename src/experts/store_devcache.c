/* The routed experts stay in host memory the device reads directly (pinned where they already are,
 * or copied once into pinned buffers when that memory cannot be pinned), and each layer has a fixed
 * pool of slots in the backend's memory in front of them (ops.h qf_xcache): the device resolves
 * every step's experts itself, so a hit costs no host round trip and decode steps stay one graph.
 * Everything is allocated at creation; nothing is allocated as it runs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/dtype.h"
#include "base/err.h"
#include "base/timer.h"
#include "experts/cache_policy.h"
#include "experts/host_moe.h"
#include "experts/store.h"

typedef struct dc_layer {
    qf_xcache x;
    qf_expert *views;   /* [E] home views (host memory) */
    const void **home;  /* [3][E] backend memory */
    const void **tab;   /* [3][E] backend memory, rewritten by the device */
    int32_t *chosen;    /* [QF_EXPERT_ID_ROWS][top_k] backend memory */
} dc_layer;

typedef struct span {
    char *p;
    size_t n;
} span;

typedef struct devcache_store {
    qf_expert_store base;
    qf_expert_store *src; /* owns the home bytes' mapping or buffers */
    qf_backend *be;
    int n_layers, n_experts, top_k;
    size_t slot_bytes;
    dc_layer *layers;
    unsigned long long *counters; /* [n_layers][QF_XC_COUNTERS] backend memory */
    unsigned long long *ctr_host;
    void *stage_mem[2];           /* a whole layer's experts each, for prompt chunks (NULL: none) */
    const void **stage_tab[2];    /* [3][E] pointers into each, backend memory */
    int staged[2];                /* the layer each holds (or is being copied), -1: none */
    void **cp_dst;                /* [3E] one layer's copies */
    const void **cp_src;
    size_t *cp_bytes;
    uint32_t *fill_host;          /* [2][slots]: a layer's fills, for describe */
    uint64_t staged_bytes;
    span *pinned;                 /* host ranges registered with the device */
    int n_pinned;
    void *copy;                   /* pinned copy of every expert, when the home could not be pinned */
    qf_host_moe *host;            /* hybrid execution (NULL: off): the host's experts */
    qf_xc_job *job;               /* mapped host memory, every layer's */
    void *zero;                   /* slot_bytes of zeros, backend memory */
    uint64_t host_computed;       /* experts the host computed (a host node's thread adds; read between steps) */
    int host_fail_in;             /* test hook: the host call that many calls on fails (0: none) */
} devcache_store;

/* A matrix as the device reads it: its rows and, for FP8, the scales after them (the home copy
 * is packed so: copy_home). */
static size_t mat_bytes(const qf_mat *w) { return qf_mat_packed_bytes(w); }
static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

size_t qf_es_slot_bytes(const qf_expert *x) { return align256(mat_bytes(&x->gate)) + align256(mat_bytes(&x->up)) + align256(mat_bytes(&x->down)); }

static int dc_acquire(qf_expert_store *s, int L, int e, qf_expert *out) {
    devcache_store *d = (devcache_store *)s;
    int rc = qf_es_check_expert(L, e, d->n_layers, d->n_experts);
    if (rc == QF_OK) *out = d->layers[L].views[e];
    return rc;
}

static void dc_release(qf_expert_store *s, int L, int e) { (void)s, (void)L, (void)e; }

static int dc_table(qf_expert_store *s, int L, qf_expert_table *out) {
    devcache_store *d = (devcache_store *)s;
    int rc = qf_es_check_layer(L, d->n_layers);
    if (rc != QF_OK) return rc;
    dc_layer *l = &d->layers[L];
    *out = (qf_expert_table){l->views, l->tab, l->chosen, 1, l->x.slots ? &l->x : NULL};
    return QF_OK;
}

/* The device's counters summed over the layers into stats. */
static void dc_refresh(qf_expert_store *s) {
    devcache_store *d = (devcache_store *)s;
    size_t n = (size_t)d->n_layers * QF_XC_COUNTERS;
    qf_be_download(d->be, d->ctr_host, d->counters, n * sizeof *d->ctr_host);
    unsigned long long sum[QF_XC_COUNTERS] = {0};
    for (size_t i = 0; i < n; i++) sum[i % QF_XC_COUNTERS] += d->ctr_host[i];
    /* a miss crosses the link once, copied into a slot or (declined) read in place, unless the host computed it where it lives */
    s->stats.hits = sum[QF_XC_HITS], s->stats.misses = sum[QF_XC_MISSES], s->stats.host_computed = d->host_computed;
    s->stats.bytes_loaded = (sum[QF_XC_MISSES] - d->host_computed) * d->slot_bytes;
    s->stats.acquires = s->stats.hits + s->stats.misses;
    s->stats.bytes_loaded += d->staged_bytes;
}

/* The last step's fills, layer by layer, from each layer's state (a few small downloads). */
static void dc_describe(qf_expert_store *s, char *buf, size_t cap) {
    devcache_store *d = (devcache_store *)s;
    size_t at = 0;
    int used_min = d->layers[0].x.n_slots, loads = 0;
    uint32_t head[QF_XC_HEAD_WORDS], *fill = d->fill_host;
    buf[0] = 0;
    for (int L = 0; fill && L < d->n_layers && d->layers[L].x.state; L++) {
        const qf_xcache *x = &d->layers[L].x;
        uint32_t *w = x->state;
        qf_be_download(d->be, head, w, sizeof head);
        int nf = (int)head[2] < x->n_slots ? (int)head[2] : x->n_slots;
        used_min = (int)head[1] < used_min ? (int)head[1] : used_min;
        loads += nf;
        if (!nf) continue;
        size_t off = QF_XC_HEAD_WORDS + 3 * (size_t)x->n_experts + 2 * (size_t)x->n_slots; /* fill_e, then fill_s */
        qf_be_download(d->be, fill, w + off, 2 * (size_t)x->n_slots * sizeof *fill);
        if (at + 1 < cap) at += (size_t)snprintf(buf + at, cap - at, "%sL%d", at ? " | " : "", L);
        for (int i = 0; i < nf && at + 1 < cap; i++) at += (size_t)snprintf(buf + at, cap - at, " e%u>s%u", fill[i], fill[x->n_slots + i]);
    }
    if (at + 1 < cap) snprintf(buf + at, cap - at, "%s%d copied into slots; every layer has %d of %d slots filled", at ? "; " : "", loads, used_min, d->layers[0].x.n_slots);
}

/* Every expert of layer L copied from home into staging buffer b, on the copy engine. */
static void stage_layer(devcache_store *d, int b, int L) {
    int E = d->n_experts, n = 0;
    for (int e = 0; e < E; e++) {
        const qf_expert *x = &d->layers[L].views[e];
        const qf_mat *m[3] = {&x->gate, &x->up, &x->down};
        char *slot = (char *)d->stage_mem[b] + (size_t)e * d->slot_bytes;
        for (int i = 0; i < 3; i++, n++)
            d->cp_dst[n] = slot + d->layers[L].x.off[i], d->cp_src[n] = m[i]->data, d->cp_bytes[n] = mat_bytes(m[i]);
    }
    d->be->ops->stage(d->be, b, n, d->cp_dst, d->cp_src, d->cp_bytes);
    d->staged[b] = L;
    d->staged_bytes += (uint64_t)E * d->slot_bytes;
}

/* A prompt chunk's layer L reads staging buffer L % 2; layer L + 1's copies start meanwhile
 * (after every op queued so far, so after layer L - 1's experts were read from that buffer). */
static int dc_wide_table(qf_expert_store *s, int L, int rows, qf_expert_table *out) {
    devcache_store *d = (devcache_store *)s;
    (void)rows;
    int rc = dc_table(s, L, out);
    if (rc != QF_OK || !d->stage_mem[0]) return rc;
    int b = L % 2;
    if (d->staged[b] != L) stage_layer(d, b, L);
    if (L + 1 < d->n_layers && d->staged[1 - b] != L + 1) stage_layer(d, 1 - b, L + 1);
    d->be->ops->stage_wait(d->be, b);
    out->dev = d->stage_tab[b], out->cache = NULL;
    return QF_OK;
}

static void dc_destroy(qf_expert_store *s) {
    devcache_store *d = (devcache_store *)s;
    for (int L = 0; d->layers && L < d->n_layers; L++) {
        dc_layer *l = &d->layers[L];
        qf_be_free(d->be, (void *)l->home), qf_be_free(d->be, (void *)l->tab), qf_be_free(d->be, l->chosen);
        qf_be_free(d->be, l->x.slots), qf_be_free(d->be, l->x.state), qf_be_free(d->be, l->x.host_words);
        free(l->views);
    }
    qf_host_moe_free(d->host), qf_be_free(d->be, d->zero);
    if (d->job) d->be->ops->pin_free(d->be, d->job);
    for (int b = 0; b < 2; b++) qf_be_free(d->be, d->stage_mem[b]), qf_be_free(d->be, (void *)d->stage_tab[b]);
    free(d->cp_dst), free((void *)d->cp_src), free(d->cp_bytes), free(d->fill_host);
    for (int i = 0; i < d->n_pinned; i++) d->be->ops->unpin(d->be, d->pinned[i].p);
    if (d->copy) d->be->ops->pin_free(d->be, d->copy);
    qf_be_free(d->be, d->counters);
    free(d->ctr_host), free(d->pinned), free(d->layers);
    qf_es_destroy(d->src);
    free(d);
}

/* Layer L's home addresses as a [3][E] table: gate, up, down of each expert. */
static void home_ptrs(const devcache_store *d, int L, const void **out) {
    int E = d->n_experts;
    const qf_expert *v = d->layers[L].views;
    for (int e = 0; e < E; e++) out[e] = v[e].gate.data, out[E + e] = v[e].up.data, out[2 * E + e] = v[e].down.data;
}

/* The slot map rewritten on the host (the device's clock kept), the slots' bytes uploaded from home
 * and the table pointed at them, every other expert home. */
static int dc_fill(qf_expert_store *s, int L, const int *experts, int n) {
    devcache_store *d = (devcache_store *)s;
    int rc = qf_es_check_layer(L, d->n_layers), E = d->n_experts;
    qf_xcache *x = rc == QF_OK ? &d->layers[L].x : NULL;
    if (rc == QF_OK && (!x->slots || n < 0 || n > x->n_slots)) rc = qf_fail(QF_EINVAL, "layer %d: %d experts for %d device slots", L, n, x ? x->n_slots : 0);
    for (int i = 0; rc == QF_OK && i < n; i++) rc = qf_es_check_expert(L, experts[i], d->n_layers, E);
    size_t bytes = rc == QF_OK ? qf_xcache_state_bytes(E, x->n_slots) : 0;
    uint32_t *w = bytes ? malloc(bytes) : NULL;
    const void **tab = bytes ? malloc(3 * (size_t)E * sizeof *tab) : NULL;
    if (rc == QF_OK && (!w || !tab)) rc = qf_fail(QF_ENOMEM, "out of memory");
    if (rc == QF_OK) rc = qf_be_sync(d->be);
    if (rc == QF_OK) {
        int S = x->n_slots;
        qf_be_download(d->be, w, x->state, bytes);
        uint32_t now = w[0], *slot1_of = w + QF_XC_HEAD_WORDS, *expert1_in = slot1_of + E, *last = expert1_in + S, *count = last + S, *count_at = count + E;
        memset(slot1_of, 0, (size_t)E * sizeof *w), memset(expert1_in, 0, (size_t)S * sizeof *w);
        home_ptrs(d, L, tab);
        for (int i = 0; i < n; i++) {
            int e = experts[i];
            const qf_expert *v = &d->layers[L].views[e];
            const qf_mat *m[3] = {&v->gate, &v->up, &v->down};
            slot1_of[e] = (uint32_t)i + 1, expert1_in[i] = (uint32_t)e + 1, last[i] = now ? now - 1 : 0;
            count[e] = count[e] > QF_COUNT_ONE ? count[e] : QF_COUNT_ONE, count_at[e] = now;
            for (int k = 0; k < 3; k++) {
                char *dst = x->slots + (size_t)i * x->slot_bytes + x->off[k];
                qf_be_upload(d->be, dst, m[k]->data, mat_bytes(m[k]));
                tab[k * E + e] = dst;
            }
        }
        w[1] = (uint32_t)n, w[2] = 0;
        int32_t none = 0; /* no host experts from a last step to point home again: the table is whole */
        qf_be_upload(d->be, x->state, w, bytes);
        qf_be_upload(d->be, (void *)x->tab, tab, 3 * (size_t)E * sizeof *tab);
        if (x->host_words) qf_be_upload(d->be, x->host_words, &none, sizeof none);
        rc = qf_be_sync(d->be);
    }
    free(w), free(tab);
    return rc;
}

static const qf_expert_store_ops k_dc_ops = {
    .acquire = dc_acquire,
    .release = dc_release,
    .destroy = dc_destroy,
    .table = dc_table,
    .refresh = dc_refresh,
    .wide_table = dc_wide_table,
    .describe = dc_describe,
    .fill = dc_fill,
};

static int cmp_span(const void *a, const void *b) {
    const char *x = ((const span *)a)->p, *y = ((const span *)b)->p;
    return (x > y) - (x < y);
}

/* Every expert matrix's pages, merged into disjoint ranges, registered with the device. */
static int pin_home(devcache_store *d) {
    size_t n = (size_t)d->n_layers * d->n_experts * 3, page = (size_t)sysconf(_SC_PAGESIZE);
    span *sp = malloc(n * sizeof *sp);
    if (!sp) return qf_fail(QF_ENOMEM, "out of memory");
    size_t k = 0;
    for (int L = 0; L < d->n_layers; L++)
        for (int e = 0; e < d->n_experts; e++) {
            const qf_mat *m[3] = {&d->layers[L].views[e].gate, &d->layers[L].views[e].up, &d->layers[L].views[e].down};
            for (int i = 0; i < 3; i++) {
                uintptr_t a = (uintptr_t)m[i]->data & ~(uintptr_t)(page - 1), b = ((uintptr_t)m[i]->data + mat_bytes(m[i]) + page - 1) & ~(uintptr_t)(page - 1);
                sp[k++] = (span){(char *)a, (size_t)(b - a)};
            }
        }
    qsort(sp, k, sizeof *sp, cmp_span);
    size_t m = 0;
    for (size_t i = 0; i < k; i++) {
        if (m && sp[i].p <= sp[m - 1].p + sp[m - 1].n) {
            char *end = sp[i].p + sp[i].n;
            if (end > sp[m - 1].p + sp[m - 1].n) sp[m - 1].n = (size_t)(end - sp[m - 1].p);
        } else sp[m++] = sp[i];
    }
    d->pinned = sp;
    int rc = QF_OK;
    for (size_t i = 0; i < m && rc == QF_OK; i++)
        if ((rc = d->be->ops->pin(d->be, sp[i].p, sp[i].n)) == QF_OK) d->n_pinned++;
    return rc;
}

/* The fallback: every expert copied once into one pinned buffer, the views re-pointed. */
static int copy_home(devcache_store *d, size_t slot_bytes) {
    for (int i = 0; i < d->n_pinned; i++) d->be->ops->unpin(d->be, d->pinned[i].p);
    d->n_pinned = 0;
    size_t total = slot_bytes * (size_t)d->n_experts * (size_t)d->n_layers;
    if (!(d->copy = d->be->ops->pin_alloc(d->be, total)))
        return qf_fail(QF_ENOMEM, "cannot pin %.1f GiB of host memory for the routed experts", (double)total / 1073741824.0);
    char *at = d->copy;
    for (int L = 0; L < d->n_layers; L++)
        for (int e = 0; e < d->n_experts; e++, at += slot_bytes) {
            qf_expert *x = &d->layers[L].views[e];
            qf_mat *m[3] = {&x->gate, &x->up, &x->down};
            for (size_t i = 0, off = 0; i < 3; off += align256(mat_bytes(m[i])), i++) *m[i] = qf_es_put_mat(NULL, at + off, m[i]);
        }
    return QF_OK;
}

/* Layer L's views from src and its tables in backend memory; the table starts at home. */
static int make_layer(devcache_store *d, int L, size_t slot_bytes) {
    dc_layer *l = &d->layers[L];
    int E = d->n_experts, rc = QF_OK;
    if (!(l->views = calloc((size_t)E, sizeof *l->views))) return qf_fail(QF_ENOMEM, "out of memory");
    for (int e = 0; e < E && rc == QF_OK; e++) {
        rc = d->src->ops->acquire(d->src, L, e, &l->views[e]);
        if (rc == QF_OK) d->src->ops->release(d->src, L, e);
        if (rc == QF_OK && qf_es_slot_bytes(&l->views[e]) != slot_bytes) rc = qf_fail(QF_EFORMAT, "expert %d of layer %d differs in size from expert 0", e, L);
    }
    l->home = qf_be_alloc(d->be, 3 * (size_t)E * sizeof(void *));
    l->tab = qf_be_alloc(d->be, 3 * (size_t)E * sizeof(void *));
    l->chosen = qf_be_alloc(d->be, (size_t)QF_EXPERT_ID_ROWS * (size_t)d->top_k * sizeof(int32_t));
    if (rc == QF_OK && (!l->home || !l->tab || !l->chosen)) rc = qf_fail(QF_ENOMEM, "out of device memory for layer %d's expert tables", L);
    return rc;
}

/* Layer L's slots and the state the device resolves them with. */
static int make_slots(devcache_store *d, int L, int slots, int policy) {
    dc_layer *l = &d->layers[L];
    const qf_expert *x = &l->views[0];
    size_t g = align256(mat_bytes(&x->gate)), u = align256(mat_bytes(&x->up));
    l->x = (qf_xcache){.n_experts = d->n_experts, .n_slots = slots, .policy = policy, .half_life = 64, .slot_bytes = d->slot_bytes,
                       .off = {0, g, g + u}, .bytes = {mat_bytes(&x->gate), mat_bytes(&x->up), mat_bytes(&x->down)}, .home = l->home, .tab = l->tab,
                       .slots = qf_be_alloc(d->be, (size_t)slots * d->slot_bytes), .state = qf_be_alloc(d->be, qf_xcache_state_bytes(d->n_experts, slots)),
                       .counters = d->counters + (size_t)L * QF_XC_COUNTERS};
    if (!l->x.slots || !l->x.state)
        return qf_fail(QF_ENOMEM, "out of device memory for layer %d's %d expert slots (%.1f MiB)", L, slots, (double)slots * (double)d->slot_bytes / 1048576.0);
    return QF_OK;
}

/* The two staging buffers, their tables and the host arrays one layer's copies are issued from. */
static int make_staging(devcache_store *d) {
    int E = d->n_experts;
    const void **host = malloc(3 * (size_t)E * sizeof *host);
    d->cp_dst = malloc(3 * (size_t)E * sizeof *d->cp_dst), d->cp_src = malloc(3 * (size_t)E * sizeof *d->cp_src);
    d->cp_bytes = malloc(3 * (size_t)E * sizeof *d->cp_bytes);
    int rc = host && d->cp_dst && d->cp_src && d->cp_bytes ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    for (int b = 0; b < 2 && rc == QF_OK; b++) {
        d->staged[b] = -1;
        d->stage_mem[b] = qf_be_alloc(d->be, (size_t)E * d->slot_bytes);
        d->stage_tab[b] = qf_be_alloc(d->be, 3 * (size_t)E * sizeof(void *));
        if (!d->stage_mem[b] || !d->stage_tab[b]) {
            rc = qf_fail(QF_ENOMEM, "out of device memory for a prompt staging buffer of %.1f MiB", (double)E * (double)d->slot_bytes / 1048576.0);
            break;
        }
        for (int e = 0; e < E; e++)
            for (int i = 0; i < 3; i++) host[i * E + e] = (char *)d->stage_mem[b] + (size_t)e * d->slot_bytes + d->layers[0].x.off[i];
        qf_be_upload(d->be, (void *)d->stage_tab[b], host, 3 * (size_t)E * sizeof *host);
    }
    free(host);
    return rc;
}

int qf_es_devcache_set_slots(qf_expert_store *s, int slots, int policy, int stage) {
    devcache_store *d = (devcache_store *)s;
    if (s->ops != &k_dc_ops || d->layers[0].x.slots) return qf_fail(QF_EINVAL, "not a device expert cache without slots");
    if (slots < 1 || slots > d->n_experts || (policy != QF_POLICY_LRU && policy != QF_POLICY_DLFU && policy != QF_POLICY_DLFU_AD))
        return qf_fail(QF_EINVAL, "a device expert cache takes 1 to %d slots a layer and the lru, dlfu or dlfu-admit policy", d->n_experts);
    int rc = (d->fill_host = malloc(2 * (size_t)slots * sizeof *d->fill_host)) ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    for (int L = 0; L < d->n_layers && rc == QF_OK; L++) rc = make_slots(d, L, slots, policy);
    if (rc == QF_OK && stage) rc = d->be->ops->stage ? make_staging(d) : qf_fail(QF_EUNSUPPORTED, "backend %s cannot stage copies", d->be->ops->name);
    if (rc == QF_OK) rc = qf_be_sync(d->be);
    if (rc != QF_OK) { /* back to no cache: the tables still point home */
        for (int L = 0; L < d->n_layers; L++) qf_be_free(d->be, d->layers[L].x.slots), qf_be_free(d->be, d->layers[L].x.state), memset(&d->layers[L].x, 0, sizeof d->layers[L].x);
        for (int b = 0; b < 2; b++) qf_be_free(d->be, d->stage_mem[b]), qf_be_free(d->be, (void *)d->stage_tab[b]), d->stage_mem[b] = NULL, d->stage_tab[b] = NULL;
        free(d->fill_host), d->fill_host = NULL;
        return rc;
    }
    s->stats.slots = slots, s->stats.pool_bytes = (size_t)slots * d->slot_bytes * (size_t)d->n_layers;
    return QF_OK;
}

/* The home addresses into each layer's home table and its starting table. */
static int upload_tables(devcache_store *d) {
    int E = d->n_experts;
    const void **host = malloc(3 * (size_t)E * sizeof *host);
    if (!host) return qf_fail(QF_ENOMEM, "out of memory");
    for (int L = 0; L < d->n_layers; L++) {
        home_ptrs(d, L, host);
        qf_be_upload(d->be, (void *)d->layers[L].home, host, 3 * (size_t)E * sizeof *host);
        qf_be_upload(d->be, (void *)d->layers[L].tab, host, 3 * (size_t)E * sizeof *host);
    }
    free(host);
    return qf_be_sync(d->be);
}

int qf_es_devcache_create(qf_expert_store **out, qf_expert_store *src, qf_backend *be, int n_layers, int n_experts, int top_k) {
    *out = NULL;
    if (!be->ops->pin || !be->ops->pin_alloc || !be->ops->alloc)
        return qf_fail(QF_EUNSUPPORTED, "backend %s cannot read host memory from the device: no expert cache there", be->ops->name);
    qf_expert x0;
    int rc = src->ops->acquire(src, 0, 0, &x0);
    if (rc != QF_OK) return rc;
    src->ops->release(src, 0, 0);
    size_t slot_bytes = qf_es_slot_bytes(&x0);
    devcache_store *d = calloc(1, sizeof *d);
    if (!d) return qf_fail(QF_ENOMEM, "out of memory");
    d->base.ops = &k_dc_ops;
    d->src = src, d->be = be, d->n_layers = n_layers, d->n_experts = n_experts, d->top_k = top_k, d->slot_bytes = slot_bytes;
    d->layers = calloc((size_t)n_layers, sizeof *d->layers);
    d->ctr_host = calloc((size_t)n_layers * QF_XC_COUNTERS, sizeof *d->ctr_host);
    d->counters = qf_be_alloc(be, (size_t)n_layers * QF_XC_COUNTERS * sizeof *d->counters);
    rc = d->layers && d->ctr_host && d->counters ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    for (int L = 0; L < n_layers && rc == QF_OK; L++) rc = make_layer(d, L, slot_bytes);
    /* memory that cannot be pinned in place is copied, as are FP8 experts (their scales lie apart) */
    if (rc == QF_OK && (d->layers[0].views[0].gate.scales || pin_home(d) != QF_OK)) rc = copy_home(d, slot_bytes);
    if (rc == QF_OK) rc = upload_tables(d);
    if (rc != QF_OK) {
        d->src = NULL; /* the caller keeps src on failure */
        dc_destroy(&d->base);
        return rc;
    }
    *out = &d->base;
    return QF_OK;
}

/* A host node's call: layer L's host experts of the job, from their home views. */
static int dc_host_run(void *ctx, int L, qf_xc_job *job) {
    devcache_store *d = ctx;
    if (d->host_fail_in > 0 && --d->host_fail_in == 0) return qf_fail(QF_EIO, "a failure injected by a test");
    qf_host_moe_job j = {d->layers[L].views, d->n_experts, job->n, job->top_k, job->xn, job->ids, job->w, job->y};
    int rc = qf_host_moe_run(d->host, &j);
    if (rc == QF_OK) d->host_computed += (uint64_t)job->n_host;
    return rc;
}

int qf_es_devcache_set_host(qf_expert_store *s, qf_pool *pool, float share) {
    devcache_store *d = (devcache_store *)s;
    if (s->ops != &k_dc_ops || !d->layers[0].x.slots || d->host) return qf_fail(QF_EINVAL, "not a device expert cache with slots and no host share");
    const qf_mat *g = &d->layers[0].views[0].gate;
    int H = (int)g->cols, rc = qf_host_moe_create(&d->host, pool, H, (int)g->rows, d->top_k, QF_XC_ROWS);
    size_t head = (sizeof(qf_xc_job) + 255) & ~(size_t)255;
    if (rc == QF_OK && !(d->job = d->be->ops->pin_alloc(d->be, head + 2 * (size_t)QF_XC_ROWS * H * sizeof(float))))
        rc = qf_fail(QF_ENOMEM, "out of pinned host memory for the host experts' job");
    if (rc == QF_OK && !(d->zero = qf_be_alloc(d->be, d->slot_bytes))) rc = qf_fail(QF_ENOMEM, "out of device memory for the zero expert");
    for (int L = 0; L < d->n_layers && rc == QF_OK; L++)
        if (!(d->layers[L].x.host_words = qf_be_alloc(d->be, QF_XC_HOST_WORDS * sizeof(int32_t)))) rc = qf_fail(QF_ENOMEM, "out of device memory");
    if (rc != QF_OK) return rc; /* what was made is freed with the store; job stays NULL: hybrid off */
    d->job->xn = (float *)((char *)d->job + head), d->job->y = d->job->xn + (size_t)QF_XC_ROWS * H;
    for (int L = 0; L < d->n_layers; L++) {
        qf_xcache *x = &d->layers[L].x;
        x->job = d->job, x->zero = d->zero, x->host_run = dc_host_run, x->host_ctx = d, x->layer = L;
    }
    qf_es_devcache_host_share(s, share, 0.0f);
    return qf_be_sync(d->be);
}

void qf_es_devcache_fail_host(qf_expert_store *s, int calls) {
    if (s->ops == &k_dc_ops) ((devcache_store *)s)->host_fail_in = calls;
}

void qf_es_devcache_host_share(qf_expert_store *s, float share, float fixed) {
    devcache_store *d = (devcache_store *)s;
    share = share < 0.0f ? 0.0f : share > 1.0f ? 1.0f : share;
    fixed = fixed > 0.0f ? fixed : 0.0f;
    for (int L = 0; s->ops == &k_dc_ops && d->job && L < d->n_layers; L++) d->layers[L].x.host_share = share, d->layers[L].x.host_fixed = fixed;
}

/* Layer L's experts e0, e0 + stride, ... (k of them) read over the link the way a step reads them
 * (read_pinned; else a copy) into the zero expert. */
static void read_experts(devcache_store *d, int L, int e0, int stride, int k) {
    for (int i = 0; i < k; i++) {
        const qf_expert *x = &d->layers[L].views[(e0 + i * stride) % d->n_experts];
        const qf_mat *m[3] = {&x->gate, &x->up, &x->down};
        for (int j = 0; j < 3; j++) {
            void *dst = (char *)d->zero + d->layers[L].x.off[j];
            if (d->be->ops->read_pinned && !((uintptr_t)m[j]->data & 15)) d->be->ops->read_pinned(d->be, dst, m[j]->data, mat_bytes(m[j]));
            else qf_be_upload(d->be, dst, m[j]->data, mat_bytes(m[j]));
        }
    }
}

/* Best of 3 rounds, each on experts no round read before (a step's misses come from memory, not
 * the caches): one expert on one row on the host, then top_k others (the difference is the
 * experts' cost, the rest a call's), then top_k more read over the link into the zero expert,
 * zeroed again after. */
int qf_es_devcache_measure(qf_expert_store *s, double *host_ms, double *host_fixed_ms, double *link_ms) {
    devcache_store *d = (devcache_store *)s;
    if (s->ops != &k_dc_ops || !d->job) return qf_fail(QF_EINVAL, "not a device expert cache with a host share");
    int K = d->top_k, E = d->n_experts, H = (int)d->layers[0].views[0].gate.cols, rc = QF_OK, stride = E / (2 * K + 1) > 0 ? E / (2 * K + 1) : 1;
    qf_xc_job *j = d->job;
    for (int i = 0; i < H; i++) j->xn[i] = 0.01f * (float)(i % 17);
    j->n = 1, j->top_k = K, j->n_host = 0; /* counts no computed misses */
    double one = 1e30, all = 1e30;
    *link_ms = 1e30;
    for (int r = 0; r < 3 && rc == QF_OK; r++) {
        int L = (r * (d->n_layers / 3 + 1)) % d->n_layers; /* a layer a round; in it, 2K + 1 experts spread over E */
        for (int k = 0; k < K; k++) j->ids[k] = k ? -1 : (int)((size_t)2 * K * stride % (size_t)E), j->w[k] = 1.0f / (float)K;
        double t0 = qf_now();
        rc = dc_host_run(d, L, j);
        for (int k = 0; k < K; k++) j->ids[k] = (k * stride) % E;
        double t1 = qf_now();
        if (rc == QF_OK) rc = dc_host_run(d, L, j);
        double t2 = qf_now();
        if (rc == QF_OK) read_experts(d, L, K * stride, stride, K);
        if (rc == QF_OK) rc = qf_be_sync(d->be);
        double t3 = qf_now();
        one = fmin(one, 1e3 * (t1 - t0)), all = fmin(all, 1e3 * (t2 - t1)), *link_ms = fmin(*link_ms, 1e3 * (t3 - t2) / K);
    }
    *host_ms = K > 1 && all > one ? (all - one) / (K - 1) : all / K;
    *host_fixed_ms = fmax(0.0, one - *host_ms);
    qf_be_zero(d->be, d->zero, d->slot_bytes);
    return rc == QF_OK ? qf_be_sync(d->be) : rc;
}
