#include "grammar/grammar_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

/* ---- the sorted vocabulary ---- */

typedef struct vtok {
    const unsigned char *p;
    int len, id;
} vtok;

/* Tokens in byte order, with each one's common prefix with the one before. */
typedef struct vlist {
    vtok *t;
    int *lcp;
    int *first_end; /* the index past the last token with the same first byte */
    int n;
} vlist;

/* The tokens made only of a loop's bytes (allowed at once) and the list of the others. */
typedef struct loopcache {
    qf_cset set;
    uint32_t *all_in; /* a bit per id */
    int32_t *by_len;  /* the ids of all_in, shortest first */
    int *len_end;     /* by_len[0 .. len_end[k]) are the ones of at most k bytes */
    vlist rest;
    int n_all_in, used;
    uint64_t stamp;
} loopcache;

#define N_LOOPCACHE 8

struct qf_vocab_index {
    int vocab, max_len;
    vlist all;
    int32_t *eos;
    int n_eos;
    loopcache lc[N_LOOPCACHE];
    uint64_t clock;
};

static int vtok_cmp(const void *a, const void *b) {
    const vtok *x = a, *y = b;
    int n = x->len < y->len ? x->len : y->len, c = memcmp(x->p, y->p, (size_t)n);
    return c ? c : x->len - y->len;
}

static void vlist_free(vlist *l) {
    free(l->t);
    free(l->lcp);
    free(l->first_end);
    *l = (vlist){0};
}

static void vlist_lcp(vlist *l) {
    for (int i = 0; i < l->n; i++) {
        int k = 0;
        if (i > 0) {
            const vtok *a = &l->t[i - 1], *b = &l->t[i];
            while (k < a->len && k < b->len && a->p[k] == b->p[k]) k++;
        }
        l->lcp[i] = k;
    }
    for (int i = l->n - 1; i >= 0; i--) l->first_end[i] = i + 1 < l->n && l->lcp[i + 1] > 0 ? l->first_end[i + 1] : i + 1;
}

void qf_vocab_index_free(qf_vocab_index *v) {
    if (!v) return;
    vlist_free(&v->all);
    for (int i = 0; i < N_LOOPCACHE; i++) {
        free(v->lc[i].all_in);
        free(v->lc[i].by_len);
        free(v->lc[i].len_end);
        vlist_free(&v->lc[i].rest);
    }
    free(v->eos);
    free(v);
}

int qf_vocab_index_create_raw(qf_vocab_index **out, const char *const *pieces, const size_t *lens, int vocab, const int32_t *eos, int n_eos) {
    *out = NULL;
    qf_vocab_index *v = calloc(1, sizeof *v);
    if (!v) return qf_fail(QF_ENOMEM, "out of memory for the vocabulary index");
    v->vocab = vocab;
    v->all.t = malloc((size_t)vocab * sizeof(vtok) + 1);
    v->all.lcp = malloc((size_t)vocab * sizeof(int) + 1);
    v->all.first_end = malloc((size_t)vocab * sizeof(int) + 1);
    v->eos = malloc(((size_t)n_eos + 1) * sizeof(int32_t));
    if (!v->all.t || !v->all.lcp || !v->all.first_end || !v->eos) {
        qf_vocab_index_free(v);
        return qf_fail(QF_ENOMEM, "out of memory for the vocabulary index");
    }
    if (n_eos) memcpy(v->eos, eos, (size_t)n_eos * sizeof(int32_t));
    v->n_eos = n_eos;
    for (int id = 0; id < vocab; id++) {
        if (!pieces[id] || !lens[id]) continue;
        v->all.t[v->all.n++] = (vtok){(const unsigned char *)pieces[id], (int)lens[id], id};
        if ((int)lens[id] > v->max_len) v->max_len = (int)lens[id];
    }
    qsort(v->all.t, (size_t)v->all.n, sizeof(vtok), vtok_cmp);
    vlist_lcp(&v->all);
    *out = v;
    return QF_OK;
}

int qf_vocab_index_create(qf_vocab_index **out, const qf_tokenizer *t, int vocab, const int32_t *eos, int n_eos) {
    const char **pieces = calloc((size_t)vocab + 1, sizeof *pieces);
    size_t *lens = calloc((size_t)vocab + 1, sizeof *lens);
    if (!pieces || !lens) {
        free(pieces);
        free(lens);
        return qf_fail(QF_ENOMEM, "out of memory for the vocabulary index");
    }
    for (int id = 0; id < vocab; id++) {
        int skip = qf_tok_is_special(t, id);
        for (int k = 0; k < n_eos && !skip; k++) skip = eos[k] == id;
        if (!skip) pieces[id] = qf_tok_piece(t, id, &lens[id]);
    }
    int rc = qf_vocab_index_create_raw(out, pieces, lens, vocab, eos, n_eos);
    free(pieces);
    free(lens);
    return rc;
}

static void allow(uint32_t *bits, int32_t id) { bits[id >> 5] |= 1u << (id & 31); }
static int allowed_id(const uint32_t *bits, int32_t id) { return (bits[id >> 5] >> (id & 31)) & 1u; }

static int all_in(const vtok *t, const qf_cset *s) {
    for (int i = 0; i < t->len; i++)
        if (!qf_cset_has(s, t->p[i])) return 0;
    return 1;
}

/* The cache entry for a loop's byte set, made on first use (the least recently used is reused). */
static loopcache *loop_cache(qf_vocab_index *v, const qf_cset *s) {
    loopcache *victim = &v->lc[0];
    for (int i = 0; i < N_LOOPCACHE; i++) {
        loopcache *c = &v->lc[i];
        if (c->used && !memcmp(&c->set, s, sizeof *s)) {
            c->stamp = ++v->clock;
            return c;
        }
        if (!c->used || c->stamp < victim->stamp) victim = c;
    }
    loopcache *c = victim;
    if (!c->all_in) {
        c->all_in = malloc(((size_t)v->vocab + 31) / 32 * sizeof(uint32_t));
        c->rest.t = malloc((size_t)v->all.n * sizeof(vtok) + 1);
        c->rest.lcp = malloc((size_t)v->all.n * sizeof(int) + 1);
        c->rest.first_end = malloc((size_t)v->all.n * sizeof(int) + 1);
        c->by_len = malloc((size_t)v->all.n * sizeof(int32_t) + 1);
        c->len_end = calloc((size_t)v->max_len + 2, sizeof(int));
        if (!c->all_in || !c->rest.t || !c->rest.lcp || !c->rest.first_end || !c->by_len || !c->len_end) return NULL;
    }
    memset(c->all_in, 0, ((size_t)v->vocab + 31) / 32 * sizeof(uint32_t));
    c->set = *s;
    c->rest.n = c->n_all_in = 0;
    memset(c->len_end, 0, ((size_t)v->max_len + 2) * sizeof(int));
    for (int i = 0; i < v->all.n; i++) {
        const vtok *t = &v->all.t[i];
        if (all_in(t, s)) allow(c->all_in, t->id), c->n_all_in++, c->len_end[t->len]++;
        else c->rest.t[c->rest.n++] = *t;
    }
    vlist_lcp(&c->rest);
    /* by_len: a counting sort of the all-in tokens by length */
    for (int k = 1; k <= v->max_len + 1; k++) c->len_end[k] += c->len_end[k - 1];
    int *fill = c->len_end; /* filled from the back so len_end ends as the bounds */
    for (int i = v->all.n - 1; i >= 0; i--)
        if (allowed_id(c->all_in, v->all.t[i].id)) c->by_len[--fill[v->all.t[i].len]] = v->all.t[i].id;
    for (int k = 0; k <= v->max_len; k++) c->len_end[k] = c->len_end[k + 1];
    c->len_end[v->max_len + 1] = c->n_all_in;
    c->used = 1;
    c->stamp = ++v->clock;
    return c;
}

/* ---- the matcher ---- */

typedef struct gnode {
    int32_t alt, pos, parent; /* continue alternative alt at element pos, then return to parent */
} gnode;

#define SET_MAX 256
#define EXPAND_DEPTH 200

typedef struct gset {
    int32_t top[SET_MAX];
    int n, complete;
} gset;

struct qf_gmatch {
    const qf_grammar *g;
    qf_vocab_index *v;
    gnode *arena;
    int n_arena, cap_arena, err;
    gset cur;
    gset *depth;           /* (max_len + 1) sets for the mask walk */
    int *depth_mark;       /* the arena's size after each depth's set */
    int32_t *special_id;   /* the grammar's special tokens, -1 where the tokenizer has none */
    const qf_tokenizer *t;
    int32_t free_until;    /* the grammar starts after this token; -1 once it has */
    gset tmp, tmp2;
    uint32_t *allowed;     /* a bit per id */
    int32_t *remap, *chain; /* compaction */
    gnode *arena2;
    int n2;
    int32_t *hc;           /* HC_SIZE recent nodes by hash (push_node) */
};

static int same_node(const gnode *a, const gnode *b) { return a->alt == b->alt && a->pos == b->pos && a->parent == b->parent; }

static int popcount(const qf_cset *s) {
    int n = 0;
    for (int w = 0; w < 8; w++) n += __builtin_popcount(s->w[w]);
    return n;
}

/* Nodes are shared where their contents are equal (a small cache of recent ones by hash), so that
 * parses that meet again (a+)+ have one stack, not one per way they got there; a slot whose node
 * was dropped or moved is simply not equal any more. */
#define HC_SIZE (1 << 15)
#define HC_WAYS 4

static int32_t push_node(qf_gmatch *m, int32_t alt, int32_t pos, int32_t parent) {
    gnode want = {alt, pos, parent};
    uint32_t h = ((uint32_t)alt * 2654435761u ^ (uint32_t)pos * 40503u ^ (uint32_t)parent * 2246822519u) & (HC_SIZE - 1), free_slot = h;
    for (uint32_t k = 0; k < HC_WAYS; k++) {
        uint32_t slot = (h + k) & (HC_SIZE - 1);
        int32_t i = m->hc[slot];
        int live = i >= 0 && i < m->n_arena;
        if (live && same_node(&m->arena[i], &want)) return i;
        if (!live && free_slot == h) free_slot = slot;
    }
    if (m->n_arena >= m->cap_arena) {
        m->err = 1;
        return -1;
    }
    m->arena[m->n_arena] = want;
    m->hc[free_slot] = m->n_arena;
    return m->n_arena++;
}

static void set_add(qf_gmatch *m, gset *o, int32_t alt, int32_t pos, int32_t parent) {
    gnode want = {alt, pos, parent};
    for (int i = 0; i < o->n; i++)
        if (same_node(&m->arena[o->top[i]], &want)) return;
    if (o->n >= SET_MAX) {
        m->err = 2;
        return;
    }
    int32_t n = push_node(m, alt, pos, parent);
    if (n >= 0) o->top[o->n++] = n;
}

/* Adds to o every way to reach a byte set from "alternative alt at pos, then parent". */
static void expand(qf_gmatch *m, gset *o, int32_t alt, int32_t pos, int32_t parent, int depth) {
    const qf_grammar *g = m->g;
    if (depth > EXPAND_DEPTH) {
        m->err = 3;
        return;
    }
    while (pos == g->alt_n[alt]) {
        if (parent < 0) {
            o->complete = 1;
            return;
        }
        const gnode *p = &m->arena[parent];
        alt = p->alt, pos = p->pos + 1, parent = p->parent;
    }
    int32_t el = g->elems[g->alt_e0[alt] + pos];
    if (el >= 0) {
        set_add(m, o, alt, pos, parent);
        return;
    }
    int r = -el - 1;
    int32_t ret = pos + 1 == g->alt_n[alt] ? parent : push_node(m, alt, pos, parent); /* a last call returns straight to parent */
    if (m->err) return;
    for (int a = g->rule_a0[r]; a < g->rule_a0[r] + g->rule_na[r]; a++) expand(m, o, a, 0, ret, depth + 1);
}

static void advance(qf_gmatch *m, const gset *in, unsigned char c, gset *o) {
    o->n = o->complete = 0;
    for (int i = 0; i < in->n && !m->err; i++) {
        const gnode *x = &m->arena[in->top[i]];
        if (qf_cset_has(&m->g->sets[m->g->elems[m->g->alt_e0[x->alt] + x->pos]], c)) expand(m, o, x->alt, x->pos + 1, x->parent, 0);
    }
}

/* Copies node idx and the part of its chain not yet copied into arena2 (m->n2 nodes so far). */
static int32_t copy_chain(qf_gmatch *m, int32_t idx) {
    int n = 0;
    for (int32_t i = idx; i >= 0 && m->remap[i] < 0; i = m->arena[i].parent) m->chain[n++] = i;
    for (int k = n - 1; k >= 0; k--) {
        gnode x = m->arena[m->chain[k]];
        x.parent = x.parent >= 0 ? m->remap[x.parent] : -1;
        m->arena2[m->n2] = x;
        m->remap[m->chain[k]] = m->n2++;
    }
    return m->remap[idx];
}

/* Keeps only the nodes the current stacks use. */
static void compact(qf_gmatch *m) {
    for (int i = 0; i < m->n_arena; i++) m->remap[i] = -1;
    m->n2 = 0;
    for (int i = 0; i < m->cur.n; i++) m->cur.top[i] = copy_chain(m, m->cur.top[i]);
    gnode *a = m->arena;
    m->arena = m->arena2;
    m->arena2 = a;
    m->n_arena = m->n2;
}

void qf_gmatch_free(qf_gmatch *m) {
    if (!m) return;
    free(m->arena);
    free(m->arena2);
    free(m->remap);
    free(m->chain);
    free(m->allowed);
    free(m->depth);
    free(m->depth_mark);
    free(m->special_id);
    free(m->hc);
    free(m);
}

static int start(qf_gmatch *m) {
    const qf_grammar *g = m->g;
    m->n_arena = 0;
    m->err = 0;
    m->cur.n = m->cur.complete = 0;
    for (int a = g->rule_a0[g->root]; a < g->rule_a0[g->root] + g->rule_na[g->root]; a++) expand(m, &m->cur, a, 0, -1, 0);
    return m->err ? qf_fail(QF_EINVAL, "grammar: more than %d ways to begin (a long enum, many tools, nested alternatives) or left recursion", SET_MAX) : QF_OK;
}

int qf_gmatch_create(qf_gmatch **out, const qf_grammar *g, qf_vocab_index *v, const qf_tokenizer *t, int32_t free_until) {
    *out = NULL;
    qf_gmatch *m = calloc(1, sizeof *m);
    if (!m) return qf_fail(QF_ENOMEM, "out of memory for a grammar matcher");
    m->g = g, m->v = v, m->t = t, m->free_until = free_until;
    m->cap_arena = 1 << 16;
    m->arena = malloc((size_t)m->cap_arena * sizeof(gnode));
    m->arena2 = malloc((size_t)m->cap_arena * sizeof(gnode));
    m->remap = malloc((size_t)m->cap_arena * sizeof(int32_t));
    m->chain = malloc((size_t)m->cap_arena * sizeof(int32_t));
    m->allowed = malloc(((size_t)v->vocab + 31) / 32 * sizeof(uint32_t));
    m->depth = malloc(((size_t)v->max_len + 2) * sizeof(gset));
    m->depth_mark = malloc(((size_t)v->max_len + 2) * sizeof(int));
    m->special_id = malloc(((size_t)g->n_specials + 1) * sizeof(int32_t));
    m->hc = malloc(HC_SIZE * sizeof(int32_t));
    if (m->hc) memset(m->hc, 0xff, HC_SIZE * sizeof(int32_t));
    if (!m->arena || !m->arena2 || !m->remap || !m->chain || !m->allowed || !m->depth || !m->depth_mark || !m->special_id || !m->hc) {
        qf_gmatch_free(m);
        return qf_fail(QF_ENOMEM, "out of memory for a grammar matcher");
    }
    for (int i = 0; i < g->n_specials; i++) m->special_id[i] = t ? qf_tok_lookup(t, g->specials[i]) : -1;
    int rc = start(m);
    if (rc != QF_OK) {
        qf_gmatch_free(m);
        return rc;
    }
    *out = m;
    return QF_OK;
}

int qf_grammar_check(const qf_grammar *g) {
    qf_vocab_index *v = calloc(1, sizeof *v); /* the start needs no vocabulary */
    if (!v) return qf_fail(QF_ENOMEM, "out of memory");
    v->vocab = 1, v->max_len = 1;
    qf_gmatch *m = NULL;
    int rc = qf_gmatch_create(&m, g, v, NULL, -1);
    qf_gmatch_free(m);
    free(v);
    return rc;
}

int qf_gmatch_complete(const qf_gmatch *m) { return m->free_until < 0 && m->cur.complete; }

/* Matches bytes from the current stacks; the stacks after them end in m->tmp (the arena grows:
 * the caller keeps or resets it). */
static int match_from_cur(qf_gmatch *m, const unsigned char *p, size_t n) {
    const gset *in = &m->cur;
    gset *a = &m->tmp, *b = &m->tmp2;
    for (size_t i = 0; i < n; i++) {
        advance(m, in, p[i], a);
        if (m->err || (!a->n && !(i + 1 == n && a->complete))) return 0;
        in = a;
        gset *t = a;
        a = b, b = t;
    }
    if (in != &m->tmp) m->tmp = *in;
    return 1;
}

int qf_gmatch_try_bytes(qf_gmatch *m, const char *bytes, size_t n) {
    int mark = m->n_arena;
    int ok = match_from_cur(m, (const unsigned char *)bytes, n);
    m->n_arena = mark;
    m->err = 0;
    return ok;
}

int qf_gmatch_accept_bytes(qf_gmatch *m, const char *bytes, size_t n) {
    int mark = m->n_arena;
    if (!match_from_cur(m, (const unsigned char *)bytes, n)) {
        int err = m->err;
        m->n_arena = mark;
        m->err = 0;
        return err ? qf_fail(QF_EINVAL, "grammar: the parse outgrew its limits") : qf_fail(QF_EINVAL, "grammar: the text is not allowed here");
    }
    m->cur = m->tmp;
    if (m->n_arena > m->cap_arena / 2) compact(m);
    return QF_OK;
}

int qf_gmatch_accept(qf_gmatch *m, int32_t tok) {
    if (m->free_until >= 0) {
        if (tok == m->free_until) m->free_until = -1;
        return QF_OK;
    }
    size_t len = 0;
    const char *p = qf_tok_piece(m->t, tok, &len);
    if (!p || !len) return qf_fail(QF_EINVAL, "grammar: token %d has no text", tok);
    return qf_gmatch_accept_bytes(m, p, len);
}

static void disallow(float *logits, const uint32_t *allowed, int vocab) {
    for (int w = 0; w * 32 < vocab; w++) {
        uint32_t bits = allowed[w];
        int n = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
        float *l = logits + w * 32;
        if (bits == 0xffffffffu) continue;
        if (!bits)
            for (int k = 0; k < n; k++) l[k] = -INFINITY;
        else
            for (int k = 0; k < n; k++)
                if (!((bits >> k) & 1u)) l[k] = -INFINITY;
    }
}

/* Marks in allowed every token of l that the current stacks accept. */
static int walk(qf_gmatch *m, const vlist *l, uint32_t *allowed) {
    int base = m->n_arena, count = 0;
    m->depth[0] = m->cur;
    m->depth_mark[0] = base;
    for (int i = 0; i < l->n;) {
        const vtok *t = &l->t[i];
        int d = l->lcp[i]; /* depth[d] holds the stacks after t's first d bytes */
        m->n_arena = m->depth_mark[d];
        int ok = 1;
        for (; d < t->len; d++) {
            advance(m, &m->depth[d], t->p[d], &m->depth[d + 1]);
            if (m->err) return -1;
            m->depth_mark[d + 1] = m->n_arena;
            if (!m->depth[d + 1].n && !(d + 1 == t->len && m->depth[d + 1].complete)) {
                ok = 0;
                break;
            }
        }
        if (ok) {
            allow(allowed, t->id);
            count++;
            i++;
            continue;
        }
        /* every following token sharing the first d + 1 bytes fails the same way */
        if (d == 0) i = l->first_end[i];
        else
            for (i++; i < l->n && l->lcp[i] > d; i++) {}
    }
    m->n_arena = base;
    return count;
}

/* The widest byte loop the parse sits in, or NULL. */
static const qf_cset *loop_set(const qf_gmatch *m) {
    const qf_cset *best = NULL;
    int best_n = -1;
    for (int i = 0; i < m->cur.n; i++) {
        const gnode *x = &m->arena[m->cur.top[i]];
        if (x->pos != 0 || !m->g->alt_loop[x->alt]) continue;
        const qf_cset *s = &m->g->sets[m->g->elems[m->g->alt_e0[x->alt]]];
        int n = popcount(s);
        if (n > best_n) best = s, best_n = n;
    }
    return best;
}

/* The parse is in a counted run of a wide byte set S (a bounded string), and every other live
 * parse is where the run ends up when it stops: returns the S bytes it can still take when that
 * continuation takes no byte of S (so a token of more S bytes is refused by every path); else 0. */
static int run_left(qf_gmatch *m, const qf_cset **set) {
    const qf_grammar *g = m->g;
    const gnode *x = NULL;
    for (int i = 0; i < m->cur.n && !x; i++) {
        const gnode *y = &m->arena[m->cur.top[i]];
        if (!y->pos && g->alt_chain[y->alt] >= 2) x = y;
    }
    if (!x) return 0;
    const qf_cset *S = &g->sets[g->elems[g->alt_e0[x->alt]]];
    if (popcount(S) < 16) return 0;
    int mark = m->n_arena, ok = 1;
    gset *after = &m->tmp;
    after->n = after->complete = 0;
    if (x->parent >= 0) {
        const gnode *p = &m->arena[x->parent];
        expand(m, after, p->alt, p->pos + 1, p->parent, 0);
    }
    for (int i = 0; i < after->n && ok && !m->err; i++) {
        const gnode *t = &m->arena[after->top[i]];
        const qf_cset *ts = &g->sets[g->elems[g->alt_e0[t->alt] + t->pos]];
        for (int w = 0; w < 8; w++) ok &= !(ts->w[w] & S->w[w]);
    }
    for (int i = 0; i < m->cur.n && ok; i++) { /* every other parse is one of those */
        const gnode *y = &m->arena[m->cur.top[i]];
        int known = y == x;
        for (int k = 0; k < after->n && !known; k++) known = same_node(y, &m->arena[after->top[k]]);
        ok &= known;
    }
    ok &= !m->err;
    m->n_arena = mark, m->err = 0;
    *set = S;
    return ok ? g->alt_chain[x->alt] : 0;
}

int qf_gmatch_mask(qf_gmatch *m, float *logits) {
    qf_vocab_index *v = m->v;
    if (m->free_until >= 0) return v->vocab;
    uint32_t *allowed = m->allowed;
    size_t words = ((size_t)v->vocab + 31) / 32;
    memset(allowed, 0, words * sizeof(uint32_t));
    const qf_cset *ls = loop_set(m), *rs = NULL;
    int run = ls ? 0 : run_left(m, &rs), count = 0;
    loopcache *lc = ls ? loop_cache(v, ls) : run ? loop_cache(v, rs) : NULL;
    if (lc && ls) {
        for (size_t w = 0; w < words; w++) allowed[w] = lc->all_in[w];
        count = lc->n_all_in;
    } else if (lc) { /* the run's tokens that fit what is left of it */
        int k = run < v->max_len ? run : v->max_len;
        for (int i = 0; i < lc->len_end[k]; i++) allow(allowed, lc->by_len[i]);
        count = lc->len_end[k];
    }
    int got = walk(m, lc ? &lc->rest : &v->all, allowed);
    m->err = 0;
    if (got < 0) return qf_fail(QF_EINVAL, "grammar: the parse outgrew its limits");
    count += got;
    for (int i = 0; i < m->g->n_specials; i++) {
        int32_t id = m->special_id[i];
        if (id < 0 || id >= v->vocab) continue;
        if (qf_gmatch_try_bytes(m, m->g->specials[i], strlen(m->g->specials[i]))) allow(allowed, id), count++;
    }
    if (m->cur.complete)
        for (int k = 0; k < v->n_eos; k++) allow(allowed, v->eos[k]), count++;
    disallow(logits, allowed, v->vocab);
    return count;
}
