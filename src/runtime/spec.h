/* A sequence's speculative decoding with the model's MTP head (runtime/spec.c), for the
 * scheduler's sequences: the head's state and the buffers of its drafts and of
 * the model's verify forwards. Greedy only: a step's drafts are accepted while they equal the
 * model's picks, so the output is the plain loop's. */
#ifndef QF_RUNTIME_SPEC_H
#define QF_RUNTIME_SPEC_H

#include <stdint.h>

#include "runtime/engine.h"

#define QF_SPEC_MAX_DRAFT QF_MAX_DRAFT

typedef struct qf_spec_seq qf_spec_seq;

/* Up to max_draft drafts a step, forwards of up to rows rows, max_ctx positions of the head.
 * NULL (the error set): out of memory. The engine opened with drafts has checked the head (qf_engine_open). */
qf_spec_seq *qf_spec_seq_create(const qf_engine *e, int max_draft, int rows, int max_ctx);
void qf_spec_seq_free(qf_spec_seq *q);
/* A new sequence: the head forgets its pairs. */
void qf_spec_seq_reset(qf_spec_seq *q);
/* Where a forward of the sequence's rows puts their hidden states (qf_seq_step.hidden) for
 * qf_spec_seq_fed. */
float *qf_spec_seq_hidden(qf_spec_seq *q);
/* After a forward of n rows of tokens tok whose hidden states are in qf_spec_seq_hidden: the head
 * gets the pairs (tok[i], hidden before tok[i]) the rows complete: tok[0]'s with the last row of the
 * forward before (none at the sequence's start: first), then tok[i + 1]'s with row i. */
int qf_spec_seq_fed(qf_engine *e, qf_spec_seq *q, const int32_t *tok, int n, int first);
/* A step from d[0] (picked, not fed yet; the head has every pair before it), in parts so that many
 * sequences share the model's forwards (the scheduler's): d[1..n] drafted from
 * d[0] and a copy of the DeltaNet states taken; the forward of d[0..n] puts its picks in
 * qf_spec_seq_picks (QF_LOGITS_PICKS) and its hidden states in qf_spec_seq_hidden; the drafts that equal the
 * model's picks are counted; when one was refused the state goes back to its copy (position p0)
 * and the k + 1 rows that stand run again; then the head gets their pairs and out the k accepted
 * drafts and the next pick. */
int qf_spec_seq_draft(qf_engine *e, qf_spec_seq *q, qf_state *st, int32_t *d, int n);
int32_t *qf_spec_seq_picks(qf_spec_seq *q);
int qf_spec_seq_accepted(const qf_spec_seq *q, const int32_t *d, int n);
void qf_spec_seq_restore(qf_spec_seq *q, qf_state *st, int p0);
int qf_spec_seq_kept(qf_engine *e, qf_spec_seq *q, const int32_t *d, int keep, int32_t *out);
/* Positions left in the head's context beyond a step's pair: a step may draft fewer than these. */
int qf_spec_seq_room(const qf_spec_seq *q);

#endif
