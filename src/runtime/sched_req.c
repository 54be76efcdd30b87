#include "runtime/sched_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/timer.h"
#include "runtime/prefix.h"

const double qf_sched_ttft_buckets[15] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80};
const double qf_sched_tok_buckets[15] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000};
const double qf_sched_itl_buckets[15] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5};

/* ---- requests ---- */


static void req_free(qf_req *r) {
    if (r->after) qf_req_release(r->after);
    qf_sampler_free(r->smp);
    qf_gmatch_free(r->gm);
    qf_grammar_free(r->grammar);
    free(r->toks);
    free(r->stop_ids);
    free(r->bias_ids);
    free(r->bias);
    free(r->hold);
    free(r->chan);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void qf_req_release(qf_req *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    int left = --r->refs;
    pthread_mutex_unlock(&r->mu);
    if (left == 0) req_free(r);
}

static int check_params(const qf_sched *s, const qf_req_params *p) {
    int ctx = s->o.ctx;
    if (p->n_prompt < 1) return qf_fail(QF_EINVAL, "the prompt is empty");
    if (p->n_prompt + 1 > ctx)
        return qf_fail(QF_EINVAL, "the prompt has %d tokens; with at least 1 generated token it exceeds the context of %d tokens",
                       p->n_prompt, ctx);
    int V = s->e->model->cfg.vocab;
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= V)
            return qf_fail(QF_EINVAL, "prompt token %d (id %d) is outside the vocabulary (0..%d)", i, p->prompt[i], V - 1);
    if (p->n_stop < 0 || p->n_stop > QF_MAX_STOP) return qf_fail(QF_EINVAL, "at most %d stop strings", QF_MAX_STOP);
    for (int i = 0; i < p->n_stop; i++) {
        size_t n = strlen(p->stop[i]);
        if (n == 0 || n > QF_MAX_STOP_LEN) return qf_fail(QF_EINVAL, "stop strings must be 1..%d bytes", QF_MAX_STOP_LEN);
    }
    if (p->logprobs > QF_MAX_TOP_LOGPROBS) return qf_fail(QF_EINVAL, "top_logprobs must be at most %d", QF_MAX_TOP_LOGPROBS);
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= V) return qf_fail(QF_EINVAL, "stop token id %d is outside the vocabulary (0..%d)", p->stop_ids[i], V - 1);
    for (int i = 0; i < p->n_bias; i++)
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= V || !isfinite(p->bias[i]))
            return qf_fail(QF_EINVAL, "logit bias of token id %d: the id must be within the vocabulary (0..%d), the bias finite", p->bias_ids[i], V - 1);
    if (p->think_budget_on && (p->think_end < 0 || p->think_end >= V || p->think_budget < 0)) return qf_fail(QF_EINVAL, "a reasoning budget needs its end token");
    return qf_sampling_check(&p->sampling);
}

static qf_req *req_new(qf_sched *s, const qf_req_params *p, int fork, qf_req *after) {
    qf_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->refs = 2; /* the caller's and the scheduler's */
    int room = s->o.ctx - p->n_prompt;
    r->max_tokens = p->max_tokens > 0 && p->max_tokens < room ? p->max_tokens : room;
    r->cap_toks = p->n_prompt + r->max_tokens;
    r->toks = malloc((size_t)r->cap_toks * sizeof *r->toks);
    r->smp = qf_sampler_create(s->e->model->cfg.vocab, &p->sampling);
    r->n_stop = p->n_stop;
    for (int i = 0; i < p->n_stop; i++) {
        r->stop_len[i] = strlen(p->stop[i]);
        memcpy(r->stop[i], p->stop[i], r->stop_len[i] + 1);
        if (r->stop_len[i] > r->max_stop) r->max_stop = r->stop_len[i];
    }
    r->min_tokens = p->min_tokens;
    r->snap_at = p->snap_at > 0 && p->snap_at < p->n_prompt ? p->snap_at : 0;
    r->think_on = p->think_budget_on, r->think_budget = p->think_budget, r->think_end = p->think_end;
    r->n_stop_ids = p->n_stop_ids, r->n_bias = p->n_bias;
    r->stop_ids = p->n_stop_ids ? malloc((size_t)p->n_stop_ids * sizeof *r->stop_ids) : NULL;
    r->bias_ids = p->n_bias ? malloc((size_t)p->n_bias * sizeof *r->bias_ids) : NULL;
    r->bias = p->n_bias ? malloc((size_t)p->n_bias * sizeof *r->bias) : NULL;
    if ((p->n_stop_ids && !r->stop_ids) || (p->n_bias && (!r->bias_ids || !r->bias))) {
        req_free(r);
        return NULL;
    }
    if (p->n_stop_ids) memcpy(r->stop_ids, p->stop_ids, (size_t)p->n_stop_ids * sizeof *r->stop_ids);
    if (p->n_bias) memcpy(r->bias_ids, p->bias_ids, (size_t)p->n_bias * sizeof *r->bias_ids), memcpy(r->bias, p->bias, (size_t)p->n_bias * sizeof *r->bias);
    r->hold = malloc(r->max_stop + s->text_cap + 1);
    r->chan_cap = CHAN_BASE + 2 * s->rec_max;
    r->chan = malloc(r->chan_cap);
    if (!r->toks || !r->smp || !r->hold || !r->chan) {
        req_free(r);
        return NULL;
    }
    memcpy(r->toks, p->prompt, (size_t)p->n_prompt * sizeof *r->toks);
    r->n_prompt = r->n_toks = p->n_prompt;
    r->logprobs = p->logprobs;
    r->want_ids = p->want_ids;
    r->ignore_eos = p->ignore_eos;
    r->sparsity_set = p->sparsity_set, r->sparsity = p->sparsity;
    r->grammar = p->grammar, r->grammar_after = p->grammar_after;
    r->fork = fork && p->n_prompt > 1;
    if (after) { /* a reference: the first choice's copy lives in it until every other took it */
        pthread_mutex_lock(&after->mu);
        after->refs++;
        pthread_mutex_unlock(&after->mu);
        r->after = after;
    }
    r->notify = p->notify;
    r->notify_ud = p->notify_ud;
    r->slot = -1;
    r->status.prompt_tokens = p->n_prompt;
    r->status.stop_index = r->status.stop_token = -1;
    r->t_submit = qf_now();
    return r;
}

/* n requests of one prompt, queued together or not at all: the first prefills the prompt, the
 * others (seeds seed + i) wait for its copy. p->grammar is taken (each gets a reference). */
int qf_sched_submit_n(qf_sched *s, const qf_req_params *p, int n, qf_req **out) {
    for (int i = 0; i < n; i++) out[i] = NULL;
    int rc = n >= 1 ? check_params(s, p) : qf_fail(QF_EINVAL, "no choices");
    if (rc == QF_OK && p->grammar && !s->e->tok) rc = qf_fail(QF_EINVAL, "constrained output needs the model's tokenizer");
    for (int i = 0; rc == QF_OK && i < n; i++) {
        qf_req_params q = *p;
        q.sampling.seed += (uint64_t)i;
        q.grammar = qf_grammar_ref(p->grammar);
        out[i] = req_new(s, &q, n > 1 && i == 0, i ? out[0] : NULL);
        if (!out[i]) qf_grammar_free(q.grammar), rc = qf_fail(QF_ENOMEM, "out of memory for a request");
    }
    qf_grammar_free(p->grammar);
    if (rc == QF_OK) {
        pthread_mutex_lock(&s->mu);
        if (s->stop || s->n_waiting + n > s->o.max_queue)
            rc = s->stop ? qf_fail(QF_EBUSY, "the server is shutting down") : qf_fail(QF_EBUSY, "the request queue is full (%d waiting)", s->o.max_queue);
        for (int i = 0; rc == QF_OK && i < n; i++) {
            qf_req *r = out[i];
            r->seq_no = ++s->next_seq_no;
            if (s->q_tail) s->q_tail->next = r;
            else s->q_head = r;
            s->q_tail = r;
            s->n_waiting++;
            s->stats.requests++;
        }
        if (rc == QF_OK) out[0]->fork_waiters = n - 1; /* before the scheduler thread can see it */
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    if (rc != QF_OK)
        for (int i = n - 1; i >= 0; i--)
            if (out[i]) req_free(out[i]), out[i] = NULL;
    return rc;
}

int qf_sched_submit(qf_sched *s, const qf_req_params *p, qf_req **out) { return qf_sched_submit_n(s, p, 1, out); }

void qf_req_cancel(qf_req *r) { atomic_store(&r->cancel, 1); }

void sc_notify(qf_req *r) {
    pthread_mutex_lock(&r->mu);
    r->signals++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->notify) r->notify(r->notify_ud);
}

void qf_req_wait(qf_req *r, uint64_t *seen, double timeout) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long ns = ts.tv_nsec + (long)(timeout * 1e9);
    ts.tv_sec += ns / 1000000000L, ts.tv_nsec = ns % 1000000000L;
    pthread_mutex_lock(&r->mu);
    while (r->signals == *seen && r->status.finish == QF_FINISH_NONE)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) != 0) break;
    *seen = r->signals;
    pthread_mutex_unlock(&r->mu);
}

int qf_sched_run(qf_sched *s, const qf_req_params *p, const qf_req_sink *sink, const volatile sig_atomic_t *cancel, qf_req_status *st) {
    qf_req *r;
    memset(st, 0, sizeof *st);
    int rc = qf_sched_submit(s, p, &r);
    if (rc != QF_OK) return rc;
    uint64_t seen = 0;
    for (int asked = 0;;) {
        qf_req_wait(r, &seen, 0.05); /* a timeout, so that a signal handler's cancel is seen */
        if (cancel && *cancel && !asked) qf_req_cancel(r), qf_sched_kick(s), asked = 1;
        qf_req_poll(r, sink, st);
        if (st->finish != QF_FINISH_NONE) break;
    }
    qf_req_release(r);
    return st->finish == QF_FINISH_ERROR ? qf_fail(QF_EIO, "%s", st->error) : QF_OK;
}

void qf_req_poll(qf_req *r, const qf_req_sink *sink, qf_req_status *st) {
    pthread_mutex_lock(&r->mu);
    size_t i = 0;
    while (i < r->chan_len) {
        unsigned char type = r->chan[i++];
        if (type == REC_TEXT) {
            uint32_t n;
            memcpy(&n, r->chan + i, 4);
            if (sink && sink->text) sink->text(sink->ud, (const char *)r->chan + i + 4, n);
            i += 4 + n;
        } else {
            qf_token_lp t;
            memcpy(&t, r->chan + i, sizeof t);
            if (sink && sink->token) sink->token(sink->ud, &t);
            i += sizeof t;
        }
    }
    r->chan_len = 0;
    *st = r->status;
    pthread_mutex_unlock(&r->mu);
}

/* Channel writes happen with r->mu held by the caller. Room is checked before a request is
 * scheduled, so a record always fits. */
static void chan_text(qf_req *r, const char *p, size_t n) {
    if (!n) return;
    uint32_t n32 = (uint32_t)n;
    r->chan[r->chan_len] = REC_TEXT;
    memcpy(r->chan + r->chan_len + 1, &n32, 4);
    memcpy(r->chan + r->chan_len + 5, p, n);
    r->chan_len += 5 + n;
}

void sc_chan_token(qf_req *r, const qf_token_lp *t) {
    r->chan[r->chan_len] = REC_TOKEN;
    memcpy(r->chan + r->chan_len + 1, t, sizeof *t);
    r->chan_len += 1 + sizeof *t;
}

/* ---- stop strings ---- */

/* Longest suffix of h[0..n) that is a proper prefix of some stop string. */
static size_t partial_stop(const qf_req *r, const char *h, size_t n) {
    size_t best = 0;
    for (int i = 0; i < r->n_stop; i++)
        for (size_t k = r->stop_len[i] - 1; k > best; k--)
            if (k <= n && memcmp(h + n - k, r->stop[i], k) == 0) {
                best = k;
                break;
            }
    return best;
}

/* Earliest complete stop string in h[0..n), or n when none; *which: its index. */
static size_t find_stop(const qf_req *r, const char *h, size_t n, int *which) {
    size_t at = n;
    for (int i = 0; i < r->n_stop; i++) {
        const char *p = memmem(h, n, r->stop[i], r->stop_len[i]);
        if (p && (size_t)(p - h) < at) at = (size_t)(p - h), *which = i;
    }
    return at;
}

/* Adds new text to the holdback buffer and releases what can no longer start a stop string.
 * Returns 1 when a stop string completed (the text before it is released, the rest dropped). */
int sc_push_text(qf_req *r, const char *p, size_t n, int final) {
    memcpy(r->hold + r->hold_len, p, n);
    r->hold_len += n;
    int which = -1;
    size_t at = r->n_gen >= r->min_tokens ? find_stop(r, r->hold, r->hold_len, &which) : r->hold_len;
    if (at < r->hold_len) {
        chan_text(r, r->hold, at);
        r->hold_len = 0;
        r->status.stop_index = which;
        return 1;
    }
    size_t keep = final ? 0 : partial_stop(r, r->hold, r->hold_len);
    chan_text(r, r->hold, r->hold_len - keep);
    memmove(r->hold, r->hold + r->hold_len - keep, keep);
    r->hold_len = keep;
    return 0;
}

/* ---- logprobs ---- */

void sc_fill_logprobs(const float *logits, int V, int top, int32_t tok, qf_token_lp *t) {
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)(logits[i] - mx));
    float lse = mx + (float)log(sum);
    t->id = tok;
    t->logprob = logits[tok] - lse;
    t->n_top = 0;
    for (int i = 0; i < V; i++) { /* insertion into a short sorted list */
        float v = logits[i];
        if (t->n_top == top && (top == 0 || v <= t->top_lp[top - 1])) continue;
        int j = t->n_top < top ? t->n_top++ : top - 1;
        while (j > 0 && t->top_lp[j - 1] < v) {
            t->top_lp[j] = t->top_lp[j - 1];
            t->top_id[j] = t->top_id[j - 1];
            j--;
        }
        t->top_lp[j] = v;
        t->top_id[j] = i;
    }
    for (int j = 0; j < t->n_top; j++) t->top_lp[j] -= lse;
}

/* ---- histograms and stats (s->mu held) ---- */

void sc_hist_add(uint64_t *h, const double *bounds, double v) {
    for (int i = 0; i < 15; i++)
        if (v <= bounds[i]) h[i]++;
    h[15]++;
}

void qf_sched_get_stats(qf_sched *s, qf_sched_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    out->waiting = s->n_waiting;
    pthread_mutex_unlock(&s->mu);
}
