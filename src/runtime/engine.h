/* The engine: a loaded model with its tokenizer, backend, thread pool and workspace. Generation
 * runs through the scheduler (runtime/sched.h), which owns sampling, speculative decoding and
 * prefix snapshots for every front end. */
#ifndef QF_RUNTIME_ENGINE_H
#define QF_RUNTIME_ENGINE_H

#define QF_MAX_DRAFT 8 /* MTP drafts a step */

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "experts/plan.h"
#include "model/model.h"
#include "runtime/sampler.h"
#include "tokenizer/tokenizer.h"

typedef struct qf_engine_opts {
    int n_threads;   /* 0 = all cores */
    int max_batch;   /* workspace rows (prefill chunk); 0 = 512 */
    qf_diag *diag;
    const qf_synth_opts *synth; /* make a synthetic model instead of loading dir (no tokenizer) */
    const char *device;         /* "cpu" (default) or "cuda" / "cuda:N" */
    const qf_backend_opts *backend; /* the backends' tuning options (NULL: defaults) */
    size_t expert_cache;        /* bytes of the routed experts' cache; 0: config_flash.json's, else all resident */
    size_t gpu_mem;             /* the device budget (--gpu-mem): the expert cache gets what the rest leaves */
    const char *expert_policy;  /* lru, dlfu or dlfu-admit (NULL: dlfu-admit) */
    const char *expert_heat;    /* a routing trace whose most used experts fill the RAM cache at load (NULL: none) */
    int expert_prefetch;        /* the CPU's RAM expert cache reads ahead each row's N next-layer guesses (0: off) */
    int expert_threads;         /* with --gpu-mem: host threads computing a share of the misses beside the device (0: off; negative: the cores less 4, off under 5) */
    int reserve_seqs, reserve_tokens; /* what the caller allocates on the device after load: states, KV tokens */
    size_t reserve_kv_bytes;          /* or the KV pool's bytes, when the caller sizes it so */
    size_t reserve_host_bytes;        /* host memory the caller holds after load under a device budget: prefix snapshots */
    int max_prompt;                   /* with streamed experts: the longest prompt run layer by layer at once (0: 8192) */
    int sparsity_given;               /* --sparsity-level given: sparsity_level for every layer; else config_flash.json's, else 0 */
    float sparsity_level;
    int draft;                        /* --draft: MTP draft tokens a step (0: none; needs the model's MTP head) */
    void (*progress)(void *ud, int done, int total);
    void *progress_ud;
} qf_engine_opts;

typedef struct qf_engine {
    qf_model *model;
    qf_tokenizer *tok; /* NULL when the directory has no tokenizer.json */
    qf_pool *pool;
    qf_pool *host_pool; /* hybrid expert execution's threads (NULL: off) */
    qf_backend be;
    int on_gpu;
    qf_workspace *ws;
    float *logits;     /* (vocab) */
    size_t text_cap;   /* the most bytes one token's text takes: 3 x longest piece + 8 (every byte may become U+FFFD) */
    double load_seconds;
    qf_plan plan; /* the device memory plan when the routed experts stream (experts/plan.h) */
    char notice[256]; /* what the caller should tell the user about the load (empty: nothing) */
    int draft, max_draft; /* MTP drafts a step (0: off) and the most opts.draft allows */
    int expert_policy;    /* the expert buffer's policy (QF_POLICY_*) */
} qf_engine;

int qf_engine_open(qf_engine **out, const char *dir, const qf_engine_opts *opts);
void qf_engine_close(qf_engine *e);
/* What the layers above ask of a loaded engine (the server keeps out of the model). */
const qf_config *qf_engine_config(const qf_engine *e);
/* Whether a request may set its own sparsity level (the model's sparse paths are ready). */
int qf_engine_sparsity_ready(const qf_engine *e);
/* The expert store's counters (NULL: every expert resident, no store). */
const qf_expert_stats *qf_engine_expert_stats(const qf_engine *e);

int qf_engine_is_eos(const qf_engine *e, int32_t tok);

/* Speculative decoding's drafts a step from now on (0: off), at most the count the engine was
 * opened with (opts.draft); the scheduler's greedy sequences draft with the MTP head (spec.c). */
void qf_engine_set_draft(qf_engine *e, int draft);
int qf_engine_drafts(const qf_engine *e);

#endif
