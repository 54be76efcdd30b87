/* Expert parallelism's dispatch and combine (experts/ep.c) over an in-process all-to-all: R
 * ranks as threads, each with its own rows, each running only the experts it holds. Every rank's
 * MoE output equals, bit for bit, the single-device sum (experts in ascending id), for R = 1..4,
 * uneven expert shares, a rank without rows; an expert that fails on its rank fails the rows that
 * chose it on theirs; bad arguments are refused. And the bundled model's forward with its MoE
 * layers spread over 2 and 3 ranks (each its own copy of the model and its own sequences, in
 * lockstep): every sequence's greedy ids and last logits equal the one-rank forward's, bit for bit. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/pool.h"
#include "experts/ep.h"
#include "model/model.h"
#include "test_util.h"

#define MAX_R 4
#define H 48
#define I 16

typedef struct {
    int E, K, n_rows, fail_e;
    float *gate, *up, *down; /* [E][I][H], [E][I][H], [E][H][I] */
    float *x, *w;            /* [rows][H], [rows][K] */
    int32_t *ti;             /* [rows][K] */
} world;

/* The in-process all-to-all: every rank publishes its send side, waits for all, copies what is
 * addressed to it, and waits again before its buffers may change. */
typedef struct {
    pthread_barrier_t bar;
    const char *send[MAX_R];
    const size_t *off[MAX_R], *len[MAX_R];
    int mismatch;
} mailbox;

static int fake_alltoallv(qf_ep_comm *c, const void *send, const size_t *send_off, const size_t *send_bytes, void *recv, const size_t *recv_off,
                          const size_t *recv_bytes) {
    mailbox *m = c->impl;
    int me = c->rank;
    m->send[me] = send, m->off[me] = send_off, m->len[me] = send_bytes;
    pthread_barrier_wait(&m->bar);
    for (int j = 0; j < c->n_ranks; j++) {
        if (m->len[j][me] != recv_bytes[j]) m->mismatch = 1;
        else memcpy((char *)recv + recv_off[j], m->send[j] + m->off[j][me], recv_bytes[j]);
    }
    pthread_barrier_wait(&m->bar);
    return QF_OK;
}

typedef struct {
    world *w;
    int rank, R, row0, n, foreign, rc;
    float *out;
    char err[256];
} rank_job;

static float silu(float v) { return v / (1.0f + expf(-v)); }

static int expert_plain(const world *w, int e, const float *x, float *y) {
    float h[I];
    for (int j = 0; j < I; j++) {
        float g = 0.0f, u = 0.0f;
        for (int c = 0; c < H; c++) g += w->gate[((size_t)e * I + j) * H + c] * x[c], u += w->up[((size_t)e * I + j) * H + c] * x[c];
        h[j] = silu(g) * u;
    }
    for (int c = 0; c < H; c++) {
        float s = 0.0f;
        for (int j = 0; j < I; j++) s += w->down[((size_t)e * H + c) * I + j] * h[j];
        y[c] = s;
    }
    return QF_OK;
}

static int expert_on_rank(void *ctx, int e, const float *x, float *y) {
    rank_job *j = ctx;
    if (qf_ep_owner(j->w->E, j->R, e) != j->rank) j->foreign++;
    if (e == j->w->fail_e) return qf_fail(QF_EIO, "expert %d could not be read", e);
    return expert_plain(j->w, e, x, y);
}

static mailbox g_box;
static qf_ep_comm g_comm[MAX_R];

static void *rank_main(void *arg) {
    rank_job *j = arg;
    world *w = j->w;
    qf_ep *ep = qf_ep_create(&g_comm[j->rank], w->E, w->K, H, 16);
    if (!ep) {
        j->rc = QF_EINVAL;
        return NULL;
    }
    j->rc = qf_ep_moe(ep, w->x + (size_t)j->row0 * H, j->n, w->ti + (size_t)j->row0 * w->K, w->w + (size_t)j->row0 * w->K, expert_on_rank, j, j->out);
    if (j->rc != QF_OK) snprintf(j->err, sizeof j->err, "%s", qf_last_error());
    qf_ep_free(ep);
    return NULL;
}

/* The single-device sum: experts in ascending id, each adding w * its output to the row. */
static void reference(const world *w, float *out) {
    float y[H];
    memset(out, 0, (size_t)w->n_rows * H * sizeof(float));
    for (int e = 0; e < w->E; e++)
        for (int i = 0; i < w->n_rows; i++)
            for (int k = 0; k < w->K; k++)
                if (w->ti[(size_t)i * w->K + k] == e) {
                    expert_plain(w, e, w->x + (size_t)i * H, y);
                    for (int c = 0; c < H; c++) out[(size_t)i * H + c] += w->w[(size_t)i * w->K + k] * y[c];
                }
}

static world make_world(int E, int K, int rows) {
    world w = {E, K, rows, -1, qt_rnd((size_t)E * I * H, 0.2f), qt_rnd((size_t)E * I * H, 0.2f), qt_rnd((size_t)E * H * I, 0.2f),
               qt_rnd((size_t)rows * H, 1.0f), malloc((size_t)rows * K * sizeof(float)), malloc((size_t)rows * K * sizeof(int32_t))};
    for (int i = 0; i < rows; i++) {
        float sum = 0.0f;
        for (int k = 0; k < K; k++) {
            int e, dup;
            do {
                e = (int)((qt_frand() * 0.5f + 0.5f) * E) % E, dup = 0;
                for (int q = 0; q < k; q++) dup |= w.ti[(size_t)i * K + q] == e;
            } while (dup);
            w.ti[(size_t)i * K + k] = e, w.w[(size_t)i * K + k] = qt_frand() * 0.5f + 0.6f, sum += w.w[(size_t)i * K + k];
        }
        for (int k = 0; k < K; k++) w.w[(size_t)i * K + k] /= sum;
    }
    return w;
}

static void free_world(world *w) { free(w->gate), free(w->up), free(w->down), free(w->x), free(w->w), free(w->ti); }

/* R ranks over the world's rows (rank r takes rows[r] of them); each rank's output against the
 * reference, bit for bit; fail_rows: the ranks that must fail instead (a mask), when an expert fails. */
static void run_ranks(world *w, int R, const int *rows, const char *what) {
    float *want = malloc((size_t)w->n_rows * H * sizeof(float)), *got = calloc((size_t)w->n_rows * H, sizeof(float));
    reference(w, want);
    pthread_barrier_init(&g_box.bar, NULL, (unsigned)R);
    g_box.mismatch = 0;
    rank_job jobs[MAX_R];
    pthread_t th[MAX_R];
    for (int r = 0, row0 = 0; r < R; row0 += rows[r], r++) {
        g_comm[r] = (qf_ep_comm){R, r, fake_alltoallv, &g_box};
        jobs[r] = (rank_job){w, r, R, row0, rows[r], 0, QF_OK, got + (size_t)row0 * H, ""};
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g_box.bar);
    CHECK(!g_box.mismatch, "%s: a rank received other sizes than were sent", what);
    int failed = 0;
    for (int r = 0, row0 = 0; r < R; row0 += rows[r], r++) {
        CHECK(jobs[r].foreign == 0, "%s: rank %d ran %d experts it does not hold", what, r, jobs[r].foreign);
        int chose = 0; /* whether a row of this rank chose the failing expert */
        for (int i = row0; i < row0 + rows[r]; i++)
            for (int k = 0; k < w->K; k++) chose |= w->ti[(size_t)i * w->K + k] == w->fail_e;
        if (chose) {
            CHECK(jobs[r].rc == QF_EIO && strstr(jobs[r].err, "failed on rank"), "%s: rank %d: rc %d (%s), want the expert's failure", what, r,
                  jobs[r].rc, jobs[r].err);
            failed++;
            continue;
        }
        CHECK(jobs[r].rc == QF_OK, "%s: rank %d: %s", what, r, jobs[r].err);
        CHECK(memcmp(got + (size_t)row0 * H, want + (size_t)row0 * H, (size_t)rows[r] * H * sizeof(float)) == 0,
              "%s: rank %d's rows differ from the single-device sum (%.3g)", what, r,
              qt_max_abs_diff(got + (size_t)row0 * H, want + (size_t)row0 * H, (int64_t)rows[r] * H));
    }
    CHECK(w->fail_e < 0 || failed > 0, "%s: no rank chose the failing expert", what);
    free(want), free(got);
}

static void test_owner(void) {
    const int shapes[][2] = {{64, 1}, {64, 2}, {64, 3}, {10, 3}, {256, 8}, {7, 7}, {257, 4}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int E = shapes[s][0], R = shapes[s][1], bad = 0;
        for (int r = 0; r < R; r++) {
            int lo = qf_ep_first(E, R, r), hi = qf_ep_first(E, R, r + 1);
            bad |= hi - lo < E / R || hi - lo > E / R + 1;
            for (int e = lo; e < hi; e++) bad |= qf_ep_owner(E, R, e) != r;
        }
        CHECK(!bad && qf_ep_first(E, R, 0) == 0 && qf_ep_first(E, R, R) == E, "placement of %d experts over %d ranks", E, R);
    }
}

static void test_refusals(void) {
    qf_ep_comm c = {2, 0, fake_alltoallv, &g_box};
    CHECK(qf_ep_create(&c, 1, 1, H, 4) == NULL && strstr(qf_last_error(), "1 experts top-1 over 2 ranks"), "fewer experts than ranks: %s",
          qf_last_error());
    c.rank = 2;
    CHECK(qf_ep_create(&c, 8, 2, H, 4) == NULL, "rank outside the ranks accepted");
    c = (qf_ep_comm){1, 0, fake_alltoallv, &g_box};
    pthread_barrier_init(&g_box.bar, NULL, 1);
    qf_ep *ep = qf_ep_create(&c, 8, 2, H, 2);
    float x[3 * H] = {0}, w[6] = {0}, out[3 * H];
    int32_t ti[6] = {0, 1, 2, 3, 4, 9};
    CHECK(ep && qf_ep_moe(ep, x, 3, ti, w, expert_on_rank, NULL, out) == QF_EINVAL && strstr(qf_last_error(), "3 rows"), "rows over max: %s",
          qf_last_error());
    CHECK(qf_ep_moe(ep, x, 2, ti + 2, w, expert_on_rank, NULL, out) == QF_EINVAL && strstr(qf_last_error(), "routed expert 9"),
          "expert id out of range: %s", qf_last_error());
    qf_ep_free(ep);
    pthread_barrier_destroy(&g_box.bar);
}

/* ---- the model's forward over ranks ---- */

enum { SEQS_PER_RANK = 2, PROMPT = 12, GEN = 10 };

typedef struct {
    int rank, R, ep_on, rc, V;
    int32_t ids[SEQS_PER_RANK][PROMPT + GEN];
    float *last; /* [SEQS_PER_RANK][vocab]: the last step's logits */
    char err[256];
} fwd_job;

/* Rank r's sequences: prompts of the bundled model's vocabulary, different on every rank. */
static void fwd_prompts(fwd_job *j, int V) {
    for (int s = 0; s < SEQS_PER_RANK; s++)
        for (int t = 0; t < PROMPT; t++) j->ids[s][t] = (int32_t)((7919u * (unsigned)(j->rank * SEQS_PER_RANK + s + 1) + 104729u * (unsigned)t) % (unsigned)V);
}

/* Prompt then GEN greedy steps, each a forward of the rank's sequences together; with ep_on the
 * MoE layers exchange rows with the other ranks (so every rank runs the same forwards). */
static void *fwd_rank(void *arg) {
    fwd_job *j = arg;
    qf_model *m = NULL;
    j->rc = qf_model_load(&m, qt_path("models/qwen36moe-code-14m"), NULL);
    int V = j->V = m ? m->cfg.vocab : 1;
    qf_pool *pool = qf_pool_create(1);
    qf_backend be = {qf_cpu_ops_best(), pool, NULL};
    qf_workspace *ws = m ? qf_workspace_create(m, SEQS_PER_RANK * PROMPT) : NULL;
    qf_ep *ep = m && j->ep_on ? qf_ep_create(&g_comm[j->rank], m->cfg.n_experts, m->cfg.n_experts_used, m->cfg.hidden, SEQS_PER_RANK * PROMPT) : NULL;
    qf_state *st[SEQS_PER_RANK] = {0};
    j->last = malloc((size_t)SEQS_PER_RANK * V * sizeof(float));
    for (int s = 0; m && s < SEQS_PER_RANK; s++) st[s] = qf_state_create(m, PROMPT + GEN + 4);
    if (j->rc == QF_OK && (!ws || !j->last || !st[0] || !st[SEQS_PER_RANK - 1] || (j->ep_on && !ep))) j->rc = QF_ENOMEM;
    if (ep) qf_workspace_set_ep(ws, ep);
    fwd_prompts(j, V);
    for (int step = 0; step <= GEN && j->rc == QF_OK; step++) { /* every rank runs GEN + 1 forwards, whatever happens */
        qf_seq_step q[SEQS_PER_RANK];
        for (int s = 0; s < SEQS_PER_RANK; s++) {
            int at = step ? PROMPT + step - 1 : 0;
            q[s] = (qf_seq_step){st[s], &j->ids[s][at], step ? 1 : PROMPT, QF_LOGITS_LAST, j->last + (size_t)s * V, NULL, 0, 0, NULL, NULL, NULL};
        }
        j->rc = qf_forward(m, &be, ws, q, SEQS_PER_RANK);
        for (int s = 0; j->rc == QF_OK && step < GEN && s < SEQS_PER_RANK; s++) j->ids[s][PROMPT + step] = qt_argmax(j->last + (size_t)s * V, V);
    }
    if (j->rc != QF_OK) snprintf(j->err, sizeof j->err, "%s", qf_last_error());
    for (int s = 0; s < SEQS_PER_RANK; s++) qf_state_free(st[s]);
    qf_ep_free(ep), qf_workspace_free(ws), qf_pool_destroy(pool), qf_model_free(m);
    return NULL;
}

static void test_forward_ranks(int R) {
    fwd_job one[MAX_R], many[MAX_R];
    pthread_t th[MAX_R];
    for (int r = 0; r < R; r++) { /* each rank's sequences alone, every expert at hand */
        one[r] = (fwd_job){.rank = r, .R = R};
        fwd_rank(&one[r]);
    }
    pthread_barrier_init(&g_box.bar, NULL, (unsigned)R);
    g_box.mismatch = 0;
    for (int r = 0; r < R; r++) {
        g_comm[r] = (qf_ep_comm){R, r, fake_alltoallv, &g_box};
        many[r] = (fwd_job){.rank = r, .R = R, .ep_on = 1};
        pthread_create(&th[r], NULL, fwd_rank, &many[r]);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g_box.bar);
    CHECK(!g_box.mismatch, "forward over %d ranks: a rank received other sizes than were sent", R);
    for (int r = 0; r < R; r++) {
        CHECK(one[r].rc == QF_OK && many[r].rc == QF_OK, "forward over %d ranks, rank %d: %s %s", R, r, one[r].err, many[r].err);
        CHECK(!memcmp(one[r].ids, many[r].ids, sizeof one[r].ids), "forward over %d ranks, rank %d: greedy ids differ from one rank's", R, r);
        CHECK(one[r].last && many[r].last && one[r].V == many[r].V && !memcmp(one[r].last, many[r].last, (size_t)SEQS_PER_RANK * one[r].V * sizeof(float)),
              "forward over %d ranks, rank %d: the last logits differ from one rank's", R, r);
        free(one[r].last), free(many[r].last);
    }
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    test_owner();
    test_refusals();
    world w = make_world(64, 4, 40);
    run_ranks(&w, 1, (int[]){16}, "1 rank");
    run_ranks(&w, 2, (int[]){7, 12}, "2 ranks");
    run_ranks(&w, 3, (int[]){5, 0, 9}, "3 ranks, one without rows");
    run_ranks(&w, 4, (int[]){10, 10, 10, 10}, "4 ranks");
    w.fail_e = w.ti[5 * 4 + 2]; /* chosen by row 5 (rank 0's) and maybe others */
    run_ranks(&w, 3, (int[]){8, 8, 8}, "3 ranks, an expert failing");
    free_world(&w);
    world u = make_world(10, 3, 24);
    run_ranks(&u, 3, (int[]){8, 8, 8}, "10 experts over 3 ranks");
    run_ranks(&u, 4, (int[]){6, 6, 6, 6}, "10 experts over 4 ranks");
    free_world(&u);
    test_forward_ranks(2);
    test_forward_ranks(3);
    return qt_finish();
}
