/* Speculative decoding with the model's MTP head (docs/model-spec.md §8.3), greedy.
 *
 * A step: the token x the model picked is emitted; the head drafts d1..dN from the pair (x, h) (h:
 * the model's hidden state where x was picked) and then from its own outputs; the model runs
 * [x, d1..dN] in one forward, and its picks g0..gN accept the drafts while g(i) = d(i+1). The
 * accepted drafts are emitted, g(k) becomes the next x. The DeltaNet states cannot be cut back,
 * so a copy of them is taken before the forward and, when a draft is refused (or a stop comes
 * among the accepted), they go back to it, the position too (attention reads no key past it), and
 * the rows that stand run again: every state and every pick is then the one the plain loop makes
 * (CPU products give a row the same bits alone or in a batch). The head keeps its pairs of true
 * values only: its drafts' entries are cut off (qf_mtp_truncate) and the accepted rows' pairs fed
 * instead. */
#include "runtime/spec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/timer.h"
#include "runtime/engine_int.h"

struct qf_spec_seq {
    qf_backend *be;   /* the engine's: where the states' copies live */
    int max_draft, rows;
    size_t H;
    qf_mtp_run *mtp;
    float *hb;        /* (rows + 1, H): the hidden state of the row before a forward, then its rows' */
    float *hm;        /* (max_draft + 1, H): the head's outputs of a draft chain */
    int32_t *pk;      /* (rows): the model's picks of a forward's rows */
    float *saved;     /* a copy of a state's DeltaNet block (saved_floats), the backend's memory */
    size_t saved_floats;
};

/* The engine's own loop: one sequence. */
typedef struct qf_spec {
    int draft, max_draft; /* drafts a step; what the buffers hold */
    int off;              /* the head's context is full: the request goes on without drafts */
    qf_spec_seq *q;
} qf_spec;

/* ---- one sequence ---- */

qf_spec_seq *qf_spec_seq_create(const qf_engine *e, int max_draft, int rows, int max_ctx) {
    const qf_model *m = e->model;
    if (!m->mtp) {
        qf_fail(QF_EINVAL, "--draft needs a model with an MTP head (mtp_num_hidden_layers and mtp.* tensors)");
        return NULL;
    }
    if (m->dev && !m->mtp->dev) {
        qf_fail(QF_EUNSUPPORTED, "--draft on a GPU needs the experts resident there (not streamed: no --gpu-mem or --expert-cache)");
        return NULL;
    }
    qf_spec_seq *q = calloc(1, sizeof *q);
    if (!q) {
        qf_fail(QF_ENOMEM, "out of memory");
        return NULL;
    }
    q->be = (qf_backend *)&e->be, q->max_draft = max_draft, q->rows = rows, q->H = (size_t)m->cfg.hidden;
    q->mtp = qf_mtp_run_create(m, rows, max_ctx);
    q->hb = calloc(((size_t)rows + 1) * q->H, sizeof(float)), q->hm = malloc((size_t)(max_draft + 1) * q->H * sizeof(float));
    q->pk = malloc((size_t)rows * sizeof(int32_t));
    if (!q->mtp || !q->hb || !q->hm || !q->pk || rows < max_draft + 1) {
        qf_spec_seq_free(q);
        qf_fail(QF_ENOMEM, "out of memory for speculative decoding (or forwards of under %d rows)", max_draft + 1);
        return NULL;
    }
    return q;
}

void qf_spec_seq_free(qf_spec_seq *q) {
    if (!q) return;
    qf_mtp_run_free(q->mtp);
    free(q->hb), free(q->hm), free(q->pk);
    qf_be_free(q->be, q->saved);
    free(q);
}

void qf_spec_seq_reset(qf_spec_seq *q) { qf_mtp_run_reset(q->mtp); }
float *qf_spec_seq_hidden(qf_spec_seq *q) { return q->hb + q->H; }

int qf_spec_seq_room(const qf_spec_seq *q) { return qf_mtp_state(q->mtp)->max_ctx - qf_mtp_pos(q->mtp) - 2; }

/* The pairs (tok[i], hb[i]), i < n, to the head (hb[0]: the row before tok[0]); then the last row
 * of the forward moves to hb[0] for the next one. */
static int feed(qf_engine *e, qf_spec_seq *q, const int32_t *tok, const float *h, int n, int last_row) {
    int rc = n > 0 ? qf_mtp_step(e->model, &e->be, q->mtp, tok, h, n, QF_LOGITS_NONE, NULL, NULL, NULL) : QF_OK;
    if (rc == QF_OK) memmove(q->hb, q->hb + (size_t)(last_row + 1) * q->H, q->H * sizeof(float));
    return rc;
}

int qf_spec_seq_fed(qf_engine *e, qf_spec_seq *q, const int32_t *tok, int n, int first) {
    if (qf_spec_seq_room(q) <= n) return QF_OK; /* full: no more pairs, no drafts */
    if (first) return feed(e, q, tok + 1, q->hb + q->H, n - 1, n - 1);
    return feed(e, q, tok, q->hb, n, n - 1);
}

/* d[1..n] chained from the pair (d[0], hb[0]). */
static int draft_chain(qf_engine *e, qf_spec_seq *q, int32_t *d, int n) {
    int rc = QF_OK;
    const float *hin = q->hb;
    for (int i = 1; i <= n && rc == QF_OK; i++) {
        /* the pick where the logits are (on a GPU only the id comes back) */
        rc = qf_mtp_step(e->model, &e->be, q->mtp, &d[i - 1], hin, 1, QF_LOGITS_TOP1, NULL, &d[i], q->hm + (size_t)i * q->H);
        hin = q->hm + (size_t)i * q->H;
    }
    return rc;
}

/* n rows of the model in one forward: their hidden states after hb[0], their picks into pk. */
static int run_rows(qf_engine *e, qf_spec_seq *q, qf_state *st, const int32_t *tok, int n) {
    qf_seq_step s = {st, tok, n, QF_LOGITS_PICKS, NULL, q->pk, 0, 0, NULL, q->hb + q->H, NULL};
    return qf_forward(e->model, &e->be, e->ws, &s, 1);
}

int qf_spec_seq_draft(qf_engine *e, qf_spec_seq *q, qf_state *st, int32_t *d, int n) {
    int mp = qf_mtp_pos(q->mtp);
    int rc = n ? draft_chain(e, q, d, n) : qf_mtp_step(e->model, &e->be, q->mtp, d, q->hb, 1, QF_LOGITS_NONE, NULL, NULL, NULL);
    qf_mtp_truncate(q->mtp, mp + 1); /* the pair (d[0], hb[0]) stays; the chain's go */
    if (rc != QF_OK) return rc;
    if (q->saved_floats < st->block_floats) { /* once a state size, not a token */
        qf_be_free(q->be, q->saved);
        q->saved_floats = (q->saved = qf_be_alloc(q->be, st->block_floats * sizeof(float))) ? st->block_floats : 0;
        if (!q->saved) return qf_fail(QF_ENOMEM, "out of memory for a state copy");
    }
    qf_be_copy(q->be, q->saved, st->block, st->block_floats * sizeof(float));
    return QF_OK;
}

int32_t *qf_spec_seq_picks(qf_spec_seq *q) { return q->pk; }

int qf_spec_seq_accepted(const qf_spec_seq *q, const int32_t *d, int n) {
    int k = 0;
    while (k < n && d[k + 1] == q->pk[k]) k++;
    return k;
}

void qf_spec_seq_restore(qf_spec_seq *q, qf_state *st, int p0) {
    qf_be_copy(q->be, st->block, q->saved, st->block_floats * sizeof(float));
    st->pos = p0;
    int full = p0 / qf_kv_pool_page_tokens(st->kv);
    if (st->kv_summarized > full) st->kv_summarized = full;
}

/* After keep rows stand: the head gets the pairs of the accepted drafts, hb[0] the last row. */
static int after_keep(qf_engine *e, qf_spec_seq *q, const int32_t *d, int keep) {
    return feed(e, q, d + 1, q->hb + q->H, keep - 1, keep - 1);
}

int qf_spec_seq_kept(qf_engine *e, qf_spec_seq *q, const int32_t *d, int keep, int32_t *out) {
    int rc = after_keep(e, q, d, keep);
    if (rc != QF_OK) return rc;
    for (int i = 0; i + 1 < keep; i++) out[i] = d[i + 1];
    out[keep - 1] = q->pk[keep - 1];
    return QF_OK;
}

/* The head drafts d[1..n] from d[0], a copy of the DeltaNet states is taken, the model runs d[0..n]. */
static int draft_and_run(qf_engine *e, qf_spec_seq *q, qf_state *st, int32_t *d, int n) {
    int rc = qf_spec_seq_draft(e, q, st, d, n);
    return rc == QF_OK ? run_rows(e, q, st, d, n + 1) : rc;
}

/* Only keep of the forward's rows stand: the state back to its copy, and they run again. */
static int keep_rows(qf_engine *e, qf_spec_seq *q, qf_state *st, const int32_t *d, int p0, int keep) {
    qf_spec_seq_restore(q, st, p0);
    return run_rows(e, q, st, d, keep);
}

/* ---- the engine's loop ---- */

int qf_spec_open(qf_engine *e, int draft) {
    if (draft > QF_SPEC_MAX_DRAFT) return qf_fail(QF_EINVAL, "--draft %d: at most %d", draft, QF_SPEC_MAX_DRAFT);
    qf_spec *s = calloc(1, sizeof *s);
    if (!s) return qf_fail(QF_ENOMEM, "out of memory");
    const qf_model *m = e->model;
    s->draft = s->max_draft = draft;
    s->q = qf_spec_seq_create(e, draft, qf_workspace_rows(e->ws), m->cfg.max_pos < 32768 ? m->cfg.max_pos : 32768);
    e->spec = s;
    if (!s->q) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", qf_last_error());
        qf_spec_close(e);
        return qf_fail(QF_EINVAL, "%s", msg);
    }
    return QF_OK;
}

void qf_spec_close(qf_engine *e) {
    qf_spec *s = e->spec;
    if (!s) return;
    qf_spec_seq_free(s->q);
    free(s);
    e->spec = NULL;
}

void qf_spec_set_draft(qf_engine *e, int draft) {
    if (e->spec) e->spec->draft = draft < 0 ? 0 : draft > e->spec->max_draft ? e->spec->max_draft : draft;
}

int qf_spec_drafts(const qf_engine *e) { return e->spec ? e->spec->draft : 0; }

int qf_spec_takes(const qf_engine *e, const qf_state *st, const qf_gen_request *req) {
    return e->spec && e->spec->draft > 0 && st->pos == 0 && qf_sampler_is_greedy(req->sampler) &&
           req->n_prompt + 2 < qf_mtp_state(e->spec->q->mtp)->max_ctx;
}

/* The prompt in workspace-sized chunks; the head gets every pair of it. */
static int prefill(qf_engine *e, qf_state *st, const int32_t *p, int n, int32_t *pick) {
    qf_spec_seq *q = e->spec->q;
    int rc = QF_OK;
    for (int i = 0; i < n && rc == QF_OK; i += q->rows) {
        int c = n - i < q->rows ? n - i : q->rows;
        qf_seq_step s = {st, p + i, c, QF_LOGITS_LAST, e->logits, NULL, 0, 0, NULL, qf_spec_seq_hidden(q), NULL};
        rc = qf_forward(e->model, &e->be, e->ws, &s, 1);
        if (rc == QF_OK) rc = qf_spec_seq_fed(e, q, p + i, c, i == 0);
    }
    if (rc == QF_OK) *pick = qf_argmax_f32(e->logits, e->model->cfg.vocab);
    return rc;
}

/* How many drafts this step may make: within the context and the tokens still wanted. */
static int drafts_now(const qf_engine *e, const qf_emitter *em, const qf_state *st) {
    int n = e->spec->draft, room = st->max_ctx - st->pos - 2, left = em->req->max_tokens - em->n;
    n = n < room ? n : room;
    n = n < left ? n : left;
    return n > 0 ? n : 0;
}

/* One step from x (picked, not fed): emit x, draft, verify, emit the accepted drafts. *x gets the
 * next pick; 1 when generation ends (the state then holds what the plain loop's would). */
static int step(qf_engine *e, qf_emitter *em, qf_state *st, int32_t *x, int *rc) {
    qf_spec *s = e->spec;
    qf_spec_seq *q = s->q;
    int32_t d[QF_SPEC_MAX_DRAFT + 1];
    int p0 = st->pos, how = qf_engine_emit(em, st, p0, *x);
    if (how == 2) return 1;
    s->off |= qf_spec_seq_room(q) <= s->draft;
    int n = how || s->off ? 0 : drafts_now(e, em, st);
    d[0] = *x;
    if (s->off) { /* the head's context is full: plain steps */
        *rc = run_rows(e, q, st, d, 1);
        *x = q->pk[0];
        return how == 1 || *rc != QF_OK;
    }
    if ((*rc = draft_and_run(e, q, st, d, n)) != QF_OK) return 1;
    int k = qf_spec_seq_accepted(q, d, n);
    em->stats->steps += n > 0, em->stats->drafted += n, em->stats->accepted += k;
    int keep = k + 1, end = how == 1; /* rows of the forward that stand */
    for (int i = 0; i < k && !end; i++) {
        int h2 = qf_engine_emit(em, st, p0 + 1 + i, d[i + 1]);
        if (h2) keep = i + (h2 == 1 ? 2 : 1), end = 1;
    }
    em->stats->reruns += keep < n + 1;
    if (keep < n + 1 && (*rc = keep_rows(e, q, st, d, p0, keep)) != QF_OK) return 1;
    if ((*rc = after_keep(e, q, d, keep)) != QF_OK) return 1;
    *x = q->pk[keep - 1];
    return end;
}

int qf_spec_generate(qf_engine *e, qf_state *st, const qf_gen_request *req, qf_gen_stats *stats) {
    double t0 = qf_now();
    int32_t x;
    qf_spec_seq_reset(e->spec->q);
    e->spec->off = 0;
    int rc = prefill(e, st, req->prompt, req->n_prompt, &x);
    if (rc != QF_OK) return rc;
    double t1 = qf_engine_prompt_done(req, stats, t0);
    qf_emitter em = {.e = e, .req = req, .stats = stats};
    while (em.n < req->max_tokens && !step(e, &em, st, &x, &rc)) {
    }
    qf_engine_emit_end(&em);
    stats->gen_seconds = qf_now() - t1;
    return rc;
}
