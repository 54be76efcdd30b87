/* Speculative decoding with the model's MTP head (model-spec §8.3), greedy, one sequence.
 *
 * A step: the token x the model picked is emitted; the head drafts d1..dN from the pair (x, h) (h:
 * the model's hidden state where x was picked) and then from its own outputs; the model runs
 * [x, d1..dN] in one forward, and its picks g0..gN accept the drafts while g(i) = d(i+1). The
 * accepted drafts are emitted, g(k) becomes the next x. The DeltaNet states cannot be cut back,
 * so a copy of them is taken before the forward and, when a draft is refused (or a stop comes
 * among the accepted), they go back to it, the position too (attention reads no key past it), and
 * the rows that stand run again: every
 * state and every pick is then the one the plain loop makes (CPU products give a row the same
 * bits alone or in a batch). The head keeps its pairs of true values only: its drafts' entries
 * are cut off (qf_mtp_truncate) and the accepted rows' pairs fed instead. */
#include <stdlib.h>
#include <string.h>

#include "base/timer.h"
#include "runtime/engine_int.h"

#define SPEC_MAX_DRAFT 8

typedef struct qf_spec {
    int draft, rows;  /* drafts a step; rows a forward of the model takes at once */
    qf_mtp_run *mtp;
    float *h;         /* (rows, hidden): the model's hidden states of a forward */
    float *hm;        /* (draft + 1, hidden): the head's outputs of a draft chain */
    float *lg;        /* (draft + 1, vocab) */
    float *h_last;    /* (hidden): where the next x was picked */
    float *saved;     /* a copy of a state's DeltaNet block (saved_floats) */
    size_t saved_floats;
    int off;          /* the head's context is full: the request goes on without drafts */
    int max_draft;    /* what the buffers hold */
} qf_spec;

int qf_spec_open(qf_engine *e, int draft) {
    const qf_model *m = e->model;
    if (!m->mtp) return qf_fail(QF_EINVAL, "--draft needs a model with an MTP head (mtp_num_hidden_layers and mtp.* tensors)");
    if (e->on_gpu) return qf_fail(QF_EUNSUPPORTED, "--draft runs on the CPU only so far");
    if (draft > SPEC_MAX_DRAFT) return qf_fail(QF_EINVAL, "--draft %d: at most %d", draft, SPEC_MAX_DRAFT);
    qf_spec *s = calloc(1, sizeof *s);
    size_t H = (size_t)m->cfg.hidden, V = (size_t)m->cfg.vocab;
    if (!s) return qf_fail(QF_ENOMEM, "out of memory");
    s->draft = s->max_draft = draft, s->rows = qf_workspace_rows(e->ws);
    s->mtp = qf_mtp_run_create(m, s->rows, m->cfg.max_pos < 32768 ? m->cfg.max_pos : 32768);
    s->h = malloc((size_t)s->rows * H * sizeof(float)), s->hm = malloc((size_t)(draft + 1) * H * sizeof(float));
    s->lg = malloc((size_t)(draft + 1) * V * sizeof(float)), s->h_last = malloc(H * sizeof(float));
    e->spec = s;
    if (!s->mtp || !s->h || !s->hm || !s->lg || !s->h_last || s->rows < draft + 1) {
        qf_spec_close(e);
        return qf_fail(QF_ENOMEM, "out of memory for speculative decoding (or a workspace under %d rows)", draft + 1);
    }
    return QF_OK;
}

void qf_spec_close(qf_engine *e) {
    qf_spec *s = e->spec;
    if (!s) return;
    qf_mtp_run_free(s->mtp);
    free(s->h), free(s->hm), free(s->lg), free(s->h_last), free(s->saved);
    free(s);
    e->spec = NULL;
}

void qf_spec_set_draft(qf_engine *e, int draft) {
    if (e->spec) e->spec->draft = draft < 0 ? 0 : draft > e->spec->max_draft ? e->spec->max_draft : draft;
}

int qf_spec_takes(const qf_engine *e, const qf_state *st, const qf_gen_request *req) {
    return e->spec && e->spec->draft > 0 && st->pos == 0 && qf_sampler_is_greedy(req->sampler) && req->n_prompt + 2 < qf_mtp_state(e->spec->mtp)->max_ctx;
}

/* n rows of the model in one forward: their hidden states into s->h, their logits into s->lg. */
static int run_rows(qf_engine *e, qf_state *st, const int32_t *tok, int n) {
    qf_seq_step q = {st, tok, n, QF_LOGITS_ALL, e->spec->lg, NULL, 0, 0, NULL, e->spec->h};
    return qf_forward(e->model, &e->be, e->ws, &q, 1);
}

/* The prompt in workspace-sized chunks; the head gets every pair (x[t+1], h[t]) of it. */
static int prefill(qf_engine *e, qf_state *st, const int32_t *p, int n, int32_t *pick) {
    qf_spec *s = e->spec;
    int H = e->model->cfg.hidden, rc = QF_OK;
    for (int i = 0; i < n && rc == QF_OK; i += s->rows) {
        int c = n - i < s->rows ? n - i : s->rows;
        qf_seq_step q = {st, p + i, c, QF_LOGITS_LAST, e->logits, NULL, 0, 0, NULL, s->h};
        rc = qf_forward(e->model, &e->be, e->ws, &q, 1);
        int pairs = i + c < n ? c : c - 1; /* the last row's next token is the pick */
        if (rc == QF_OK && pairs > 0) rc = qf_mtp_step(e->model, &e->be, s->mtp, p + i + 1, s->h, pairs, QF_LOGITS_NONE, NULL, NULL);
        if (rc == QF_OK && i + c == n) memcpy(s->h_last, s->h + (size_t)(c - 1) * H, (size_t)H * sizeof(float));
    }
    if (rc == QF_OK) *pick = qf_argmax_f32(e->logits, e->model->cfg.vocab);
    return rc;
}

/* d[1..n] chained from the pair (d[0], h_last). */
static int draft_chain(qf_engine *e, int32_t *d, int n) {
    qf_spec *s = e->spec;
    int H = e->model->cfg.hidden, V = e->model->cfg.vocab, rc = QF_OK;
    const float *hin = s->h_last;
    for (int i = 1; i <= n && rc == QF_OK; i++) {
        rc = qf_mtp_step(e->model, &e->be, s->mtp, &d[i - 1], hin, 1, QF_LOGITS_LAST, s->lg, s->hm + (size_t)i * H);
        d[i] = qf_argmax_f32(s->lg, V);
        hin = s->hm + (size_t)i * H;
    }
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
    int32_t d[SPEC_MAX_DRAFT + 1];
    int H = e->model->cfg.hidden, V = e->model->cfg.vocab, p0 = st->pos, mp = qf_mtp_pos(s->mtp);
    int how = qf_engine_emit(em, st, p0, *x);
    if (how == 2) return 1;
    s->off |= mp + s->draft + 2 >= qf_mtp_state(s->mtp)->max_ctx;
    int n = how || s->off ? 0 : drafts_now(e, em, st);
    d[0] = *x;
    if (!s->off) *rc = n ? draft_chain(e, d, n) : qf_mtp_step(e->model, &e->be, s->mtp, d, s->h_last, 1, QF_LOGITS_NONE, NULL, NULL);
    qf_mtp_truncate(s->mtp, mp + 1); /* the pair (x, h) stands; the chain's do not */
    if (*rc != QF_OK) return 1;
    memcpy(s->saved, st->block, st->block_floats * sizeof(float));
    if ((*rc = run_rows(e, st, d, n + 1)) != QF_OK) return 1;
    int k = 0;
    while (k < n && d[k + 1] == qf_argmax_f32(s->lg + (size_t)k * V, V)) k++;
    em->stats->steps += n > 0, em->stats->drafted += n, em->stats->accepted += k;
    int keep = k + 1, end = how == 1; /* rows of the forward that stand */
    for (int i = 0; i < k && !end; i++) {
        int h2 = qf_engine_emit(em, st, p0 + 1 + i, d[i + 1]);
        if (h2) keep = i + (h2 == 1 ? 2 : 1), end = 1;
    }
    if (keep < n + 1) { /* back to the copy, and the rows that stand again */
        memcpy(st->block, s->saved, st->block_floats * sizeof(float));
        st->pos = p0;
        int full = p0 / qf_kv_pool_page_tokens(st->kv);
        if (st->kv_summarized > full) st->kv_summarized = full;
        *rc = run_rows(e, st, d, keep);
    }
    if (*rc == QF_OK && keep > 1 && !s->off) *rc = qf_mtp_step(e->model, &e->be, s->mtp, d + 1, s->h, keep - 1, QF_LOGITS_NONE, NULL, NULL);
    memcpy(s->h_last, s->h + (size_t)(keep - 1) * H, (size_t)H * sizeof(float));
    *x = qf_argmax_f32(s->lg + (size_t)(keep - 1) * V, V);
    return end || *rc != QF_OK;
}

int qf_spec_generate(qf_engine *e, qf_state *st, const qf_gen_request *req, qf_gen_stats *stats) {
    qf_spec *s = e->spec;
    if (s->saved_floats < st->block_floats) { /* once a state size, not a token */
        free(s->saved);
        s->saved_floats = (s->saved = malloc(st->block_floats * sizeof(float))) ? st->block_floats : 0;
        if (!s->saved) return qf_fail(QF_ENOMEM, "out of memory for a state copy");
    }
    double t0 = qf_now();
    int32_t x;
    qf_mtp_run_reset(e->spec->mtp);
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
