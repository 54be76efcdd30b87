/* Constrained decoding: a context-free grammar over bytes, a matcher that follows the generated
 * bytes, and the mask of the tokens that may come next.
 *
 * A grammar is rules of alternatives of element sequences; an element is a byte set or a rule.
 * Repetition is right recursion (a rule calling itself last is a loop: it takes no stack). The
 * matcher keeps every live parse as a stack of continuations in an arena (stacks share their
 * tails, and equal stacks are one), so an ambiguous point (an optional member, anyOf) costs one
 * more stack, not a copy, and parses that meet again ((a+)+) merge. Left recursion is refused
 * when the matcher expands it; a loop over a body that may be empty is built over the body's
 * nonempty part (qf_gb_nonempty).
 *
 * Masks: the vocabulary is sorted by bytes once (qf_vocab_index); a token's bytes are matched
 * from the stacks its longest common prefix with the previous token left, and a rejected prefix
 * skips every token that shares it. Where the parse sits in a byte loop (a string's characters),
 * every token made only of those bytes is allowed at once from a cached set, and only the other
 * tokens are matched. Nothing is allocated per token: the arena, stacks and lists are sized at
 * creation, and an arena that fills is compacted to what the live stacks use. */
#ifndef QF_GRAMMAR_GRAMMAR_H
#define QF_GRAMMAR_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tokenizer.h"

typedef struct qf_cset {
    uint32_t w[8];
} qf_cset;

static inline void qf_cset_add(qf_cset *s, int lo, int hi) {
    for (int c = lo; c <= hi; c++) s->w[c >> 5] |= 1u << (c & 31);
}
static inline int qf_cset_has(const qf_cset *s, unsigned c) { return (s->w[c >> 5] >> (c & 31)) & 1u; }

/* ---- building ---- */

typedef struct qf_gbuild qf_gbuild;
typedef struct qf_grammar qf_grammar;

/* An element sequence under construction (a caller-owned buffer). */
typedef struct qf_gseq {
    int32_t *e;
    int n, cap, oom;
} qf_gseq;

qf_gbuild *qf_gb_create(void);
void qf_gb_free(qf_gbuild *b);
int qf_gb_rule(qf_gbuild *b);                               /* a new rule without alternatives; -1 on OOM */
void qf_gb_alt(qf_gbuild *b, int rule, const qf_gseq *seq); /* adds seq as an alternative of rule (copied) */
void qf_gseq_set(qf_gbuild *b, qf_gseq *q, const qf_cset *s);
void qf_gseq_byte(qf_gbuild *b, qf_gseq *q, unsigned char c);
void qf_gseq_lit(qf_gbuild *b, qf_gseq *q, const char *text);
void qf_gseq_ref(qf_gseq *q, int rule);
void qf_gseq_append(qf_gseq *q, const qf_gseq *more);
void qf_gseq_clear(qf_gseq *q);
void qf_gseq_free(qf_gseq *q);
/* Whether frag may match the empty string (over the rules built so far). */
int qf_gb_seq_nullable(const qf_gbuild *b, const qf_gseq *frag);
/* A new rule matching frag's nonempty strings, so that a loop over a body that may be empty
 * ((a*)*, (a?)+) repeats only what makes progress (the same language, no empty loop); -1 when
 * frag matches only the empty string, -2 (and the builder marked out of memory) on failure. */
int qf_gb_nonempty(qf_gbuild *b, const qf_gseq *frag);
/* A special (added) token the grammar may emit as one token where its text is allowed. */
void qf_gb_special(qf_gbuild *b, const char *text);
/* The grammar whose start is root; the builder is left empty. QF_ENOMEM or QF_EINVAL (a rule
 * without alternatives, named by number). */
int qf_gb_finish(qf_gbuild *b, int root, qf_grammar **out);
/* Grammars are immutable once built and counted: ref adds a holder, free drops one. */
qf_grammar *qf_grammar_ref(qf_grammar *g);
void qf_grammar_free(qf_grammar *g);
int qf_grammar_rules(const qf_grammar *g);

/* ---- the vocabulary, sorted once per tokenizer ---- */

typedef struct qf_vocab_index qf_vocab_index;
/* Ids 0..vocab-1 (the logits' rows): every token with bytes, except special tokens and the ids
 * in eos[0..n_eos); ids without a token are never allowed. */
int qf_vocab_index_create(qf_vocab_index **out, const qf_tokenizer *t, int vocab, const int32_t *eos, int n_eos);
/* The same from the tokens' bytes (pieces[id], lens[id]; NULL or empty: never allowed), which the
 * caller keeps while the index lives. */
int qf_vocab_index_create_raw(qf_vocab_index **out, const char *const *pieces, const size_t *lens, int vocab, const int32_t *eos, int n_eos);
void qf_vocab_index_free(qf_vocab_index *v);

/* ---- matching ---- */

typedef struct qf_gmatch qf_gmatch;
/* A matcher at the grammar's start. free_until >= 0: the grammar starts after that token (a
 * reasoning block's end); until it is generated every token is allowed. */
int qf_gmatch_create(qf_gmatch **out, const qf_grammar *g, qf_vocab_index *v, const qf_tokenizer *t, int32_t free_until);
void qf_gmatch_free(qf_gmatch *m);
/* Whether a matcher can start on g (no vocabulary needed): QF_EINVAL when its start holds more
 * parses than a matcher keeps, so a request can be refused before it is queued. */
int qf_grammar_check(const qf_grammar *g);
/* Sets logits[tok] = -inf for every token the grammar does not allow next; the end-of-sequence
 * ids stay only when the grammar is complete. Returns the number of tokens left allowed, 0 when
 * the parse is stuck (no token and not complete), or a negative error. */
int qf_gmatch_mask(qf_gmatch *m, float *logits);
/* Follows a generated token. QF_EINVAL when the grammar does not allow it. */
int qf_gmatch_accept(qf_gmatch *m, int32_t tok);
/* Whether what was accepted is a complete sentence of the grammar. */
int qf_gmatch_complete(const qf_gmatch *m);
/* Whether bytes[0..n) would be accepted from the current state (no change). For tests. */
int qf_gmatch_try_bytes(qf_gmatch *m, const char *bytes, size_t n);
/* Follows bytes (for tests and forced text). QF_EINVAL when they are not allowed. */
int qf_gmatch_accept_bytes(qf_gmatch *m, const char *bytes, size_t n);

#endif
