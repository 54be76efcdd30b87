#include "grammar/jc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

/* ---- regular expressions (pattern, format) ---- */

typedef struct rx {
    jc *c;
    const char *p, *end, *path;
} rx;

static int rx_alt(rx *x);

/* L ::= frag L | empty (a byte loop when frag is one byte set). */
/* L ::= frag L | empty; a body that may be empty loops over its nonempty part ((a*)* is a*). */
static int loop_of(jc *c, const qf_gseq *frag, const char *path) {
    int L = gj_newrule(c), body = -3;
    if (L >= 0 && qf_gb_seq_nullable(c->b, frag)) {
        if (++c->empty_loops > 64) return gj_jfail(c, path, "pattern: more than 64 repetitions of something that may be empty");
        body = qf_gb_nonempty(c->b, frag);
    }
    if (L < 0 || body == -2) return gj_jfail(c, path, "out of memory");
    qf_gseq t = {0};
    if (body >= 0) qf_gseq_ref(&t, body);
    else if (body == -3) qf_gseq_append(&t, frag);
    if (body != -1) {
        qf_gseq_ref(&t, L);
        gj_add_alt(c, L, &t);
    }
    qf_gb_alt(c->b, L, &t);
    qf_gseq_free(&t);
    return L;
}

/* Any characters (a raw, unquoted text's free part). */
static int anychar_loop(jc *c) {
    if (c->anyloop >= 0) return c->anyloop;
    qf_gseq q = {0};
    qf_gseq_ref(&q, gj_anychar_rule(c));
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
        qf_cset u = gj_cset_range(0x20, 0x7e);
        for (int w = 0; w < 8; w++) u.w[w] &= ~t.w[w];
        t = u;
    }
    for (int w = 0; w < 8; w++) s->w[w] |= t.w[w];
    return 1;
}

/* A set of ASCII characters, or that set and every non-ASCII character (wide). */
static int rx_set_rule(rx *x, qf_cset s, int wide, qf_gseq *q) {
    gj_cset_del(&s, '"');
    gj_cset_del(&s, '\\');
    for (int b = 0; b < 0x20; b++) gj_cset_del(&s, b);
    if (!wide) {
        qf_gseq_set(x->c->b, q, &s);
        return 0;
    }
    int r = gj_newrule(x->c);
    qf_gseq t = {0};
    qf_gseq_set(x->c->b, &t, &s);
    qf_gb_alt(x->c->b, r, &t);
    qf_gseq_free(&t);
    gj_add_multibyte(x->c, r);
    qf_gseq_ref(q, r);
    return 0;
}

/* \xHH after the x: the ASCII character, or -1 (refused). */
static int rx_hex(rx *x) {
    int v = 0;
    for (int i = 0; i < 2; i++, x->p++) {
        char h = x->p < x->end ? *x->p : 0;
        int d = h >= '0' && h <= '9' ? h - '0' : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10 : -1;
        if (d < 0) return gj_jfail(x->c, x->path, "pattern: \\x needs two hex digits");
        v = v * 16 + d;
    }
    return v < 0x80 ? v : gj_jfail(x->c, x->path, "pattern: \\x%02X is not an ASCII character (write the character itself)", v);
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
        if (lo >= 0x80) return gj_jfail(x->c, x->path, "pattern: non-ASCII characters in a [...] class are not supported");
        if (lo == '\\' && x->p < x->end) {
            int n2;
            char e = *x->p++;
            if (rx_class_escape(e, &s, &n2)) {
                wide_in |= n2;
                continue;
            }
            int h = e == 'x' ? rx_hex(x) : 0;
            if (h < 0) return -1;
            if ((e >= '0' && e <= '9') || e == 'p' || e == 'P' || e == 'u' || e == 'b' || e == 'B') return gj_jfail(x->c, x->path, "pattern: the escape \\%c in a [...] class is not supported", e);
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
            if (hi < lo || hi >= 0x80) return gj_jfail(x->c, x->path, "pattern: bad range in a [...] class");
        }
        qf_cset_add(&s, lo, hi);
    }
    if (x->p >= x->end) return gj_jfail(x->c, x->path, "pattern: unterminated [...] class");
    x->p++;
    if (neg) {
        qf_cset u = gj_cset_range(0x20, 0x7e);
        for (int w = 0; w < 8; w++) u.w[w] &= ~s.w[w];
        s = u;
    }
    int wide = neg ? !wide_in : wide_in;
    if (!wide && cset_empty(&s)) return gj_jfail(x->c, x->path, "pattern: a [...] class that matches no character");
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
            } else return gj_jfail(x->c, x->path, "pattern: lookaround and (?...) groups are not supported");
        }
        int r = rx_alt(x);
        if (r < 0) return -1;
        if (x->p >= x->end || *x->p != ')') return gj_jfail(x->c, x->path, "pattern: unbalanced parentheses");
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
        qf_gseq_ref(q, gj_anychar_rule(x->c));
        return 0;
    }
    if (ch == '^' || ch == '$') return gj_jfail(x->c, x->path, "pattern: ^ and $ are supported only at the ends");
    if (ch == '*' || ch == '+' || ch == '?' || ch == '{') return gj_jfail(x->c, x->path, "pattern: a quantifier with nothing before it");
    if (ch == '\\') {
        x->p++;
        if (x->p >= x->end) return gj_jfail(x->c, x->path, "pattern: a trailing backslash");
        char e = *x->p++;
        qf_cset s = {{0}};
        int neg;
        if (rx_class_escape(e, &s, &neg)) return rx_set_rule(x, s, neg, q);
        if ((e >= '0' && e <= '9') || e == 'b' || e == 'B' || e == 'p' || e == 'P' || e == 'u' || e == 'k')
            return gj_jfail(x->c, x->path, "pattern: the escape \\%c is not supported", e);
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
    if (e == x->p + 1) return gj_jfail(x->c, x->path, "pattern: a '{' that is not a {n,m} count (escape it)");
    if (*e == ',') {
        if (e[1] == '}') b = -1, e++;
        else b = strtol(e + 1, &e, 10);
    }
    if (*e != '}' || a < 0 || (b >= 0 && b < a) || a > MAX_UNROLL || b > MAX_UNROLL) return gj_jfail(x->c, x->path, "pattern: a bad {n,m} count (at most %d)", MAX_UNROLL);
    x->p = e + 1;
    *lo = (int)a, *hi = (int)b;
    return 1;
}

/* Appends atom (elements frag) lo..hi times (hi < 0: no limit) to q. */
int gj_repeat(jc *c, qf_gseq *q, const qf_gseq *frag, int lo, int hi, const char *path) {
    if ((c->unrolled += lo + (hi > lo ? hi - lo : 0)) > 20 * MAX_UNROLL) return gj_jfail(c, path, "the schema's counts write out over %d positions", 20 * MAX_UNROLL);
    for (int i = 0; i < lo; i++)
        qf_gseq_append(q, frag);
    qf_gseq t = {0};
    if (hi < 0) {
        qf_gseq_ref(q, loop_of(c, frag, path));
    } else {
        int next = -1;
        for (int i = lo; i < hi; i++) { /* O ::= frag O' | empty */
            int O = gj_newrule(c);
            qf_gseq_append(&t, frag);
            if (next >= 0) qf_gseq_ref(&t, next);
            gj_add_alt(c, O, &t);
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
        if (gj_repeat(x->c, q, &frag, lo, hi, x->path) < 0) break;
    }
    qf_gseq_free(&frag);
    return x->c->failed ? -1 : 0;
}

static int rx_alt(rx *x) {
    int r = gj_newrule(x->c);
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
int gj_pattern_rule(jc *c, const char *pat, const char *path, int quoted) {
    size_t n = strlen(pat);
    int head = n && pat[0] == '^', tail = n > (size_t)head && pat[n - 1] == '$' && (n < 2 || pat[n - 2] != '\\');
    rx x = {c, pat + head, pat + n - tail, path};
    int body = rx_alt(&x);
    if (body < 0) return -1;
    if (x.p != x.end) return gj_jfail(c, path, "pattern: unbalanced parentheses");
    qf_gseq q = {0};
    if (quoted) qf_gseq_byte(c->b, &q, '"');
    if (!head) qf_gseq_ref(&q, quoted ? gj_content_rule(c) : anychar_loop(c));
    qf_gseq_ref(&q, body);
    if (!tail) qf_gseq_ref(&q, quoted ? gj_content_rule(c) : anychar_loop(c));
    if (quoted) qf_gseq_byte(c->b, &q, '"');
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

const char *gj_format_pattern(const char *f) {
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
