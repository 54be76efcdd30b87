/* Which experts a layer's fixed slots hold: the eviction and admission policies an expert cache
 * uses, apart from where the bytes live, so they can be replayed over recorded routing traces
 * (qflash route-replay) before a store uses them.
 *
 * One cache per layer. For each routed (token, expert): find() is a hit or -1; on -1 the expert is
 * loaded and insert() gives it a slot, evicting the policy's victim; or, with an admitting policy,
 * declines (-1): the expert is used once from a scratch slot and the cache is left as it was.
 * tick() after each token ages the frequency counts. */
#ifndef QF_EXPERTS_CACHE_POLICY_H
#define QF_EXPERTS_CACHE_POLICY_H

#include <stdint.h>

#include "backend/ops.h"

const char *qf_policy_name(int policy);
int qf_policy_parse(const char *name); /* -1: unknown */

/* Counts are integers (QF_COUNT_ONE a use) halved at every multiple of half_life ticks, and victims
 * are the least by (count, last use, slot) or (last use, slot): every step is exact integer work,
 * so a device that keeps the same state makes the same choices (the CUDA expert cache is tested
 * against qf_slot_cache_access). The policies' names are backend/ops.h's, where the device's
 * cache is defined. */

typedef struct qf_slot_cache {
    int policy, n_experts, n_slots, used, half_life;
    int32_t *slot_of;   /* [n_experts]: its slot, or -1 */
    int32_t *expert_in; /* [n_slots]: its expert */
    uint32_t *last;     /* [n_slots]: the tick of its last use */
    uint32_t *count;    /* [n_experts]: decayed use count as of count_at */
    uint32_t *count_at; /* [n_experts] */
    uint32_t *seen;     /* [n_experts]: now + 1 when access() met it this tick */
    uint32_t now;
    uint64_t hits, misses, declined;
} qf_slot_cache;

int qf_slot_cache_init(qf_slot_cache *c, int policy, int n_experts, int n_slots, int half_life);
void qf_slot_cache_free(qf_slot_cache *c);
int qf_slot_cache_find(qf_slot_cache *c, int expert);
/* next_use (MIN only, else NULL): for each expert, the tick it is next used (UINT64_MAX: never). */
int qf_slot_cache_insert(qf_slot_cache *c, int expert, int *evicted, const uint64_t *next_use);
void qf_slot_cache_tick(qf_slot_cache *c);
/* A prefetch: the expert is loaded ahead of its use unless held, into the victim's slot whatever
 * the admission rule (not a use, not a hit or miss). 1 when it was loaded. */
int qf_slot_cache_prefetch(qf_slot_cache *c, int expert, const uint64_t *next_use);
/* One step's routings at once (n ids, repeats allowed), as a device resolves them: each distinct
 * expert is used once, in order of first appearance; the hits are marked first, so no expert this
 * step needs is a victim; then each miss is inserted in order. fill_e/fill_s (may be NULL; room
 * for n) get the admitted experts and their slots. Returns how many were admitted. No tick. */
int qf_slot_cache_access(qf_slot_cache *c, const int32_t *ids, int n, const uint64_t *next_use, int32_t *fill_e, int32_t *fill_s);

#endif
