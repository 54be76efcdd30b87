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
 * instead. The scheduler runs these steps for its greedy sequences, many in one forward. */
#include "runtime/spec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

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

/* ---- one sequence ---- */

qf_spec_seq *qf_spec_seq_create(const qf_engine *e, int max_draft, int rows, int max_ctx) {
    const qf_model *m = e->model; /* its head, where the model runs: checked when the engine opened with drafts */
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
