#include "runtime/sched_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/timer.h"
#include "runtime/prefix.h"

/* Where the forward runs long prompts layer by layer (streamed experts), the first prompt longer
 * than a chunk that may run so: alone in its step, each layer's experts then move once for the
 * whole prompt, not once a chunk. -1: none. *decoding: whether any other sequence decodes. */
static int lone_slot(qf_sched *s, int *decoding) {
    int found = -1;
    *decoding = 0;
    for (int i = 0; i < s->o.max_batch; i++) {
        slot *sl = &s->slots[i];
        qf_req *r = sl->req;
        if (!r || sc_chan_room(r) < 2 * s->rec_max) continue;
        int left = r->n_toks - r->n_fed;
        if (left == 1) *decoding = 1;
        else if (found < 0 && s->lone_rows > s->rows && left > s->o.prefill_chunk && !sl->sp_on && !r->fork) found = i;
    }
    return found;
}

/* A long prompt and the decoding sequences take turns (a step of the prompt alone, then one of
 * the others): the prompt's experts move once, and the others' tokens wait one layered step at
 * most. Returns the lone prompt's slot when this step is its, else -1 with *skip the slot to leave
 * out (or -1). */
static int lone_turn(qf_sched *s, int *skip) {
    int decoding, i = lone_slot(s, &decoding);
    *skip = -1;
    if (i < 0) return -1;
    if (!decoding || s->lone_turn) {
        s->lone_turn = 0;
        return i;
    }
    s->lone_turn = 1, *skip = i;
    return -1;
}

static int plan_step(qf_sched *s, int *n_decode, int *rows_out, int *pages_out) {
    int skip, only = lone_turn(s, &skip);
    for (;;) {
        int n = 0, rows = 0, pages = 0;
        *n_decode = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < s->o.max_batch; i++) {
                slot *sl = &s->slots[i];
                qf_req *r = sl->req;
                if (!r || i == skip || (only >= 0 && i != only)) continue;
                int left = r->n_toks - r->n_fed, decode = left == 1;
                if (decode != (pass == 0) || sc_chan_room(r) < 2 * s->rec_max) continue;
                int take = left < s->o.prefill_chunk ? left : s->o.prefill_chunk;
                if (s->prefix && r->n_fed < r->n_prompt) { /* chunks end on snapshot boundaries */
                    int to_mark = s->o.prefix_interval - r->n_fed % s->o.prefix_interval;
                    if (r->n_fed < r->snap_at && r->snap_at - r->n_fed < to_mark) to_mark = r->snap_at - r->n_fed;
                    take = take < to_mark ? take : to_mark;
                }
                if (r->fork && r->fork_state == FORK_NONE && r->n_fed < r->n_prompt - 1 && take > r->n_prompt - 1 - r->n_fed) take = r->n_prompt - 1 - r->n_fed;
                /* the lone prompt: in one step; with prefix snapshots it stops where the last turn
                 * starts (the snapshot the next turn reuses) and at its end, not at every interval */
                int lone = i == only;
                if (lone) {
                    take = left < s->lone_rows ? left : s->lone_rows;
                    if (s->prefix && r->n_fed < r->snap_at && r->snap_at - r->n_fed < take) take = r->snap_at - r->n_fed;
                }
                if (take > s->rows - rows && !(lone && take > s->o.prefill_chunk)) take = s->rows - rows;
                if (take <= 0) continue;
                sl->batch_n = take;
                /* a plain pick without logprobs or grammar: made where the logits are (on a GPU, only the id comes back) */
                int plain = r->logprobs < 0 && !r->gm && !sc_shapes_logits(r);
                int mode = take < left ? QF_LOGITS_NONE
                           : take > s->rows ? QF_LOGITS_LAST /* the layered path: its last row's logits */
                           : plain && qf_sampler_is_greedy(r->smp) ? QF_LOGITS_TOP1
                           : plain && sc_device_draws(s, r) ? QF_LOGITS_DRAW
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
        sc_preempt_newest(s);
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
    if (logits) sc_shape_logits(s, r, logits);
    if (r->gm && apply_grammar(s, r, logits) != QF_OK) return QF_FINISH_ERROR;
    int32_t tok = top1 ? *top1 : qf_sampler_sample(r->smp, logits);
    if (r->think_on && (tok == r->think_end || r->n_gen >= r->think_budget)) tok = r->think_end, r->think_on = 0;
    if (r->logprobs >= 0) sc_fill_logprobs(s->lp_scratch, V, r->logprobs, tok, &lp);
    double now = qf_now();
    pthread_mutex_lock(&s->mu);
    if (r->n_gen == 0) {
        r->t_first = now;
        sc_hist_add(s->stats.ttft_hist, qf_sched_ttft_buckets, now - r->t_submit);
        s->stats.ttft_n++;
        s->stats.ttft_sum += now - r->t_submit;
    } else {
        sc_hist_add(s->stats.itl_hist, qf_sched_itl_buckets, now - r->t_last);
        s->stats.itl_n++;
        s->stats.itl_sum += now - r->t_last;
    }
    s->stats.gen_tokens++;
    pthread_mutex_unlock(&s->mu);
    r->t_last = now;
    r->n_gen++;
    int eos = (qf_engine_is_eos(e, tok) && (!r->ignore_eos || r->gm)) || sc_is_stop_id(r, tok); /* a grammar allows an end only where it is complete */
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
    if (r->logprobs < 0 && r->want_ids) lp = (qf_token_lp){.id = tok};
    if ((r->logprobs >= 0 || r->want_ids) && !eos) sc_chan_token(r, &lp);
    int stopped = sc_push_text(r, s->text, len, done);
    pthread_mutex_unlock(&r->mu);
    if (stopped || eos) return QF_FINISH_STOP;
    return done ? QF_FINISH_LENGTH : QF_FINISH_NONE;
}

static void drop_cancelled(qf_sched *s) {
    for (int i = 0; i < s->o.max_batch; i++) {
        qf_req *r = s->slots[i].req;
        if (r && atomic_load(&r->cancel)) sc_finish(s, r, QF_FINISH_CANCELLED, NULL);
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
    int running = sc_slots_running(s);
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

static void count_step(qf_sched *s, uint64_t *step_no, int drafting, int drafted, int accepted, int rerun) {
    pthread_mutex_lock(&s->mu);
    *step_no = ++s->stats.steps;
    s->stats.spec_steps += (uint64_t)drafting, s->stats.spec_drafted += (uint64_t)drafted, s->stats.spec_accepted += (uint64_t)accepted;
    s->stats.spec_reruns += (uint64_t)rerun;
    pthread_mutex_unlock(&s->mu);
}

/* How many drafts a greedy decoding sequence may make this step: within its tokens still wanted,
 * the context, the head's context, its channel, the step's rows left and the pages free. */
static int drafts_now(qf_sched *s, const slot *sl, int rows_left, int pages_left) {
    const qf_req *r = sl->req;
    int n = qf_engine_drafts(s->e), left = r->max_tokens - r->n_gen - 1, ctx = s->o.ctx - r->n_toks - 1, head = qf_spec_seq_room(sl->sp) - 1;
    n = n < left ? n : left;
    n = n < ctx ? n : ctx;
    n = n < head ? n : head;
    n = n < rows_left ? n : rows_left;
    while (n > 0 && qf_state_pages_needed(sl->st, n + 1) - qf_state_pages_needed(sl->st, 1) > pages_left) n--;
    if (n <= 0 || sc_chan_room(sl->req) < (size_t)(n + 2) * s->rec_max) return 0;
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
static int settle_drafts(qf_sched *s, int n, int *rc, int *rerun) {
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
    *rerun = m > 0;
    return accepted;
}

/* A drafting sequence's tokens after its step: the accepted drafts and the next pick, in order. */
static void emit_drafted(qf_sched *s, slot *sl) {
    qf_req *r = sl->req;
    int32_t out[QF_SPEC_MAX_DRAFT + 1];
    int keep = sl->spec_k + 1;
    if (qf_spec_seq_kept(s->e, sl->sp, sl->spec_d, keep, out) != QF_OK) {
        sc_finish(s, r, QF_FINISH_ERROR, qf_last_error());
        return;
    }
    r->n_fed += keep;
    for (int t = 0; t < keep; t++) {
        int why = emit_token(s, r, NULL, &out[t]);
        if (why != QF_FINISH_NONE) {
            sc_finish(s, r, why, why == QF_FINISH_ERROR ? qf_last_error() : NULL);
            return;
        }
    }
    sc_notify(r);
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
        pre[j] = mode == QF_LOGITS_DRAW || (mode == QF_LOGITS_LAST && r->n_fed + sl->batch_n == r->n_toks && r->logprobs < 0 && !r->gm && !sc_shapes_logits(r));
        if (pre[j] && (mode == QF_LOGITS_LAST || sl->top1 < 0)) d.idx[d.n++] = j;
    }
    if (d.n > 1) qf_pool_run(s->e->pool, draw_one, &d, d.n);
    else if (d.n == 1) draw_one(&d, 0);
}

/* Returns 0 when there was nothing it could run. */
static int run_step(qf_sched *s) {
    int n_decode, rows, pages, n = plan_step(s, &n_decode, &rows, &pages);
    if (n == 0) return 0;
    int drafting = 0, drafted = qf_engine_drafts(s->e) ? plan_drafts(s, n, pages, &rows, &drafting) : 0, accepted = 0;
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
    int rerun = 0;
    if (rc == QF_OK && drafted) accepted = settle_drafts(s, n, &rc, &rerun);
    uint64_t step_no;
    count_step(s, &step_no, drafting, drafted, accepted, rerun);
    LOG(s, "step %llu: %d decode + %d prefill sequences, %d rows (%d drafts, %d accepted) in %.2f ms, KV pages %d/%d in use\n", (unsigned long long)step_no,
        n_decode, n - n_decode, rows, drafted, accepted, 1e3 * (qf_now() - t0), qf_kv_pool_pages(s->kv) - qf_kv_pool_free_pages(s->kv), qf_kv_pool_pages(s->kv));
    if (s->o.verbose) log_skips(s, step_no, es, &es0, &sp0, t0);
    const char *err = rc == QF_OK ? NULL : qf_last_error();
    if (!err) draw_rows(s, n, s->pre);
    for (int j = 0; j < n; j++) {
        slot *sl = &s->slots[s->step_slot[j]];
        qf_req *r = sl->req;
        if (err) {
            sc_finish(s, r, QF_FINISH_ERROR, err);
            continue;
        }
        if (sl->spec_n) {
            emit_drafted(s, sl);
            continue;
        }
        if (sl->sp_on && qf_spec_seq_fed(s->e, sl->sp, r->toks + r->n_fed, sl->batch_n, sl->sp_fresh) != QF_OK) {
            sc_finish(s, r, QF_FINISH_ERROR, qf_last_error());
            continue;
        }
        sl->sp_fresh = 0;
        r->n_fed += sl->batch_n;
        sc_fork_mark(s, r, sl->st);
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
        if (why != QF_FINISH_NONE) sc_finish(s, r, why, why == QF_FINISH_ERROR ? qf_last_error() : NULL);
        else if (r->n_fed + 1 == r->n_toks) sc_notify(r);
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
        sc_admit(s);
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
    s->lone_rows = qf_forward_lone_rows(e->model, e->ws);
    s->text_cap = e->text_cap + 16;
    s->rec_max = 1 + sizeof(qf_token_lp) + 5 + QF_MAX_STOP_LEN + s->text_cap;
    s->kv = qf_kv_pool_create(e->model, pt, s->o.kv_pages);
    if (s->o.prefix_interval <= 0) s->o.prefix_interval = s->o.prefill_chunk;
    s->o.prefix_interval = (s->o.prefix_interval + pt - 1) / pt * pt; /* whole pages: a snapshot's pages are all full */
    /* under a device budget the snapshots' DeltaNet copies wait in host memory, outside the plan's device memory */
    if (s->kv && s->o.prefix_cache_bytes &&
        qf_prefix_create(&s->prefix, s->kv, e->model->dev, e->plan.active, qf_state_block_bytes(e->model), qf_kv_pool_page_bytes(e->model, pt),
                         s->o.prefix_cache_bytes) != QF_OK) {
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
        int nd = qf_engine_drafts(e);
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
        if (s->slots[i].req) sc_finish(s, s->slots[i].req, QF_FINISH_CANCELLED, NULL);
        qf_state_free(s->slots[i].st);
        free(s->slots[i].logits);
        qf_spec_seq_free(s->slots[i].sp);
    }
    while (s->q_head) {
        qf_req *r = s->q_head;
        s->q_head = r->next;
        sc_finish(s, r, QF_FINISH_CANCELLED, NULL);
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
