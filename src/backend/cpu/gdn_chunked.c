/* The gated delta rule over a prompt in chunks of C tokens (the "WY" form of Gated DeltaNet): the
 * same results as the token-by-token rule (ops_ref.c, docs/model-spec.md §5.6) up to rounding, but every
 * step but one triangular solve is a product of whole matrices, which is what lets a GPU run a
 * prompt's recurrence on its tensor cores instead of one dependent chain per token. Plain loops:
 * this is the reference that a chunked device kernel is checked against, step by step.
 *
 * Within a chunk (tokens t = 0..n-1, state S0 [dk][dv] on entry), with unit-norm k_t, scaled q_t,
 * G_t = log g_0 + ... + log g_t and the rule's u_t = beta_t (v_t - (g_t S_{t-1})^T k_t):
 *   (I + A) U = diag(beta) V - diag(beta e^G) K S0,  A[t][s] = beta_t e^(G_t - G_s) k_t.k_s (s < t)
 *   so U = Ut - W S0 with Ut = (I + A)^-1 diag(beta) V, W = (I + A)^-1 diag(beta e^G) K;
 *   o_t = e^G_t S0^T q_t + sum_{s <= t} e^(G_t - G_s) (q_t.k_s) u_s;
 *   S_n = e^G_{n-1} S0 + sum_s e^(G_{n-1} - G_s) k_s u_s^T. */
#include <math.h>

#include "backend/cpu/cpu_int.h"

size_t qf_gdn_chunked_floats(int dk, int dv, int C) { return (size_t)C * (3 * (size_t)dk + (size_t)dv + 2); }

typedef struct chunk_bufs {
    float *qn, *kn, *u, *w, *G, *beta; /* [C][dk] [C][dk] [C][dv] [C][dk] [C] [C] */
} chunk_bufs;

static float dotf(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Head h's inputs of tokens c0 .. c0 + n - 1: normalised q and k, beta, the decays' running log sum. */
static void chunk_inputs(const qf_gdn_args *a, int h, int c0, int n, chunk_bufs *b) {
    int dk = a->dk, kh = h / (a->nv / a->nk);
    float qscale = 1.0f / sqrtf((float)dk), G = 0.0f;
    for (int t = 0; t < n; t++) {
        int64_t row = (int64_t)(c0 + t) * a->stride + kh * dk;
        qf_ref_l2norm(a->q + row, dk, qscale, b->qn + (size_t)t * dk);
        qf_ref_l2norm(a->k + row, dk, 1.0f, b->kn + (size_t)t * dk);
        G += a->g[(c0 + t) * a->nv + h];
        b->G[t] = G, b->beta[t] = a->beta[(c0 + t) * a->nv + h];
    }
}

/* Ut and W by forward substitution through (I + A); u holds Ut, then U = Ut - W S0. */
static void chunk_solve(const qf_gdn_args *a, int h, int c0, int n, const float *S0, chunk_bufs *b) {
    int dk = a->dk, dv = a->dv;
    for (int t = 0; t < n; t++) {
        const float *kt = b->kn + (size_t)t * dk, *v = a->v + (int64_t)(c0 + t) * a->stride + (int64_t)h * dv;
        float *ut = b->u + (size_t)t * dv, *wt = b->w + (size_t)t * dk, bt = b->beta[t], eg = expf(b->G[t]);
        for (int j = 0; j < dv; j++) ut[j] = bt * v[j];
        for (int i = 0; i < dk; i++) wt[i] = bt * eg * kt[i];
        for (int s = 0; s < t; s++) {
            float ats = bt * expf(b->G[t] - b->G[s]) * dotf(kt, b->kn + (size_t)s * dk, dk);
            for (int j = 0; j < dv; j++) ut[j] -= ats * b->u[(size_t)s * dv + j];
            for (int i = 0; i < dk; i++) wt[i] -= ats * b->w[(size_t)s * dk + i];
        }
    }
    for (int t = 0; t < n; t++)
        for (int j = 0; j < dv; j++) {
            float ws = 0.0f;
            for (int i = 0; i < dk; i++) ws += b->w[(size_t)t * dk + i] * S0[(size_t)i * dv + j];
            b->u[(size_t)t * dv + j] -= ws;
        }
}

/* The chunk's outputs, and its final state into S. */
static void chunk_out(const qf_gdn_args *a, int h, int c0, int n, float *S, chunk_bufs *b) {
    int dk = a->dk, dv = a->dv;
    for (int t = 0; t < n; t++) {
        const float *qt = b->qn + (size_t)t * dk;
        float *o = a->out + ((int64_t)(c0 + t) * a->nv + h) * dv, eg = expf(b->G[t]);
        for (int j = 0; j < dv; j++) {
            float acc = 0.0f;
            for (int i = 0; i < dk; i++) acc += qt[i] * S[(size_t)i * dv + j];
            o[j] = eg * acc;
        }
        for (int s = 0; s <= t; s++) {
            float p = expf(b->G[t] - b->G[s]) * dotf(qt, b->kn + (size_t)s * dk, dk);
            for (int j = 0; j < dv; j++) o[j] += p * b->u[(size_t)s * dv + j];
        }
    }
    float eg = expf(b->G[n - 1]); /* the outputs are written: S0 is not needed any more */
    for (size_t i = 0; i < (size_t)dk * dv; i++) S[i] *= eg;
    for (int s = 0; s < n; s++) {
        float f = expf(b->G[n - 1] - b->G[s]);
        for (int i = 0; i < dk; i++) {
            float ki = f * b->kn[(size_t)s * dk + i];
            for (int j = 0; j < dv; j++) S[(size_t)i * dv + j] += ki * b->u[(size_t)s * dv + j];
        }
    }
}

void qf_gdn_chunked(const qf_gdn_args *a, int C, float *scratch) {
    int dk = a->dk, dv = a->dv;
    chunk_bufs b;
    b.qn = scratch, b.kn = b.qn + (size_t)C * dk, b.u = b.kn + (size_t)C * dk, b.w = b.u + (size_t)C * dv;
    b.G = b.w + (size_t)C * dk, b.beta = b.G + C;
    for (int h = 0; h < a->nv; h++) {
        float *S = a->S + (int64_t)h * dk * dv;
        for (int c0 = 0; c0 < a->T; c0 += C) {
            int n = a->T - c0 < C ? a->T - c0 : C;
            chunk_inputs(a, h, c0, n, &b);
            chunk_solve(a, h, c0, n, S, &b);
            chunk_out(a, h, c0, n, S, &b);
        }
    }
}
