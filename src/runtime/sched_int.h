/* The scheduler's state, shared by its parts: requests and their output (sched_req.c), slots and
 * admission (sched_slots.c), the step loop and lifetime (sched.c). */
#ifndef QF_RUNTIME_SCHED_INT_H
#define QF_RUNTIME_SCHED_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "base/utf8.h"
#include "runtime/sched.h"
#include "runtime/prefix.h"
#include "runtime/spec.h"

enum { REC_TEXT = 1, REC_TOKEN = 2, CHAN_BASE = 64 * 1024 };

/* A first choice's copy: not made yet, kept, gone (dropped, or none could be made); a later
 * choice that has taken it or given it up is FORK_LEFT. */
enum fork_state { FORK_NONE, FORK_KEPT, FORK_GONE, FORK_LEFT };

struct qf_req {
    pthread_mutex_t mu;
    int refs;
    atomic_int cancel;
    /* set at submit, then the scheduler thread's alone */
    int32_t *toks;
    int n_prompt, n_toks, cap_toks, n_fed, n_gen, max_tokens, logprobs, want_ids, ignore_eos, primed, slot, sparsity_set;
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
    pthread_cond_t cv; /* signalled with notify, for a reader that waits (qf_req_wait); under mu */
    uint64_t signals;
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
    int lone_rows; /* rows a step of one prefilling sequence may take (qf_forward_lone_rows) */
    int lone_turn; /* a long prompt and decoding sequences take turns: the prompt's step is next */
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

void sc_chan_token(qf_req *r, const qf_token_lp *t);
int sc_push_text(qf_req *r, const char *p, size_t n, int final);
void sc_fill_logprobs(const float *logits, int V, int top, int32_t tok, qf_token_lp *t);
void sc_hist_add(uint64_t *h, const double *bounds, double v);
void sc_fork_mark(qf_sched *s, qf_req *r, const qf_state *st);
int sc_slots_running(const qf_sched *s);
void sc_finish(qf_sched *s, qf_req *r, int why, const char *err);
/* Output is ready: the waiting reader woken, the owner's notify called. */
void sc_notify(qf_req *r);
void sc_admit(qf_sched *s);
void sc_preempt_newest(qf_sched *s);
size_t sc_chan_room(qf_req *r);
int sc_is_stop_id(const qf_req *r, int32_t tok);
int sc_shapes_logits(const qf_req *r);
void sc_shape_logits(const qf_sched *s, const qf_req *r, float *logits);
int sc_device_draws(const qf_sched *s, const qf_req *r);

#endif
