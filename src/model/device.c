/* Moving a bound model to a device backend: each checkpoint tensor a dense weight view points into
 * is copied once, straight from the map, and the views are re-pointed at the copy. The small fp32
 * vectors made at bind time are copied one by one. The routed experts are the expert store's:
 * a device-resident store takes them (src/experts/store_device.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/dtype.h"
#include "model/model_int.h"

typedef struct mover {
    qf_model *m;   /* whose layers move (the model, or its MTP head's view) */
    qf_model *own; /* whose dev_bufs keep the copies (the model) */
    qf_backend *be;
    const qf_st_tensor **by_addr; /* tensors sorted by data address */
    void **dev;                   /* device copy of by_addr[i], made on first use */
    int n, rc;
} mover;

static int cmp_addr(const void *a, const void *b) {
    const char *x = (*(const qf_st_tensor *const *)a)->data, *y = (*(const qf_st_tensor *const *)b)->data;
    return (x > y) - (x < y);
}

static int keep(mover *mv, void *p) { return qf_model_keep_dev(mv->own, p) == QF_OK; }

static void *copy_up(mover *mv, const void *src, size_t bytes) {
    void *d = qf_be_alloc(mv->be, bytes);
    if (!d || !keep(mv, d)) {
        qf_be_free(mv->be, d);
        mv->rc = qf_fail(QF_ENOMEM, "out of device memory copying %zu bytes of weights", bytes);
        return NULL;
    }
    qf_be_upload(mv->be, d, src, bytes);
    return d;
}

/* A weight with block scales (FP8) gets one device allocation: its bytes, then its scales at
 * qf_mat_scale_off, where the kernels look for them (the expert stores' packed copy). */
static void move_packed(mover *mv, qf_mat *w) {
    void *d = qf_be_alloc(mv->be, qf_mat_packed_bytes(w));
    if (!d || !keep(mv, d)) {
        qf_be_free(mv->be, d);
        mv->rc = qf_fail(QF_ENOMEM, "out of device memory copying %zu bytes of weights", qf_mat_packed_bytes(w));
        return;
    }
    *w = qf_es_put_mat(mv->be, d, w);
}

static void move_mat(mover *mv, qf_mat *w) {
    if (!w->data || mv->rc != QF_OK) return;
    const char *p = w->data;
    int lo = 0, hi = mv->n - 1, at = -1;
    while (lo <= hi) { /* the last tensor starting at or before p */
        int mid = (lo + hi) / 2;
        if ((const char *)mv->by_addr[mid]->data <= p) at = mid, lo = mid + 1;
        else hi = mid - 1;
    }
    if (w->scales) return move_packed(mv, w);
    size_t bytes = qf_mat_bytes(w);
    const qf_st_tensor *t = at >= 0 ? mv->by_addr[at] : NULL;
    if (t && p + bytes <= (const char *)t->data + t->nbytes) {
        if (!mv->dev[at]) mv->dev[at] = copy_up(mv, t->data, t->nbytes);
        if (mv->dev[at]) w->data = (char *)mv->dev[at] + (p - (const char *)t->data);
    } else { /* a copy made at bind time (misaligned in the file) */
        void *d = copy_up(mv, w->data, bytes);
        if (d) w->data = d;
    }
}

static void move_vec(mover *mv, float **v, size_t n) {
    if (!*v || mv->rc != QF_OK) return;
    float *d = copy_up(mv, *v, n * sizeof(float));
    if (d) *v = d;
}

/* Copies parts (same dtype and columns) into one device matrix, one after another, and points
 * each part's view into it. Returns the whole, or a zero matrix when the parts do not fit. */
static qf_mat fuse(mover *mv, qf_mat **parts, int n) {
    qf_mat all = {0};
    if (mv->rc != QF_OK || !parts[0]->data) return all;
    int64_t rows = 0;
    for (int i = 0; i < n; i++) {
        if (!parts[i]->data || parts[i]->dtype != parts[0]->dtype || parts[i]->cols != parts[0]->cols || parts[i]->scales) return all;
        rows += parts[i]->rows;
    }
    size_t row_bytes = qf_mat_bytes(parts[0]) / (size_t)parts[0]->rows;
    char *host = malloc((size_t)rows * row_bytes);
    if (!host) return all;
    size_t at = 0;
    for (int i = 0; i < n; i++) memcpy(host + at, parts[i]->data, (size_t)parts[i]->rows * row_bytes), at += (size_t)parts[i]->rows * row_bytes;
    char *dev = copy_up(mv, host, (size_t)rows * row_bytes);
    free(host);
    if (!dev) return all;
    all = (qf_mat){parts[0]->dtype, dev, rows, parts[0]->cols, NULL};
    at = 0;
    for (int i = 0; i < n; i++) parts[i]->data = dev + at, at += (size_t)parts[i]->rows * row_bytes;
    return all;
}

static void move_layer(mover *mv, int L) {
    qf_model *m = mv->m;
    const qf_config *c = &m->cfg;
    qf_layer_w *w = &m->layers[L];
    qf_mat *lin[] = {&w->w_qkv, &w->w_z, &w->w_b, &w->w_a}, *att[] = {&w->wq, &w->wk, &w->wv};
    qf_mat *ffn[] = {&w->router, &w->sh_gate, &w->sh_up, &w->sh_gate_w};
    if (w->kind == QF_LAYER_FULL) w->in_proj = fuse(mv, att, 3);
    else w->in_proj = fuse(mv, lin, 4);
    if (c->shared_ffn > 0) w->ffn_in = fuse(mv, ffn, 4);
    /* what fuse placed is already on the device */
    qf_mat *mats[] = {w->in_proj.data ? NULL : &w->wq, w->in_proj.data ? NULL : &w->wk, w->in_proj.data ? NULL : &w->wv, &w->wo,
                      w->in_proj.data ? NULL : &w->w_qkv, w->in_proj.data ? NULL : &w->w_z, w->in_proj.data ? NULL : &w->w_b,
                      w->in_proj.data ? NULL : &w->w_a, &w->w_out, w->ffn_in.data ? NULL : &w->router,
                      w->ffn_in.data ? NULL : &w->sh_gate, w->ffn_in.data ? NULL : &w->sh_up, &w->sh_down,
                      w->ffn_in.data ? NULL : &w->sh_gate_w, &w->gate, &w->up, &w->down};
    for (size_t i = 0; i < sizeof mats / sizeof *mats; i++)
        if (mats[i]) move_mat(mv, mats[i]);
    move_vec(mv, &w->attn_norm, (size_t)c->hidden);
    move_vec(mv, &w->ffn_norm, (size_t)c->hidden);
    move_vec(mv, &w->q_norm, (size_t)c->head_dim);
    move_vec(mv, &w->k_norm, (size_t)c->head_dim);
    move_vec(mv, &w->conv_w, (size_t)qf_cfg_conv_dim(c) * (size_t)c->conv_kernel);
    move_vec(mv, &w->dt_bias, (size_t)c->lin_v_heads);
    move_vec(mv, &w->neg_A, (size_t)c->lin_v_heads);
    move_vec(mv, &w->gnorm, (size_t)c->lin_v_dim);
}

/* The routed experts go to a device-resident store (the resident one it replaces held views into
 * the checkpoint). */
static int move_experts(qf_model *m, qf_backend *be) {
    if (!m->experts) return QF_OK;
    qf_expert_store *d;
    int rc = qf_es_device_create(&d, m->experts, be, m->cfg.n_layers, m->cfg.n_experts, m->cfg.n_experts_used);
    if (rc != QF_OK) return rc;
    qf_es_destroy(m->experts);
    m->experts = d;
    return QF_OK;
}

static int bf16_rows(const qf_mat *w) {
    return w->data && w->dtype == QF_DT_BF16 && w->cols % 8 == 0 && (uintptr_t)w->data % 16 == 0;
}

/* What the fused decode products take: bf16 rows, or int8 rows of whole 16-byte units (blocks of
 * 32 weights: 256 columns make 17 units of quants and scales). */
static int dec_rows(const qf_mat *w) {
    return bf16_rows(w) || (w->data && w->dtype == QF_DT_Q8_B32 && w->cols % 256 == 0 && (uintptr_t)w->data % 16 == 0);
}

/* Whether the fused decode ops (ops.h qf_dec_ops) can run this model: a MoE with a shared expert,
 * every trunk product's parts fused in rows dec_rows takes (one format a fused matrix; lm_head
 * too: the MTP head's drafts may read an int8 copy), the shared expert's down rows bf16, experts
 * qf_moe_dec_fits takes, and shapes the kernels hold. */
static int dec_fits(const qf_model *m) {
    const qf_config *c = &m->cfg;
    if (c->arch != QF_ARCH_QWEN35_MOE || c->shared_ffn <= 0 || !m->experts || c->hidden % 8 || c->expert_ffn % 8 || c->shared_ffn % 8 ||
        c->head_dim > 256 || c->lin_k_dim > 128 || c->n_experts_used > 64 || c->n_experts > 512 || c->n_heads % c->n_kv_heads || !dec_rows(&m->lm_head))
        return 0;
    for (int L = 0; L < c->n_layers; L++) {
        const qf_layer_w *w = &m->layers[L];
        qf_expert_table t;
        if (m->experts->ops->table(m->experts, L, &t) != QF_OK) return 0;
        const qf_expert *x = &t.experts[0];
        if (!dec_rows(&w->in_proj) || !dec_rows(&w->ffn_in) || !dec_rows(w->kind == QF_LAYER_FULL ? &w->wo : &w->w_out) ||
            !bf16_rows(&w->sh_down) || x->up.dtype != x->gate.dtype || x->down.dtype != x->gate.dtype ||
            !qf_moe_dec_fits(x->gate.dtype, c->hidden, c->expert_ffn, c->shared_ffn) || (uintptr_t)x->gate.data % 16 || (uintptr_t)x->down.data % 16)
            return 0;
    }
    return 1;
}

/* The MTP head's view as the model: its layer, final norm and expert store, and the model's fc and
 * norms of its inputs; it shares the model's (moved) embeddings, lm_head and RoPE. */
static void move_mtp(mover *mv) {
    qf_model *m = mv->own, *v = m->mtp;
    if (!v) return;
    size_t H = (size_t)m->cfg.hidden;
    v->embed = m->embed, v->lm_head = m->lm_head, v->inv_freq = m->inv_freq;
    move_mat(mv, &m->mtp_fc);
    move_vec(mv, &m->mtp_norm_e, H);
    move_vec(mv, &m->mtp_norm_h, H);
    move_vec(mv, &v->final_norm, H);
    mv->m = v;
    move_layer(mv, 0);
    mv->m = m;
    if (mv->rc == QF_OK) mv->rc = move_experts(v, mv->be);
    if (mv->rc == QF_OK) v->dev = mv->be, v->dec_ok = dec_fits(v); /* its one-pair drafts take the fused decode ops too */
}

int qf_model_to_device(qf_model *m, qf_backend *be, int flags) {
    int drop_host = flags & QF_TO_DEVICE_DROP_HOST, experts_home = flags & QF_TO_DEVICE_EXPERTS_HOME;
    /* host memory already is the backend's, unless its fused decode ops want the fused matrices */
    if (!be->ops->alloc && !be->ops->dec) return QF_OK;
    mover mv = {m, m, be, malloc((size_t)(m->st.n_tensors + 1) * sizeof(void *)), calloc((size_t)m->st.n_tensors + 1, sizeof(void *)),
                m->st.n_tensors, QF_OK};
    if (!mv.by_addr || !mv.dev) mv.rc = qf_fail(QF_ENOMEM, "out of memory");
    for (int i = 0; mv.rc == QF_OK && i < m->st.n_tensors; i++) mv.by_addr[i] = &m->st.tensors[i];
    if (mv.rc == QF_OK) qsort(mv.by_addr, (size_t)mv.n, sizeof *mv.by_addr, cmp_addr);
    m->dev = be; /* set first: the device buffers are freed through it even if this fails */
    int tied = m->lm_head.data == m->embed.data;
    move_mat(&mv, &m->embed);
    if (tied) m->lm_head = m->embed;
    else move_mat(&mv, &m->lm_head);
    move_vec(&mv, &m->final_norm, (size_t)m->cfg.hidden);
    move_vec(&mv, &m->inv_freq, (size_t)(m->cfg.rot_dim / 2));
    for (int L = 0; L < m->cfg.n_layers && mv.rc == QF_OK; L++) move_layer(&mv, L);
    if (mv.rc == QF_OK && !experts_home) mv.rc = move_experts(m, be);
    if (mv.rc == QF_OK && !experts_home) move_mtp(&mv); /* streamed experts: the head stays on the host (--draft says so) */
    if (mv.rc == QF_OK) mv.rc = qf_be_sync(be); /* a copy that failed on the device fails the load */
    for (int i = 0; drop_host && !experts_home && mv.rc == QF_OK && i < m->st.n_tensors; i++) {
        qf_st_tensor *t = &m->st.tensors[i];
        if (t->owned) free(t->owned), t->owned = NULL, t->data = NULL;
    }
    free(mv.by_addr);
    free(mv.dev);
    m->dec_ok = mv.rc == QF_OK && !experts_home && dec_fits(m);
    return mv.rc;
}

void qf_model_set_prefetch(qf_model *m, int n) { m->prefetch_n = n > 0 ? n : 0; }

void qf_model_use_experts(qf_model *m, qf_expert_store *s) {
    m->experts = s;
    qf_model_dec_check(m);
}

int qf_model_dec_check(qf_model *m) {
    m->dec_ok = m->dev && dec_fits(m);
    return m->dec_ok;
}
