#include "runtime/sched_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/timer.h"
#include "runtime/prefix.h"

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
void sc_fork_mark(qf_sched *s, qf_req *r, const qf_state *st) {
    if (!r->fork || r->fork_state != FORK_NONE || r->n_fed != r->n_prompt - 1) return;
    r->fork_state = qf_state_snap_take(st, &r->fork_snap, NULL, 0) == QF_OK ? FORK_KEPT : FORK_GONE;
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
int sc_slots_running(const qf_sched *s) {
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
    for (int i = 0; i < 6; i++) sc_hist_add(h[i], i < 4 ? qf_sched_ttft_buckets : qf_sched_tok_buckets, v[i]), *sum[i] += v[i];
    st->req_n++;
    st->finished_stop += why == QF_FINISH_STOP, st->finished_length += why == QF_FINISH_LENGTH, st->finished_error += why == QF_FINISH_ERROR;
}

void sc_finish(qf_sched *s, qf_req *r, int why, const char *err) {
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
    int running = sc_slots_running(s); /* counted before the reader hears of the end: /metrics and /ready agree with the answer */
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
    sc_notify(r);
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

void sc_admit(qf_sched *s) {
    for (;;) {
        qf_req *cancelled = NULL;
        pthread_mutex_lock(&s->mu);
        int fs = free_slot(s);
        qf_req *r = pop_admissible(s, fs, &cancelled);
        pthread_mutex_unlock(&s->mu);
        while (cancelled) {
            qf_req *c = cancelled;
            cancelled = c->next;
            sc_finish(s, c, QF_FINISH_CANCELLED, NULL);
        }
        if (!r) return;
        r->slot = fs;
        r->n_fed = r->after && r->fork_state != FORK_LEFT ? fork_join(s, r, s->slots[fs].st) : 0;
        if (!r->n_fed && s->prefix) r->n_fed = qf_prefix_restore(s->prefix, s->slots[fs].st, r->toks, r->n_toks);
        sc_fork_mark(s, r, s->slots[fs].st);
        if (!r->primed) {
            pthread_mutex_lock(&r->mu); /* status is the reader's too */
            r->status.cached_tokens = r->n_fed;
            pthread_mutex_unlock(&r->mu);
        }
        s->slots[fs].req = r;
        if (r->t_admit == 0) r->t_admit = qf_now();
        if (!r->primed && r->grammar && grammar_start(s, r) != QF_OK) {
            sc_finish(s, r, QF_FINISH_ERROR, qf_last_error());
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
void sc_preempt_newest(qf_sched *s) {
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

size_t sc_chan_room(qf_req *r) {
    pthread_mutex_lock(&r->mu);
    size_t room = r->chan_cap - r->chan_len;
    pthread_mutex_unlock(&r->mu);
    return room;
}

int sc_is_stop_id(const qf_req *r, int32_t tok) {
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == tok) return 1;
    return 0;
}

/* Whether the request changes its logits before the pick (logit bias, ends held off by
 * min_tokens), so they must come to the host. */
int sc_shapes_logits(const qf_req *r) {
    return r->n_bias > 0 || r->n_gen < r->min_tokens;
}

/* Logit bias, then the ends masked while fewer than min_tokens are out. */
void sc_shape_logits(const qf_sched *s, const qf_req *r, float *logits) {
    for (int i = 0; i < r->n_bias; i++) logits[r->bias_ids[i]] += r->bias[i];
    if (r->n_gen >= r->min_tokens) return;
    const qf_config *c = &s->e->model->cfg;
    for (int i = 0; i < c->n_eos; i++) logits[c->eos_ids[i]] = -INFINITY;
    for (int i = 0; i < r->n_stop_ids; i++) logits[r->stop_ids[i]] = -INFINITY;
}

/* Whether the device draws this request's tokens (backend/ops.h qf_draw): the backend can, and
 * its top_k is one the draw takes. */
int sc_device_draws(const qf_sched *s, const qf_req *r) {
    const qf_dec_ops *d = s->e->be.ops->dec;
    return d && d->draw && qf_sampler_can_draw(r->smp);
}

/* Picks the step's rows: one token for every decoding sequence first, then prompt chunks.
 * Returns the number of sequences; the pages they need (*pages_out) are guaranteed free. */
