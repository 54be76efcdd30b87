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

enum {
    QF_POLICY_LRU,     /* least recently used leaves */
    QF_POLICY_DLFU,    /* lowest decayed use count leaves (counts kept for every expert, halving every half_life tokens) */
    QF_POLICY_DLFU_AD, /* the same, and a newcomer is admitted only if its count beats the victim's */
    QF_POLICY_MIN,     /* Belady's optimum: the expert used furthest in the future leaves (replay only: needs next_use) */
    QF_N_POLICIES
};

const char *qf_policy_name(int policy);
int qf_policy_parse(const char *name); /* -1: unknown */

typedef struct qf_slot_cache {
    int policy, n_experts, n_slots, used;
    int32_t *slot_of;   /* [n_experts]: its slot, or -1 */
    int32_t *expert_in; /* [n_slots]: its expert */
    uint64_t *last;     /* [n_slots]: the tick of its last use */
    double *count;      /* [n_experts]: decayed use count as of count_at */
    uint64_t *count_at; /* [n_experts] */
    uint64_t now;
    double decay;       /* per tick */
    uint64_t hits, misses, declined;
} qf_slot_cache;

int qf_slot_cache_init(qf_slot_cache *c, int policy, int n_experts, int n_slots, double half_life);
void qf_slot_cache_free(qf_slot_cache *c);
int qf_slot_cache_find(qf_slot_cache *c, int expert);
/* next_use (MIN only, else NULL): for each expert, the tick it is next used (UINT64_MAX: never). */
int qf_slot_cache_insert(qf_slot_cache *c, int expert, int *evicted, const uint64_t *next_use);
void qf_slot_cache_tick(qf_slot_cache *c);
/* A prefetch: the expert is loaded ahead of its use unless held, into the victim's slot whatever
 * the admission rule (not a use, not a hit or miss). 1 when it was loaded. */
int qf_slot_cache_prefetch(qf_slot_cache *c, int expert, const uint64_t *next_use);

#endif
