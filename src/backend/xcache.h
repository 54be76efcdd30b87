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
/* Hybrid expert execution: in a decode step (rows routed by the device, no sparsity drop), of
 * the misses the policy declines, the first ceil(host_share x misses - host_fixed) are computed on the host
 * instead of read over the link. Their table entries point at zeros (an all-zero expert in
 * backend memory: exactly 0 on the device), the device writes the job below into mapped host
 * memory (one job for every layer: the layers run one after another), a host node runs
 * host_run(host_ctx, layer, job) beside the hits' kernels, and the device adds y to the MoE's
 * output after both. The next step's table points the host's experts home again. */
#define QF_XC_ROWS 64     /* rows of a hybrid step (a decode step's) */
#define QF_XC_K 16        /* top-k a hybrid step takes */
#define QF_XC_HOST_MAX 64 /* distinct experts the host takes a layer and step */
typedef struct qf_xc_job {
    int32_t n, top_k, n_host, status;         /* rows, choices a row, the host's experts; host_run's result */
    int32_t host_ids[QF_XC_HOST_MAX];         /* the host's experts, in the order the policy met them */
    int32_t ids[QF_XC_ROWS * QF_XC_K];        /* [n][top_k]: the host's choices, -1 the device's */
    float w[QF_XC_ROWS * QF_XC_K];            /* [n][top_k]: every choice's routing weight */
    float *xn, *y;                            /* [QF_XC_ROWS][hidden] each (mapped): the MoE's normed input; the host's sums */
} qf_xc_job;
/* Device words a layer keeps for it: the last step's host experts (count, then ids), the step's chosen ids [QF_XC_ROWS][QF_XC_K]. */
#define QF_XC_HOST_WORDS (1 + QF_XC_HOST_MAX + QF_XC_ROWS * QF_XC_K)

typedef struct qf_xcache {
    int n_experts, n_slots, policy, half_life;
    size_t slot_bytes, off[3], bytes[3]; /* gate, up, down inside a slot */
    const void *const *home;             /* [3][E] each expert's matrices in host memory, as the device reads them */
    const void **tab;                    /* [3][E] what the MoE kernels read: a slot's or the home address */
    char *slots;                         /* n_slots x slot_bytes */
    void *state;
    unsigned long long *counters;        /* [QF_XC_COUNTERS] backend memory, zeroed once */
    /* hybrid expert execution (job NULL: off) */
    float host_share, host_fixed; /* the host's share of a step's misses, less its call's fixed cost in experts */
    qf_xc_job *job;       /* mapped host memory */
    const char *zero;     /* slot_bytes of zeros, backend memory */
    int32_t *host_words;  /* QF_XC_HOST_WORDS, backend memory, zeroed once */
    int (*host_run)(void *ctx, int layer, qf_xc_job *job); /* on a device thread: no device calls; QF_OK or an error (its message kept) */
    void *host_ctx;
    int layer;
} qf_xcache;

/* The state's layout, in 32-bit words: now, used, n_fill, pad, then slot1_of[E] (slot + 1, 0:
 * none), expert1_in[S] (expert + 1), last[S], count[E], count_at[E], fill_e[S], fill_s[S]. The
 * counters count distinct experts a step: hits, misses (admitted or declined), declined. */
enum { QF_XC_HITS, QF_XC_MISSES, QF_XC_DECLINED, QF_XC_COUNTERS };
#define QF_XC_HEAD_WORDS 4
static inline size_t qf_xcache_state_bytes(int E, int S) { return ((size_t)QF_XC_HEAD_WORDS + 3 * (size_t)E + 4 * (size_t)S) * 4; }

#endif
