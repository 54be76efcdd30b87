/* The scheduler: continuous (iteration-level) batching of many sequences on one engine.
 *
 * One thread runs steps. A step is one batched forward holding the next token of every decoding
 * sequence plus prompt chunks of sequences still prefilling, so running streams keep flowing
 * while new prompts come in. States (DeltaNet conv + recurrent state) exist once per slot; the
 * full-attention KV cache comes from a page pool allocated at start. When the pool runs dry the
 * most recently admitted sequence is preempted and later recomputed, which gives the same tokens.
 *
 * Requests are submitted from any thread. Output (text released past stop-string holdback, and
 * per-token logprobs) goes into a fixed-size channel per request that the owner drains in
 * qf_req_poll after a notify callback; a request whose channel is full is skipped for a step,
 * so a slow reader slows only itself. Nothing is allocated per token. */
#ifndef QF_RUNTIME_SCHED_H
#define QF_RUNTIME_SCHED_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/engine.h"
#include "grammar/grammar.h"
#include "runtime/sampler.h"

#define QF_MAX_STOP 16
#define QF_MAX_STOP_LEN 256
#define QF_MAX_TOP_LOGPROBS 20

typedef struct qf_sched_opts {
    int max_batch;     /* running sequences */
    int ctx;           /* tokens per sequence (prompt + generated) */
    int kv_pages;      /* 0 = kv_mib, or else enough for max_batch full contexts */
    double kv_mib;     /* KV pool as a memory budget instead of a page count */
    int page_tokens;   /* 0 = 16 */
    int prefill_chunk; /* prompt tokens per sequence per step; 0 = 256 */
    int max_queue;     /* waiting requests before submit says busy */
    size_t prefix_cache_bytes; /* snapshots for prefix reuse (0: off) */
    int prefix_interval;       /* tokens between snapshots while a prompt is prefilled (0: prefill_chunk) */
    int verbose;       /* [FLASH-SCHEDULER] lines on log */
    FILE *log;
} qf_sched_opts;

typedef struct qf_sched qf_sched;
typedef struct qf_req qf_req;

enum qf_finish { QF_FINISH_NONE = 0, QF_FINISH_STOP, QF_FINISH_LENGTH, QF_FINISH_CANCELLED, QF_FINISH_ERROR };

typedef struct qf_req_params {
    const int32_t *prompt; /* copied */
    int n_prompt;
    int max_tokens;        /* <= 0: up to the context */
    qf_sampling sampling;
    const char *stop[QF_MAX_STOP];
    int n_stop;
    int logprobs;          /* top alternatives per token, -1 = no logprobs */
    int want_ids;          /* without logprobs: each generated id to the sink's token (logprob 0, no alternatives; drafting stays on) */
    int ignore_eos;
    int sparsity_set;      /* this request's sparsity level instead of the model's */
    float sparsity;
    qf_grammar *grammar;   /* the reply follows it (constrained decoding); submit takes it, even when it fails */
    int32_t grammar_after; /* the grammar starts after this token (a reasoning block's end); -1: at once */
    int min_tokens;        /* the end (eos, stop_ids, stop strings) is held off until this many tokens */
    const int32_t *stop_ids; /* more ids that end the reply, not emitted (copied) */
    int n_stop_ids;
    const int32_t *bias_ids; /* logit_bias: bias[i] added to logit bias_ids[i] before sampling (copied) */
    const float *bias;
    int n_bias;
    int think_budget_on;   /* the reply starts in a reasoning block that ends (think_end forced) */
    int think_budget;      /* after this many generated tokens when not ended before */
    int32_t think_end;
    int snap_at;           /* a prefix snapshot also after this many prompt tokens (where the generation
                              prompt begins, which the next turn's prompt shares); 0: none */
    void (*notify)(void *ud); /* called from the scheduler thread when output is ready */
    void *notify_ud;
} qf_req_params;

/* Starts the scheduler thread. The engine stays owned by the caller and must outlive it. */
int qf_sched_create(qf_sched **out, qf_engine *e, const qf_sched_opts *o);
/* Cancels everything still running, joins the thread, frees. */
void qf_sched_destroy(qf_sched *s);

/* QF_EINVAL: bad parameters or prompt over the context (message gives both counts);
 * QF_EBUSY: the queue is full. On success *out holds a reference the caller releases. */
int qf_sched_submit(qf_sched *s, const qf_req_params *p, qf_req **out);
/* n choices of one prompt, queued together or not at all (out[n]): the prompt is prefilled once,
 * by the first; the others start from a copy of its state before the prompt's last token, with
 * seeds seed + 1, seed + 2, ... (greedy choices are the same). */
int qf_sched_submit_n(qf_sched *s, const qf_req_params *p, int n, qf_req **out);
/* Stops the request; its slot and pages are freed within one step. */
void qf_req_cancel(qf_req *r);
void qf_req_release(qf_req *r);
/* Wakes the scheduler thread (after a cancel, so the slot is freed at once). */
void qf_sched_kick(qf_sched *s);

typedef struct qf_req_status {
    int finish;            /* enum qf_finish; NONE while running */
    int prompt_tokens, gen_tokens;
    int cached_tokens;     /* prompt tokens not prefilled: taken from a prefix snapshot */
    int stop_index;        /* finish STOP by a stop string: its index in the params' stop; else -1 */
    int32_t stop_token;    /* finish STOP by an end token (eos or stop_ids): the id; else -1 */
    double ttft;           /* seconds from submit to the first token; 0 before it */
    char error[256];
} qf_req_status;

typedef struct qf_token_lp {
    int32_t id;
    float logprob;
    int n_top;
    int32_t top_id[QF_MAX_TOP_LOGPROBS];
    float top_lp[QF_MAX_TOP_LOGPROBS];
} qf_token_lp;

typedef struct qf_req_sink {
    void (*text)(void *ud, const char *s, size_t n);
    void (*token)(void *ud, const qf_token_lp *t); /* only when logprobs or want_ids were asked for */
    void *ud;
} qf_req_sink;

/* Hands everything produced since the last poll to sink, in order, and fills st. */
void qf_req_poll(qf_req *r, const qf_req_sink *sink, qf_req_status *st);
/* Waits until the request has output it had not when *seen was taken (or it finished), at most
 * timeout seconds; *seen is updated. For a reader on its own thread instead of notify. */
void qf_req_wait(qf_req *r, uint64_t *seen, double timeout);
/* One request run to its end on the calling thread: submitted, its output handed to sink as it
 * comes, st its final status; a nonzero *cancel (a signal handler's flag; may be NULL) cancels it.
 * The command-line front ends' way through the scheduler. QF_EIO with the message of a request
 * that failed while running; submit's errors as they are. */
int qf_sched_run(qf_sched *s, const qf_req_params *p, const qf_req_sink *sink, const volatile sig_atomic_t *cancel, qf_req_status *st);

typedef struct qf_sched_stats {
    uint64_t requests, finished, cancelled, preempted, prompt_tokens, gen_tokens, steps;
    int running, waiting, kv_pages_used, kv_pages_total, kv_pages_cached; /* used: by running sequences; cached: by prefix snapshots alone */
    uint64_t expert_hits, expert_misses, expert_bytes_loaded; /* the expert store's counters */
    /* cumulative histogram counts at the bucket bounds of qf_sched_*_buckets */
    uint64_t ttft_hist[16], itl_hist[16], ttft_n, itl_n;
    double ttft_sum, itl_sum;
    uint64_t prefix_hits, prefix_misses, prefix_tokens, prefix_evicted; /* prefix reuse */
    int prefix_snapshots;
    size_t prefix_bytes, prefix_budget;
    uint64_t spec_steps, spec_drafted, spec_accepted; /* serve --draft: steps with drafts, the drafts, those accepted */
    uint64_t spec_reruns;  /* steps whose refused drafts made their standing rows run again (one more forward) */
    /* finished requests (stop, length, error): histograms of their phases and sizes (vLLM's) */
    uint64_t e2e_hist[16], queue_hist[16], prefill_hist[16], decode_hist[16], ptok_hist[16], gtok_hist[16], req_n;
    double e2e_sum, queue_sum, prefill_sum, decode_sum, ptok_sum, gtok_sum;
    uint64_t finished_stop, finished_length, finished_error;
    uint64_t masks;        /* grammar masks computed, and their time */
    double mask_seconds;
} qf_sched_stats;

extern const double qf_sched_ttft_buckets[15];
extern const double qf_sched_itl_buckets[15];
extern const double qf_sched_tok_buckets[15]; /* token counts */

void qf_sched_get_stats(qf_sched *s, qf_sched_stats *out);

#endif
