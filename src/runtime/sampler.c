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
};

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
    if (!s->count_all || !s->count_gen || !s->touched || !s->c || !s->w) {
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

static void apply_penalties(qf_sampler *s, float *logits) {
    const qf_sampling *p = &s->p;
    for (int i = 0; i < s->n_touched; i++) {
        int32_t t = s->touched[i];
        if (p->repetition_penalty != 1.0f) logits[t] = logits[t] > 0 ? logits[t] / p->repetition_penalty : logits[t] * p->repetition_penalty;
        if (s->count_gen[t]) logits[t] -= p->presence_penalty + p->frequency_penalty * (float)s->count_gen[t];
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

/* Moves the k best candidates to the front of c, sorted best first; returns how many. */
static int select_top_k(cand *c, int n, int k) {
    if (k <= 0 || k >= n) {
        qsort(c, (size_t)n, sizeof *c, cmp_cand);
        return n;
    }
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(c, k, i);
    for (int i = k; i < n; i++)
        if (cmp_cand(&c[i], &c[0]) < 0) {
            c[0] = c[i];
            sift_down(c, k, 0);
        }
    qsort(c, (size_t)k, sizeof *c, cmp_cand);
    return k;
}

int qf_sampler_is_greedy(const qf_sampler *s) {
    const qf_sampling *p = &s->p;
    return p->temperature == 0.0f && p->repetition_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f;
}

int32_t qf_sampler_sample(qf_sampler *s, float *logits) {
    const qf_sampling *p = &s->p;
    apply_penalties(s, logits);
    if (p->temperature == 0.0f) return qf_argmax_f32(logits, s->vocab);
    for (int i = 0; i < s->vocab; i++) s->c[i] = (cand){logits[i] / p->temperature, i};
    int n = select_top_k(s->c, s->vocab, p->top_k);
    /* softmax over the survivors (sorted, best first): w[i] / sum is candidate i's probability */
    double sum = 0, mx = s->c[0].logit;
    for (int i = 0; i < n; i++) sum += s->w[i] = exp((double)s->c[i].logit - mx);
    /* top-p over the sorted probabilities; min-p drops tokens below min_p x the top one */
    double cum = 0, keep_min = p->min_p;
    int kept = n;
    for (int i = 0; i < n; i++) {
        if (i > 0 && s->w[i] < keep_min) {
            kept = i;
            break;
        }
        cum += s->w[i] / sum;
        if (cum >= p->top_p) {
            kept = i + 1;
            break;
        }
    }
    double total = 0;
    for (int i = 0; i < kept; i++) total += s->w[i];
    double u = next_unit(s->rng) * total, acc = 0;
    for (int i = 0; i < kept; i++) {
        acc += s->w[i];
        if (u < acc) return s->c[i].id;
    }
    return s->c[kept - 1].id;
}
