/* The host half of hybrid expert execution (host_moe.h). A job runs in three passes over the
 * pool: gate and up slices, then down slices, then each row's sum in ascending expert order. */
#include "experts/host_moe.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/quant.h"

/* Rows of a matrix a task takes: small, so a step's one or two experts still keep every thread
 * busy; fp8's block height, so its slices keep whole scale blocks. */
#define HM_SLICE 32
#define HM_SLICE_FP8 128

struct qf_host_moe {
    qf_pool *pool;
    qf_backend cpu; /* the CPU table, single-threaded inside a task */
    int hidden, ffn, top_k, max_rows, slice; /* slice: the job's rows a task (HM_SLICE, or fp8's) */
    /* the job grouped by expert: group g is expert gx[g], pairs [g0[g], g0[g + 1]) of the pair
     * arrays (pr: row, pw: weight), rows ascending within a group */
    int n_groups, *gx, *g0, *pr;
    float *pw;
    float *xin, *g, *u, *h, *out, *part; /* [pairs][hidden], [pairs][ffn] x3, [pairs][hidden], slices' outputs */
    const qf_host_moe_job *job;
};

static int slices_of(int64_t rows, int slice) { return (int)((rows + slice - 1) / slice); }
static int slices(const qf_host_moe *h, int64_t rows) { return slices_of(rows, h->slice); }
/* A pair's share of a pass's slice outputs at once (part_at), slices of s rows. */
static size_t part_floats(int hidden, int ffn, int s) {
    size_t gu = 2 * (size_t)slices_of(ffn, s), dn = (size_t)slices_of(hidden, s);
    return (gu > dn ? gu : dn) * (size_t)s;
}

int qf_host_moe_create(qf_host_moe **out, qf_pool *pool, int hidden, int ffn, int top_k, int max_rows) {
    *out = NULL;
    if (hidden < 1 || ffn < 1 || top_k < 1 || max_rows < 1) return qf_fail(QF_EINVAL, "host experts: hidden %d, width %d, top-k %d, rows %d", hidden, ffn, top_k, max_rows);
    qf_host_moe *h = calloc(1, sizeof *h);
    if (!h) return qf_fail(QF_ENOMEM, "out of memory for the host experts");
    size_t P = (size_t)max_rows * top_k, a = part_floats(hidden, ffn, HM_SLICE), b = part_floats(hidden, ffn, HM_SLICE_FP8), part = a > b ? a : b;
    *h = (qf_host_moe){.pool = pool, .cpu = {qf_cpu_ops_best(), NULL, NULL}, .hidden = hidden, .ffn = ffn, .top_k = top_k, .max_rows = max_rows};
    h->gx = malloc(P * sizeof(int)), h->g0 = malloc((P + 1) * sizeof(int)), h->pr = malloc(P * sizeof(int));
    h->pw = malloc(P * sizeof(float)), h->xin = malloc(P * hidden * sizeof(float)), h->out = malloc(P * hidden * sizeof(float));
    h->g = malloc(P * ffn * sizeof(float)), h->u = malloc(P * ffn * sizeof(float)), h->h = malloc(P * ffn * sizeof(float));
    h->part = malloc(P * part * sizeof(float));
    if (!h->gx || !h->g0 || !h->pr || !h->pw || !h->xin || !h->out || !h->g || !h->u || !h->h || !h->part) {
        qf_host_moe_free(h);
        return qf_fail(QF_ENOMEM, "out of memory for the host experts (%zu pairs)", P);
    }
    *out = h;
    return QF_OK;
}

void qf_host_moe_free(qf_host_moe *h) {
    if (!h) return;
    free(h->gx), free(h->g0), free(h->pr), free(h->pw);
    free(h->xin), free(h->out), free(h->g), free(h->u), free(h->h), free(h->part);
    free(h);
}

/* Rows [r0, r0 + rows) of m as a matrix of their own (r0 a multiple of the slice). */
static qf_mat mat_rows(const qf_mat *m, int64_t r0, int64_t rows) {
    qf_mat v = *m;
    v.data = (const char *)m->data + (size_t)r0 * qf_mat_row_bytes(m), v.rows = rows;
    if (m->scales) v.scales = m->scales + (size_t)(r0 / QF_FP8_BLOCK) * (size_t)((m->cols + QF_FP8_BLOCK - 1) / QF_FP8_BLOCK);
    return v;
}

/* y[n][m->rows] = x . m^T, slice s of it computed into part (at off floats) and moved into place. */
static void slice_product(qf_host_moe *h, const qf_mat *m, int s, const float *x, int n, float *part, float *y) {
    int64_t r0 = (int64_t)s * h->slice, nr = m->rows - r0 < h->slice ? m->rows - r0 : h->slice;
    qf_mat v = mat_rows(m, r0, nr);
    h->cpu.ops->matmul(&h->cpu, &v, x, n, part);
    for (int i = 0; i < n; i++) memcpy(y + (size_t)i * m->rows + r0, part + (size_t)i * nr, (size_t)nr * sizeof(float));
}

/* A slice's [n][slice] outputs: group g's pairs own slices x n rows of part from p0 on. */
static float *part_at(qf_host_moe *h, int p0, int n, int per, int idx) { return h->part + ((size_t)p0 * per + (size_t)idx * n) * h->slice; }

/* Pass 1 task i: group i / (2 S), gate or up, slice. */
static void pass_gu(void *ctx, int i) {
    qf_host_moe *h = ctx;
    int S = slices(h, h->ffn), g = i / (2 * S), k = i % (2 * S), which = k / S, p0 = h->g0[g], n = h->g0[g + 1] - p0;
    const qf_expert *x = &h->job->experts[h->gx[g]];
    slice_product(h, which ? &x->up : &x->gate, k % S, h->xin + (size_t)p0 * h->hidden, n, part_at(h, p0, n, 2 * S, k), (which ? h->u : h->g) + (size_t)p0 * h->ffn);
}

/* Pass 2 task i: group i / S, down slice. */
static void pass_down(void *ctx, int i) {
    qf_host_moe *h = ctx;
    int S = slices(h, h->hidden), g = i / S, s = i % S, p0 = h->g0[g], n = h->g0[g + 1] - p0;
    const qf_expert *x = &h->job->experts[h->gx[g]];
    slice_product(h, &x->down, s, h->h + (size_t)p0 * h->ffn, n, part_at(h, p0, n, S, s), h->out + (size_t)p0 * h->hidden);
}

/* Pass 3 task r: row r's sum over its pairs, groups in ascending expert order. */
static void pass_sum(void *ctx, int r) {
    qf_host_moe *h = ctx;
    int H = h->hidden;
    float *y = h->job->y + (size_t)r * H;
    memset(y, 0, (size_t)H * sizeof(float));
    for (int g = 0; g < h->n_groups; g++)
        for (int p = h->g0[g]; p < h->g0[g + 1]; p++)
            if (h->pr[p] == r) h->cpu.ops->axpy(&h->cpu, y, h->out + (size_t)p * H, h->pw[p], H);
}

/* The job's pairs grouped by expert, ascending expert ids, rows ascending within a group. */
static int group(qf_host_moe *h, const qf_host_moe_job *j) {
    int E = j->n_experts, K = j->top_k, at = 0;
    h->n_groups = 0;
    for (int e = 0; e < E; e++) {
        int first = at;
        for (int r = 0; r < j->n; r++)
            for (int k = 0; k < K; k++)
                if (j->ids[r * K + k] == e) h->pr[at] = r, h->pw[at] = j->w[r * K + k], at++;
        if (at == first) continue;
        const qf_expert *x = &j->experts[e];
        if (x->gate.rows != h->ffn || x->gate.cols != h->hidden || x->up.rows != h->ffn || x->down.rows != h->hidden || x->down.cols != h->ffn)
            return qf_fail(QF_EINVAL, "host experts: expert %d is %lldx%lld, not %dx%d", e, (long long)x->gate.rows, (long long)x->gate.cols, h->ffn, h->hidden);
        h->gx[h->n_groups] = e, h->g0[h->n_groups++] = first;
    }
    h->g0[h->n_groups] = at;
    return QF_OK;
}

int qf_host_moe_run(qf_host_moe *h, const qf_host_moe_job *j) {
    if (j->n < 0 || j->n > h->max_rows || j->top_k != h->top_k)
        return qf_fail(QF_EINVAL, "host experts: %d rows of top-%d (at most %d of top-%d)", j->n, j->top_k, h->max_rows, h->top_k);
    for (int i = 0; i < j->n * j->top_k; i++)
        if (j->ids[i] < -1 || j->ids[i] >= j->n_experts) return qf_fail(QF_EINVAL, "host experts: expert id %d of row %d is out of range", j->ids[i], i / j->top_k);
    int rc = group(h, j);
    if (rc != QF_OK) return rc;
    h->job = j;
    h->slice = h->n_groups && j->experts[h->gx[0]].gate.scales ? HM_SLICE_FP8 : HM_SLICE;
    int H = h->hidden, I = h->ffn, P = h->g0[h->n_groups];
    for (int p = 0; p < P; p++) memcpy(h->xin + (size_t)p * H, j->xn + (size_t)h->pr[p] * H, (size_t)H * sizeof(float));
    qf_pool_run(h->pool, pass_gu, h, h->n_groups * 2 * slices(h, I));
    for (int g = 0; g < h->n_groups; g++) { /* swiglu per group, as the CPU path runs it per expert */
        int p0 = h->g0[g], n = h->g0[g + 1] - p0;
        h->cpu.ops->swiglu(&h->cpu, h->g + (size_t)p0 * I, h->u + (size_t)p0 * I, I, n, I, h->h + (size_t)p0 * I);
    }
    qf_pool_run(h->pool, pass_down, h, h->n_groups * slices(h, H));
    qf_pool_run(h->pool, pass_sum, h, j->n);
    h->job = NULL;
    return QF_OK;
}
