#include "grammar/grammar_int.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

/* ---- building ---- */

typedef struct balt {
    int rule, e0, n;
} balt;

struct qf_gbuild {
    int n_rules;
    balt *alts;
    int n_alts, cap_alts;
    int32_t *elems;
    int n_elems, cap_elems;
    qf_cset *sets;
    int n_sets, cap_sets;
    char **specials;
    int n_specials, cap_specials;
    int oom;
};

static int grow(void **p, int *cap, int need, size_t size) {
    if (need <= *cap) return 1;
    int c = *cap ? *cap * 2 : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (!q) return 0;
    *p = q;
    *cap = c;
    return 1;
}

qf_gbuild *qf_gb_create(void) { return calloc(1, sizeof(qf_gbuild)); }

void qf_gb_free(qf_gbuild *b) {
    if (!b) return;
    free(b->alts);
    free(b->elems);
    free(b->sets);
    for (int i = 0; i < b->n_specials; i++) free(b->specials[i]);
    free(b->specials);
    free(b);
}

int qf_gb_rule(qf_gbuild *b) { return b->oom ? -1 : b->n_rules++; }

void qf_gb_alt(qf_gbuild *b, int rule, const qf_gseq *q) {
    if (q->oom || rule < 0 || !grow((void **)&b->alts, &b->cap_alts, b->n_alts + 1, sizeof *b->alts) ||
        !grow((void **)&b->elems, &b->cap_elems, b->n_elems + q->n, sizeof *b->elems)) {
        b->oom = 1;
        return;
    }
    if (q->n) memcpy(b->elems + b->n_elems, q->e, (size_t)q->n * sizeof *q->e);
    b->alts[b->n_alts++] = (balt){rule, b->n_elems, q->n};
    b->n_elems += q->n;
}

static void seq_push(qf_gseq *q, int32_t v) {
    if (!grow((void **)&q->e, &q->cap, q->n + 1, sizeof *q->e)) {
        q->oom = 1;
        return;
    }
    q->e[q->n++] = v;
}

static int set_id(qf_gbuild *b, const qf_cset *s) {
    for (int i = 0; i < b->n_sets; i++)
        if (!memcmp(&b->sets[i], s, sizeof *s)) return i;
    if (!grow((void **)&b->sets, &b->cap_sets, b->n_sets + 1, sizeof *b->sets)) {
        b->oom = 1;
        return 0;
    }
    b->sets[b->n_sets] = *s;
    return b->n_sets++;
}

void qf_gseq_set(qf_gbuild *b, qf_gseq *q, const qf_cset *s) { seq_push(q, set_id(b, s)); }

void qf_gseq_byte(qf_gbuild *b, qf_gseq *q, unsigned char c) {
    qf_cset s = {{0}};
    qf_cset_add(&s, c, c);
    qf_gseq_set(b, q, &s);
}

void qf_gseq_lit(qf_gbuild *b, qf_gseq *q, const char *text) {
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) qf_gseq_byte(b, q, *p);
}

void qf_gseq_ref(qf_gseq *q, int rule) { seq_push(q, -(rule + 1)); }
void qf_gseq_append(qf_gseq *q, const qf_gseq *more) {
    for (int i = 0; i < more->n; i++) seq_push(q, more->e[i]);
}
void qf_gseq_clear(qf_gseq *q) { q->n = 0; }
void qf_gseq_free(qf_gseq *q) {
    free(q->e);
    *q = (qf_gseq){0};
}

/* ---- the nonempty part of a sequence, for loops whose body may be empty ---- */

typedef struct ne_ctx {
    qf_gbuild *b;
    unsigned char *nul; /* rule may derive the empty string */
    int *first, *next;  /* alternatives of each rule (of those there when the call began) */
    int *map;           /* rule -> its nonempty rule, or -1 */
    int n_rules, depth;
} ne_ctx;

static int elem_nullable(const ne_ctx *x, int32_t e) { return e < 0 && -e - 1 < x->n_rules && x->nul[-e - 1]; }

static void ne_nullable(ne_ctx *x) {
    for (int changed = 1; changed;) {
        changed = 0;
        for (int a = 0; a < x->b->n_alts; a++) {
            const balt *al = &x->b->alts[a];
            if (x->nul[al->rule]) continue;
            int all = 1;
            for (int i = 0; i < al->n && all; i++) all = elem_nullable(x, x->b->elems[al->e0 + i]);
            if (all) x->nul[al->rule] = 1, changed = 1;
        }
    }
}

static int ne_rule(ne_ctx *x, int r);

/* Adds to rule to the nonempty strings of elements e[0..n): for each i with e[0..i) all empty,
 * e[i]'s nonempty part followed by e[i+1..n) as they are. */
static int ne_seq(ne_ctx *x, int to, const int32_t *e, int n) {
    qf_gseq q = {0};
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        int32_t head = e[i];
        if (head < 0) {
            int sub = ne_rule(x, -head - 1);
            if (sub < -1) rc = -1;
            head = sub >= 0 ? -(sub + 1) : 0;
            if (sub == -1) goto next; /* derives only the empty string */
        }
        qf_gseq_clear(&q);
        seq_push(&q, head);
        for (int k = i + 1; k < n; k++) seq_push(&q, e[k]);
        if (!(q.n == 1 && q.e[0] == -(to + 1))) qf_gb_alt(x->b, to, &q);
    next:
        if (!elem_nullable(x, e[i])) break;
    }
    qf_gseq_free(&q);
    return rc || x->b->oom ? -1 : 0;
}

/* The rule of r's nonempty strings; -1 when r derives only the empty string, -2 on failure. */
static int ne_rule(ne_ctx *x, int r) {
    if (x->map[r] != -1) return x->map[r] == -3 ? -1 : x->map[r];
    if (++x->depth > 256) return -2;
    int R = qf_gb_rule(x->b);
    if (R < 0) return -2;
    x->map[r] = R;
    int before = x->b->n_alts;
    for (int a = x->first[r]; a >= 0; a = x->next[a]) {
        balt al = x->b->alts[a];
        int32_t *copy = malloc((size_t)(al.n ? al.n : 1) * sizeof *copy); /* the builder's elements move as it grows */
        if (!copy) return -2;
        if (al.n) memcpy(copy, x->b->elems + al.e0, (size_t)al.n * sizeof *copy);
        int rc = ne_seq(x, R, copy, al.n);
        free(copy);
        if (rc < 0) return -2;
    }
    x->depth--;
    int any = 0;
    for (int a = before; a < x->b->n_alts && !any; a++) any = x->b->alts[a].rule == R;
    if (!any) { /* nothing but the empty string; a reference made meanwhile (recursion) matches nothing */
        x->map[r] = -3;
        qf_gseq q = {0};
        qf_cset none = {{0}};
        qf_gseq_set(x->b, &q, &none);
        qf_gb_alt(x->b, R, &q);
        qf_gseq_free(&q);
    }
    return any ? R : -1;
}

int qf_gb_nonempty(qf_gbuild *b, const qf_gseq *frag) {
    ne_ctx x = {b, NULL, NULL, NULL, NULL, b->n_rules, 0};
    int n_alts = b->n_alts, out = -2;
    x.nul = calloc((size_t)x.n_rules + 1, 1);
    x.first = malloc(((size_t)x.n_rules + 1) * sizeof *x.first);
    x.next = malloc(((size_t)n_alts + 1) * sizeof *x.next);
    x.map = malloc(((size_t)x.n_rules + 1) * sizeof *x.map);
    if (x.nul && x.first && x.next && x.map && !b->oom) {
        for (int r = 0; r < x.n_rules; r++) x.first[r] = -1, x.map[r] = -1;
        for (int a = n_alts - 1; a >= 0; a--) x.next[a] = x.first[b->alts[a].rule], x.first[b->alts[a].rule] = a;
        ne_nullable(&x);
        int R = qf_gb_rule(b);
        int32_t *copy = malloc((size_t)(frag->n ? frag->n : 1) * sizeof *copy);
        if (R >= 0 && copy) {
            memcpy(copy, frag->e, (size_t)frag->n * sizeof *copy);
            out = ne_seq(&x, R, copy, frag->n) < 0 ? -2 : R;
        }
        free(copy);
        int any = 0;
        for (int a = n_alts; out >= 0 && a < b->n_alts && !any; a++) any = b->alts[a].rule == R;
        if (out >= 0 && !any) { /* R stays a valid rule that matches nothing */
            qf_gseq q = {0};
            qf_cset none = {{0}};
            qf_gseq_set(b, &q, &none);
            qf_gb_alt(b, R, &q);
            qf_gseq_free(&q);
            out = -1;
        }
    }
    free(x.nul), free(x.first), free(x.next), free(x.map);
    if (out == -2) b->oom = 1;
    return out;
}

int qf_gb_seq_nullable(const qf_gbuild *b, const qf_gseq *frag) {
    ne_ctx x = {(qf_gbuild *)b, calloc((size_t)b->n_rules + 1, 1), NULL, NULL, NULL, b->n_rules, 0};
    if (!x.nul) return 0;
    ne_nullable(&x);
    int all = 1;
    for (int i = 0; i < frag->n && all; i++) all = elem_nullable(&x, frag->e[i]);
    free(x.nul);
    return all;
}

void qf_gb_special(qf_gbuild *b, const char *text) {
    for (int i = 0; i < b->n_specials; i++)
        if (!strcmp(b->specials[i], text)) return;
    char *t = strdup(text);
    if (!t || !grow((void **)&b->specials, &b->cap_specials, b->n_specials + 1, sizeof *b->specials)) {
        free(t);
        b->oom = 1;
        return;
    }
    b->specials[b->n_specials++] = t;
}

qf_grammar *qf_grammar_ref(qf_grammar *g) {
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void qf_grammar_free(qf_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) > 1) return;
    free(g->rule_a0);
    free(g->rule_na);
    free(g->alt_e0);
    free(g->alt_n);
    free(g->alt_loop);
    free(g->alt_chain);
    free(g->elems);
    free(g->sets);
    for (int i = 0; i < g->n_specials; i++) free(g->specials[i]);
    free(g->specials);
    free(g);
}

int qf_grammar_rules(const qf_grammar *g) { return g->n_rules; }

/* Alternatives are grouped by rule (in the order they were added). */
static void order_alts(const qf_gbuild *b, qf_grammar *g) {
    for (int a = 0; a < b->n_alts; a++) g->rule_na[b->alts[a].rule]++;
    for (int r = 0, at = 0; r < b->n_rules; r++) g->rule_a0[r] = at, at += g->rule_na[r];
    int *fill = calloc((size_t)b->n_rules, sizeof *fill);
    for (int a = 0; fill && a < b->n_alts; a++) {
        const balt *x = &b->alts[a];
        int to = g->rule_a0[x->rule] + fill[x->rule]++;
        g->alt_e0[to] = x->e0;
        g->alt_n[to] = x->n;
        g->alt_loop[to] = x->n == 2 && b->elems[x->e0] >= 0 && b->elems[x->e0 + 1] == -(x->rule + 1);
    }
    free(fill);
}

/* A counted run (O_k ::= S O_k-1 | ...): alternative a = [S, call of N] where N has [S, call of N']
 * or [S]: the S bytes it can take in a row. Memoised in alt_chain; chains are short-lived rules
 * written out by counts, so the depth is bounded by the count (at most a few thousand). */
static int chain_len(qf_grammar *g, int a, int depth) {
    if (g->alt_chain[a] || depth > 4096) return g->alt_chain[a];
    const int32_t *e = g->elems + g->alt_e0[a];
    if (g->alt_n[a] == 1 && e[0] >= 0) return 1; /* not kept: a one-byte step is no run */
    if (g->alt_n[a] != 2 || e[0] < 0 || e[1] >= 0 || g->alt_loop[a]) return 0;
    int N = -e[1] - 1, best = 0;
    for (int b = g->rule_a0[N]; b < g->rule_a0[N] + g->rule_na[N]; b++)
        if (g->alt_n[b] >= 1 && g->elems[g->alt_e0[b]] == e[0]) {
            int k = chain_len(g, b, depth + 1);
            best = k > best ? k : best;
        }
    return g->alt_chain[a] = best ? best + 1 : 0;
}

int qf_gb_finish(qf_gbuild *b, int root, qf_grammar **out) {
    *out = NULL;
    if (b->oom) return qf_fail(QF_ENOMEM, "out of memory building a grammar");
    if (root < 0 || root >= b->n_rules) return qf_fail(QF_EINVAL, "grammar: no start rule");
    qf_grammar *g = calloc(1, sizeof *g);
    if (!g) return qf_fail(QF_ENOMEM, "out of memory building a grammar");
    atomic_init(&g->refs, 1);
    int R = b->n_rules, A = b->n_alts;
    g->n_rules = R, g->n_alts = A, g->n_sets = b->n_sets, g->root = root;
    g->rule_a0 = calloc((size_t)R, sizeof(int));
    g->rule_na = calloc((size_t)R, sizeof(int));
    g->alt_e0 = calloc((size_t)A + 1, sizeof(int));
    g->alt_n = calloc((size_t)A + 1, sizeof(int));
    g->alt_loop = calloc((size_t)A + 1, sizeof(int));
    g->alt_chain = calloc((size_t)A + 1, sizeof(int));
    g->elems = malloc(((size_t)b->n_elems + 1) * sizeof(int32_t));
    g->sets = malloc(((size_t)b->n_sets + 1) * sizeof(qf_cset));
    if (!g->rule_a0 || !g->rule_na || !g->alt_e0 || !g->alt_n || !g->alt_loop || !g->alt_chain || !g->elems || !g->sets) {
        qf_grammar_free(g);
        return qf_fail(QF_ENOMEM, "out of memory building a grammar");
    }
    if (b->n_elems) memcpy(g->elems, b->elems, (size_t)b->n_elems * sizeof(int32_t));
    if (b->n_sets) memcpy(g->sets, b->sets, (size_t)b->n_sets * sizeof(qf_cset));
    order_alts(b, g);
    for (int r = 0; r < R; r++)
        if (!g->rule_na[r]) {
            qf_grammar_free(g);
            return qf_fail(QF_EINVAL, "grammar: rule %d has no alternatives", r);
        }
    for (int a = 0; a < A; a++) chain_len(g, a, 0);
    g->specials = b->specials, g->n_specials = b->n_specials;
    b->specials = NULL, b->n_specials = b->cap_specials = 0;
    *out = g;
    return QF_OK;
}
