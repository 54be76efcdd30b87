#include "grammar/jc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

int gj_jfail(jc *c, const char *path, const char *fmt, ...) {
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

int gj_newrule(jc *c) {
    int r = qf_gb_rule(c->b);
    if (r < 0 || r >= MAX_RULES) {
        c->failed = 1;
        snprintf(c->err, sizeof c->err, "the schema makes a grammar over %d rules", MAX_RULES);
        return -1;
    }
    return r;
}

/* q becomes an alternative of rule r, and q is emptied for the next. */
void gj_add_alt(jc *c, int r, qf_gseq *q) {
    qf_gb_alt(c->b, r, q);
    qf_gseq_clear(q);
}

/* A rule with one alternative: seq (which is cleared). */
int gj_rule_of(jc *c, qf_gseq *q) {
    int r = gj_newrule(c);
    if (r >= 0) qf_gb_alt(c->b, r, q);
    qf_gseq_clear(q);
    return r;
}

int gj_lit_rule(jc *c, const char *text) {
    qf_gseq q = {0};
    qf_gseq_lit(c->b, &q, text);
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

qf_cset gj_cset_range(int lo, int hi) {
    qf_cset s = {{0}};
    qf_cset_add(&s, lo, hi);
    return s;
}

void gj_cset_del(qf_cset *s, int c) { s->w[c >> 5] &= ~(1u << (c & 31)); }

/* ---- the building blocks ---- */

/* 0..k copies of a digit. */
int gj_digits_opt(jc *c, int k) {
    if (c->digit_opt[k] >= 0) return c->digit_opt[k];
    int r = gj_newrule(c);
    qf_gseq q = {0};
    qf_gb_alt(c->b, r, &q);
    if (k > 0) {
        qf_cset d = gj_cset_range('0', '9');
        qf_gseq_set(c->b, &q, &d);
        qf_gseq_ref(&q, gj_digits_opt(c, k - 1));
        qf_gb_alt(c->b, r, &q);
    }
    qf_gseq_free(&q);
    return c->digit_opt[k] = r;
}

/* At most a newline and MAX_INDENT spaces. */
int gj_ws_rule(jc *c) {
    if (c->ws >= 0) return c->ws;
    qf_gseq q = {0};
    int sp = gj_newrule(c);
    qf_gb_alt(c->b, sp, &q);
    for (int k = 0; k < MAX_INDENT; k++) {
        int r = gj_newrule(c);
        qf_gb_alt(c->b, r, &q);
        qf_gseq_byte(c->b, &q, ' ');
        qf_gseq_ref(&q, sp);
        gj_add_alt(c, r, &q);
        sp = r;
    }
    c->ws = gj_newrule(c);
    qf_gb_alt(c->b, c->ws, &q);
    qf_gseq_byte(c->b, &q, ' ');
    gj_add_alt(c, c->ws, &q);
    qf_gseq_byte(c->b, &q, '\n');
    qf_gseq_ref(&q, sp);
    qf_gb_alt(c->b, c->ws, &q);
    qf_gseq_free(&q);
    return c->ws;
}

/* What follows a backslash in a JSON string. */
static int esc_rule(jc *c) {
    if (c->esc >= 0) return c->esc;
    c->esc = gj_newrule(c);
    qf_gseq q = {0};
    qf_cset s = {{0}};
    for (const char *p = "\"\\/bfnrt"; *p; p++) qf_cset_add(&s, *p, *p);
    qf_gseq_set(c->b, &q, &s);
    gj_add_alt(c, c->esc, &q);
    qf_cset hex = gj_cset_range('0', '9');
    qf_cset_add(&hex, 'a', 'f');
    qf_cset_add(&hex, 'A', 'F');
    qf_gseq_byte(c->b, &q, 'u');
    for (int i = 0; i < 4; i++) qf_gseq_set(c->b, &q, &hex);
    qf_gb_alt(c->b, c->esc, &q);
    qf_gseq_free(&q);
    return c->esc;
}

/* Bytes that stand for themselves in a JSON string. */
qf_cset gj_plain_bytes(void) {
    qf_cset s = gj_cset_range(0x20, 0xff);
    gj_cset_del(&s, '"');
    gj_cset_del(&s, '\\');
    return s;
}

/* A string's characters, any number: a byte loop, so masks take its tokens at once. */
int gj_content_rule(jc *c) {
    if (c->content >= 0) return c->content;
    int r = c->content = gj_newrule(c);
    qf_gseq q = {0};
    qf_cset s = gj_plain_bytes();
    qf_gseq_set(c->b, &q, &s);
    qf_gseq_ref(&q, r);
    gj_add_alt(c, r, &q);
    qf_gseq_byte(c->b, &q, '\\');
    qf_gseq_ref(&q, esc_rule(c));
    qf_gseq_ref(&q, r);
    gj_add_alt(c, r, &q);
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    return r;
}

int gj_string_rule(jc *c) {
    if (c->str >= 0) return c->str;
    qf_gseq q = {0};
    qf_gseq_byte(c->b, &q, '"');
    qf_gseq_ref(&q, gj_content_rule(c));
    qf_gseq_byte(c->b, &q, '"');
    c->str = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return c->str;
}

/* One UTF-8 character of 2-4 bytes. */
void gj_add_multibyte(jc *c, int r) {
    qf_gseq q = {0};
    qf_cset cont = gj_cset_range(0x80, 0xbf);
    static const int lead[3][2] = {{0xc2, 0xdf}, {0xe0, 0xef}, {0xf0, 0xf4}};
    for (int k = 0; k < 3; k++) {
        qf_cset l = gj_cset_range(lead[k][0], lead[k][1]);
        qf_gseq_set(c->b, &q, &l);
        for (int i = 0; i <= k; i++) qf_gseq_set(c->b, &q, &cont);
        gj_add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
}

/* Any character a regular expression's "." stands for (no escapes: those are literal). */
int gj_anychar_rule(jc *c) {
    if (c->anychar >= 0) return c->anychar;
    int r = c->anychar = gj_newrule(c);
    qf_gseq q = {0};
    qf_cset s = gj_cset_range(0x20, 0x7f);
    gj_cset_del(&s, '"');
    gj_cset_del(&s, '\\');
    qf_gseq_set(c->b, &q, &s);
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    gj_add_multibyte(c, r);
    return r;
}

/* One character of a JSON string (counted by minLength): any plain character or an escape. */
int gj_cchar_rule(jc *c) {
    if (c->cchar >= 0) return c->cchar;
    int r = c->cchar = gj_newrule(c);
    qf_gseq q = {0};
    qf_gseq_ref(&q, gj_anychar_rule(c));
    gj_add_alt(c, r, &q);
    qf_gseq_byte(c->b, &q, '\\');
    qf_gseq_ref(&q, esc_rule(c));
    gj_add_alt(c, r, &q);
    qf_gseq_free(&q);
    return r;
}

/* -?(0|[1-9][0-9]{0,14}) then, for numbers, an optional fraction and exponent. */
int gj_number_rule(jc *c, int integer, int sign) {
    qf_gseq q = {0};
    int ip = gj_newrule(c);
    qf_gseq_byte(c->b, &q, '0');
    gj_add_alt(c, ip, &q);
    qf_cset nz = gj_cset_range('1', '9'), d = gj_cset_range('0', '9');
    qf_gseq_set(c->b, &q, &nz);
    qf_gseq_ref(&q, gj_digits_opt(c, NUM_DIGITS - 1));
    gj_add_alt(c, ip, &q);
    int r = gj_newrule(c);
    for (int neg = 0; neg <= sign; neg++) {
        if (neg) qf_gseq_byte(c->b, &q, '-');
        qf_gseq_ref(&q, ip);
        if (!integer) {
            int frac = gj_newrule(c), ex = gj_newrule(c);
            qf_gseq f = {0};
            qf_gb_alt(c->b, frac, &f);
            qf_gseq_byte(c->b, &f, '.');
            qf_gseq_set(c->b, &f, &d);
            qf_gseq_ref(&f, gj_digits_opt(c, NUM_DIGITS - 1));
            gj_add_alt(c, frac, &f);
            qf_gb_alt(c->b, ex, &f);
            qf_cset e = {{0}}, pm = {{0}};
            qf_cset_add(&e, 'e', 'e');
            qf_cset_add(&e, 'E', 'E');
            qf_cset_add(&pm, '+', '+');
            qf_cset_add(&pm, '-', '-');
            int sg = gj_newrule(c);
            qf_gb_alt(c->b, sg, &f);
            qf_gseq_set(c->b, &f, &pm);
            gj_add_alt(c, sg, &f);
            qf_gseq_set(c->b, &f, &e);
            qf_gseq_ref(&f, sg);
            qf_gseq_set(c->b, &f, &d);
            qf_gseq_ref(&f, gj_digits_opt(c, 2));
            qf_gb_alt(c->b, ex, &f);
            qf_gseq_free(&f);
            qf_gseq_ref(&q, frac);
            qf_gseq_ref(&q, ex);
        }
        gj_add_alt(c, r, &q);
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
        qf_cset s = gj_cset_range(a[0], b[0]);
        qf_gseq_set(c->b, pre, &s);
        if (a[0] == b[0]) fixed_range(c, r, pre, a + 1, b + 1, n - 1);
        else {
            qf_cset d = gj_cset_range('0', '9');
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
        qf_cset s = gj_cset_range(a[0] + 1, b[0] - 1), d = gj_cset_range('0', '9');
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

int gj_int_range_rule(jc *c, long long lo, long long hi) {
    int r = gj_newrule(c);
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
