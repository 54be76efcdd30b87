#include "runtime/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/numeric.h"

typedef struct cand {
    float logit;
    int32_t id;
} cand;

struct qf_sampler {
    qf_sampling p;
    int vocab;
    uint64_t rng[4];
    int *count_all, *count_gen; /* per token */
    int32_t *touched;           /* ids with a non-zero count, to reset and penalise cheaply */
    int n_touched;
    cand *c;                    /* (vocab) candidates */
    double *w;                  /* (vocab) exp(logit - max) of the sorted candidates */
    float *x;                   /* (vocab) the logits over the temperature */
    unsigned char *best;        /* (vocab) 1: among the sorted candidates (the unsorted tail's walk skips it) */
    float *sub;                 /* (vocab) per touched id, what the presence and frequency penalties take (draw_desc) */
};

/* With top_k off, the best candidates sorted first: top-p and min-p stop inside them unless the
 * distribution is flat, and only then is every candidate sorted (the walk of backend/ops.h's
 * qf_draw, which the device's draw follows too). */
#define SORTED_FIRST QF_DRAW_SORTED

qf_sampling qf_sampling_default(void) {
    qf_sampling p = {0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0};
    return p;
}

int qf_sampling_check(const qf_sampling *p) {
    if (!(p->temperature >= 0.0f && p->temperature <= 100.0f)) return qf_fail(QF_EINVAL, "temperature must be in [0, 100]");
    if (p->top_k < 0) return qf_fail(QF_EINVAL, "top_k must be >= 0");
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) return qf_fail(QF_EINVAL, "top_p must be in (0, 1]");
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) return qf_fail(QF_EINVAL, "min_p must be in [0, 1]");
    if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 10.0f)) return qf_fail(QF_EINVAL, "repetition_penalty must be in (0, 10]");
    if (!(fabsf(p->presence_penalty) <= 2.0f)) return qf_fail(QF_EINVAL, "presence_penalty must be in [-2, 2]");
    if (!(fabsf(p->frequency_penalty) <= 2.0f)) return qf_fail(QF_EINVAL, "frequency_penalty must be in [-2, 2]");
    return QF_OK;
}

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** */
static uint64_t next_u64(uint64_t *s) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

static double next_unit(uint64_t *s) { return (double)(next_u64(s) >> 11) * (1.0 / 9007199254740992.0); }

qf_sampler *qf_sampler_create(int vocab, const qf_sampling *p) {
    if (vocab < 1 || qf_sampling_check(p) != QF_OK) return NULL;
    qf_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = *p;
    s->vocab = vocab;
    s->count_all = calloc((size_t)vocab, sizeof(int));
    s->count_gen = calloc((size_t)vocab, sizeof(int));
    s->touched = malloc((size_t)vocab * sizeof(int32_t));
    s->c = malloc((size_t)vocab * sizeof(cand));
    s->w = malloc((size_t)vocab * sizeof(double));
    s->x = malloc((size_t)vocab * sizeof(float));
    s->best = calloc((size_t)vocab, 1);
    s->sub = malloc((size_t)vocab * sizeof(float));
    if (!s->count_all || !s->count_gen || !s->touched || !s->c || !s->w || !s->x || !s->best || !s->sub) {
        qf_sampler_free(s);
        return NULL;
    }
    qf_sampler_reset(s);
    return s;
}

void qf_sampler_free(qf_sampler *s) {
    if (!s) return;
    free(s->count_all);
    free(s->count_gen);
    free(s->touched);
    free(s->c);
    free(s->w);
    free(s->x);
    free(s->best);
    free(s->sub);
    free(s);
}

void qf_sampler_reset(qf_sampler *s) {
    for (int i = 0; i < s->n_touched; i++) s->count_all[s->touched[i]] = s->count_gen[s->touched[i]] = 0;
    s->n_touched = 0;
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix(&x);
}

void qf_sampler_accept(qf_sampler *s, int32_t tok, int generated) {
    if (tok < 0 || tok >= s->vocab) return;
    if (!s->count_all[tok]) s->touched[s->n_touched++] = tok;
    s->count_all[tok]++;
    if (generated) s->count_gen[tok]++;
}

/* What the presence and frequency penalties take from a token generated gen times. */
static float gen_sub(const qf_sampling *p, int gen) { return p->presence_penalty + p->frequency_penalty * (float)gen; }

static void apply_penalties(qf_sampler *s, float *logits) {
    const qf_sampling *p = &s->p;
    for (int i = 0; i < s->n_touched; i++) {
        int32_t t = s->touched[i];
        if (p->repetition_penalty != 1.0f) logits[t] = logits[t] > 0 ? logits[t] / p->repetition_penalty : logits[t] * p->repetition_penalty;
        if (s->count_gen[t]) logits[t] -= gen_sub(p, s->count_gen[t]);
    }
}

static int cmp_cand(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* Heap with the worst candidate (by cmp_cand order) at the root. */
static void sift_down(cand *h, int size, int j) {
    for (;;) {
        int l = 2 * j + 1, r = l + 1, w = j;
        if (l < size && cmp_cand(&h[l], &h[w]) > 0) w = l;
        if (r < size && cmp_cand(&h[r], &h[w]) > 0) w = r;
        if (w == j) return;
        cand t = h[j];
        h[j] = h[w];
        h[w] = t;
        j = w;
    }
}

/* A logit below this one, divided by t, is below r for certain (3 ulps of margin): most of the
 * vocabulary is rejected without a division. */
static float below(float r, float t) {
    float a = r * t;
    return a - (fabsf(a) * 4e-7f + 1e-30f);
}

/* c[0..k) = the k best of the n values l[i] / t (ids 0..n-1), sorted best first (cmp_cand's
 * order): a heap of the k best so far with the worst at its root, which most values fail against
 * at one compare. x (may be NULL) keeps every value. */
static int select_best(cand *c, const float *l, float t, int n, int k, float *x) {
    if (k > n) k = n;
    for (int i = 0; i < k; i++) c[i] = (cand){l[i] / t, i};
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(c, k, i);
    for (int i = 0; x && i < k; i++) x[i] = l[i] / t;
    float lo = below(c[0].logit, t);
    for (int i = k; i < n; i++) {
        if (!x && l[i] < lo) continue;
        float v = l[i] / t;
        if (x) x[i] = v;
        if (v < c[0].logit) continue;
        cand u = {v, i};
        if (cmp_cand(&u, &c[0]) < 0) {
            c[0] = u;
            sift_down(c, k, 0);
            lo = below(c[0].logit, t);
        }
    }
    qsort(c, (size_t)k, sizeof *c, cmp_cand);
    return k;
}

/* sum exp(x[i] - mx) over all n (the normaliser of top-p with top_k off), in double lanes: at a
 * 248k vocabulary float lanes drift by about one tail token's weight, moving the draw's threshold
 * onto another token than the device's (and the walk's own double sums) would pick. */
static double exp_sum(const float *x, int n, float mx) {
    double lane[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += expf(x[i + j] - mx);
    double sum = 0;
    for (; i < n; i++) sum += expf(x[i] - mx);
    for (int j = 0; j < 8; j++) sum += lane[j];
    return sum;
}

int qf_sampler_is_greedy(const qf_sampler *s) {
    const qf_sampling *p = &s->p;
    return p->temperature == 0.0f && p->repetition_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f;
}

/* How many of the n sorted candidates (w: their exp(logit - max), sum: of every candidate) top-p
 * and min-p keep; n + 1 when they keep them all and want more. */
static int keep_count(const qf_sampling *p, const double *w, int n, double sum) {
    double cum = 0;
    for (int i = 0; i < n; i++) {
        if (i > 0 && w[i] < p->min_p) return i; /* min-p: below min_p x the top one */
        cum += w[i] / sum;
        if (cum >= p->top_p) return i + 1;
    }
    return n + 1;
}

/* A draw with the uniform number u0 from the kept sorted candidates. */
static int32_t draw_sorted(qf_sampler *s, int kept, double u0) {
    double total = 0;
    for (int i = 0; i < kept; i++) total += s->w[i];
    double u = u0 * total, acc = 0;
    for (int i = 0; i < kept; i++) {
        acc += s->w[i];
        if (u < acc) return s->c[i].id;
    }
    return s->c[kept - 1].id;
}

/* Every token kept (top-p and min-p off): the sorted best first, then the rest in id order (the
 * same distribution; no order of the rest is needed for a draw). */
static int32_t draw_all(qf_sampler *s, int k, double sum, double u0) {
    double u = u0 * sum, acc = 0, mx = s->c[0].logit;
    int32_t last = s->c[k - 1].id;
    for (int i = 0; i < k; i++) {
        acc += s->w[i];
        if (u < acc) return s->c[i].id;
    }
    for (int i = 0; i < k; i++) s->best[s->c[i].id] = 1;
    for (int i = 0; i < s->vocab; i++) {
        if (s->best[i]) continue;
        acc += exp((double)s->x[i] - mx), last = i;
        if (u < acc) break;
    }
    for (int i = 0; i < k; i++) s->best[s->c[i].id] = 0;
    return last;
}

/* The draw with u0 from penalised logits (temperature above 0). */
static int32_t draw_from(qf_sampler *s, float *logits, double u0) {
    const qf_sampling *p = &s->p;
    int all = p->top_k <= 0 || p->top_k >= s->vocab;
    int n = select_best(s->c, logits, p->temperature, s->vocab, all ? SORTED_FIRST : p->top_k, all ? s->x : NULL);
    /* softmax over the survivors (sorted, best first): w[i] / sum is candidate i's probability */
    double sum = 0, mx = s->c[0].logit;
    for (int i = 0; i < n; i++) sum += s->w[i] = exp((double)s->c[i].logit - mx);
    if (all && n < s->vocab) sum = exp_sum(s->x, s->vocab, (float)mx);
    int kept = keep_count(p, s->w, n, sum);
    if (kept <= n) return draw_sorted(s, kept, u0);
    if (!all || n == s->vocab) return draw_sorted(s, n, u0);
    if (p->top_p >= 1.0f && p->min_p <= 0.0f) return draw_all(s, n, sum, u0);
    /* a flat distribution: top-p or min-p reaches past the first candidates, so all are sorted */
    n = select_best(s->c, s->x, 1.0f, s->vocab, s->vocab, NULL);
    for (int i = 0; i < n; i++) s->w[i] = exp((double)s->c[i].logit - mx);
    kept = keep_count(p, s->w, n, sum);
    return draw_sorted(s, kept <= n ? kept : n, u0);
}

int32_t qf_sampler_sample_u(qf_sampler *s, float *logits, double u) {
    apply_penalties(s, logits);
    if (s->p.temperature == 0.0f) return qf_argmax_f32(logits, s->vocab);
    return draw_from(s, logits, u);
}

/* A number from the stream only when a draw will use it (greedy takes none). */
int32_t qf_sampler_sample(qf_sampler *s, float *logits) { return qf_sampler_sample_u(s, logits, s->p.temperature > 0.0f ? next_unit(s->rng) : 0.0); }

int qf_sampler_can_draw(const qf_sampler *s) { return !(s->p.top_k > QF_DRAW_MAX_K && s->p.top_k < s->vocab); }

int qf_sampler_draw_desc(qf_sampler *s, qf_draw *d) {
    const qf_sampling *p = &s->p;
    if (!qf_sampler_can_draw(s)) return 0;
    int pen = p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    for (int i = 0; pen && i < s->n_touched; i++) s->sub[i] = s->count_gen[s->touched[i]] ? gen_sub(p, s->count_gen[s->touched[i]]) : 0.0f;
    *d = (qf_draw){1, p->temperature, p->top_p, p->min_p, p->repetition_penalty, p->top_k, pen ? s->n_touched : 0, s->touched, s->sub,
                   p->temperature > 0.0f ? next_unit(s->rng) : 0.0};
    return 1;
}
