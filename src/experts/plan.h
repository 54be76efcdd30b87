/* The device memory plan of buffered expert streaming: how a GPU budget splits into the context,
 * the trunk, the workspace and scratch, the states and KV the caller reserves, a margin, and the
 * expert buffer (slots a layer, and two staging layers for prompt chunks when they fit). Pure
 * arithmetic on what the caller measured or counted; loading then carries the plan out. */
#ifndef QF_EXPERTS_PLAN_H
#define QF_EXPERTS_PLAN_H

#include <stddef.h>
#include <stdio.h>

#define QF_PLAN_MARGIN ((size_t)64 << 20) /* left free for the driver's and the libraries' own allocations */

typedef struct qf_plan_in {
    size_t budget;      /* --gpu-mem (0: none; cache_bytes names the buffer) */
    size_t cache_bytes; /* --expert-cache: the buffer itself (0: what the budget leaves) */
    size_t device_total;
    size_t device_free; /* free once the trunk and the workspace are there */
    double host_ram;    /* bytes of RAM (0: unknown) */
    size_t host_reserve; /* host memory the caller holds beside the experts: prefix snapshots */
    size_t context, trunk, reserve, sparse;
    size_t workspace; /* the forward's workspace and the ops' scratch, by their arithmetic */
    size_t slot_bytes; /* one expert's weights in a slot */
    int n_layers, n_experts, top_k, policy;
} qf_plan_in;

typedef struct qf_plan {
    int active;                                 /* an expert cache on the device */
    size_t budget, device_total, context, trunk, workspace, reserve, margin, buffer;
    size_t stage;                               /* of the buffer: two layers' experts for prompt chunks (0: none) */
    size_t sparse;                              /* sparsity's transposed weights, made after the plan */
    size_t host_experts;                        /* host memory the experts take (pinned) */
    size_t host_reserve;                        /* and the prefix snapshots at most (pinned) */
    size_t slot_bytes;
    int slots, n_experts, n_layers, policy;
    size_t used_after_warmup;                   /* the device's memory in use once warmed up */
    int host_threads;                           /* hybrid execution: host threads (0: off), their share of the misses */
    float host_share, host_fixed;               /* host_fixed: a host call's fixed cost in experts, taken off a step's share */
    double host_ms, host_fixed_ms, link_ms;     /* the cost model's measured ms an expert on the host (and a call's), over the link */
} qf_plan;

/* The plan for in, or QF_EINVAL with a message naming what does not fit and the least budget that
 * would (fewer than 2 x top-k slots a layer, more than the device or the host holds). */
int qf_plan_make(const qf_plan_in *in, qf_plan *out);
/* The plan as the load prints it (nothing when not active). */
void qf_plan_print(FILE *f, const qf_plan *p);

#endif
