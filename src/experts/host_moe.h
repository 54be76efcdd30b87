/* Routed experts computed on the host's cores from their home views in host memory: the host half
 * of hybrid expert execution. Beside a device that computes a MoE layer's hits (and the shared
 * expert), the host computes the misses it was handed, where moving their weights over the link
 * would cost more than reading them where they are (a token needs a few KB of activations; an
 * expert is megabytes).
 *
 * Each row's output is the weighted sum of its host choices in ascending expert order, each
 * expert the CPU's swiglu MLP (gate and up products, swiglu, down product) from the CPU ops
 * table: the CPU path's arithmetic (model/forward.c's routed_experts), bit for bit. The work of
 * a job is split over the pool by 128-row slices of the experts' matrices, so one expert on one
 * row still uses every thread. Everything is sized at creation: nothing is allocated per job. */
#ifndef QF_EXPERTS_HOST_MOE_H
#define QF_EXPERTS_HOST_MOE_H

#include <stdint.h>

#include "backend/ops.h"
#include "base/pool.h"

typedef struct qf_host_moe qf_host_moe;

typedef struct qf_host_moe_job {
    const qf_expert *experts; /* [n_experts] the layer's experts, views into host memory */
    int n_experts, n, top_k;  /* n rows of top_k choices */
    const float *xn;          /* [n][hidden] the MoE's normed input */
    const int32_t *ids;       /* [n][top_k] the host's choices; -1: not the host's */
    const float *w;           /* [n][top_k] their routing weights */
    float *y;                 /* [n][hidden]: each row's sum (0 where it has no host choice) */
} qf_host_moe_job;

/* For jobs of up to max_rows rows of top_k choices, experts of hidden x ffn; pool: the host's
 * threads (NULL: the calling thread alone; not owned). QF_ENOMEM, or QF_EINVAL for a shape. */
int qf_host_moe_create(qf_host_moe **out, qf_pool *pool, int hidden, int ffn, int top_k, int max_rows);
void qf_host_moe_free(qf_host_moe *h);
/* Runs the job; QF_EINVAL naming what is wrong (rows past max_rows, an expert id out of range, an
 * expert of another shape), with y then untouched. */
int qf_host_moe_run(qf_host_moe *h, const qf_host_moe_job *j);

#endif
