#include "runtime/grammar_json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

#define MAX_UNROLL 1000   /* positions written out for a bounded count (items, characters) */
#define MAX_RULES 200000
#define NUM_DIGITS 15
#define MAX_INDENT 24

typedef struct memo {
    json_t *node;
    int rule;
} memo;

typedef struct jc {
    qf_gbuild *b;
    json_t *root;
    memo *memo;
    int n_memo, cap_memo;
    int ws, any, str, content, cchar, anychar, anyloop, esc, xtext, digit_opt[NUM_DIGITS + 1], failed, unrolled, empty_loops;
    char err[512];
} jc;

static int jfail(jc *c, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int jfail(jc *c, const char *path, const char *fmt, ...) {
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        char m[400];
        vsnprintf(m, sizeof m, fmt, ap);
        va_end(ap);
        snprintf(c->err, sizeof c->err, "%s (at %s)", m, path[0] ? path : "the schema's root");
        c->failed = 1;
    }
    return -1;
}

static int newrule(jc *c) {
    int r = qf_gb_rule(c->b);
    if (r < 0 || r >= MAX_RULES) {
        c->failed = 1;
        snprintf(c->err, sizeof c->err, "the schema makes a grammar over %d rules", MAX_RULES);
        return -1;
    }
    return r;
}

/* q becomes an alternative of rule r, and q is emptied for the next. */
static void add_alt(jc *c, int r, qf_gseq *q) {
    qf_gb_alt(c->b, r, q);
    qf_gseq_clear(q);
}

/* A rule with one alternative: seq (which is cleared). */
static int rule_of(jc *c, qf_gseq *q) {
    int r = newrule(c);
    if (r >= 0) qf_gb_alt(c->b, r, q);
    qf_gseq_clear(q);
    return r;
}

static int lit_rule(jc *c, const char *text) {
    qf_gseq q = {0};
    qf_gseq_lit(c->b, &q, text);
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

static qf_cset cset_range(int lo, int hi) {
    qf_cset s = {{0}};
    qf_cset_add(&s, lo, hi);
    return s;
}

static void cset_del(qf_cset *s, int c) { s->w[c >> 5] &= ~(1u << (c & 31)); }

/* ---- the building blocks ---- */

/* 0..k copies of a digit. */
static int digits_opt(jc *c, int k) {
    if (c->digit_opt[k] >= 0) return c->digit_opt[k];
    int r = newrule(c);
    qf_gseq q = {0};
    qf_gb_alt(c->b, r, &q);
    if (k > 0) {
        qf_cset d = cset_range('0', '9');
        qf_gseq_set(c->b, &q, &d);
        qf_gseq_ref(&q, digits_opt(c, k - 1));
        qf_gb_alt(c->b, r, &q);
    }
    qf_gseq_free(&q);
    return c->digit_opt[k] = r;
}

/* At most a newline and MAX_INDENT spaces. */
static int ws_rule(jc *c) {
    if (c->ws >= 0) return c->ws;
    qf_gseq q = {0};
    int sp = newrule(c);
    qf_gb_alt(c->b, sp, &q);
    for (int k = 0; k < MAX_INDENT; k++) {
        int r = newrule(c);
        qf_gb_alt(c->b, r, &q);
        qf_gseq_byte(c->b, &q, ' ');
        qf_gseq_ref(&q, sp);
        add_alt(c, r, &q);
        sp = r;
    }
    c->ws = newrule(c);
    qf_gb_alt(c->b, c->ws, &q);
    qf_gseq_byte(c->b, &q, ' ');
    add_alt(c, c->ws, &q);
    qf_gseq_byte(c->b, &q, '\n');
    qf_gseq_ref(&q, sp);
    qf_gb_alt(c->b, c->ws, &q);
    qf_gseq_free(&q);
    return c->ws;
}

/* What follows a backslash in a JSON string. */
static int esc_rule(jc *c) {
    if (c->esc >= 0) return c->esc;
    c->esc = newrule(c);
    qf_gseq q = {0};
    qf_cset s = {{0}};
    for (const char *p = "\"\\/bfnrt"; *p; p++) qf_cset_add(&s, *p, *p);
    qf_gseq_set(c->b, &q, &s);
    add_alt(c, c->esc, &q);
    qf_cset hex = cset_range('0', '9');
    qf_cset_add(&hex, 'a', 'f');
    qf_cset_add(&hex, 'A', 'F');
    qf_gseq_byte(c->b, &q, 'u');
    for (int i = 0; i < 4; i++) qf_gseq_set(c->b, &q, &hex);
    qf_gb_alt(c->b, c->esc, &q);
    qf_gseq_free(&q);
    return c->esc;
}

/* Bytes that stand for themselves in a JSON string. */
static qf_cset plain_bytes(void) {
    qf_cset s = cset_range(0x20, 0xff);
    cset_del(&s, '"');
    cset_del(&s, '\\');
    return s;
}

/* A string's characters, any number: a byte loop, so masks take its tokens at once. */
static int content_rule(jc *c) {
    if (c->content >= 0) return c->content;
    int r = c->content = newrule(c);
    qf_gseq q = {0};
    qf_cset s = plain_bytes();
    qf_gseq_set(c->b, &q, &s);
    qf_gseq_ref(&q, r);
    add_alt(c, r, &q);
    qf_gseq_byte(c->b, &q, '\\');
    qf_gseq_ref(&q, esc_rule(c));
    qf_gseq_ref(&q, r);
    add_alt(c, r, &q);
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    return r;
}

static int string_rule(jc *c) {
    if (c->str >= 0) return c->str;
    qf_gseq q = {0};
    qf_gseq_byte(c->b, &q, '"');
    qf_gseq_ref(&q, content_rule(c));
    qf_gseq_byte(c->b, &q, '"');
    c->str = rule_of(c, &q);
    qf_gseq_free(&q);
    return c->str;
}

/* One UTF-8 character of 2-4 bytes. */
static void add_multibyte(jc *c, int r) {
    qf_gseq q = {0};
    qf_cset cont = cset_range(0x80, 0xbf);
    static const int lead[3][2] = {{0xc2, 0xdf}, {0xe0, 0xef}, {0xf0, 0xf4}};
    for (int k = 0; k < 3; k++) {
        qf_cset l = cset_range(lead[k][0], lead[k][1]);
        qf_gseq_set(c->b, &q, &l);
        for (int i = 0; i <= k; i++) qf_gseq_set(c->b, &q, &cont);
        add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
}

/* Any character a regular expression's "." stands for (no escapes: those are literal). */
static int anychar_rule(jc *c) {
    if (c->anychar >= 0) return c->anychar;
    int r = c->anychar = newrule(c);
    qf_gseq q = {0};
    qf_cset s = cset_range(0x20, 0x7f);
    cset_del(&s, '"');
    cset_del(&s, '\\');
    qf_gseq_set(c->b, &q, &s);
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    add_multibyte(c, r);
    return r;
}

/* One character of a JSON string (counted by minLength): any plain character or an escape. */
static int cchar_rule(jc *c) {
    if (c->cchar >= 0) return c->cchar;
    int r = c->cchar = newrule(c);
    qf_gseq q = {0};
    qf_gseq_ref(&q, anychar_rule(c));
    add_alt(c, r, &q);
    qf_gseq_byte(c->b, &q, '\\');
    qf_gseq_ref(&q, esc_rule(c));
    add_alt(c, r, &q);
    qf_gseq_free(&q);
    return r;
}

/* -?(0|[1-9][0-9]{0,14}) then, for numbers, an optional fraction and exponent. */
static int number_rule(jc *c, int integer, int sign) {
    qf_gseq q = {0};
    int ip = newrule(c);
    qf_gseq_byte(c->b, &q, '0');
    add_alt(c, ip, &q);
    qf_cset nz = cset_range('1', '9'), d = cset_range('0', '9');
    qf_gseq_set(c->b, &q, &nz);
    qf_gseq_ref(&q, digits_opt(c, NUM_DIGITS - 1));
    add_alt(c, ip, &q);
    int r = newrule(c);
    for (int neg = 0; neg <= sign; neg++) {
        if (neg) qf_gseq_byte(c->b, &q, '-');
        qf_gseq_ref(&q, ip);
        if (!integer) {
            int frac = newrule(c), ex = newrule(c);
            qf_gseq f = {0};
            qf_gb_alt(c->b, frac, &f);
            qf_gseq_byte(c->b, &f, '.');
            qf_gseq_set(c->b, &f, &d);
            qf_gseq_ref(&f, digits_opt(c, NUM_DIGITS - 1));
            add_alt(c, frac, &f);
            qf_gb_alt(c->b, ex, &f);
            qf_cset e = {{0}}, pm = {{0}};
            qf_cset_add(&e, 'e', 'e');
            qf_cset_add(&e, 'E', 'E');
            qf_cset_add(&pm, '+', '+');
            qf_cset_add(&pm, '-', '-');
            int sg = newrule(c);
            qf_gb_alt(c->b, sg, &f);
            qf_gseq_set(c->b, &f, &pm);
            add_alt(c, sg, &f);
            qf_gseq_set(c->b, &f, &e);
            qf_gseq_ref(&f, sg);
            qf_gseq_set(c->b, &f, &d);
            qf_gseq_ref(&f, digits_opt(c, 2));
            qf_gb_alt(c->b, ex, &f);
            qf_gseq_free(&f);
            qf_gseq_ref(&q, frac);
            qf_gseq_ref(&q, ex);
        }
        add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
    return r;
}

/* Alternatives of r for the digit strings of one length from a to b (a <= b, same length). */
static void fixed_range(jc *c, int r, qf_gseq *pre, const char *a, const char *b, int n) {
    if (n == 0) {
        qf_gb_alt(c->b, r, pre);
        return;
    }
    int at = pre->n, rest_min = 1, rest_max = 1;
    for (int i = 1; i < n; i++) rest_min &= a[i] == '0', rest_max &= b[i] == '9';
    if (a[0] == b[0] || (rest_min && rest_max)) {
        qf_cset s = cset_range(a[0], b[0]);
        qf_gseq_set(c->b, pre, &s);
        if (a[0] == b[0]) fixed_range(c, r, pre, a + 1, b + 1, n - 1);
        else {
            qf_cset d = cset_range('0', '9');
            for (int i = 1; i < n; i++) qf_gseq_set(c->b, pre, &d);
            qf_gb_alt(c->b, r, pre);
        }
        pre->n = at;
        return;
    }
    char nines[NUM_DIGITS + 2], zeros[NUM_DIGITS + 2];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    qf_gseq_byte(c->b, pre, (unsigned char)a[0]);
    fixed_range(c, r, pre, a + 1, nines, n - 1);
    pre->n = at;
    if (b[0] - a[0] > 1) {
        qf_cset s = cset_range(a[0] + 1, b[0] - 1), d = cset_range('0', '9');
        qf_gseq_set(c->b, pre, &s);
        for (int i = 1; i < n; i++) qf_gseq_set(c->b, pre, &d);
        qf_gb_alt(c->b, r, pre);
        pre->n = at;
    }
    qf_gseq_byte(c->b, pre, (unsigned char)b[0]);
    fixed_range(c, r, pre, zeros, b + 1, n - 1);
    pre->n = at;
}

/* Alternatives of r for the integers lo..hi >= 0 in decimal without leading zeros. */
static void nonneg_range(jc *c, int r, qf_gseq *pre, long long lo, long long hi) {
    long long p10 = 1;
    for (int len = 1; len <= NUM_DIGITS + 1 && lo <= hi; len++, p10 *= 10) {
        long long top = p10 * 10 - 1, from = lo, to = hi < top ? hi : top;
        if (from > to) continue;
        char a[32], b[32];
        snprintf(a, sizeof a, "%0*lld", len, from);
        snprintf(b, sizeof b, "%0*lld", len, to);
        fixed_range(c, r, pre, a, b, len);
        lo = to + 1;
    }
}

static int int_range_rule(jc *c, long long lo, long long hi) {
    int r = newrule(c);
    qf_gseq q = {0};
    if (lo < 0) {
        qf_gseq_byte(c->b, &q, '-');
        nonneg_range(c, r, &q, hi < 0 ? -hi : 1, -lo);
        qf_gseq_clear(&q);
    }
    if (hi >= 0) nonneg_range(c, r, &q, lo > 0 ? lo : 0, hi);
    qf_gseq_free(&q);
    return r;
}

/* ---- regular expressions (pattern, format) ---- */

typedef struct rx {
    jc *c;
    const char *p, *end, *path;
} rx;

static int rx_alt(rx *x);

/* L ::= frag L | empty (a byte loop when frag is one byte set). */
/* L ::= frag L | empty; a body that may be empty loops over its nonempty part ((a*)* is a*). */
static int loop_of(jc *c, const qf_gseq *frag, const char *path) {
    int L = newrule(c), body = -3;
    if (L >= 0 && qf_gb_seq_nullable(c->b, frag)) {
        if (++c->empty_loops > 64) return jfail(c, path, "pattern: more than 64 repetitions of something that may be empty");
        body = qf_gb_nonempty(c->b, frag);
    }
    if (L < 0 || body == -2) return jfail(c, path, "out of memory");
    qf_gseq t = {0};
    if (body >= 0) qf_gseq_ref(&t, body);
    else if (body == -3) qf_gseq_append(&t, frag);
    if (body != -1) {
        qf_gseq_ref(&t, L);
        add_alt(c, L, &t);
    }
    qf_gb_alt(c->b, L, &t);
    qf_gseq_free(&t);
    return L;
}

/* Any characters (a raw, unquoted text's free part). */
static int anychar_loop(jc *c) {
    if (c->anyloop >= 0) return c->anyloop;
    qf_gseq q = {0};
    qf_gseq_ref(&q, anychar_rule(c));
    c->anyloop = loop_of(c, &q, "");
    qf_gseq_free(&q);
    return c->anyloop;
}

static void rx_utf8(rx *x, qf_gseq *q) {
    const unsigned char *p = (const unsigned char *)x->p;
    int n = *p < 0x80 ? 1 : *p < 0xe0 ? 2 : *p < 0xf0 ? 3 : 4;
    for (int i = 0; i < n && x->p < x->end; i++) qf_gseq_byte(x->c->b, q, (unsigned char)*x->p++);
}

/* A decoded character as it is written inside a JSON string. */
static void rx_char(rx *x, qf_gseq *q, unsigned char ch) {
    if (ch == '"' || ch == '\\') qf_gseq_byte(x->c->b, q, '\\');
    if (ch == '\n' || ch == '\t') {
        qf_gseq_lit(x->c->b, q, ch == '\n' ? "\\n" : "\\t");
        return;
    }
    qf_gseq_byte(x->c->b, q, ch);
}

/* \d \w \s and their negations, into s (printable ASCII only); 0 when c is none of them. */
static int rx_class_escape(char e, qf_cset *s, int *neg) {
    qf_cset t = {{0}};
    switch (e | 0x20) {
    case 'd': qf_cset_add(&t, '0', '9'); break;
    case 'w': qf_cset_add(&t, '0', '9'), qf_cset_add(&t, 'a', 'z'), qf_cset_add(&t, 'A', 'Z'), qf_cset_add(&t, '_', '_'); break;
    case 's': qf_cset_add(&t, ' ', ' '); break;
    default: return 0;
    }
    *neg = e >= 'A' && e <= 'Z';
    if (*neg) {
        qf_cset u = cset_range(0x20, 0x7e);
        for (int w = 0; w < 8; w++) u.w[w] &= ~t.w[w];
        t = u;
    }
    for (int w = 0; w < 8; w++) s->w[w] |= t.w[w];
    return 1;
}

/* A set of ASCII characters, or that set and every non-ASCII character (wide). */
static int rx_set_rule(rx *x, qf_cset s, int wide, qf_gseq *q) {
    cset_del(&s, '"');
    cset_del(&s, '\\');
    for (int b = 0; b < 0x20; b++) cset_del(&s, b);
    if (!wide) {
        qf_gseq_set(x->c->b, q, &s);
        return 0;
    }
    int r = newrule(x->c);
    qf_gseq t = {0};
    qf_gseq_set(x->c->b, &t, &s);
    qf_gb_alt(x->c->b, r, &t);
    qf_gseq_free(&t);
    add_multibyte(x->c, r);
    qf_gseq_ref(q, r);
    return 0;
}

/* \xHH after the x: the ASCII character, or -1 (refused). */
static int rx_hex(rx *x) {
    int v = 0;
    for (int i = 0; i < 2; i++, x->p++) {
        char h = x->p < x->end ? *x->p : 0;
        int d = h >= '0' && h <= '9' ? h - '0' : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10 : -1;
        if (d < 0) return jfail(x->c, x->path, "pattern: \\x needs two hex digits");
        v = v * 16 + d;
    }
    return v < 0x80 ? v : jfail(x->c, x->path, "pattern: \\x%02X is not an ASCII character (write the character itself)", v);
}

static int cset_empty(const qf_cset *s) {
    for (int w = 0; w < 8; w++)
        if (s->w[w]) return 0;
    return 1;
}

static int rx_class(rx *x, qf_gseq *q) {
    int neg = *x->p == '^';
    if (neg) x->p++;
    qf_cset s = {{0}};
    int first = 1, wide_in = 0; /* wide_in: a negated escape (\S \W \D) put every non-ASCII character in */
    while (x->p < x->end && (*x->p != ']' || first)) {
        first = 0;
        unsigned char lo = (unsigned char)*x->p++;
        if (lo >= 0x80) return jfail(x->c, x->path, "pattern: non-ASCII characters in a [...] class are not supported");
        if (lo == '\\' && x->p < x->end) {
            int n2;
            char e = *x->p++;
            if (rx_class_escape(e, &s, &n2)) {
                wide_in |= n2;
                continue;
            }
            int h = e == 'x' ? rx_hex(x) : 0;
            if (h < 0) return -1;
            if ((e >= '0' && e <= '9') || e == 'p' || e == 'P' || e == 'u' || e == 'b' || e == 'B') return jfail(x->c, x->path, "pattern: the escape \\%c in a [...] class is not supported", e);
            lo = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'x' ? (unsigned char)h : (unsigned char)e;
        }
        unsigned char hi = lo;
        if (x->p + 1 < x->end && *x->p == '-' && x->p[1] != ']') {
            x->p++;
            hi = (unsigned char)*x->p++;
            if (hi == '\\' && x->p < x->end) {
                hi = (unsigned char)*x->p++;
                int h = hi == 'x' ? rx_hex(x) : hi;
                if (h < 0) return -1;
                hi = (unsigned char)h;
            }
            if (hi < lo || hi >= 0x80) return jfail(x->c, x->path, "pattern: bad range in a [...] class");
        }
        qf_cset_add(&s, lo, hi);
    }
    if (x->p >= x->end) return jfail(x->c, x->path, "pattern: unterminated [...] class");
    x->p++;
    if (neg) {
        qf_cset u = cset_range(0x20, 0x7e);
        for (int w = 0; w < 8; w++) u.w[w] &= ~s.w[w];
        s = u;
    }
    int wide = neg ? !wide_in : wide_in;
    if (!wide && cset_empty(&s)) return jfail(x->c, x->path, "pattern: a [...] class that matches no character");
    return rx_set_rule(x, s, wide, q);
}

/* One atom (its elements appended to q). */
static int rx_atom(rx *x, qf_gseq *q) {
    char ch = *x->p;
    if (ch == '(') {
        x->p++;
        if (*x->p == '?') {
            if (x->p[1] == ':') x->p += 2;
            else if (x->p[1] == '<' && x->p[2] != '=' && x->p[2] != '!') {
                while (x->p < x->end && *x->p != '>') x->p++;
                x->p++;
            } else return jfail(x->c, x->path, "pattern: lookaround and (?...) groups are not supported");
        }
        int r = rx_alt(x);
        if (r < 0) return -1;
        if (x->p >= x->end || *x->p != ')') return jfail(x->c, x->path, "pattern: unbalanced parentheses");
        x->p++;
        qf_gseq_ref(q, r);
        return 0;
    }
    if (ch == '[') {
        x->p++;
        return rx_class(x, q);
    }
    if (ch == '.') {
        x->p++;
        qf_gseq_ref(q, anychar_rule(x->c));
        return 0;
    }
    if (ch == '^' || ch == '$') return jfail(x->c, x->path, "pattern: ^ and $ are supported only at the ends");
    if (ch == '*' || ch == '+' || ch == '?' || ch == '{') return jfail(x->c, x->path, "pattern: a quantifier with nothing before it");
    if (ch == '\\') {
        x->p++;
        if (x->p >= x->end) return jfail(x->c, x->path, "pattern: a trailing backslash");
        char e = *x->p++;
        qf_cset s = {{0}};
        int neg;
        if (rx_class_escape(e, &s, &neg)) return rx_set_rule(x, s, neg, q);
        if ((e >= '0' && e <= '9') || e == 'b' || e == 'B' || e == 'p' || e == 'P' || e == 'u' || e == 'k')
            return jfail(x->c, x->path, "pattern: the escape \\%c is not supported", e);
        int h = e == 'x' ? rx_hex(x) : 0;
        if (h < 0) return -1;
        rx_char(x, q, (unsigned char)(e == 'n' ? '\n' : e == 't' ? '\t' : e == 'x' ? h : e));
        return 0;
    }
    if ((unsigned char)ch >= 0x80) {
        rx_utf8(x, q);
        return 0;
    }
    x->p++;
    rx_char(x, q, (unsigned char)ch);
    return 0;
}

/* {n}, {n,} or {n,m} after an atom; 0 when there is none. */
static int rx_braces(rx *x, int *lo, int *hi) {
    if (*x->p != '{') return 0;
    char *e;
    long a = strtol(x->p + 1, &e, 10), b = a;
    if (e == x->p + 1) return jfail(x->c, x->path, "pattern: a '{' that is not a {n,m} count (escape it)");
    if (*e == ',') {
        if (e[1] == '}') b = -1, e++;
        else b = strtol(e + 1, &e, 10);
    }
    if (*e != '}' || a < 0 || (b >= 0 && b < a) || a > MAX_UNROLL || b > MAX_UNROLL) return jfail(x->c, x->path, "pattern: a bad {n,m} count (at most %d)", MAX_UNROLL);
    x->p = e + 1;
    *lo = (int)a, *hi = (int)b;
    return 1;
}

/* Appends atom (elements frag) lo..hi times (hi < 0: no limit) to q. */
static int repeat(jc *c, qf_gseq *q, const qf_gseq *frag, int lo, int hi, const char *path) {
    if ((c->unrolled += lo + (hi > lo ? hi - lo : 0)) > 20 * MAX_UNROLL) return jfail(c, path, "the schema's counts write out over %d positions", 20 * MAX_UNROLL);
    for (int i = 0; i < lo; i++)
        qf_gseq_append(q, frag);
    qf_gseq t = {0};
    if (hi < 0) {
        qf_gseq_ref(q, loop_of(c, frag, path));
    } else {
        int next = -1;
        for (int i = lo; i < hi; i++) { /* O ::= frag O' | empty */
            int O = newrule(c);
            qf_gseq_append(&t, frag);
            if (next >= 0) qf_gseq_ref(&t, next);
            add_alt(c, O, &t);
            qf_gb_alt(c->b, O, &t);
            next = O;
        }
        if (next >= 0) qf_gseq_ref(q, next);
    }
    qf_gseq_free(&t);
    return c->failed ? -1 : 0;
}

static int rx_seq(rx *x, qf_gseq *q) {
    qf_gseq frag = {0};
    while (x->p < x->end && *x->p != '|' && *x->p != ')') {
        qf_gseq_clear(&frag);
        if (rx_atom(x, &frag) < 0) break;
        int lo = 1, hi = 1;
        char k = x->p < x->end ? *x->p : 0;
        if (k == '*' || k == '+' || k == '?') {
            x->p++;
            lo = k == '+', hi = k == '?' ? 1 : -1;
        } else if (rx_braces(x, &lo, &hi) < 0) break;
        if (x->p < x->end && *x->p == '?' && !(lo == 1 && hi == 1)) x->p++; /* lazy: the same language */
        if (repeat(x->c, q, &frag, lo, hi, x->path) < 0) break;
    }
    qf_gseq_free(&frag);
    return x->c->failed ? -1 : 0;
}

static int rx_alt(rx *x) {
    int r = newrule(x->c);
    qf_gseq q = {0};
    for (;;) {
        qf_gseq_clear(&q);
        if (rx_seq(x, &q) < 0) break;
        qf_gb_alt(x->c->b, r, &q);
        if (x->p >= x->end || *x->p != '|') break;
        x->p++;
    }
    qf_gseq_free(&q);
    return x->c->failed ? -1 : r;
}

/* A JSON string whose decoded text matches pattern somewhere (anchors pin it to an end); quoted 0:
 * the text alone (a tool call's raw parameter). */
static int pattern_rule(jc *c, const char *pat, const char *path, int quoted) {
    size_t n = strlen(pat);
    int head = n && pat[0] == '^', tail = n > (size_t)head && pat[n - 1] == '$' && (n < 2 || pat[n - 2] != '\\');
    rx x = {c, pat + head, pat + n - tail, path};
    int body = rx_alt(&x);
    if (body < 0) return -1;
    if (x.p != x.end) return jfail(c, path, "pattern: unbalanced parentheses");
    qf_gseq q = {0};
    if (quoted) qf_gseq_byte(c->b, &q, '"');
    if (!head) qf_gseq_ref(&q, quoted ? content_rule(c) : anychar_loop(c));
    qf_gseq_ref(&q, body);
    if (!tail) qf_gseq_ref(&q, quoted ? content_rule(c) : anychar_loop(c));
    if (quoted) qf_gseq_byte(c->b, &q, '"');
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

static const char *format_pattern(const char *f) {
#define DATE "\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])"
#define TIME "([01]\\d|2[0-3]):[0-5]\\d:[0-5]\\d(\\.\\d{1,6})?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)"
#define OCTET "(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)"
    static const char *const table[][2] = {
        {"date", "^" DATE "$"},
        {"time", "^" TIME "$"},
        {"date-time", "^" DATE "T" TIME "$"},
        {"uuid", "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"},
        {"ipv4", "^(" OCTET "\\.){3}" OCTET "$"},
        {"email", "^[a-zA-Z0-9._+-]{1,64}@[a-zA-Z0-9-]{1,63}(\\.[a-zA-Z0-9-]{1,63}){0,4}\\.[a-zA-Z]{2,12}$"},
    };
#undef DATE
#undef TIME
#undef OCTET
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(f, table[i][0])) return table[i][1];
    return NULL;
}

/* ---- schemas ---- */

static int compile(jc *c, json_t *node, const char *path);

static void subpath(char *out, size_t n, const char *path, const char *key) { snprintf(out, n, "%s/%s", path, key); }

static int memo_find(jc *c, json_t *node) {
    for (int i = 0; i < c->n_memo; i++)
        if (c->memo[i].node == node) return c->memo[i].rule;
    return -1;
}

static void memo_add(jc *c, json_t *node, int rule) {
    if (c->n_memo == c->cap_memo) {
        int cap = c->cap_memo ? 2 * c->cap_memo : 32;
        memo *m = realloc(c->memo, (size_t)cap * sizeof *m);
        if (!m) {
            c->failed = 1;
            snprintf(c->err, sizeof c->err, "out of memory");
            return;
        }
        c->memo = m, c->cap_memo = cap;
    }
    c->memo[c->n_memo++] = (memo){node, rule};
}

/* A JSON value written compactly (enum, const, keys). */
static int literal_rule(jc *c, json_t *v, const char *path) {
    char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) return jfail(c, path, "a value that cannot be written as JSON");
    int r = lit_rule(c, text);
    free(text);
    return r;
}

static int any_value(jc *c);

/* "[" items "]" with any values, or "{" members "}" with any keys (value: the members' rule). */
static int any_container(jc *c, int object, int value) {
    int ws = ws_rule(c), item = newrule(c), loop = newrule(c), body = newrule(c), r = newrule(c);
    qf_gseq q = {0};
    if (object) {
        qf_gseq_ref(&q, string_rule(c));
        qf_gseq_ref(&q, ws);
        qf_gseq_byte(c->b, &q, ':');
        qf_gseq_ref(&q, ws);
    }
    qf_gseq_ref(&q, value);
    add_alt(c, item, &q);
    qf_gseq_ref(&q, ws); /* loop ::= ws "," ws item loop | empty */
    qf_gseq_byte(c->b, &q, ',');
    qf_gseq_ref(&q, ws);
    qf_gseq_ref(&q, item);
    qf_gseq_ref(&q, loop);
    add_alt(c, loop, &q);
    qf_gb_alt(c->b, loop, &q);
    qf_gb_alt(c->b, body, &q); /* body ::= item loop ws | empty */
    qf_gseq_ref(&q, item);
    qf_gseq_ref(&q, loop);
    qf_gseq_ref(&q, ws);
    add_alt(c, body, &q);
    qf_gseq_byte(c->b, &q, object ? '{' : '[');
    qf_gseq_ref(&q, ws);
    qf_gseq_ref(&q, body);
    qf_gseq_byte(c->b, &q, object ? '}' : ']');
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    return r;
}

static int any_value(jc *c) {
    if (c->any >= 0) return c->any;
    int r = c->any = newrule(c);
    qf_gseq q = {0};
    int parts[] = {any_container(c, 1, r), any_container(c, 0, r), string_rule(c), number_rule(c, 0, 1),
                   lit_rule(c, "true"), lit_rule(c, "false"), lit_rule(c, "null")};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        qf_gseq_ref(&q, parts[i]);
        add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
    return r;
}

static int get_count(jc *c, json_t *node, const char *key, long long dflt, long long *out, const char *path) {
    json_t *v = json_object_get(node, key);
    *out = dflt;
    if (!v) return 0;
    if (!json_is_integer(v) && !(json_is_real(v) && json_real_value(v) == floor(json_real_value(v))))
        return jfail(c, path, "'%s' must be an integer", key);
    *out = json_is_integer(v) ? json_integer_value(v) : (long long)json_real_value(v);
    if (*out < 0) return jfail(c, path, "'%s' must not be negative", key);
    return 0;
}

/* '"', lo characters, then up to hi - lo more bytes without escapes (a run the masks take at once;
 * as characters are never fewer than bytes, every reply keeps to maxLength), then '"'. */
static int counted_string(jc *c, long long lo, long long hi, const char *path) {
    if (lo > MAX_UNROLL || hi > MAX_UNROLL) return jfail(c, path, "minLength / maxLength over %d are not supported", MAX_UNROLL);
    qf_gseq q = {0}, ch = {0};
    qf_gseq_ref(&ch, cchar_rule(c));
    qf_gseq_byte(c->b, &q, '"');
    repeat(c, &q, &ch, (int)lo, (int)lo, path);
    if (hi < 0) qf_gseq_ref(&q, content_rule(c));
    else {
        qf_gseq plain = {0};
        qf_cset s = plain_bytes();
        qf_gseq_set(c->b, &plain, &s);
        repeat(c, &q, &plain, 0, (int)(hi - lo), path);
        qf_gseq_free(&plain);
    }
    qf_gseq_byte(c->b, &q, '"');
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    qf_gseq_free(&ch);
    return c->failed ? -1 : r;
}

static int type_string(jc *c, json_t *node, const char *path) {
    long long lo, hi;
    if (get_count(c, node, "minLength", 0, &lo, path) < 0 || get_count(c, node, "maxLength", -1, &hi, path) < 0) return -1;
    json_t *pat = json_object_get(node, "pattern"), *fmt = json_object_get(node, "format");
    const char *fp = json_is_string(fmt) ? format_pattern(json_string_value(fmt)) : NULL;
    if (pat && !json_is_string(pat)) return jfail(c, path, "'pattern' must be a string");
    if ((pat || fp) && (lo > 0 || hi >= 0)) return jfail(c, path, "'pattern' or 'format' together with minLength / maxLength is not supported");
    if (pat && fp) return jfail(c, path, "'pattern' together with a 'format' is not supported");
    if (hi >= 0 && hi < lo) return jfail(c, path, "maxLength is below minLength");
    if (pat || fp) return pattern_rule(c, pat ? json_string_value(pat) : fp, path, 1);
    if (lo > 0 || hi >= 0) return counted_string(c, lo, hi, path);
    return string_rule(c);
}

/* An integer bound (minimum, exclusive...) as a whole number; 0 when absent. */
static int int_bound(jc *c, json_t *node, const char *key, long long *out, int integral, const char *path) {
    json_t *v = json_object_get(node, key);
    if (!v) return 0;
    if (!json_is_number(v)) return jfail(c, path, "'%s' must be a number", key);
    double d = json_number_value(v), lim = 1e15 - 1;
    if (d != floor(d)) {
        if (!integral) return jfail(c, path, "a non-integer '%s' on a number is not supported", key);
        d = strstr(key, "inimum") ? ceil(d) : floor(d); /* the integers within a fractional bound */
    }
    int lower = strstr(key, "inimum") != NULL; /* clamping the other side only narrows what is generated */
    if ((lower && d > lim) || (!lower && d < -lim))
        return jfail(c, path, "'%s' %g lies beyond the 15 digits integers are generated with: no value could meet it", key, d);
    *out = (long long)(d > lim ? lim : d < -lim ? -lim : d);
    return 1;
}

static int type_number(jc *c, json_t *node, int integer, const char *path) {
    long long lo = -999999999999999LL, hi = 999999999999999LL, v;
    int any = 0, k;
    if ((k = int_bound(c, node, "minimum", &v, integer, path)) < 0) return -1;
    if (k) lo = v > lo ? v : lo, any = 1;
    if ((k = int_bound(c, node, "exclusiveMinimum", &v, integer, path)) < 0) return -1;
    if (k) lo = v + 1 > lo ? v + 1 : lo, any = 2;
    if ((k = int_bound(c, node, "maximum", &v, integer, path)) < 0) return -1;
    if (k) hi = v < hi ? v : hi, any |= 4;
    if ((k = int_bound(c, node, "exclusiveMaximum", &v, integer, path)) < 0) return -1;
    if (k) hi = v - 1 < hi ? v - 1 : hi, any |= 8;
    if (json_object_get(node, "multipleOf")) return jfail(c, path, "'multipleOf' is not supported");
    if (!any) return number_rule(c, integer, 1);
    if (lo > hi) return jfail(c, path, "the bounds leave no %s", integer ? "integer" : "number");
    if (integer) return int_range_rule(c, lo, hi);
    /* numbers: a fraction only where the integer part leaves room for it both ways */
    qf_gseq q = {0};
    int r = newrule(c), whole = int_range_rule(c, lo, hi);
    qf_gseq_ref(&q, whole);
    add_alt(c, r, &q);
    long long flo = (any & 3) ? lo + 1 : lo, fhi = (any & 12) ? hi - 1 : hi;
    if ((any & 3) && lo <= 0 && hi >= 0 && !(any & 2)) flo = 0; /* 0.x >= 0 */
    if (flo <= fhi) {
        qf_cset d = cset_range('0', '9');
        qf_gseq_ref(&q, int_range_rule(c, flo, fhi));
        qf_gseq_byte(c->b, &q, '.');
        qf_gseq_set(c->b, &q, &d);
        qf_gseq_ref(&q, digits_opt(c, NUM_DIGITS - 1));
        qf_gb_alt(c->b, r, &q);
    }
    qf_gseq_free(&q);
    return r;
}

typedef struct member {
    const char *key;
    json_t *schema;
    int required;
} member;

static int is_required(json_t *req, const char *key) {
    size_t i;
    json_t *v;
    json_array_foreach(req, i, v) if (json_is_string(v) && !strcmp(json_string_value(v), key)) return 1;
    return 0;
}

/* "key" ws ":" ws value */
static int member_rule(jc *c, const member *m, const char *path) {
    json_t *k = json_string(m->key);
    char sub[512];
    snprintf(sub, sizeof sub, "%s/properties/%s", path, m->key);
    int kr = literal_rule(c, k, path), vr = m->schema ? compile(c, m->schema, sub) : any_value(c);
    json_decref(k);
    if (kr < 0 || vr < 0) return -1;
    qf_gseq q = {0};
    qf_gseq_ref(&q, kr);
    qf_gseq_ref(&q, ws_rule(c));
    qf_gseq_byte(c->b, &q, ':');
    qf_gseq_ref(&q, ws_rule(c));
    qf_gseq_ref(&q, vr);
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

/* The declared members in order, optional ones may be left out, separated by commas. */
static int members_rule(jc *c, const member *m, int n, const char *path) {
    int rest = newrule(c), first = newrule(c); /* after the last member: nothing */
    qf_gseq q = {0};
    qf_gb_alt(c->b, rest, &q);
    qf_gb_alt(c->b, first, &q);
    for (int k = n - 1; k >= 0 && !c->failed; k--) {
        int mr = member_rule(c, &m[k], path);
        if (mr < 0) break;
        int rest_k = newrule(c), first_k = newrule(c);
        qf_gseq_ref(&q, ws_rule(c)); /* rest_k ::= ws "," ws member_k rest_k+1 | rest_k+1 (optional) */
        qf_gseq_byte(c->b, &q, ',');
        qf_gseq_ref(&q, ws_rule(c));
        qf_gseq_ref(&q, mr);
        qf_gseq_ref(&q, rest);
        add_alt(c, rest_k, &q);
        qf_gseq_ref(&q, mr); /* first_k ::= member_k rest_k+1 | first_k+1 (optional) */
        qf_gseq_ref(&q, rest);
        add_alt(c, first_k, &q);
        if (!m[k].required) {
            qf_gseq_ref(&q, rest);
            add_alt(c, rest_k, &q);
            qf_gseq_ref(&q, first);
            add_alt(c, first_k, &q);
        }
        rest = rest_k, first = first_k;
    }
    qf_gseq_free(&q);
    return c->failed ? -1 : first;
}

static int type_object(jc *c, json_t *node, const char *path) {
    json_t *props = json_object_get(node, "properties"), *req = json_object_get(node, "required");
    json_t *add = json_object_get(node, "additionalProperties");
    if (props && !json_is_object(props)) return jfail(c, path, "'properties' must be an object");
    if (req && !json_is_array(req)) return jfail(c, path, "'required' must be an array");
    if (add && !json_is_boolean(add) && !json_is_object(add)) return jfail(c, path, "'additionalProperties' must be a boolean or a schema");
    json_t *extra = add && json_is_object(add) ? add : NULL;
    size_t n_props = props ? json_object_size(props) : 0, n_req = req ? json_array_size(req) : 0;
    if (!n_props && !n_req && !json_is_false(add)) {
        int v = extra ? compile(c, extra, path) : any_value(c);
        return v < 0 ? -1 : any_container(c, 1, v);
    }
    member *m = calloc(n_props + n_req + 1, sizeof *m);
    if (!m) return jfail(c, path, "out of memory");
    int n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(props, key, v) m[n++] = (member){key, v, req && is_required(req, key)};
    for (size_t i = 0; i < n_req; i++) { /* required but not declared: any value (or additionalProperties') */
        json_t *k = json_array_get(req, i);
        if (!json_is_string(k)) {
            free(m);
            return jfail(c, path, "'required' must list strings");
        }
        if (!props || !json_object_get(props, json_string_value(k))) {
            if (json_is_false(add)) { /* no object can hold it */
                free(m);
                return jfail(c, path, "'required' names '%s', which 'additionalProperties': false with no such property forbids", json_string_value(k));
            }
            m[n++] = (member){json_string_value(k), extra, 1};
        }
    }
    int body = members_rule(c, m, n, path);
    free(m);
    if (body < 0) return -1;
    qf_gseq q = {0};
    qf_gseq_byte(c->b, &q, '{');
    qf_gseq_ref(&q, ws_rule(c));
    qf_gseq_ref(&q, body);
    qf_gseq_ref(&q, ws_rule(c));
    qf_gseq_byte(c->b, &q, '}');
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

/* Position i's item, with the separator before it. */
static int item_rule(jc *c, json_t *sch, int i, const char *path) {
    int v = sch ? compile(c, sch, path) : any_value(c);
    if (v < 0) return -1;
    qf_gseq q = {0};
    if (i > 0) {
        qf_gseq_ref(&q, ws_rule(c));
        qf_gseq_byte(c->b, &q, ',');
        qf_gseq_ref(&q, ws_rule(c));
    }
    qf_gseq_ref(&q, v);
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

static int type_array(jc *c, json_t *node, const char *path) {
    json_t *items = json_object_get(node, "items"), *pre = json_object_get(node, "prefixItems");
    long long lo, hi;
    if (get_count(c, node, "minItems", 0, &lo, path) < 0 || get_count(c, node, "maxItems", -1, &hi, path) < 0) return -1;
    if (pre && !json_is_array(pre)) return jfail(c, path, "'prefixItems' must be an array");
    if (items && !json_is_object(items) && !json_is_boolean(items)) return jfail(c, path, "'items' must be a schema");
    if (json_object_get(node, "uniqueItems") && json_is_true(json_object_get(node, "uniqueItems"))) return jfail(c, path, "'uniqueItems' is not supported");
    long long np = pre ? (long long)json_array_size(pre) : 0;
    if (json_is_false(items)) hi = hi < 0 || hi > np ? np : hi;
    if (hi >= 0 && hi < lo) return jfail(c, path, "the item counts leave no array");
    long long explicit_n = hi >= 0 ? hi : (lo > np ? lo : np);
    if (explicit_n > MAX_UNROLL || (c->unrolled += (int)explicit_n) > 20 * MAX_UNROLL) return jfail(c, path, "minItems / maxItems / prefixItems over %d are not supported", MAX_UNROLL);
    json_t *each = json_is_object(items) ? items : NULL;
    char sub[512];
    subpath(sub, sizeof sub, path, "items");
    qf_gseq q = {0};
    int next = newrule(c); /* after the written-out positions: more items, or nothing */
    if (hi < 0) {
        int it0 = item_rule(c, each, (int)explicit_n, sub), loop = explicit_n > 0 ? next : newrule(c);
        if (explicit_n == 0) { /* first ::= item loop | empty; loop ::= sep item loop | empty */
            int it = item_rule(c, each, 1, sub);
            qf_gseq_ref(&q, it);
            qf_gseq_ref(&q, loop);
            add_alt(c, loop, &q);
            qf_gb_alt(c->b, loop, &q);
        }
        qf_gseq_ref(&q, it0);
        qf_gseq_ref(&q, loop);
        add_alt(c, next, &q);
        if (explicit_n == 0 || lo <= explicit_n) qf_gb_alt(c->b, next, &q);
    } else qf_gb_alt(c->b, next, &q);
    for (long long i = explicit_n - 1; i >= 0 && !c->failed; i--) {
        json_t *s = i < np ? json_array_get(pre, (size_t)i) : each;
        int node_i = newrule(c), it = item_rule(c, s, (int)i, sub);
        qf_gseq_ref(&q, it);
        qf_gseq_ref(&q, next);
        add_alt(c, node_i, &q);
        if (i >= lo) qf_gb_alt(c->b, node_i, &q);
        next = node_i;
    }
    qf_gseq_byte(c->b, &q, '[');
    qf_gseq_ref(&q, ws_rule(c));
    qf_gseq_ref(&q, next);
    qf_gseq_ref(&q, ws_rule(c));
    qf_gseq_byte(c->b, &q, ']');
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return c->failed ? -1 : r;
}

static int type_rule(jc *c, const char *t, json_t *node, const char *path) {
    if (!strcmp(t, "string")) return type_string(c, node, path);
    if (!strcmp(t, "integer")) return type_number(c, node, 1, path);
    if (!strcmp(t, "number")) return type_number(c, node, 0, path);
    if (!strcmp(t, "boolean")) {
        int r = newrule(c);
        qf_gseq q = {0};
        qf_gseq_ref(&q, lit_rule(c, "true"));
        add_alt(c, r, &q);
        qf_gseq_ref(&q, lit_rule(c, "false"));
        qf_gb_alt(c->b, r, &q);
        qf_gseq_free(&q);
        return r;
    }
    if (!strcmp(t, "null")) return lit_rule(c, "null");
    if (!strcmp(t, "object")) return type_object(c, node, path);
    if (!strcmp(t, "array")) return type_array(c, node, path);
    return jfail(c, path, "unknown type '%s'", t);
}

static const char *const ignored_keys[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                                           "readOnly", "writeOnly", "$defs", "definitions", "format", "nullable", "strict", "additionalProperties",
                                           "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required", "items",
                                           "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
                                           "exclusiveMinimum", "exclusiveMaximum", "uniqueItems", "multipleOf"};

static int check_keys(jc *c, json_t *node, const char *path) {
    const char *key;
    json_t *v;
    json_object_foreach(node, key, v) {
        size_t i = 0, n = sizeof ignored_keys / sizeof ignored_keys[0];
        while (i < n && strcmp(key, ignored_keys[i])) i++;
        if (i == n) return jfail(c, path, "the schema keyword '%s' is not supported", key);
    }
    return 0;
}

static json_t *resolve_ref(jc *c, const char *ref, const char *path) {
    if (ref[0] != '#') return jfail(c, path, "only local $ref (#...) are supported, not '%s'", ref), NULL;
    json_t *at = c->root;
    const char *p = ref + 1;
    while (*p == '/' && at) {
        char part[256];
        size_t n = 0;
        for (p++; *p && *p != '/' && n + 1 < sizeof part; p++) {
            if (*p == '~' && (p[1] == '0' || p[1] == '1')) part[n++] = p[1] == '0' ? '~' : '/', p++;
            else part[n++] = *p;
        }
        part[n] = 0;
        at = json_is_object(at) ? json_object_get(at, part) : json_is_array(at) ? json_array_get(at, (size_t)atol(part)) : NULL;
    }
    if (!at || *p) return jfail(c, path, "$ref '%s' points at nothing", ref), NULL;
    return at;
}

/* Whether alternative i of list v (compiled to rule a) repeats an earlier one: the same rule (a
 * $ref given twice) or an equal schema. */
static int same_alt(json_t *v, size_t i, int a, const int *seen, int n_seen) {
    for (int k = 0; k < n_seen; k++)
        if (seen[k] == a) return 1;
    for (size_t k = 0; k < i && k < 256; k++)
        if (json_equal(json_array_get(v, k), json_array_get(v, i))) return 1;
    return 0;
}

/* Every alternative the schema allows, added to rule r. */
static int compile_into(jc *c, json_t *node, int r, const char *path) {
    qf_gseq q = {0};
    int sub = -1;
    if (json_is_true(node) || (json_is_object(node) && !json_object_size(node))) sub = any_value(c);
    else if (!json_is_object(node)) return jfail(c, path, json_is_false(node) ? "the schema 'false' allows nothing" : "a schema must be an object");
    else if (check_keys(c, node, path) < 0) return -1;
    json_t *v, *t = NULL;
    char sp[512];
    if (sub >= 0) {
    } else if ((v = json_object_get(node, "$ref"))) {
        if (!json_is_string(v)) return jfail(c, path, "'$ref' must be a string");
        json_t *to = resolve_ref(c, json_string_value(v), path);
        sub = to ? compile(c, to, json_string_value(v)) : -1;
    } else if ((v = json_object_get(node, "const"))) {
        sub = literal_rule(c, v, path);
    } else if ((v = json_object_get(node, "enum"))) {
        if (!json_is_array(v) || !json_array_size(v)) return jfail(c, path, "'enum' must be a non-empty array");
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            qf_gseq_ref(&q, literal_rule(c, e, path));
            add_alt(c, r, &q);
        }
    } else if ((v = json_object_get(node, "anyOf")) || (v = json_object_get(node, "oneOf")) || (v = json_object_get(node, "allOf"))) {
        const char *kw = v == json_object_get(node, "anyOf") ? "anyOf" : v == json_object_get(node, "oneOf") ? "oneOf" : "allOf";
        if (!json_is_array(v) || !json_array_size(v)) return jfail(c, path, "'%s' must be a non-empty array", kw);
        if (!strcmp(kw, "allOf") && json_array_size(v) > 1) return jfail(c, path, "'allOf' of more than one schema is not supported");
        size_t i;
        json_t *e;
        int seen[64], n_seen = 0;
        json_array_foreach(v, i, e) {
            char idx[32];
            snprintf(idx, sizeof idx, "%s/%zu", kw, i);
            subpath(sp, sizeof sp, path, idx);
            int a = compile(c, e, sp);
            if (a < 0) break;
            if (same_alt(v, i, a, seen, n_seen)) continue; /* a repeated alternative would double the parses at every level */
            if (n_seen < 64) seen[n_seen++] = a;
            qf_gseq_ref(&q, a);
            add_alt(c, r, &q);
        }
    } else if ((t = json_object_get(node, "type")) && json_is_array(t)) {
        size_t i;
        json_t *e;
        json_array_foreach(t, i, e) {
            if (!json_is_string(e)) return jfail(c, path, "'type' must name types");
            qf_gseq_ref(&q, type_rule(c, json_string_value(e), node, path));
            add_alt(c, r, &q);
        }
    } else if (t) {
        if (!json_is_string(t)) return jfail(c, path, "'type' must be a string or a list");
        sub = type_rule(c, json_string_value(t), node, path);
    } else if (json_object_get(node, "properties") || json_object_get(node, "required") || json_object_get(node, "additionalProperties")) {
        sub = type_object(c, node, path);
    } else if (json_object_get(node, "items") || json_object_get(node, "prefixItems") || json_object_get(node, "minItems") || json_object_get(node, "maxItems")) {
        sub = type_array(c, node, path);
    } else if (json_object_get(node, "pattern") || json_object_get(node, "minLength") || json_object_get(node, "maxLength") || json_object_get(node, "format")) {
        sub = type_string(c, node, path);
    } else sub = any_value(c);
    if (sub >= 0) {
        qf_gseq_ref(&q, sub);
        add_alt(c, r, &q);
    }
    if (json_is_object(node) && json_is_true(json_object_get(node, "nullable"))) {
        qf_gseq_ref(&q, lit_rule(c, "null"));
        qf_gb_alt(c->b, r, &q);
    }
    qf_gseq_free(&q);
    return c->failed ? -1 : 0;
}

/* A {"$ref"} with only annotations (or definitions) beside it: the rule of its target itself, so alternatives that
 * name one definition in different words are one rule (and deduplicated). */
static json_t *plain_ref(jc *c, json_t *node, const char *path) {
    static const char *const notes[] = {"$ref", "description", "title", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "$schema", "$id"};
    json_t *ref = json_object_get(node, "$ref");
    if (!json_is_string(ref)) return NULL;
    const char *key;
    json_t *v;
    json_object_foreach(node, key, v) {
        size_t i = 0;
        while (i < sizeof notes / sizeof *notes && strcmp(key, notes[i])) i++;
        if (i == sizeof notes / sizeof *notes) return NULL;
    }
    return resolve_ref(c, json_string_value(ref), path);
}

/* The end of a chain of plain refs, which stands for the chain; one that comes back (or runs on)
 * is refused (NULL). */
static json_t *chain_end(jc *c, json_t *node, const char *path) {
    json_t *chain[64];
    for (int hops = 0; json_is_object(node); hops++) {
        json_t *to = plain_ref(c, node, path);
        if (!to) break;
        chain[hops] = node;
        int cycle = hops == 63;
        for (int k = 0; k <= hops && !cycle; k++) cycle = chain[k] == to;
        if (cycle) return jfail(c, path, "'$ref' '%s' is a cycle of references that never reaches a schema", json_string_value(json_object_get(node, "$ref"))), NULL;
        node = to;
    }
    return c->failed ? NULL : node;
}

static int compile(jc *c, json_t *node, const char *path) {
    int r = memo_find(c, node);
    if (r >= 0) return r;
    if (!(node = chain_end(c, node, path))) return -1;
    if ((r = memo_find(c, node)) >= 0) return r;
    r = newrule(c);
    if (r < 0) return -1;
    memo_add(c, node, r);
    return compile_into(c, node, r, path) < 0 ? -1 : r;
}

static void jc_init(jc *c, json_t *root) {
    memset(c, 0, sizeof *c);
    c->root = root;
    c->ws = c->any = c->str = c->content = c->cchar = c->anychar = c->anyloop = c->esc = c->xtext = -1;
    for (int i = 0; i <= NUM_DIGITS; i++) c->digit_opt[i] = -1;
    c->b = qf_gb_create();
    if (!c->b) c->failed = 1, snprintf(c->err, sizeof c->err, "out of memory");
}

/* The grammar of start rule root, or the compiler's message. */
static int jc_finish(jc *c, int root, qf_grammar **out) {
    int rc;
    if (c->failed || root < 0) rc = qf_fail(QF_EINVAL, "%s", c->err[0] ? c->err : "the schema cannot be compiled");
    else rc = qf_gb_finish(c->b, root, out);
    qf_gb_free(c->b);
    free(c->memo);
    return rc;
}

int qf_grammar_json(qf_grammar **out, json_t *schema) {
    *out = NULL;
    jc c;
    jc_init(&c, schema);
    int root = -1;
    if (!c.failed) {
        if (schema) root = compile(&c, schema, "");
        else {
            json_t *obj = json_pack("{s:s}", "type", "object");
            root = obj ? compile(&c, obj, "") : -1;
            json_decref(obj);
        }
    }
    if (root >= 0) { /* the value, then nothing but white space */
        qf_gseq q = {0};
        qf_gseq_ref(&q, root);
        qf_gseq_ref(&q, ws_rule(&c));
        root = rule_of(&c, &q);
        qf_gseq_free(&q);
    }
    return jc_finish(&c, root, out);
}

/* ---- tool calls ---- */

/* Free raw text: text ::= [^<] text | "<" [^/<t] text | empty (no tag closes or opens in it). */
static int xml_text(jc *c) {
    if (c->xtext >= 0) return c->xtext;
    int r = c->xtext = newrule(c);
    qf_gseq q = {0};
    qf_cset s = cset_range(0x01, 0xff);
    cset_del(&s, '<');
    qf_gseq_set(c->b, &q, &s);
    qf_gseq_ref(&q, r);
    add_alt(c, r, &q);
    cset_del(&s, '/');
    cset_del(&s, 't');
    qf_gseq_byte(c->b, &q, '<');
    qf_gseq_set(c->b, &q, &s);
    qf_gseq_ref(&q, r);
    add_alt(c, r, &q);
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    return r;
}

/* A parameter's value in the XML form, as the parser reads it back: JSON for a parameter whose
 * type is given and is not "string"; else raw text (an enum's or const's values as written, a
 * pattern's text unquoted). */
static int xml_value(jc *c, json_t *sch, const char *path) {
    if (!(sch = chain_end(c, sch, path))) return -1;
    json_t *t = json_is_object(sch) ? json_object_get(sch, "type") : NULL;
    if (json_is_string(t) && strcmp(json_string_value(t), "string")) return compile(c, sch, path);
    json_t *en = json_is_object(sch) ? json_object_get(sch, "enum") : NULL, *cn = json_is_object(sch) ? json_object_get(sch, "const") : NULL;
    json_t *pat = json_is_object(sch) ? json_object_get(sch, "pattern") : NULL, *fmt = json_is_object(sch) ? json_object_get(sch, "format") : NULL;
    const char *fp = json_is_string(fmt) ? format_pattern(json_string_value(fmt)) : NULL;
    if (json_is_string(pat) || fp) return pattern_rule(c, json_is_string(pat) ? json_string_value(pat) : fp, path, 0);
    if (!json_is_array(en) && !cn) return xml_text(c);
    int r = newrule(c);
    qf_gseq q = {0};
    size_t n = cn ? 1 : json_array_size(en);
    for (size_t i = 0; i < n; i++) {
        json_t *v = cn ? cn : json_array_get(en, i);
        char *text = json_is_string(v) ? strdup(json_string_value(v)) : json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (text) qf_gseq_lit(c->b, &q, text);
        free(text);
        add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
    return r;
}

static int xml_params(jc *c, json_t *params, const char *path) {
    if (params && !(params = chain_end(c, params, path))) return -1;
    json_t *props = json_is_object(params) ? json_object_get(params, "properties") : NULL, *req = json_is_object(params) ? json_object_get(params, "required") : NULL;
    qf_gseq q = {0};
    int next = newrule(c);
    qf_gb_alt(c->b, next, &q);
    size_t n = json_is_object(props) ? json_object_size(props) : 0;
    const char **keys = calloc(n + 1, sizeof *keys);
    json_t **schs = calloc(n + 1, sizeof *schs);
    size_t k = 0;
    const char *key;
    json_t *v;
    if (n) json_object_foreach(props, key, v) keys[k] = key, schs[k++] = v;
    for (size_t i = n; i-- > 0 && keys && schs && !c->failed;) {
        char sub[512], open[300];
        subpath(sub, sizeof sub, path, keys[i]);
        int val = xml_value(c, schs[i], sub), r = newrule(c);
        snprintf(open, sizeof open, "<parameter=%s>\n", keys[i]);
        qf_gseq_lit(c->b, &q, open);
        qf_gseq_ref(&q, val);
        qf_gseq_lit(c->b, &q, "\n</parameter>\n");
        qf_gseq_ref(&q, next);
        add_alt(c, r, &q);
        if (!json_is_array(req) || !is_required(req, keys[i])) {
            qf_gseq_ref(&q, next);
            add_alt(c, r, &q);
        }
        next = r;
    }
    free(keys);
    free(schs);
    qf_gseq_free(&q);
    return c->failed ? -1 : next;
}

static int one_call(jc *c, json_t *fn, int form, const char *path) {
    const char *name = json_string_value(json_object_get(fn, "name"));
    json_t *params = json_object_get(fn, "parameters");
    if (!name) return jfail(c, path, "a tool has no function name");
    c->root = params;
    qf_gseq q = {0};
    char head[300];
    if (form == QF_TOOLS_XML) {
        int body = xml_params(c, params, path);
        snprintf(head, sizeof head, "<tool_call>\n<function=%s>\n", name);
        qf_gseq_lit(c->b, &q, head);
        qf_gseq_ref(&q, body);
        qf_gseq_lit(c->b, &q, "</function>\n</tool_call>");
    } else {
        json_t *js = json_string(name);
        char *quoted = json_dumps(js, JSON_ENCODE_ANY);
        json_decref(js);
        snprintf(head, sizeof head, "<tool_call>\n{\"name\": %s, \"arguments\": ", quoted ? quoted : "\"\"");
        free(quoted);
        int args = params ? compile(c, params, path) : any_container(c, 1, any_value(c));
        qf_gseq_lit(c->b, &q, head);
        qf_gseq_ref(&q, args);
        qf_gseq_lit(c->b, &q, "}\n</tool_call>");
    }
    int r = rule_of(c, &q);
    qf_gseq_free(&q);
    return c->failed ? -1 : r;
}

const char *qf_tool_param_type(json_t *params, const char *key) {
    jc c;
    memset(&c, 0, sizeof c); /* no builder: only references are followed */
    c.root = params;
    json_t *ps = chain_end(&c, params, "");
    json_t *sch = chain_end(&c, json_object_get(json_object_get(ps, "properties"), key), "");
    json_t *t = json_object_get(sch, "type");
    return json_is_string(t) && strcmp(json_string_value(t), "string") ? json_string_value(t) : NULL;
}

int qf_tool_calls_max(int n_tools) {
    long long m = (long long)n_tools * QF_TOOL_CALLS_PER_TOOL;
    return m > QF_TOOL_CALLS_MOST ? QF_TOOL_CALLS_MOST : m < 1 ? 1 : (int)m;
}

int qf_grammar_tools(qf_grammar **out, json_t *tools, const char *name, int form, int parallel) {
    *out = NULL;
    jc c;
    jc_init(&c, NULL);
    qf_gbuild *b = c.b;
    int call = c.failed ? -1 : newrule(&c), found = 0;
    size_t i;
    json_t *t;
    qf_gseq q = {0};
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        const char *fname = json_string_value(json_object_get(fn, "name"));
        if (c.failed || !fname || (name && strcmp(name, fname))) continue;
        char path[300];
        snprintf(path, sizeof path, "tools/%zu/function/parameters", i);
        qf_gseq_ref(&q, one_call(&c, fn, form, path));
        add_alt(&c, call, &q);
        found++;
    }
    int root = -1;
    if (!found && !c.failed) jfail(&c, "tools", name ? "no tool is named '%s'" : "no tools%s", name ? name : "");
    else if (!c.failed) {
        /* the calls after the first, unrolled so that the count is bounded: more_k ::= empty |
         * "\n" call more_(k+1), and the last allows only the end */
        int most = parallel ? qf_tool_calls_max(found) : 1, more = newrule(&c);
        qf_gb_alt(b, more, &q);
        for (int k = most - 1; k > 0 && !c.failed; k--) {
            int prev = more;
            more = newrule(&c);
            qf_gb_alt(b, more, &q);
            qf_gseq_byte(b, &q, '\n');
            qf_gseq_ref(&q, call);
            qf_gseq_ref(&q, prev);
            add_alt(&c, more, &q);
        }
        qf_gseq_ref(&q, call);
        qf_gseq_ref(&q, more);
        root = rule_of(&c, &q);
        qf_gb_special(b, "<tool_call>");
        qf_gb_special(b, "</tool_call>");
    }
    qf_gseq_free(&q);
    return jc_finish(&c, root, out);
}
