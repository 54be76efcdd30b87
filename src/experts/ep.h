/* Expert parallelism: a MoE layer's routed experts partitioned over R ranks (the GPUs of one
 * host), each rank holding the dense trunk and a contiguous share of the experts. A rank's rows
 * are dispatched to the ranks that hold their chosen experts (each row sent once to each such
 * rank, with the choices it makes there), every rank runs the experts it holds on the rows it
 * received, and the outputs travel back to combine in the row's own rank, summed in ascending
 * expert order as the single-device MoE does (model/forward.c), so the result does not depend on
 * R. The exchange is a variable-size all-to-all behind qf_ep_comm: NCCL between devices, or an
 * in-process one for tests.
 *
 * Nothing here allocates per step: qf_ep_create sizes every buffer for max_rows rows a rank. */
#ifndef QF_EXPERTS_EP_H
#define QF_EXPERTS_EP_H

#include <stddef.h>
#include <stdint.h>

/* An all-to-all among n_ranks: this rank sends send_bytes[j] bytes from send + send_off[j] to
 * rank j and receives recv_bytes[j] bytes from rank j at recv + recv_off[j]. Every rank calls it
 * with matching sizes (recv_bytes[j] on this rank = send_bytes[this rank] on rank j). */
typedef struct qf_ep_comm {
    int n_ranks, rank;
    int (*alltoallv)(struct qf_ep_comm *c, const void *send, const size_t *send_off, const size_t *send_bytes, void *recv,
                     const size_t *recv_off, const size_t *recv_bytes);
    void *impl;
} qf_ep_comm;

/* The first expert rank r holds of E over R ranks (contiguous shares, sizes differing by one at
 * most); rank r holds [qf_ep_first(E, R, r), qf_ep_first(E, R, r + 1)). */
static inline int qf_ep_first(int E, int R, int r) { return (int)(((int64_t)E * r) / R); }
int qf_ep_owner(int E, int R, int e);
/* The choice (of a row's K, ids ti; -1: dropped) with the smallest expert id above last; -1 when
 * none is left. From last = -1, the choices in ascending expert order: the order a MoE sums in. */
int qf_ep_next_choice(const int32_t *ti, int K, int last);

/* y[H] = expert e (held by this rank) applied to x[H]. */
typedef int (*qf_ep_expert_fn)(void *ctx, int e, const float *x, float *y);

typedef struct qf_ep qf_ep;

qf_ep *qf_ep_create(qf_ep_comm *comm, int n_experts, int top_k, int hidden, int max_rows);
void qf_ep_free(qf_ep *ep);

/* One MoE layer's routed part for this rank's n rows (x [n][hidden], topi/topw [n][top_k] from
 * routing; a choice of -1 was dropped): out[i] = sum over row i's choices, in ascending expert id,
 * of topw * expert(x[i]). Collective: every rank calls it for the same layer (n may differ, and be
 * 0). out NULL: no sum; each choice's output is then qf_ep_output's (the caller sums with its own
 * arithmetic, as the model's MoE does). */
int qf_ep_moe(qf_ep *ep, const float *x, int n, const int32_t *topi, const float *topw, qf_ep_expert_fn fn, void *ctx, float *out);
/* After qf_ep_moe: expert(x[i]) of row i's choice k (hidden floats). */
const float *qf_ep_output(const qf_ep *ep, int i, int k);

#endif
