#include "experts/ep.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"

/* Records, all 4-byte words. Dispatch (one per row and destination rank): row, nk, then K expert
 * ids and K choice slots (nk used), then the row's hidden values. Return (one per computed
 * choice): row, slot, the expert's status (a failure reaches the rank whose row it was), then the
 * expert's output. */
struct qf_ep {
    qf_ep_comm *comm;
    int E, K, H, max_rows, R;
    size_t drec, yrec;                 /* bytes of a dispatch and of a return record */
    char *dsend, *drecv, *ysend, *yrecv; /* record buffers */
    float *yk;                         /* [max_rows][K][H]: each choice's output before the sum */
    size_t *off_s, *len_s, *off_r, *len_r, *cnt_s, *cnt_r, *one_len;
    int *sent;                         /* [R]: choices sent to each rank (its return records) */
};

int qf_ep_owner(int E, int R, int e) {
    int r = (int)(((int64_t)e * R) / E);
    while (r + 1 < R && e >= qf_ep_first(E, R, r + 1)) r++;
    while (r > 0 && e < qf_ep_first(E, R, r)) r--;
    return r;
}

int qf_ep_next_choice(const int32_t *ti, int K, int last) {
    int k = -1;
    for (int j = 0; j < K; j++)
        if (ti[j] > last && (k < 0 || ti[j] < ti[k])) k = j;
    return k;
}

qf_ep *qf_ep_create(qf_ep_comm *comm, int n_experts, int top_k, int hidden, int max_rows) {
    if (!comm || comm->n_ranks < 1 || comm->rank < 0 || comm->rank >= comm->n_ranks || n_experts < comm->n_ranks || top_k < 1 ||
        top_k > n_experts || hidden < 1 || max_rows < 0) {
        qf_fail(QF_EINVAL, "expert parallel: %d experts top-%d over %d ranks (rank %d) is not a valid split", n_experts, top_k,
                comm ? comm->n_ranks : 0, comm ? comm->rank : -1);
        return NULL;
    }
    qf_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return NULL;
    int R = comm->n_ranks, K = top_k;
    ep->comm = comm, ep->E = n_experts, ep->K = K, ep->H = hidden, ep->max_rows = max_rows, ep->R = R;
    ep->drec = (size_t)(2 + 2 * K + hidden) * 4, ep->yrec = (size_t)(3 + hidden) * 4;
    size_t rows = (size_t)max_rows + 1, out_recs = rows * (size_t)K; /* a rank sends at most one record a choice */
    ep->dsend = malloc(out_recs * ep->drec);
    ep->drecv = malloc((size_t)R * out_recs * ep->drec);
    ep->ysend = malloc((size_t)R * out_recs * ep->yrec);
    ep->yrecv = malloc(out_recs * ep->yrec);
    ep->yk = malloc(rows * (size_t)K * (size_t)hidden * sizeof(float));
    size_t *z = calloc((size_t)7 * R, sizeof(size_t));
    ep->sent = calloc((size_t)R, sizeof(int));
    if (!ep->dsend || !ep->drecv || !ep->ysend || !ep->yrecv || !ep->yk || !z || !ep->sent) {
        free(z);
        qf_ep_free(ep);
        qf_fail(QF_ENOMEM, "expert parallel: out of memory for %d rows", max_rows);
        return NULL;
    }
    ep->off_s = z, ep->len_s = z + R, ep->off_r = z + 2 * R, ep->len_r = z + 3 * R;
    ep->cnt_s = z + 4 * R, ep->cnt_r = z + 5 * R, ep->one_len = z + 6 * R;
    return ep;
}

void qf_ep_free(qf_ep *ep) {
    if (!ep) return;
    free(ep->dsend), free(ep->drecv), free(ep->ysend), free(ep->yrecv), free(ep->yk), free(ep->off_s), free(ep->sent);
    free(ep);
}

static int32_t *word(char *base, size_t rec, size_t i) { return (int32_t *)(base + i * rec); }

/* Dispatch records grouped by destination rank (ascending rows within each); their counts. */
static void pack(qf_ep *ep, const float *x, int n, const int32_t *topi) {
    int K = ep->K, H = ep->H;
    size_t at = 0;
    for (int j = 0; j < ep->R; j++) {
        ep->sent[j] = 0;
        size_t first = at;
        for (int i = 0; i < n; i++) {
            int32_t *r = word(ep->dsend, ep->drec, at), nk = 0;
            for (int k = 0; k < K; k++) {
                int32_t e = topi[(size_t)i * K + k]; /* -1: dropped by sparsity */
                if (e >= 0 && qf_ep_owner(ep->E, ep->R, e) == j) r[2 + nk] = e, r[2 + K + nk] = k, nk++;
            }
            if (!nk) continue;
            r[0] = i, r[1] = nk;
            memcpy(r + 2 + 2 * K, x + (size_t)i * H, (size_t)H * sizeof(float));
            ep->sent[j] += nk, at++;
        }
        ep->cnt_s[j] = at - first;
    }
}

/* The experts of every received record: a return record per choice, grouped by source rank. A
 * failed expert still answers (its status), so the exchange stays whole on every rank. */
static void compute(qf_ep *ep, qf_ep_expert_fn fn, void *ctx, size_t *ret_len) {
    int K = ep->K;
    size_t rec = 0, out = 0;
    for (int s = 0; s < ep->R; s++) {
        size_t first = out;
        for (size_t q = 0; q < ep->cnt_r[s]; q++, rec++) {
            const int32_t *r = word(ep->drecv, ep->drec, rec);
            for (int c = 0; c < r[1]; c++, out++) {
                int32_t *y = word(ep->ysend, ep->yrec, out);
                y[0] = r[0], y[1] = r[2 + K + c];
                y[2] = fn(ctx, r[2 + c], (const float *)(r + 2 + 2 * K), (float *)(y + 3));
                if (y[2] != QF_OK) memset(y + 3, 0, (size_t)ep->H * sizeof(float));
            }
        }
        ret_len[s] = (out - first) * ep->yrec;
    }
}

/* out[i] = the sum over row i's choices in ascending expert id of topw * output (the plain MoE's
 * order: experts in turn, each adding to the rows that chose it). */
static void combine(qf_ep *ep, int n, const int32_t *topi, const float *topw, float *out) {
    int K = ep->K, H = ep->H;
    memset(out, 0, (size_t)n * H * sizeof(float));
    for (int i = 0; i < n; i++) {
        const int32_t *ti = topi + (size_t)i * K;
        for (int k = qf_ep_next_choice(ti, K, -1); k >= 0; k = qf_ep_next_choice(ti, K, ti[k])) {
            const float *y = ep->yk + ((size_t)i * K + k) * H;
            float w = topw[(size_t)i * K + k], *o = out + (size_t)i * H;
            for (int c = 0; c < H; c++) o[c] += w * y[c];
        }
    }
}

static int exchange(qf_ep *ep, const void *send, const size_t *len_s, void *recv, const size_t *len_r) {
    for (int j = 0, so = 0, ro = 0; j < ep->R; j++) {
        ep->off_s[j] = (size_t)so, ep->off_r[j] = (size_t)ro;
        so += (int)len_s[j], ro += (int)len_r[j];
    }
    return ep->comm->alltoallv(ep->comm, send, ep->off_s, len_s, recv, ep->off_r, len_r);
}

int qf_ep_moe(qf_ep *ep, const float *x, int n, const int32_t *topi, const float *topw, qf_ep_expert_fn fn, void *ctx, float *out) {
    int R = ep->R, K = ep->K;
    if (n < 0 || n > ep->max_rows) return qf_fail(QF_EINVAL, "expert parallel: %d rows, more than the %d it was made for", n, ep->max_rows);
    for (size_t i = 0; i < (size_t)n * K; i++)
        if (topi[i] < -1 || topi[i] >= ep->E) return qf_fail(QF_EINVAL, "expert parallel: routed expert %d of row %zu is outside 0..%d", topi[i], i / K, ep->E - 1);
    pack(ep, x, n, topi);
    for (int j = 0; j < R; j++) ep->one_len[j] = sizeof(size_t); /* first the record counts */
    int rc = exchange(ep, ep->cnt_s, ep->one_len, ep->cnt_r, ep->one_len);
    for (int j = 0; rc == QF_OK && j < R; j++) ep->len_s[j] = ep->cnt_s[j] * ep->drec, ep->len_r[j] = ep->cnt_r[j] * ep->drec;
    if (rc == QF_OK) rc = exchange(ep, ep->dsend, ep->len_s, ep->drecv, ep->len_r);
    if (rc == QF_OK) compute(ep, fn, ctx, ep->len_s); /* len_s: now the return records' bytes a source rank */
    for (int j = 0; rc == QF_OK && j < R; j++) ep->len_r[j] = (size_t)ep->sent[j] * ep->yrec;
    if (rc == QF_OK) rc = exchange(ep, ep->ysend, ep->len_s, ep->yrecv, ep->len_r);
    if (rc != QF_OK) return rc;
    size_t total = 0;
    for (int j = 0; j < R; j++) total += (size_t)ep->sent[j];
    for (size_t q = 0; q < total; q++) {
        const int32_t *y = word(ep->yrecv, ep->yrec, q);
        if (y[2] != QF_OK && rc == QF_OK)
            rc = qf_fail(y[2], "expert parallel: expert %d of row %d failed on rank %d", topi[(size_t)y[0] * K + y[1]], y[0], qf_ep_owner(ep->E, R, topi[(size_t)y[0] * K + y[1]]));
        memcpy(ep->yk + ((size_t)y[0] * K + y[1]) * ep->H, y + 3, (size_t)ep->H * sizeof(float));
    }
    if (rc != QF_OK) return rc;
    if (out) combine(ep, n, topi, topw, out);
    return QF_OK;
}

const float *qf_ep_output(const qf_ep *ep, int i, int k) { return ep->yk + ((size_t)i * ep->K + k) * ep->H; }
