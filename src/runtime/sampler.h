/* Token sampling: penalties, then greedy (temperature 0) or temperature, top-k, top-p, min-p and
 * a seeded draw. All buffers are allocated at creation; sampling allocates nothing. */
#ifndef QF_RUNTIME_SAMPLER_H
#define QF_RUNTIME_SAMPLER_H

#include <stdint.h>

#include "backend/ops.h"

typedef struct qf_sampling {
    float temperature;       /* 0 = greedy */
    int top_k;               /* 0 = off */
    float top_p;             /* 1 = off */
    float min_p;             /* 0 = off */
    float repetition_penalty; /* 1 = off; HF rule over every accepted token */
    float presence_penalty;  /* OpenAI rules over generated tokens */
    float frequency_penalty;
    uint64_t seed;
} qf_sampling;

/* Defaults: greedy, no penalties, seed 0. */
qf_sampling qf_sampling_default(void);

typedef struct qf_sampler qf_sampler;

qf_sampler *qf_sampler_create(int vocab, const qf_sampling *p); /* NULL on bad params or OOM */
void qf_sampler_free(qf_sampler *s);
/* Forgets the history and restarts the random stream from the seed. */
void qf_sampler_reset(qf_sampler *s);
/* Records a token: prompt tokens count for the repetition penalty only, generated ones for all. */
void qf_sampler_accept(qf_sampler *s, int32_t tok, int generated);
/* Whether sampling is the plain pick of the largest logit (greedy, no penalties): then the pick
 * can be made where the logits are (QF_LOGITS_TOP1) and sample is not needed. */
int qf_sampler_is_greedy(const qf_sampler *s);
/* Picks the next token from logits[vocab] (modified in place). */
int32_t qf_sampler_sample(qf_sampler *s, float *logits);
/* The device's share of the next pick (backend/ops.h qf_draw, which follows this sampler's rule):
 * the parameters, the penalties as a list of ids (the sampler's, valid until it next changes),
 * and the draw's uniform number, taken from the stream as sample would take it. 0 (nothing
 * taken) when the device cannot draw with these parameters (top_k above QF_DRAW_MAX_K): sample. */
int qf_sampler_draw_desc(qf_sampler *s, qf_draw *d);
/* Whether draw_desc would give the device this sampler's draws (nothing taken). */
int qf_sampler_can_draw(const qf_sampler *s);
/* sample with the uniform number u that draw_desc took (where the device could not draw after
 * all): the same pick the device would have made. */
int32_t qf_sampler_sample_u(qf_sampler *s, float *logits, double u);
/* Validates parameters; the message names the bad one. */
int qf_sampling_check(const qf_sampling *p);

#endif
