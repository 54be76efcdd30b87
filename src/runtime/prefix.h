/* Prefix reuse across requests for a hybrid model. The attention layers' KV pages can be shared
 * (they are append-only), but the DeltaNet layers carry one recurrent state that every token
 * rewrites, so a prefix is reusable only where a copy of that state was kept. Snapshots are taken
 * at fixed token intervals while a prompt is prefilled, where a chat prompt's last turn begins
 * (the next turn re-renders that turn and shares only what precedes it), at the prompt's end,
 * and at the end of every finished request;
 * each holds the prefix's tokens, a copy of the DeltaNet states and references to its KV pages.
 * A new sequence starts from the longest snapshot whose tokens begin its own (at least one token
 * is left to run, for the logits). The least recently used snapshots go when the byte budget is
 * exceeded or the KV pool needs their pages. One owner (the scheduler thread). */
#ifndef QF_RUNTIME_PREFIX_H
#define QF_RUNTIME_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

typedef struct qf_prefix qf_prefix;

typedef struct qf_prefix_stats {
    uint64_t hits, misses, tokens_reused, saved, evicted;
    int snapshots, blocks; /* blocks: DeltaNet copies allocated (kept for reuse once dropped) */
    size_t bytes, budget;
} qf_prefix_stats;

/* budget: bytes of snapshots (DeltaNet copies, the KV pages they hold, their tokens). The copies
 * (state_bytes each: qf_state_block_bytes) are be's memory, or host memory with host: under a
 * device budget they stay off the device, copied over the link when taken and restored. */
int qf_prefix_create(qf_prefix **out, qf_kv_pool *kv, qf_backend *be, int host, size_t state_bytes, size_t page_bytes, size_t budget);
void qf_prefix_free(qf_prefix *p);
/* st (empty) continues from the longest snapshot of toks[0..k), k < n; returns k (0: none). */
int qf_prefix_restore(qf_prefix *p, qf_state *st, const int32_t *toks, int n);
/* Keeps st's state as the snapshot of toks[0..st->pos) (an existing one is only refreshed). */
void qf_prefix_save(qf_prefix *p, const qf_state *st, const int32_t *toks);
/* Drops least recently used snapshots until the pool has `pages` free pages or none is left;
 * returns how many were dropped. */
int qf_prefix_evict(qf_prefix *p, int pages);
qf_prefix_stats qf_prefix_get_stats(const qf_prefix *p);

#endif
