/* The Qwen3.5/3.6 text model (dense qwen3_5 and MoE qwen3_5_moe): weights bound once at load,
 * per-sequence state objects, and a batched forward over several sequences at once. */
#ifndef QF_MODEL_MODEL_H
#define QF_MODEL_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "backend/ops.h"
#include "base/err.h"
#include "experts/ep.h"
#include "experts/store.h"
#include "format/config.h"
#include "format/safetensors.h"

typedef struct qf_layer_w {
    int kind;                  /* QF_LAYER_LINEAR or QF_LAYER_FULL */
    float *attn_norm, *ffn_norm; /* (hidden) = 1 + w */
    /* gated full attention */
    qf_mat wq;                 /* (n_heads * 2 * head_dim, hidden): per head [query | gate] */
    qf_mat wk, wv;             /* (n_kv * head_dim, hidden) */
    qf_mat wo;                 /* (hidden, n_heads * head_dim) */
    float *q_norm, *k_norm;    /* (head_dim) = 1 + w */
    /* Gated DeltaNet */
    qf_mat w_qkv;              /* (conv_dim, hidden): q | k | v */
    qf_mat w_z;                /* (nv * dv, hidden) */
    qf_mat w_b, w_a;           /* (nv, hidden) */
    qf_mat w_out;              /* (hidden, nv * dv) */
    float *conv_w;             /* (conv_dim, K) */
    float *dt_bias;            /* (nv) */
    float *neg_A;              /* (nv) = -exp(A_log) */
    float *gnorm;              /* (dv), plain gamma */
    /* MoE (router + shared expert; routed experts live in the expert store) or dense MLP */
    qf_mat router;             /* (n_experts, hidden) */
    qf_mat sh_gate, sh_up;     /* (shared_ffn, hidden) */
    qf_mat sh_down;            /* (hidden, shared_ffn) */
    qf_mat sh_gate_w;          /* (1, hidden) */
    qf_mat gate, up, down;     /* dense: (ffn, hidden), (ffn, hidden), (hidden, ffn) */
    /* On a device, the matrices that multiply the same input are stored one after another, so a
     * one-row step reads them in one launch: in_proj = w_qkv|w_z|w_b|w_a (linear) or wq|wk|wv
     * (full attention); ffn_in = router|sh_gate|sh_up|sh_gate_w. The separate views above point
     * into them. data NULL: not fused. */
    qf_mat in_proj, ffn_in;
    /* Trunk sparsity's copies, transposed (W^T: a column of W per row, for matmul_cols and
     * matmul_sparse): in_t of in_proj (its parts' concatenation where not fused), out_t of w_out /
     * wo. data NULL until a level above 0 is set (model/sparse.c). */
    qf_mat in_t, out_t;
} qf_layer_w;

typedef struct qf_model {
    qf_config cfg;
    qf_st_set st;
    qf_mat embed;       /* (vocab, hidden) */
    qf_mat lm_head;     /* (vocab, hidden) */
    float *final_norm;  /* (hidden) = 1 + w */
    float *inv_freq;    /* (rot_dim / 2) */
    qf_layer_w *layers;
    qf_expert_store *experts;
    void **owned;       /* converted small tensors, freed with the model */
    uint64_t synth_seed; /* synthetic models: the weights' seed */
    qf_pool *synth_pool; /* while a synthetic model's weights are made: the threads that fill them */
    int synth_experts;   /* a synthetic model's expert format (qf_synth_opts.experts) */
    int synth_trunk;     /* and its trunk's (qf_synth_opts.trunk) */
    qf_backend *dev;     /* set by qf_model_to_device: weights, states and scratch live there */
    void **dev_bufs;     /* device copies of the weights, freed with the model */
    int n_dev_bufs;
    int dec_ok;          /* the device's fused decode ops (ops.h qf_dec_ops) fit this model */
    int prefetch_n;      /* host path: each row's next-layer router guesses the expert store reads ahead (0: none) */
    float sparsity[QF_MAX_LAYERS]; /* each layer's sparsity level (qf_model_set_sparsity); 0: exact */
    int sparse;                    /* any level above 0 */
    uint64_t sparsity_gen;         /* counts changes of levels or thresholds (a recorded step holds them) */
    int sparse_off;                /* the levels kept off (QF_SPARSE_* bits; 0: all act) */
    int kv_min_ctx;                /* the KV level acts from this context on (0: QF_KV_MIN_CTX) */
    float (*trunk_thr)[QF_ACT_GROUPS][QF_TRUNK_GRID]; /* [n_layers]: |x| thresholds for trunk sparsity 0.1..0.9 (NULL: none) */
    int n_owned, cap_owned;
    /* The MTP head (docs/model-spec.md §8), when config.json names one and the mtp.* tensors are there:
     * u = mtp_fc . [rmsnorm(embed(x)) * mtp_norm_e | rmsnorm(h) * mtp_norm_h] runs through `mtp`, a
     * one-layer view of this model (its full-attention layer and MoE, final norm mtp.norm; embed,
     * lm_head and RoPE the main model's: it owns nothing but its struct and expert store). NULL: none. */
    struct qf_model *mtp;
    qf_mat mtp_fc;       /* (hidden, 2 * hidden) */
    float *mtp_norm_e, *mtp_norm_h; /* (hidden) = 1 + w */
} qf_model;

typedef struct qf_load_opts {
    qf_diag *diag;                                       /* every binding problem, one line each */
    void (*progress)(void *ud, int done, int total);     /* optional */
    void *progress_ud;
} qf_load_opts;

/* Loads config, checkpoint and binds every weight (dtype + shape checked). *out is NULL on error;
 * the message names the file or tensor. */
int qf_model_load(qf_model **out, const char *dir, const qf_load_opts *opts);
void qf_model_free(qf_model *m);

/* Copies every weight to the backend's memory (straight from the mapped checkpoint) and points
 * the model at it; states and workspaces made afterwards live there too. DROP_HOST frees
 * generated (synthetic) weights once copied; EXPERTS_HOME leaves the routed experts where they
 * are (and every host copy), for an expert cache to take them: qf_model_dec_check after that. */
enum { QF_TO_DEVICE_DROP_HOST = 1, QF_TO_DEVICE_EXPERTS_HOME = 2 };
int qf_model_to_device(qf_model *m, qf_backend *be, int flags);
/* Whether the device's fused decode ops fit the model with its expert store as it is now. */
int qf_model_dec_check(qf_model *m);
/* Hands the model a store built on its own (experts/: a RAM pool or device slots in front of the
 * store it has, which the new one now owns), before the model runs again; the decode ops' fit is
 * checked again. */
void qf_model_use_experts(qf_model *m, qf_expert_store *s);

/* Activation-aware sparsity: a level per layer from 0 (exact, the default) to 1, applied to the
 * steps that generate (one token per sequence); prompts run dense, where the bytes a step reads
 * are shared by all its rows. What a level does (README's table gives each setting's cost):
 *   experts: a row's routed experts whose renormalised weight is below level / top_k (that share
 *   of the uniform weight) are dropped, never fewer than ceil(top_k / 2) kept, the rest
 *   renormalised (qf_ref_route_drop); the shared expert always runs.
 *   trunk (with calibrated thresholds, qf_model_set_trunk_thresholds): the inputs of the mixer's
 *   in projections (DeltaNet in_proj, attention q/k/v) and of its out projection (out_proj, o_proj)
 *   lose the entries whose magnitude is under the threshold that zeroes level / 2 of them on the
 *   calibration text (TEAL's rule), and those products read only the kept columns, through
 *   transposed copies of their weights made when a level above 0 is first set.
 * levels: [n_layers], NULL for 0 everywhere. QF_EUNSUPPORTED on a device whose fused decode ops
 * cannot take it. */
int qf_model_set_sparsity(qf_model *m, const float *levels);
/* On the host path with an expert store that reads ahead (a RAM cache): each decode row's n
 * likeliest experts of the next layer (its router on this layer's MoE input) are handed to the
 * store while this layer's experts run; 0: none. Output unchanged (what a slot holds, not what a
 * row computes). */
void qf_model_set_prefetch(qf_model *m, int n);
/* The three levels of a sparsity level, each of which may be kept off (qf_model_sparse_off). */
enum { QF_SPARSE_EXPERTS = 1, QF_SPARSE_TRUNK = 2, QF_SPARSE_KV = 4 };
void qf_model_sparse_off(qf_model *m, int parts);
/* KV pages: from a context of kv_min_ctx tokens (config_flash.json's kv_page_min_context, default
 * QF_KV_MIN_CTX) a new token attends to the first page, the newest and the pages of the highest
 * Quest bounds, ceil((1 - level) x its pages) of them and never fewer than QF_KV_MIN_BUDGET tokens'
 * worth (qf_ref_page_select). 0: every key. */
#define QF_KV_MIN_CTX 8192
#define QF_KV_MIN_BUDGET 1024
int qf_sparsity_kv_pages(const qf_model *m, float level, int ctx, int page_tokens);
/* Whether a level above 0 runs now (per request too): on a device, its fused decode ops take it
 * and the transposed copies exist (a level above 0 was set at load). */
int qf_model_sparsity_ready(const qf_model *m);
/* The bytes of the transposed copies a first level above 0 makes (where the weights live). */
size_t qf_model_sparsity_bytes(const qf_model *m);
/* The trunk's thresholds, [n_layers][QF_ACT_GROUPS][QF_TRUNK_GRID] (copied; NULL: none). */
int qf_model_set_trunk_thresholds(qf_model *m, const float *thr);
/* The |x| threshold of layer L's group at a level: the calibrated grid 0.1..0.9 read at the
 * level's target share (linear between points, from 0 below the first); 0 without thresholds. */
float qf_sparsity_trunk_threshold(const qf_model *m, int L, int group, float level);
static inline float qf_sparsity_trunk_target(float level) { return 0.5f * level; }
static inline float qf_sparsity_expert_tau(float level, int top_k) { return level / (float)top_k; }
static inline int qf_sparsity_min_k(int top_k) { return (top_k + 1) / 2; }

/* A model with a real checkpoint's shapes and generated weights (see synthetic.c). */
typedef struct qf_synth_opts {
    const char *preset;      /* "qwen3.6-35b-a3b", ... */
    const char *config_file; /* or any config.json */
    int layers;              /* 0 = all; else the first N layers, full per-layer shapes */
    uint64_t seed;
    int experts;             /* the routed experts' format: 0 (bf16), QF_Q_I8B32 or QF_Q_I4B32 (quantised from the generated values) */
    int mtp;                 /* 1: an MTP head of the release's shapes too (mtp_num_hidden_layers 1) */
    int trunk;               /* 0 (bf16) or QF_Q_I8B32: the projections qf_quant_trunk_format names, drawn as int8 codes */
} qf_synth_opts;
int qf_model_synthetic(qf_model **out, const qf_synth_opts *so, const qf_load_opts *opts);
const char *qf_synth_presets(void);
/* A preset's config.json text (NULL: no such preset). */
const char *qf_synth_preset_json(const char *name);

/* The full-attention KV cache lives in fixed-size pages from a pool allocated once: a page holds
 * page_tokens tokens' keys and values for every full-attention layer. Not thread-safe: one owner
 * (the scheduler) allocates and frees pages. */
typedef struct qf_kv_pool qf_kv_pool;

qf_kv_pool *qf_kv_pool_create(const qf_model *m, int page_tokens, int n_pages); /* NULL on OOM */
void qf_kv_pool_free(qf_kv_pool *p);
int qf_kv_pool_pages(const qf_kv_pool *p);
int qf_kv_pool_free_pages(const qf_kv_pool *p);
int qf_kv_pool_page_tokens(const qf_kv_pool *p);
size_t qf_kv_pool_page_bytes(const qf_model *m, int page_tokens);

/* Per-sequence state: DeltaNet conv + recurrent state, and the page table of its KV cache. */
typedef struct qf_state {
    int pos;       /* tokens consumed so far */
    int max_ctx;
    float **conv;  /* per layer (linear only): (K-1, conv_dim) */
    float **ssm;   /* per layer (linear only): (nv, dk, dv) */
    size_t *kv_off;   /* per layer (full only): offset of its keys inside a page */
    size_t kv_layer_floats; /* one layer's keys in a page; its values follow, then the keys' summary */
    int kv_summarized;      /* full pages whose key summaries are made (sparsity's KV level) */
    int32_t *sel, *sel_dev; /* a decode step's chosen pages (sparsity's KV level): host, device copy */
    float *score;           /* the pages' scores for that choice (host) */
    qf_kv_pool *kv;
    int32_t *pages;   /* page table: (max_ctx / page_tokens rounded up) */
    int32_t *pages_dev; /* its copy in device memory (NULL on the host) */
    qf_backend *dev;
    int n_pages;      /* pages held */
    int owns_kv;
    float *block;     /* one allocation behind conv and ssm */
    size_t block_floats;
} qf_state;

/* A state with its own private pool, big enough for max_ctx tokens. */
qf_state *qf_state_create(const qf_model *m, int max_ctx);
/* A state whose pages come from a shared pool as it grows. */
qf_state *qf_state_create_paged(const qf_model *m, qf_kv_pool *kv, int max_ctx);
/* Makes sure pages exist for n more tokens; QF_ENOMEM (state unchanged) when the pool is empty. */
int qf_state_reserve(qf_state *s, int n);
/* Pages needed beyond those held to add n tokens. */
int qf_state_pages_needed(const qf_state *s, int n);
/* Back to an empty sequence; its pages return to the pool. */
void qf_state_reset(qf_state *s);
void qf_state_free(qf_state *s);
/* A copy of a state after pos tokens, for prefix reuse: the DeltaNet states copied, the KV pages
 * shared (each page referenced; a page is free once nobody holds it). */
typedef struct qf_state_snap {
    int pos, n_pages, kv_summarized;
    int32_t *pages;
    float *block;   /* the DeltaNet states: backend memory, or host memory where host */
    int host;       /* block is host memory: copied out of the device and back */
    int owns_block; /* block was allocated by the snapshot (backend memory) */
    qf_kv_pool *kv;
    qf_backend *dev;
} qf_state_snap;
/* The bytes of a state's DeltaNet block (one float at least), what a snapshot's block holds. */
size_t qf_state_block_bytes(const qf_model *m);
/* block: the caller's qf_state_block_bytes of memory for the states, host memory when host (a
 * pool of snapshots kept off the device), or NULL: backend memory the snapshot allocates and owns. */
int qf_state_snap_take(const qf_state *s, qf_state_snap *snap, float *block, int host);
/* The pages unreferenced; a block the caller gave stays the caller's. */
void qf_state_snap_drop(qf_state_snap *snap);
/* An empty state continues from snap: full pages shared, a partial last page copied (QF_ENOMEM
 * when the pool has no page for it), the DeltaNet states copied. */
int qf_state_adopt(qf_state *s, const qf_state_snap *snap);
void qf_kv_pool_ref(qf_kv_pool *p, int32_t page);
void qf_kv_pool_unref(qf_kv_pool *p, int32_t page);
/* Layer L's (full attention) view of the state's KV pages, for the attention ops. */
qf_kv_view qf_state_kv_view(const qf_state *s, int L);
/* Bytes of one state excluding KV pages. */
size_t qf_state_bytes(const qf_model *m);

/* Scratch for one forward of up to max_rows tokens in total, allocated once. */
typedef struct qf_workspace qf_workspace;
qf_workspace *qf_workspace_create(const qf_model *m, int max_rows);
void qf_workspace_free(qf_workspace *ws);
/* A buffer for the hidden states of prompts up to `tokens` long (nothing when that is no more than
 * the workspace's rows): with it, qf_forward_seq runs a longer prompt layer by layer, on a device
 * when the expert store stages layers (wide_table: each layer's experts cross the link once for
 * the whole prompt), on the host always (each layer's MoE over the whole prompt: a RAM cache reads
 * each expert once a layer). Allocated once, here. */
int qf_workspace_reserve_prompt(qf_workspace *ws, int tokens);
int qf_workspace_rows(const qf_workspace *ws);
/* Bytes of backend memory the workspace holds (its block and the prompt buffer). */
size_t qf_workspace_bytes(const qf_workspace *ws);
/* The largest shapes m's forward over ws asks of the backend's ops (their scratch's bound), with
 * sparsity's transposed products when sparse. */
void qf_model_scratch_shape(const qf_model *m, const qf_workspace *ws, int sparse, qf_scratch_shape *out);
/* Debug/test hook: called with the hidden state [rows][hidden] after the embedding (index 0),
 * after each layer (1..n_layers-1) and after the final norm (n_layers), as HF's hidden_states. */
typedef void (*qf_hidden_hook)(void *ud, int index, const float *h, int rows, int hidden);
void qf_workspace_set_hook(qf_workspace *ws, qf_hidden_hook fn, void *ud);
/* Study hook (routing traces): called on the host path with each MoE layer's chosen experts,
 * ids [rows][top_k] best first, and the residual x [rows][hidden] that entered the layer's MoE
 * block. A device that routes itself does not call it. */
typedef void (*qf_route_hook)(void *ud, int layer, const int *ids, int rows, int top_k, const float *x, int hidden);
void qf_workspace_set_route_hook(qf_workspace *ws, qf_route_hook fn, void *ud);
/* Expert parallelism (experts/ep.h): the routed experts of every MoE layer run on the rank that
 * holds them, the rows dispatched there and their outputs sent back, summed here as the one-rank
 * MoE sums them (the same bits). Every rank runs its forwards in lockstep with the others (each
 * layer's exchange is collective). Host path; NULL: every expert here. */
void qf_workspace_set_ep(qf_workspace *ws, qf_ep *ep);
/* Calibration hook: on the host path, each trunk projection group's input before any sparsity
 * mask, x [rows][dim] (group: QF_ACT_*). */
typedef void (*qf_act_hook)(void *ud, int layer, int group, const float *x, int rows, int dim);
/* What sparsity skipped since the workspace was made: routed experts (row, slot) chosen and
 * dropped; trunk projection inputs entries seen and zeroed (host path); KV pages a generated
 * token's attention had (full layers) and skipped. */
typedef struct qf_sparsity_counts {
    uint64_t experts, experts_dropped, trunk, trunk_zeroed, kv_pages, kv_skipped;
} qf_sparsity_counts;
qf_sparsity_counts qf_workspace_sparsity(const qf_workspace *ws);
int qf_workspace_set_act_hook(qf_workspace *ws, qf_act_hook fn, void *ud);

/* TOP1: only the greedy pick of the last token's logits (the first index of the largest), into
 * *top1: where the backend can pick on the device, the logits never travel to the host. DRAW:
 * the pick of *draw (backend/ops.h qf_draw: the sampler's rule with its uniform number) into
 * *top1, made on the device after the step; where it cannot be made there, the logits go to
 * *logits (which a DRAW row must give) and *top1 = -1: the caller samples them. */
enum qf_logits_mode { QF_LOGITS_NONE = 0, QF_LOGITS_LAST = 1, QF_LOGITS_ALL = 2, QF_LOGITS_TOP1 = 3, QF_LOGITS_DRAW = 4, QF_LOGITS_PICKS = 5 };
/* PICKS: the greedy pick of every row (TOP1's rule) into top1[0..n): a verify of drafts needs no
 * more, and on a GPU only the ids come back. */

/* One sequence's share of a batched forward. logits: vocab floats (LAST) or n * vocab (ALL). */
typedef struct qf_seq_step {
    qf_state *st;
    const int32_t *tokens;
    int n;
    int logits_mode;
    float *logits;
    int32_t *top1; /* TOP1, DRAW; PICKS: n of them */
    int sparsity_set; /* this sequence's sparsity level (every layer) instead of the model's (CPU path) */
    float sparsity;
    const float *inputs; /* n rows of hidden floats that replace the tokens' embeddings (the MTP head's; NULL: embed tokens) */
    float *hidden;       /* NULL, or where the n rows' final-normed hidden states go (host path: the MTP head's input) */
    const qf_draw *draw; /* DRAW */
} qf_seq_step;

/* On a device with fused decode ops, a step of one token a sequence runs them; so does a sequence
 * of up to QF_DEC_CHAIN tokens that wants every row's logits or pick (QF_LOGITS_ALL, QF_LOGITS_PICKS:
 * a verify of drafts), its rows chained through its state, each row's numbers those of a
 * one-token step. */
#define QF_DEC_CHAIN 9

/* Runs the tokens of every sequence through the model at once (sum of n <= workspace rows),
 * advancing each state. Fails (and changes nothing) on a bad token id or a full context. A lone
 * sequence of more rows (up to qf_forward_lone_rows) that wants no logits or the last row's runs
 * layer by layer (qf_forward_seq's path for a store that stages layers). */
int qf_forward(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_seq_step *seqs, int n_seqs);
/* The most prompt tokens a step of one sequence may take: the prompt buffer's when the expert
 * store stages whole layers (each layer's experts then cross the link once for them all), else
 * the workspace's rows. */
int qf_forward_lone_rows(const qf_model *m, const qf_workspace *ws);

/* Prefill helper for one sequence of any length: runs in workspace-sized chunks; logits of the
 * last token (or of all tokens with QF_LOGITS_ALL) as in qf_forward. */
int qf_forward_seq(const qf_model *m, qf_backend *be, qf_workspace *ws, qf_state *st,
                   const int32_t *tokens, int n, int logits_mode, float *logits);

/* The MTP head (m->mtp) run beside the model: its KV cache, workspace and input scratch, made once
 * for up to max_rows pairs a step and max_ctx positions (NULL: no head, or out of memory). Its
 * scratch is the backend's memory (the head's on a device when the model moved there); the steps'
 * hidden states in and logits and outputs out are host memory. */
typedef struct qf_mtp_run qf_mtp_run;
qf_mtp_run *qf_mtp_run_create(const qf_model *m, int max_rows, int max_ctx);
void qf_mtp_run_free(qf_mtp_run *r);
void qf_mtp_run_reset(qf_mtp_run *r);
int qf_mtp_pos(const qf_mtp_run *r);
/* Back to pos pairs (drafts that were not accepted leave the head's cache). */
void qf_mtp_truncate(qf_mtp_run *r, int pos);
qf_state *qf_mtp_state(qf_mtp_run *r);
/* n pairs (next[i], h[i]) at the head's next n positions (h: the model's final-normed hidden states,
 * qf_seq_step.hidden, or the head's own output for a chained draft): logits (or the pick, top1) as
 * qf_forward's logits_mode; hidden_out (may be NULL) gets the head's normed outputs, the h of the
 * next draft. */
/* The head's drafts pick from an int8 copy of lm_head (rows of blocks of 32, made here from the
 * model's, on its device where it lives): a draft needs only its argmax, and the copy is half the
 * bytes each draft reads; the model's own logits keep lm_head as it is, so output is unchanged.
 * Measured on the bundled model: the drafts accepted the same to a position (docs/performance.md). */
int qf_mtp_lm_head_int8(qf_model *m);
int qf_mtp_step(const qf_model *m, qf_backend *be, qf_mtp_run *r, const int32_t *next, const float *h, int n, int logits_mode, float *logits, int32_t *top1,
                float *hidden_out);

#endif
