#include "runtime/sched.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/timer.h"
#include "base/utf8.h"
#include "runtime/prefix.h"
#include "runtime/spec.h"

const double qf_sched_ttft_buckets[15] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80};
const double qf_sched_tok_buckets[15] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000};
const double qf_sched_itl_buckets[15] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5};

enum { REC_TEXT = 1, REC_TOKEN = 2, CHAN_BASE = 64 * 1024 };

struct qf_req {
    pthread_mutex_t mu;
    int refs;
    atomic_int cancel;
    /* set at submit, then the scheduler thread's alone */
    int32_t *toks;
    int n_prompt, n_toks, cap_toks, n_fed, n_gen, max_tokens, logprobs, ignore_eos, primed, slot, sparsity_set;
    float sparsity;
    char stop[QF_MAX_STOP][QF_MAX_STOP_LEN + 1];
    size_t stop_len[QF_MAX_STOP], max_stop;
    int n_stop;
    qf_sampler *smp;
    qf_grammar *grammar;
    qf_gmatch *gm;
    int32_t grammar_after;
    int min_tokens, n_stop_ids, n_bias, think_on, think_budget; /* think_on: in a reasoning block with a budget */
    int snap_at;
    int32_t *stop_ids, *bias_ids, think_end;
    float *bias;
    /* n > 1: a first choice keeps a copy of its state before the prompt's last token (fork_snap)
     * until every later choice, waiting on after, has taken it */
    int fork, fork_state, fork_waiters; /* fork_state: enum fork_state */
    qf_state_snap fork_snap;
    qf_req *after;
    qf_utf8_stream us;
    char *hold;
    size_t hold_len;
    double t_submit, t_last, t_admit, t_first; /* t_admit: first given a slot; t_first: its first token */
    void (*notify)(void *ud);
    void *notify_ud;
    qf_req *next;
    uint64_t seq_no;
    /* shared with the reader, under mu */
    unsigned char *chan;
    size_t chan_len, chan_cap;
    qf_req_status status;
};

typedef struct slot {
    qf_state *st;
    float *logits;
    qf_req *req;
    int batch_n;      /* tokens fed this step */
    int32_t top1;     /* the step's pick, when it asked for only that (QF_LOGITS_TOP1, QF_LOGITS_DRAW) */
    qf_draw draw;     /* the step's draw on the device (QF_LOGITS_DRAW) */
    int pages_before; /* pages held before this step */
    qf_spec_seq *sp;  /* the MTP head of the slot's sequence (serve --draft) */
    int sp_on;        /* the request drafts: greedy, without logprobs or a grammar */
    int sp_fresh;     /* the head has no row before the next forward's first (a new sequence) */
    int32_t spec_d[QF_SPEC_MAX_DRAFT + 1]; /* this step's token and its drafts */
    int spec_n, spec_k, spec_p0;           /* drafts this step (0: none), accepted, the position before */
} slot;

struct qf_sched {
    qf_engine *e;
    qf_sched_opts o;
    qf_kv_pool *kv;
    qf_vocab_index *vix;  /* the sorted vocabulary for grammar masks, made on first use */
    qf_prefix *prefix;    /* prefix snapshots (NULL: off) */
    unsigned char *page_mark; /* a byte per KV page (seq_pages) */
    char log_buf[4096];   /* the expert store's step description (--verbose) */
    slot *slots;
    qf_seq_step *steps;
    int *step_slot;
    int *pre;             /* per step row: its token was drawn already (draw_rows); then draw_rows' list */
    qf_seq_step *redo;    /* the drafting sequences' rows that stand, run again after a refused draft */
    float *lp_scratch;
    char *text;
    size_t text_cap, rec_max;
    int rows;
    uint64_t next_seq_no;
    pthread_t th;
    int th_started;
    pthread_mutex_t mu; /* queue, stop flag and stats */
    pthread_cond_t cv;
    int stop;
    qf_req *q_head, *q_tail;
    int n_waiting;
    qf_sched_stats stats;
};

#define LOG(s, ...)                                                      \
    do {                                                                 \
        if ((s)->o.verbose && (s)->o.log) {                              \
            fprintf((s)->o.log, "[FLASH-SCHEDULER] " __VA_ARGS__);       \
            fflush((s)->o.log);                                          \
        }                                                                \
    } while (0)

/* ---- requests ---- */

/* A first choice's copy: not made yet, kept, gone (dropped, or none could be made); a later
 * choice that has taken it or given it up is FORK_LEFT. */
enum fork_state { FORK_NONE, FORK_KEPT, FORK_GONE, FORK_LEFT };

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

static void chan_token(qf_req *r, const qf_token_lp *t) {
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
static int push_text(qf_req *r, const char *p, size_t n, int final) {
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

static void fill_logprobs(const float *logits, int V, int top, int32_t tok, qf_token_lp *t) {
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

static void hist_add(uint64_t *h, const double *bounds, double v) {
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

/* ---- slots ---- */

/* The first choice's copy goes once no later choice waits for it. */
static void fork_drop_unwanted(qf_sched *s, qf_req *first) {
    pthread_mutex_lock(&s->mu);
    int waiting = first->fork_waiters;
    pthread_mutex_unlock(&s->mu);
    if (waiting == 0 && first->fork_state == FORK_KEPT) {
        qf_state_snap_drop(&first->fork_snap);
        first->fork_state = FORK_GONE;
    }
}

/* A later choice no longer needs the first's copy. */
static void fork_leave(qf_sched *s, qf_req *r) {
    if (!r->after || r->fork_state == FORK_LEFT) return;
    r->fork_state = FORK_LEFT;
    pthread_mutex_lock(&s->mu);
    r->after->fork_waiters--;
    pthread_mutex_unlock(&s->mu);
    fork_drop_unwanted(s, r->after);
}

/* The first choice has fed all but its prompt's last token: the copy the others start from. */
static void fork_mark(qf_sched *s, qf_req *r, const qf_state *st) {
    if (!r->fork || r->fork_state != FORK_NONE || r->n_fed != r->n_prompt - 1) return;
    r->fork_state = qf_state_snap_take(st, &r->fork_snap) == QF_OK ? FORK_KEPT : FORK_GONE;
    fork_drop_unwanted(s, r);
}

/* A later choice starts from the first's copy (or, when there is none, as any request). */
static int fork_join(qf_sched *s, qf_req *r, qf_state *st) {
    int k = 0;
    if (r->after->fork_state == FORK_KEPT && qf_state_adopt(st, &r->after->fork_snap) == QF_OK) k = st->pos;
    fork_leave(s, r);
    return k;
}

/* Ends a request: its last status goes to the reader, its slot and pages are freed. */
/* Slots holding a sequence. */
static int slots_running(const qf_sched *s) {
    int n = 0;
    for (int i = 0; i < s->o.max_batch; i++) n += s->slots[i].req != NULL;
    return n;
}

/* A finished request's phases: queued (submit to a slot), prefill (to the first token), decode. */
static void record_request(qf_sched_stats *st, const qf_req *r, int why) {
    double now = qf_now(), admit = r->t_admit > 0 ? r->t_admit : now, first = r->t_first > 0 ? r->t_first : now;
    double v[6] = {now - r->t_submit, admit - r->t_submit, first - admit, now - first, r->n_prompt, r->n_gen};
    uint64_t *h[6] = {st->e2e_hist, st->queue_hist, st->prefill_hist, st->decode_hist, st->ptok_hist, st->gtok_hist};
    double *sum[6] = {&st->e2e_sum, &st->queue_sum, &st->prefill_sum, &st->decode_sum, &st->ptok_sum, &st->gtok_sum};
    for (int i = 0; i < 6; i++) hist_add(h[i], i < 4 ? qf_sched_ttft_buckets : qf_sched_tok_buckets, v[i]), *sum[i] += v[i];
    st->req_n++;
    st->finished_stop += why == QF_FINISH_STOP, st->finished_length += why == QF_FINISH_LENGTH, st->finished_error += why == QF_FINISH_ERROR;
}

static void finish(qf_sched *s, qf_req *r, int why, const char *err) {
    fork_leave(s, r);
    if (r->slot >= 0) {
        slot *sl = &s->slots[r->slot];
        int pages = sl->st->n_pages;
        if (s->prefix && (why == QF_FINISH_STOP || why == QF_FINISH_LENGTH)) qf_prefix_save(s->prefix, sl->st, r->toks);
        qf_state_reset(sl->st);
        sl->req = NULL;
        LOG(s, "seq %llu finished (%s): %d prompt + %d generated tokens, %d pages freed, %d/%d pages free\n",
            (unsigned long long)r->seq_no, why == QF_FINISH_STOP ? "stop" : why == QF_FINISH_LENGTH ? "length" : why == QF_FINISH_CANCELLED ? "cancelled" : "error",
            r->n_prompt, r->n_gen, pages, qf_kv_pool_free_pages(s->kv), qf_kv_pool_pages(s->kv));
        r->slot = -1;
    }
    int running = slots_running(s); /* counted before the reader hears of the end: /metrics and /ready agree with the answer */
    pthread_mutex_lock(&s->mu);
    if (why != QF_FINISH_CANCELLED) record_request(&s->stats, r, why);
    s->stats.finished += why != QF_FINISH_CANCELLED;
    s->stats.cancelled += why == QF_FINISH_CANCELLED;
    s->stats.running = running;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&r->mu);
    r->status.finish = why;
    r->status.gen_tokens = r->n_gen;
    if (err) snprintf(r->status.error, sizeof r->status.error, "%s", err);
    pthread_mutex_unlock(&r->mu);
    if (r->notify) r->notify(r->notify_ud);
    qf_req_release(r);
}

/* A later choice of n waits until the first has prefilled its prompt but the last token (or ended). */
static int waits(const qf_req *r) { return r->after && r->after->fork_state == FORK_NONE && r->after->status.finish == QF_FINISH_NONE; }

/* Takes r (after prev, NULL: the head) out of the queue (s->mu held). */
static void unqueue(qf_sched *s, qf_req *prev, qf_req *r) {
    if (prev) prev->next = r->next;
    else s->q_head = r->next;
    if (s->q_tail == r) s->q_tail = prev;
    s->n_waiting--;
    r->next = NULL;
}

/* Takes the first waiting request that may start (s->mu held) when a slot and pages for its tokens
 * are free. Cancelled waiters are finished on the way. */
static qf_req *pop_admissible(qf_sched *s, int free_slot, qf_req **cancelled) {
    qf_req *prev = NULL, *r = s->q_head;
    while (r) {
        qf_req *next = r->next;
        if (atomic_load(&r->cancel)) {
            unqueue(s, prev, r);
            r->next = *cancelled;
            *cancelled = r;
        } else if (waits(r)) prev = r;
        else break;
        r = next;
    }
    if (!r || free_slot < 0) return NULL;
    int pt = qf_kv_pool_page_tokens(s->kv), need = (r->n_toks + 1 + pt - 1) / pt;
    if (need > qf_kv_pool_free_pages(s->kv) && s->prefix) qf_prefix_evict(s->prefix, need);
    if (need > qf_kv_pool_free_pages(s->kv)) return NULL;
    unqueue(s, prev, r);
    return r;
}

static int free_slot(const qf_sched *s) {
    for (int i = 0; i < s->o.max_batch; i++)
        if (!s->slots[i].req) return i;
    return -1;
}

/* The request's grammar matcher (and, the first time, the sorted vocabulary). */
static int grammar_start(qf_sched *s, qf_req *r) {
    if (!s->vix) {
        int V = s->e->model->cfg.vocab, n = 0;
        int32_t eos[16];
        for (int32_t t = 0; t < V && n < 16; t++)
            if (qf_engine_is_eos(s->e, t)) eos[n++] = t;
        int rc = qf_vocab_index_create(&s->vix, s->e->tok, V, eos, n); /* every row of the logits: ids without text are masked */
        if (rc != QF_OK) return rc;
    }
    return qf_gmatch_create(&r->gm, r->grammar, s->vix, s->e->tok, r->grammar_after);
}

static void admit(qf_sched *s) {
    for (;;) {
        qf_req *cancelled = NULL;
        pthread_mutex_lock(&s->mu);
        int fs = free_slot(s);
        qf_req *r = pop_admissible(s, fs, &cancelled);
        pthread_mutex_unlock(&s->mu);
        while (cancelled) {
            qf_req *c = cancelled;
            cancelled = c->next;
            finish(s, c, QF_FINISH_CANCELLED, NULL);
        }
        if (!r) return;
        r->slot = fs;
        r->n_fed = r->after && r->fork_state != FORK_LEFT ? fork_join(s, r, s->slots[fs].st) : 0;
        if (!r->n_fed && s->prefix) r->n_fed = qf_prefix_restore(s->prefix, s->slots[fs].st, r->toks, r->n_toks);
        fork_mark(s, r, s->slots[fs].st);
        if (!r->primed) {
            pthread_mutex_lock(&r->mu); /* status is the reader's too */
            r->status.cached_tokens = r->n_fed;
            pthread_mutex_unlock(&r->mu);
        }
        s->slots[fs].req = r;
        if (r->t_admit == 0) r->t_admit = qf_now();
        if (!r->primed && r->grammar && grammar_start(s, r) != QF_OK) {
            finish(s, r, QF_FINISH_ERROR, qf_last_error());
            continue;
        }
        if (!r->primed) {
            for (int i = 0; i < r->n_prompt; i++) qf_sampler_accept(r->smp, r->toks[i], 0);
            r->primed = 1;
            pthread_mutex_lock(&s->mu);
            s->stats.prompt_tokens += (uint64_t)r->n_prompt;
            pthread_mutex_unlock(&s->mu);
        }
        slot *sl = &s->slots[fs];
        sl->sp_on = sl->sp && r->logprobs < 0 && !r->grammar && !r->n_bias && !r->min_tokens && !r->think_on && !r->n_stop_ids && qf_sampler_is_greedy(r->smp), sl->sp_fresh = 1;
        if (sl->sp_on) qf_spec_seq_reset(sl->sp); /* a reused prefix or a fork's state was not shown to the head: fewer drafts accepted, the same text */
        LOG(s, "seq %llu admitted to slot %d: %d tokens to prefill (%d reused)\n", (unsigned long long)r->seq_no, fs, r->n_toks - r->n_fed, r->n_fed);
    }
}

/* Frees the newest running sequence and puts it back at the head of the queue; it is prefilled
 * again (prompt and generated tokens) when pages are free, and continues where it was. */
static void preempt_newest(qf_sched *s) {
    slot *victim = NULL;
    for (int i = 0; i < s->o.max_batch; i++)
        if (s->slots[i].req && (!victim || s->slots[i].req->seq_no > victim->req->seq_no)) victim = &s->slots[i];
    qf_req *r = victim->req;
    LOG(s, "seq %llu preempted: %d pages freed, to be recomputed (%d tokens)\n", (unsigned long long)r->seq_no, victim->st->n_pages, r->n_toks);
    qf_state_reset(victim->st);
    victim->req = NULL;
    r->slot = -1;
    r->n_fed = 0;
    pthread_mutex_lock(&s->mu);
    r->next = s->q_head;
    s->q_head = r;
    if (!s->q_tail) s->q_tail = r;
    s->n_waiting++;
    s->stats.preempted++;
    pthread_mutex_unlock(&s->mu);
}

static size_t chan_room(qf_req *r) {
    pthread_mutex_lock(&r->mu);
    size_t room = r->chan_cap - r->chan_len;
    pthread_mutex_unlock(&r->mu);
    return room;
}

static int is_stop_id(const qf_req *r, int32_t tok) {
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == tok) return 1;
    return 0;
}

/* Whether the request changes its logits before the pick (logit bias, ends held off by
 * min_tokens), so they must come to the host. */
static int shapes_logits(const qf_req *r) {
    return r->n_bias > 0 || r->n_gen < r->min_tokens;
}

/* Logit bias, then the ends masked while fewer than min_tokens are out. */
static void shape_logits(const qf_sched *s, const qf_req *r, float *logits) {
    for (int i = 0; i < r->n_bias; i++) logits[r->bias_ids[i]] += r->bias[i];
    if (r->n_gen >= r->min_tokens) return;
    const qf_config *c = &s->e->model->cfg;
    for (int i = 0; i < c->n_eos; i++) logits[c->eos_ids[i]] = -INFINITY;
    for (int i = 0; i < r->n_stop_ids; i++) logits[r->stop_ids[i]] = -INFINITY;
}

/* Whether the device draws this request's tokens (backend/ops.h qf_draw): the backend can, and
 * its top_k is one the draw takes. */
static int device_draws(const qf_sched *s, const qf_req *r) {
    const qf_dec_ops *d = s->e->be.ops->dec;
    return d && d->draw && qf_sampler_can_draw(r->smp);
}

/* Picks the step's rows: one token for every decoding sequence first, then prompt chunks.
 * Returns the number of sequences; the pages they need (*pages_out) are guaranteed free. */
static int plan_step(qf_sched *s, int *n_decode, int *rows_out, int *pages_out) {
    for (;;) {
        int n = 0, rows = 0, pages = 0;
        *n_decode = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < s->o.max_batch; i++) {
                slot *sl = &s->slots[i];
                qf_req *r = sl->req;
                if (!r) continue;
                int left = r->n_toks - r->n_fed, decode = left == 1;
                if (decode != (pass == 0) || chan_room(r) < 2 * s->rec_max) continue;
                int take = left < s->o.prefill_chunk ? left : s->o.prefill_chunk;
                if (s->prefix && r->n_fed < r->n_prompt) { /* chunks end on snapshot boundaries */
                    int to_mark = s->o.prefix_interval - r->n_fed % s->o.prefix_interval;
                    if (r->n_fed < r->snap_at && r->snap_at - r->n_fed < to_mark) to_mark = r->snap_at - r->n_fed;
                    take = take < to_mark ? take : to_mark;
                }
                if (r->fork && r->fork_state == FORK_NONE && r->n_fed < r->n_prompt - 1 && take > r->n_prompt - 1 - r->n_fed) take = r->n_prompt - 1 - r->n_fed;
                if (take > s->rows - rows) take = s->rows - rows;
                if (take <= 0) continue;
                sl->batch_n = take;
                /* a plain pick without logprobs or grammar: made where the logits are (on a GPU, only the id comes back) */
                int plain = r->logprobs < 0 && !r->gm && !shapes_logits(r);
                int mode = take < left ? QF_LOGITS_NONE
                           : plain && qf_sampler_is_greedy(r->smp) ? QF_LOGITS_TOP1
                           : plain && device_draws(s, r) ? QF_LOGITS_DRAW
                                                          : QF_LOGITS_LAST;
                s->steps[n] = (qf_seq_step){sl->st, r->toks + r->n_fed, take, mode, sl->logits, &sl->top1, r->sparsity_set, r->sparsity, NULL,
                                            sl->sp_on ? qf_spec_seq_hidden(sl->sp) : NULL, NULL};
                s->step_slot[n++] = i;
                rows += take;
                pages += qf_state_pages_needed(sl->st, take);
                *n_decode += decode;
            }
        if (pages <= qf_kv_pool_free_pages(s->kv)) {
            *rows_out = rows, *pages_out = pages;
            return n;
        }
        if (s->prefix && qf_prefix_evict(s->prefix, pages) > 0) continue;
        preempt_newest(s);
    }
}

/* Masks the tokens the request's grammar does not allow next. */
static int apply_grammar(qf_sched *s, qf_req *r, float *logits) {
    double t0 = qf_now();
    int n = qf_gmatch_mask(r->gm, logits);
    double dt = qf_now() - t0;
    pthread_mutex_lock(&s->mu);
    s->stats.masks++;
    s->stats.mask_seconds += dt;
    pthread_mutex_unlock(&s->mu);
    if (n < 0) return n;
    return n == 0 ? qf_fail(QF_EINVAL, "the output grammar allows no next token (a dead end of the schema)") : QF_OK;
}

/* Samples the next token of a sequence whose logits are ready and routes its text. Returns a
 * finish reason, or QF_FINISH_NONE to go on. */
static int emit_token(qf_sched *s, qf_req *r, float *logits, const int32_t *top1) {
    const qf_engine *e = s->e;
    int V = e->model->cfg.vocab;
    qf_token_lp lp;
    if (r->logprobs >= 0) memcpy(s->lp_scratch, logits, (size_t)V * sizeof(float)); /* the model's own distribution */
    if (logits) shape_logits(s, r, logits);
    if (r->gm && apply_grammar(s, r, logits) != QF_OK) return QF_FINISH_ERROR;
    int32_t tok = top1 ? *top1 : qf_sampler_sample(r->smp, logits);
    if (r->think_on && (tok == r->think_end || r->n_gen >= r->think_budget)) tok = r->think_end, r->think_on = 0;
    if (r->logprobs >= 0) fill_logprobs(s->lp_scratch, V, r->logprobs, tok, &lp);
    double now = qf_now();
    pthread_mutex_lock(&s->mu);
    if (r->n_gen == 0) {
        r->t_first = now;
        hist_add(s->stats.ttft_hist, qf_sched_ttft_buckets, now - r->t_submit);
        s->stats.ttft_n++;
        s->stats.ttft_sum += now - r->t_submit;
    } else {
        hist_add(s->stats.itl_hist, qf_sched_itl_buckets, now - r->t_last);
        s->stats.itl_n++;
        s->stats.itl_sum += now - r->t_last;
    }
    s->stats.gen_tokens++;
    pthread_mutex_unlock(&s->mu);
    r->t_last = now;
    r->n_gen++;
    int eos = (qf_engine_is_eos(e, tok) && (!r->ignore_eos || r->gm)) || is_stop_id(r, tok); /* a grammar allows an end only where it is complete */
    size_t len = 0;
    if (!eos && r->gm && qf_gmatch_accept(r->gm, tok) != QF_OK) return QF_FINISH_ERROR;
    if (!eos) {
        qf_sampler_accept(r->smp, tok, 1);
        r->toks[r->n_toks++] = tok;
        const char *p = e->tok ? qf_tok_piece(e->tok, tok, &len) : NULL;
        len = p ? qf_utf8_stream_push(&r->us, p, len, s->text, s->text_cap) : 0;
    }
    int done = eos || r->n_gen >= r->max_tokens || r->n_toks >= s->o.ctx;
    if (done) len += qf_utf8_stream_flush(&r->us, s->text + len, s->text_cap - len);
    pthread_mutex_lock(&r->mu);
    if (r->n_gen == 1) r->status.ttft = now - r->t_submit;
    if (eos) r->status.stop_token = tok;
    r->status.gen_tokens = r->n_gen;
    if (r->logprobs >= 0 && !eos) chan_token(r, &lp);
    int stopped = push_text(r, s->text, len, done);
    pthread_mutex_unlock(&r->mu);
    if (stopped || eos) return QF_FINISH_STOP;
    return done ? QF_FINISH_LENGTH : QF_FINISH_NONE;
}

static void drop_cancelled(qf_sched *s) {
    for (int i = 0; i < s->o.max_batch; i++) {
        qf_req *r = s->slots[i].req;
        if (r && atomic_load(&r->cancel)) finish(s, r, QF_FINISH_CANCELLED, NULL);
    }
}

/* Pages the running sequences hold (a page two of them share counts once); the rest of the
 * pages not free are held by prefix snapshots alone, and are given back when needed. */
static int seq_pages(qf_sched *s) {
    memset(s->page_mark, 0, (size_t)qf_kv_pool_pages(s->kv));
    int n = 0;
    for (int i = 0; i < s->o.max_batch; i++)
        for (int k = 0; s->slots[i].req && k < s->slots[i].st->n_pages; k++) {
            int32_t pg = s->slots[i].st->pages[k];
            n += !s->page_mark[pg];
            s->page_mark[pg] = 1;
        }
    return n;
}

static void publish_stats(qf_sched *s) {
    int running = slots_running(s);
    pthread_mutex_lock(&s->mu);
    s->stats.running = running;
    s->stats.kv_pages_total = qf_kv_pool_pages(s->kv);
    s->stats.kv_pages_used = seq_pages(s);
    s->stats.kv_pages_cached = s->stats.kv_pages_total - qf_kv_pool_free_pages(s->kv) - s->stats.kv_pages_used;
    qf_expert_store *es = s->e->model->experts; /* counted on this thread, published under the lock */
    qf_expert_stats st = es ? qf_es_stats(es) : (qf_expert_stats){0};
    s->stats.expert_hits = st.hits, s->stats.expert_misses = st.misses, s->stats.expert_bytes_loaded = st.bytes_loaded;
    if (s->prefix) {
        qf_prefix_stats ps = qf_prefix_get_stats(s->prefix);
        s->stats.prefix_hits = ps.hits, s->stats.prefix_misses = ps.misses, s->stats.prefix_tokens = ps.tokens_reused;
        s->stats.prefix_evicted = ps.evicted, s->stats.prefix_snapshots = ps.snapshots, s->stats.prefix_bytes = ps.bytes, s->stats.prefix_budget = ps.budget;
    }
    pthread_mutex_unlock(&s->mu);
}

/* --verbose: what the step's expert cache loaded, and what sparsity skipped (against es0, sp0,
 * the counts before the step that began at t0). */
static void log_skips(qf_sched *s, uint64_t step_no, qf_expert_store *es, const qf_expert_stats *es0, const qf_sparsity_counts *sp0, double t0) {
    if (es && es->stats.slots) {
        qf_expert_stats es1 = qf_es_stats(es);
        uint64_t hits = es1.hits - es0->hits, misses = es1.misses - es0->misses;
        double ms = 1e3 * (qf_now() - t0), mb = (double)(es1.bytes_loaded - es0->bytes_loaded) / 1e6;
        LOG(s, "step %llu: %llu experts missed, %.2f MB over the link in a %.1f ms step (%.1f GB/s), %llu hits (%.0f%%)\n", (unsigned long long)step_no,
            (unsigned long long)misses, mb, ms, ms > 0 ? mb / ms : 0.0, (unsigned long long)hits, hits + misses ? 100.0 * (double)hits / (double)(hits + misses) : 0.0);
        if (es->ops->describe) {
            es->ops->describe(es, s->log_buf, sizeof s->log_buf);
            LOG(s, "step %llu loads: %s\n", (unsigned long long)step_no, s->log_buf);
        }
    }
    qf_sparsity_counts sp1 = qf_workspace_sparsity(s->e->ws);
    if (sp1.experts_dropped > sp0->experts_dropped || sp1.trunk_zeroed > sp0->trunk_zeroed || sp1.kv_skipped > sp0->kv_skipped)
        LOG(s, "step %llu: sparsity dropped %llu of %llu routed experts, zeroed %.1f%% of trunk projection inputs, skipped %llu of %llu KV pages\n",
            (unsigned long long)step_no, (unsigned long long)(sp1.experts_dropped - sp0->experts_dropped), (unsigned long long)(sp1.experts - sp0->experts),
            sp1.trunk > sp0->trunk ? 100.0 * (double)(sp1.trunk_zeroed - sp0->trunk_zeroed) / (double)(sp1.trunk - sp0->trunk) : 0.0,
            (unsigned long long)(sp1.kv_skipped - sp0->kv_skipped), (unsigned long long)(sp1.kv_pages - sp0->kv_pages));
}

static void count_step(qf_sched *s, uint64_t *step_no, int drafting, int drafted, int accepted) {
    pthread_mutex_lock(&s->mu);
    *step_no = ++s->stats.steps;
    s->stats.spec_steps += (uint64_t)drafting, s->stats.spec_drafted += (uint64_t)drafted, s->stats.spec_accepted += (uint64_t)accepted;
    pthread_mutex_unlock(&s->mu);
}

/* How many drafts a greedy decoding sequence may make this step: within its tokens still wanted,
 * the context, the head's context, its channel, the step's rows left and the pages free. */
static int drafts_now(qf_sched *s, const slot *sl, int rows_left, int pages_left) {
    const qf_req *r = sl->req;
    int n = qf_spec_drafts(s->e), left = r->max_tokens - r->n_gen - 1, ctx = s->o.ctx - r->n_toks - 1, head = qf_spec_seq_room(sl->sp) - 1;
    n = n < left ? n : left;
    n = n < ctx ? n : ctx;
    n = n < head ? n : head;
    n = n < rows_left ? n : rows_left;
    while (n > 0 && qf_state_pages_needed(sl->st, n + 1) - qf_state_pages_needed(sl->st, 1) > pages_left) n--;
    if (n <= 0 || chan_room(sl->req) < (size_t)(n + 2) * s->rec_max) return 0;
    return n;
}

/* serve --draft: each greedy decoding sequence's row becomes its token and the head's drafts, all
 * verified in the step's one forward (pages: what the step's rows need already). Returns the
 * drafts made; a failed draft fails its request. */
static int plan_drafts(qf_sched *s, int n, int pages, int *rows, int *drafting) {
    int drafted = 0, pages_left = qf_kv_pool_free_pages(s->kv) - pages;
    for (int j = 0; j < n; j++) {
        slot *sl = &s->slots[s->step_slot[j]];
        qf_req *r = sl->req;
        sl->spec_n = 0;
        if (!sl->sp_on || sl->sp_fresh || r->n_toks - r->n_fed != 1) continue; /* sp_fresh: the head has not seen its last row (a fork's adopted state) */
        int nd = drafts_now(s, sl, s->rows - *rows, pages_left);
        if (nd <= 0) continue;
        sl->spec_d[0] = r->toks[r->n_fed];
        if (qf_spec_seq_draft(s->e, sl->sp, sl->st, sl->spec_d, nd) != QF_OK) continue; /* no drafts this step */
        pages_left -= qf_state_pages_needed(sl->st, nd + 1) - qf_state_pages_needed(sl->st, 1);
        s->steps[j].tokens = sl->spec_d, s->steps[j].n = nd + 1, s->steps[j].logits_mode = QF_LOGITS_PICKS;
        s->steps[j].top1 = qf_spec_seq_picks(sl->sp);
        sl->spec_n = nd, sl->spec_p0 = sl->st->pos, sl->batch_n = nd + 1;
        *rows += nd, drafted += nd, (*drafting)++;
    }
    return drafted;
}

/* After the forward: each drafting sequence's drafts equal to the model's picks accepted; where one
 * was refused the state goes back to its copy and the rows that stand run again, every such
 * sequence in one more forward. Returns the drafts accepted (and rc through *rc). */
static int settle_drafts(qf_sched *s, int n, int *rc) {
    int m = 0, accepted = 0;
    for (int j = 0; j < n; j++) {
        slot *sl = &s->slots[s->step_slot[j]];
        if (!sl->spec_n) continue;
        int k = sl->spec_k = qf_spec_seq_accepted(sl->sp, sl->spec_d, sl->spec_n);
        accepted += k;
        if (k == sl->spec_n) continue;
        qf_spec_seq_restore(sl->sp, sl->st, sl->spec_p0);
        s->redo[m++] = (qf_seq_step){sl->st, sl->spec_d, k + 1, QF_LOGITS_PICKS, NULL, qf_spec_seq_picks(sl->sp), sl->req->sparsity_set,
                                     sl->req->sparsity, NULL, qf_spec_seq_hidden(sl->sp), NULL};
    }
    if (m) *rc = qf_forward(s->e->model, &s->e->be, s->e->ws, s->redo, m);
    return accepted;
}

/* A drafting sequence's tokens after its step: the accepted drafts and the next pick, in order. */
static void emit_drafted(qf_sched *s, slot *sl) {
    qf_req *r = sl->req;
    int32_t out[QF_SPEC_MAX_DRAFT + 1];
    int keep = sl->spec_k + 1;
    if (qf_spec_seq_kept(s->e, sl->sp, sl->spec_d, keep, out) != QF_OK) {
        finish(s, r, QF_FINISH_ERROR, qf_last_error());
        return;
    }
    r->n_fed += keep;
    for (int t = 0; t < keep; t++) {
        int why = emit_token(s, r, NULL, &out[t]);
        if (why != QF_FINISH_NONE) {
            finish(s, r, why, why == QF_FINISH_ERROR ? qf_last_error() : NULL);
            return;
        }
    }
    if (r->notify) r->notify(r->notify_ud);
}

/* The rows of a step that finish a prompt or decode and sample plainly (no logprobs, whose copy
 * must precede the sampler's penalties, and no grammar): their draws made at once on the engine's
 * threads (each row has its own logits and sampler) before the tokens are emitted in order. */
typedef struct draws {
    qf_sched *s;
    int *idx, n; /* the step rows drawn */
} draws;

static void draw_one(void *ctx, int i) {
    draws *d = ctx;
    int j = d->idx[i];
    slot *sl = &d->s->slots[d->s->step_slot[j]];
    /* a DRAW row the device left to the host: the uniform number it was given */
    if (d->s->steps[j].logits_mode == QF_LOGITS_DRAW) sl->top1 = qf_sampler_sample_u(sl->req->smp, sl->logits, sl->draw.u);
    else sl->top1 = qf_sampler_sample(sl->req->smp, sl->logits);
}

static void draw_rows(qf_sched *s, int n, int *pre) {
    draws d = {.s = s, .idx = s->pre + s->o.max_batch};
    for (int j = 0; j < n; j++) {
        slot *sl = &s->slots[s->step_slot[j]];
        qf_req *r = sl->req;
        int mode = s->steps[j].logits_mode;
        pre[j] = mode == QF_LOGITS_DRAW || (mode == QF_LOGITS_LAST && r->n_fed + sl->batch_n == r->n_toks && r->logprobs < 0 && !r->gm && !shapes_logits(r));
        if (pre[j] && (mode == QF_LOGITS_LAST || sl->top1 < 0)) d.idx[d.n++] = j;
    }
    if (d.n > 1) qf_pool_run(s->e->pool, draw_one, &d, d.n);
    else if (d.n == 1) draw_one(&d, 0);
}

/* Returns 0 when there was nothing it could run. */
static int run_step(qf_sched *s) {
    int n_decode, rows, pages, n = plan_step(s, &n_decode, &rows, &pages);
    if (n == 0) return 0;
    int drafting = 0, drafted = qf_spec_drafts(s->e) ? plan_drafts(s, n, pages, &rows, &drafting) : 0, accepted = 0;
    qf_expert_store *es = s->e->model->experts;
    qf_expert_stats es0 = es && s->o.verbose ? qf_es_stats(es) : (qf_expert_stats){0};
    for (int j = 0; j < n; j++) s->slots[s->step_slot[j]].pages_before = s->steps[j].st->n_pages;
    for (int j = 0; j < n; j++) /* the draws' uniform numbers, taken once the step is settled */
        if (s->steps[j].logits_mode == QF_LOGITS_DRAW) {
            slot *sl = &s->slots[s->step_slot[j]];
            qf_sampler_draw_desc(sl->req->smp, &sl->draw);
            s->steps[j].draw = &sl->draw;
        }
    double t0 = qf_now();
    qf_sparsity_counts sp0 = qf_workspace_sparsity(s->e->ws);
    int rc = qf_forward(s->e->model, &s->e->be, s->e->ws, s->steps, n);
    if (rc == QF_OK && drafted) accepted = settle_drafts(s, n, &rc);
    uint64_t step_no;
    count_step(s, &step_no, drafting, drafted, accepted);
    LOG(s, "step %llu: %d decode + %d prefill sequences, %d rows (%d drafts, %d accepted) in %.2f ms, KV pages %d/%d in use\n", (unsigned long long)step_no,
        n_decode, n - n_decode, rows, drafted, accepted, 1e3 * (qf_now() - t0), qf_kv_pool_pages(s->kv) - qf_kv_pool_free_pages(s->kv), qf_kv_pool_pages(s->kv));
    if (s->o.verbose) log_skips(s, step_no, es, &es0, &sp0, t0);
    const char *err = rc == QF_OK ? NULL : qf_last_error();
    if (!err) draw_rows(s, n, s->pre);
    for (int j = 0; j < n; j++) {
        slot *sl = &s->slots[s->step_slot[j]];
        qf_req *r = sl->req;
        if (err) {
            finish(s, r, QF_FINISH_ERROR, err);
            continue;
        }
        if (sl->spec_n) {
            emit_drafted(s, sl);
            continue;
        }
        if (sl->sp_on && qf_spec_seq_fed(s->e, sl->sp, r->toks + r->n_fed, sl->batch_n, sl->sp_fresh) != QF_OK) {
            finish(s, r, QF_FINISH_ERROR, qf_last_error());
            continue;
        }
        sl->sp_fresh = 0;
        r->n_fed += sl->batch_n;
        fork_mark(s, r, sl->st);
        /* snapshots on the interval's marks and at the prompt's end (a partial last page may be
         * shared while this sequence writes on past it: an adopter copies it and reads only what
         * lies before the snapshot's end) */
        if (s->prefix && r->n_fed <= r->n_prompt && (r->n_fed % s->o.prefix_interval == 0 || r->n_fed == r->n_prompt || r->n_fed == r->snap_at))
            qf_prefix_save(s->prefix, sl->st, r->toks);
        if (sl->st->n_pages > sl->pages_before)
            LOG(s, "seq %llu: %d KV pages allocated (%d held, %d free)\n", (unsigned long long)r->seq_no, sl->st->n_pages - sl->pages_before,
                sl->st->n_pages, qf_kv_pool_free_pages(s->kv));
        int why = QF_FINISH_NONE;
        if (r->n_fed == r->n_toks) why = emit_token(s, r, sl->logits, s->steps[j].logits_mode == QF_LOGITS_TOP1 || s->pre[j] ? &sl->top1 : NULL);
        if (why != QF_FINISH_NONE) finish(s, r, why, why == QF_FINISH_ERROR ? qf_last_error() : NULL);
        else if (r->n_fed + 1 == r->n_toks && r->notify) r->notify(r->notify_ud);
    }
    return 1;
}

/* Every running stream is waiting for its reader to drain output: nap instead of spinning. */
static void nap(qf_sched *s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 2000000;
    if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
    pthread_mutex_lock(&s->mu);
    pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    pthread_mutex_unlock(&s->mu);
}

static void *sched_main(void *arg) {
    qf_sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        for (;;) {
            int busy = s->q_head != NULL;
            for (int i = 0; i < s->o.max_batch && !busy; i++) busy = s->slots[i].req != NULL;
            if (s->stop || busy) break;
            pthread_cond_wait(&s->cv, &s->mu);
        }
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        drop_cancelled(s);
        admit(s);
        int ran = run_step(s);
        publish_stats(s);
        if (!ran) nap(s);
    }
    return NULL;
}

/* ---- lifetime ---- */

int qf_sched_create(qf_sched **out, qf_engine *e, const qf_sched_opts *o) {
    *out = NULL;
    if (o->max_batch < 1 || o->ctx < 2 || o->max_queue < 0) return qf_fail(QF_EINVAL, "max_batch, ctx and max_queue must be positive");
    qf_sched *s = calloc(1, sizeof *s);
    if (!s) return qf_fail(QF_ENOMEM, "out of memory");
    s->e = e;
    s->o = *o;
    if (s->o.page_tokens <= 0) s->o.page_tokens = 16;
    if (s->o.prefill_chunk <= 0) s->o.prefill_chunk = 256;
    int pt = s->o.page_tokens, ctx_pages = (o->ctx + pt - 1) / pt;
    if (s->o.kv_pages <= 0 && o->kv_mib > 0) s->o.kv_pages = (int)(o->kv_mib * 1048576.0 / (double)qf_kv_pool_page_bytes(e->model, pt));
    if (s->o.kv_pages <= 0) s->o.kv_pages = ctx_pages * o->max_batch;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (s->o.kv_pages < ctx_pages) {
        qf_sched_destroy(s);
        return qf_fail(QF_EINVAL, "%d KV pages of %d tokens cannot hold one full context of %d tokens (%d pages)", s->o.kv_pages, pt, o->ctx, ctx_pages);
    }
    int V = e->model->cfg.vocab;
    s->rows = qf_workspace_rows(e->ws);
    s->text_cap = e->text_cap + 16;
    s->rec_max = 1 + sizeof(qf_token_lp) + 5 + QF_MAX_STOP_LEN + s->text_cap;
    s->kv = qf_kv_pool_create(e->model, pt, s->o.kv_pages);
    if (s->o.prefix_interval <= 0) s->o.prefix_interval = s->o.prefill_chunk;
    s->o.prefix_interval = (s->o.prefix_interval + pt - 1) / pt * pt; /* whole pages: a snapshot's pages are all full */
    if (s->kv && s->o.prefix_cache_bytes && qf_prefix_create(&s->prefix, s->kv, qf_state_bytes(e->model), qf_kv_pool_page_bytes(e->model, pt), s->o.prefix_cache_bytes) != QF_OK) {
        qf_sched_destroy(s);
        return qf_fail(QF_ENOMEM, "out of memory for the prefix cache");
    }
    s->slots = calloc((size_t)o->max_batch, sizeof *s->slots);
    s->steps = calloc((size_t)o->max_batch, sizeof *s->steps);
    s->step_slot = calloc((size_t)o->max_batch, sizeof *s->step_slot);
    s->pre = calloc(2 * (size_t)o->max_batch, sizeof *s->pre);
    s->redo = calloc((size_t)o->max_batch, sizeof *s->redo);
    s->lp_scratch = malloc((size_t)V * sizeof(float));
    s->page_mark = malloc((size_t)s->o.kv_pages);
    s->text = malloc(s->text_cap);
    int ok = s->kv && s->slots && s->steps && s->step_slot && s->pre && s->redo && s->lp_scratch && s->text && s->page_mark;
    for (int i = 0; ok && i < o->max_batch; i++) {
        s->slots[i].st = qf_state_create_paged(e->model, s->kv, o->ctx);
        s->slots[i].logits = malloc((size_t)V * sizeof(float));
        ok = s->slots[i].st && s->slots[i].logits;
        int nd = qf_spec_drafts(e);
        if (ok && nd > 0) ok = (s->slots[i].sp = qf_spec_seq_create(e, nd, s->rows, o->ctx + nd + 2)) != NULL;
    }
    if (!ok) {
        qf_sched_destroy(s);
        return qf_fail(QF_ENOMEM, "out of memory for %d sequences and %d KV pages", o->max_batch, s->o.kv_pages);
    }
    s->stats.kv_pages_total = s->o.kv_pages;
    s->stats.prefix_budget = s->prefix ? s->o.prefix_cache_bytes : 0;
    LOG(s, "%d slots, context %d, %d KV pages of %d tokens (%.1f MiB), prefill chunk %d, %d rows per step\n", o->max_batch, o->ctx,
        s->o.kv_pages, pt, (double)s->o.kv_pages * (double)qf_kv_pool_page_bytes(e->model, pt) / 1048576.0, s->o.prefill_chunk, s->rows);
    if (pthread_create(&s->th, NULL, sched_main, s) != 0) {
        qf_sched_destroy(s);
        return qf_fail(QF_ENOMEM, "cannot start the scheduler thread");
    }
    s->th_started = 1;
    *out = s;
    return QF_OK;
}

void qf_sched_destroy(qf_sched *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->th_started) pthread_join(s->th, NULL);
    for (int i = 0; s->slots && i < s->o.max_batch; i++) {
        if (s->slots[i].req) finish(s, s->slots[i].req, QF_FINISH_CANCELLED, NULL);
        qf_state_free(s->slots[i].st);
        free(s->slots[i].logits);
        qf_spec_seq_free(s->slots[i].sp);
    }
    while (s->q_head) {
        qf_req *r = s->q_head;
        s->q_head = r->next;
        finish(s, r, QF_FINISH_CANCELLED, NULL);
    }
    qf_prefix_free(s->prefix); /* before the pool: it holds pages */
    qf_kv_pool_free(s->kv);
    qf_vocab_index_free(s->vix);
    free(s->slots);
    free(s->steps);
    free(s->step_slot);
    free(s->pre);
    free(s->redo);
    free(s->lp_scratch);
    free(s->page_mark);
    free(s->text);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* Wakes the thread after a cancel so the slot is freed without waiting for other work. */
void qf_sched_kick(qf_sched *s) {
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}
