/* Paged KV cache pool and per-sequence state. Pages are handed out from a free stack so that
 * allocation is O(1) and nothing is allocated while tokens run. */
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

struct qf_kv_pool {
    qf_backend *dev;
    int page_tokens, n_pages, n_free;
    size_t page_floats;
    float *mem;
    int32_t *free_stack;
    int32_t *refs; /* holders of each page: sequences and prefix snapshots */
};

static size_t page_floats(const qf_config *c, int page_tokens) {
    int n_full = 0;
    for (int L = 0; L < c->n_layers; L++) n_full += c->layer_kind[L] == QF_LAYER_FULL;
    /* per full layer: keys and values, then the keys' summary (min and max per channel) */
    return (size_t)n_full * 2 * ((size_t)page_tokens + 1) * (size_t)c->n_kv_heads * (size_t)c->head_dim;
}

size_t qf_kv_pool_page_bytes(const qf_model *m, int page_tokens) { return page_floats(&m->cfg, page_tokens) * sizeof(float); }

qf_kv_pool *qf_kv_pool_create(const qf_model *m, int page_tokens, int n_pages) {
    if (page_tokens < 1 || n_pages < 1) return NULL;
    qf_kv_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->page_tokens = page_tokens;
    p->n_pages = p->n_free = n_pages;
    p->page_floats = page_floats(&m->cfg, page_tokens);
    p->dev = m->dev;
    p->mem = qf_be_alloc(p->dev, (size_t)n_pages * (p->page_floats ? p->page_floats : 1) * sizeof(float));
    p->free_stack = malloc((size_t)n_pages * sizeof *p->free_stack);
    p->refs = calloc((size_t)n_pages, sizeof *p->refs);
    if (!p->mem || !p->free_stack || !p->refs) {
        qf_kv_pool_free(p);
        return NULL;
    }
    for (int i = 0; i < n_pages; i++) p->free_stack[i] = n_pages - 1 - i; /* page 0 handed out first */
    return p;
}

void qf_kv_pool_free(qf_kv_pool *p) {
    if (!p) return;
    qf_be_free(p->dev, p->mem);
    free(p->free_stack);
    free(p->refs);
    free(p);
}

int qf_kv_pool_pages(const qf_kv_pool *p) { return p->n_pages; }
int qf_kv_pool_free_pages(const qf_kv_pool *p) { return p->n_free; }
int qf_kv_pool_page_tokens(const qf_kv_pool *p) { return p->page_tokens; }

static int32_t page_take(qf_kv_pool *p) {
    int32_t pg = p->free_stack[--p->n_free];
    p->refs[pg] = 1;
    return pg;
}

void qf_kv_pool_ref(qf_kv_pool *p, int32_t page) { p->refs[page]++; }

void qf_kv_pool_unref(qf_kv_pool *p, int32_t page) {
    if (--p->refs[page] == 0) p->free_stack[p->n_free++] = page;
}

/* ---- per-sequence state ---- */

/* Floats of one linear-attention layer's conv window and recurrent state. */
static void linear_state_floats(const qf_config *c, size_t *conv, size_t *ssm) {
    *conv = (size_t)(c->conv_kernel - 1) * (size_t)qf_cfg_conv_dim(c);
    *ssm = (size_t)c->lin_v_heads * (size_t)c->lin_k_dim * (size_t)c->lin_v_dim;
}

size_t qf_state_bytes(const qf_model *m) {
    const qf_config *c = &m->cfg;
    size_t conv, ssm, total = 0;
    linear_state_floats(c, &conv, &ssm);
    for (int L = 0; L < c->n_layers; L++) total += c->layer_kind[L] == QF_LAYER_FULL ? 0 : conv + ssm;
    return total * sizeof(float);
}

static int div_up(int a, int b) { return (a + b - 1) / b; }

qf_state *qf_state_create_paged(const qf_model *m, qf_kv_pool *kv, int max_ctx) {
    const qf_config *c = &m->cfg;
    if (max_ctx < 1 || !kv) return NULL;
    size_t conv, ssm, total = qf_state_bytes(m) / sizeof(float);
    linear_state_floats(c, &conv, &ssm);
    qf_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->conv = calloc((size_t)c->n_layers * 2, sizeof(float *));
    s->kv_off = calloc((size_t)c->n_layers, sizeof *s->kv_off);
    size_t max_pages = (size_t)div_up(max_ctx, kv->page_tokens);
    s->dev = m->dev;
    s->pages = calloc(max_pages, sizeof *s->pages);
    s->sel = calloc(max_pages, sizeof *s->sel);
    s->score = calloc(max_pages, sizeof *s->score);
    if (m->dev) s->pages_dev = qf_be_alloc(m->dev, max_pages * sizeof *s->pages), s->sel_dev = qf_be_alloc(m->dev, max_pages * sizeof *s->pages);
    s->block = qf_be_alloc(m->dev, (total ? total : 1) * sizeof(float));
    if (!s->conv || !s->kv_off || !s->pages || !s->sel || !s->score || !s->block || (m->dev && (!s->pages_dev || !s->sel_dev))) {
        qf_state_free(s);
        return NULL;
    }
    s->ssm = s->conv + c->n_layers;
    float *p = s->block;
    size_t off = 0, layer_kv = (size_t)kv->page_tokens * (size_t)c->n_kv_heads * (size_t)c->head_dim;
    for (int L = 0; L < c->n_layers; L++) {
        if (c->layer_kind[L] == QF_LAYER_FULL) {
            s->kv_off[L] = off; /* keys, then values at off + kv_layer_floats, then the keys' summary */
            off += 2 * layer_kv + 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim;
        } else {
            s->conv[L] = p;
            s->ssm[L] = p + conv;
            p += conv + ssm;
        }
    }
    s->kv = kv;
    s->kv_layer_floats = layer_kv;
    s->max_ctx = max_ctx;
    s->block_floats = total;
    return s;
}

qf_state *qf_state_create(const qf_model *m, int max_ctx) {
    if (max_ctx < 1) return NULL;
    enum { PAGE = 64 };
    qf_kv_pool *kv = qf_kv_pool_create(m, PAGE, div_up(max_ctx, PAGE));
    qf_state *s = qf_state_create_paged(m, kv, max_ctx);
    if (!s) {
        qf_kv_pool_free(kv);
        return NULL;
    }
    s->owns_kv = 1;
    return s;
}

int qf_state_pages_needed(const qf_state *s, int n) {
    int want = div_up(s->pos + n, s->kv->page_tokens);
    return want > s->n_pages ? want - s->n_pages : 0;
}

int qf_state_reserve(qf_state *s, int n) {
    if (s->pos + n > s->max_ctx)
        return qf_fail(QF_EINVAL, "context full: %d cached + %d new tokens > context size %d", s->pos, n, s->max_ctx);
    int need = qf_state_pages_needed(s, n);
    if (need > s->kv->n_free) return qf_fail(QF_ENOMEM, "KV cache full: %d pages needed, %d free", need, s->kv->n_free);
    int first = s->n_pages;
    while (need-- > 0) s->pages[s->n_pages++] = page_take(s->kv);
    if (s->pages_dev && s->n_pages > first)
        qf_be_upload(s->dev, s->pages_dev + first, s->pages + first, (size_t)(s->n_pages - first) * sizeof *s->pages);
    return QF_OK;
}

/* The DeltaNet states' block (one float at least: a model without linear layers still has one). */
static size_t block_bytes(const qf_state *s) { return (s->block_floats ? s->block_floats : 1) * sizeof(float); }

static void release_pages(qf_state *s) {
    while (s->n_pages > 0) qf_kv_pool_unref(s->kv, s->pages[--s->n_pages]);
}

int qf_state_adopt(qf_state *s, const qf_state_snap *snap) {
    int pt = s->kv->page_tokens, full = snap->pos / pt, part = snap->pos % pt != 0;
    if (s->pos || s->n_pages) return qf_fail(QF_EINVAL, "adopt: the state is not empty");
    if (snap->pos > s->max_ctx) return qf_fail(QF_EINVAL, "adopt: %d tokens exceed the context of %d", snap->pos, s->max_ctx);
    if (part && s->kv->n_free < 1) return qf_fail(QF_ENOMEM, "KV cache full: no page to copy a partial page into");
    for (int i = 0; i < full; i++) qf_kv_pool_ref(s->kv, s->pages[i] = snap->pages[i]);
    s->n_pages = full;
    if (part) { /* the last page is written on from here: this sequence's own copy */
        int32_t pg = page_take(s->kv);
        qf_be_copy(s->dev, s->kv->mem + (size_t)pg * s->kv->page_floats, s->kv->mem + (size_t)snap->pages[full] * s->kv->page_floats,
                   s->kv->page_floats * sizeof(float));
        s->pages[s->n_pages++] = pg;
    }
    if (s->pages_dev) qf_be_upload(s->dev, s->pages_dev, s->pages, (size_t)s->n_pages * sizeof *s->pages);
    if (snap->host) qf_be_upload(s->dev, s->block, snap->block, block_bytes(s));
    else qf_be_copy(s->dev, s->block, snap->block, block_bytes(s));
    s->pos = snap->pos;
    s->kv_summarized = snap->kv_summarized < full ? snap->kv_summarized : full;
    return QF_OK;
}

size_t qf_state_block_bytes(const qf_model *m) {
    size_t n = qf_state_bytes(m);
    return n ? n : sizeof(float);
}

int qf_state_snap_take(const qf_state *s, qf_state_snap *snap, float *block, int host) {
    memset(snap, 0, sizeof *snap);
    int n = (s->pos + s->kv->page_tokens - 1) / s->kv->page_tokens;
    snap->pages = malloc(((size_t)n + 1) * sizeof *snap->pages);
    snap->block = block ? block : qf_be_alloc(s->dev, block_bytes(s));
    snap->owns_block = !block, snap->host = block && host;
    if (!snap->pages || !snap->block) {
        free(snap->pages);
        if (snap->owns_block) qf_be_free(s->dev, snap->block);
        memset(snap, 0, sizeof *snap);
        return qf_fail(QF_ENOMEM, "out of memory for a prefix snapshot");
    }
    for (int i = 0; i < n; i++) qf_kv_pool_ref(s->kv, snap->pages[i] = s->pages[i]);
    if (snap->host) qf_be_download(s->dev, snap->block, s->block, block_bytes(s));
    else qf_be_copy(s->dev, snap->block, s->block, block_bytes(s));
    snap->n_pages = n;
    snap->pos = s->pos;
    snap->kv_summarized = s->kv_summarized;
    snap->kv = s->kv;
    snap->dev = s->dev;
    return QF_OK;
}

void qf_state_snap_drop(qf_state_snap *snap) {
    for (int i = 0; i < snap->n_pages; i++) qf_kv_pool_unref(snap->kv, snap->pages[i]);
    free(snap->pages);
    if (snap->owns_block) qf_be_free(snap->dev, snap->block);
    memset(snap, 0, sizeof *snap);
}

void qf_state_reset(qf_state *s) {
    /* KV entries past pos are never read, but DeltaNet state must restart from zero */
    qf_be_zero(s->dev, s->block, block_bytes(s));
    release_pages(s);
    s->pos = 0;
    s->kv_summarized = 0;
}

void qf_state_free(qf_state *s) {
    if (!s) return;
    if (s->kv) release_pages(s);
    if (s->owns_kv) qf_kv_pool_free(s->kv);
    free(s->conv);
    free(s->kv_off);
    free(s->pages);
    free(s->sel);
    free(s->score);
    qf_be_free(s->dev, s->pages_dev);
    qf_be_free(s->dev, s->sel_dev);
    qf_be_free(s->dev, s->block);
    free(s);
}

qf_kv_view qf_state_kv_view(const qf_state *s, int L) {
    const qf_kv_pool *p = s->kv;
    qf_kv_view v = {p->mem, s->pages_dev ? s->pages_dev : s->pages, p->page_tokens, p->page_floats, s->kv_off[L], s->kv_off[L] + s->kv_layer_floats,
                    s->kv_off[L] + 2 * s->kv_layer_floats};
    return v;
}
