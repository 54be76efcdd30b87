/* A layer's routed-expert cache in device memory, as the model, the expert stores and a device
 * backend share it: the cache policies' names (experts/cache_policy.c holds
 * their reference, a device runs the first three) and the layout of the cache's state. */
#ifndef QF_BACKEND_XCACHE_H
#define QF_BACKEND_XCACHE_H

#include <stddef.h>
#include <stdint.h>

/* Expert cache policies (experts/cache_policy.c holds their reference; a device runs the first three). */
enum {
    QF_POLICY_LRU,     /* least recently used leaves */
    QF_POLICY_DLFU,    /* lowest decayed use count leaves (counts kept for every expert, halved every half_life ticks) */
    QF_POLICY_DLFU_AD, /* the same, and a newcomer is admitted only if its count beats the victim's */
    QF_POLICY_MIN,     /* Belady's optimum: the expert used furthest in the future leaves (replay only: needs next_use) */
    QF_N_POLICIES
};
#define QF_COUNT_ONE 65536u /* a use, in the integer decayed counts */

/* A layer's routed-expert cache in device memory (experts/store_devcache.c): n_slots slots in front
 * of experts that stay in host memory the device reads directly. Before a MoE op reads the table,
 * the device resolves the rows' chosen experts by the policy of experts/cache_policy.h
 * (qf_slot_cache_access, LRU or decayed frequency with admission, the same integer state): hits
 * stay; admitted misses are copied into the slots of their victims; a declined miss is read where
 * it lives. tab entries always point at valid bytes (a slot or home), so every choice is exact.
 * state: qf_xcache_state_bytes(E, S) bytes of backend memory, zeroed once. */
typedef struct qf_xcache {
    int n_experts, n_slots, policy, half_life;
    size_t slot_bytes, off[3], bytes[3]; /* gate, up, down inside a slot */
    const void *const *home;             /* [3][E] each expert's matrices in host memory, as the device reads them */
    const void **tab;                    /* [3][E] what the MoE kernels read: a slot's or the home address */
    char *slots;                         /* n_slots x slot_bytes */
    void *state;
    unsigned long long *counters;        /* [QF_XC_COUNTERS] backend memory, zeroed once */
} qf_xcache;

/* The state's layout, in 32-bit words: now, used, n_fill, pad, then slot1_of[E] (slot + 1, 0:
 * none), expert1_in[S] (expert + 1), last[S], count[E], count_at[E], fill_e[S], fill_s[S]. The
 * counters count distinct experts a step: hits, misses (admitted or declined), declined. */
enum { QF_XC_HITS, QF_XC_MISSES, QF_XC_DECLINED, QF_XC_COUNTERS };
#define QF_XC_HEAD_WORDS 4
static inline size_t qf_xcache_state_bytes(int E, int S) { return ((size_t)QF_XC_HEAD_WORDS + 3 * (size_t)E + 4 * (size_t)S) * 4; }

#endif
