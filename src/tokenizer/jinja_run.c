/* Jinja chat templates (jinja.h): evaluation over JSON values with Python's semantics where chat
 * templates can see them (truth, equality, str() and repr(), json.dumps, slicing, string methods),
 * jinja2's Undefined (prints as nothing, is false and empty, fails when used as an object), and
 * hard limits on output, steps and depth. */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "base/err.h"
#include "tokenizer/jinja_int.h"

#define MAX_OUT ((size_t)64 << 20)
#define MAX_STEPS 2000000L
#define MAX_DEPTH 64
#define MAX_FRAMES 256

enum { VK_UNDEF, VK_JSON, VK_MACRO };

typedef struct val {
    int k;
    json_t *j;        /* VK_JSON: a reference the holder owns */
    const jnode *mac; /* VK_MACRO */
} val;

typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

typedef struct env {
    json_t *frames[MAX_FRAMES];
    int nf, base;
    json_t *undef, *nss; /* the marker of an undefined value kept in a frame; the namespaces made */
    json_t *intkeys;     /* dict literals with integer keys (kept as their digits; read back as integers) */
    const jnode *macros[64];
    int nmac;
    sbuf *out;
    int rc, depth, brk; /* brk: 1 break, 2 continue */
    const jnode *loops[MAX_FRAMES]; /* the for loops running, and each one's item index, for error messages */
    size_t loop_at[MAX_FRAMES];
    int nloop;
    long steps;
    time_t now;
} env;

static const val UNDEF = {VK_UNDEF, NULL, NULL};

/* An expression as the template wrote it, for messages: message.content, message['content']. */
static void describe(const jnode *x, char *out, size_t cap) {
    out[0] = 0;
    if (!x) return;
    if (x->type == E_NAME) snprintf(out, cap, "%s", x->name);
    else if (x->type == E_ATTR || (x->type == E_ITEM && x->b && x->b->type == E_LIT && json_is_string(x->b->lit))) {
        char base[96];
        describe(x->a, base, sizeof base);
        if (!*base) return;
        if (x->type == E_ATTR) snprintf(out, cap, "%s.%s", base, x->name);
        else snprintf(out, cap, "%s['%s']", base, json_string_value(x->b->lit));
    }
}

/* Where the render is: the innermost loops over named lists, "messages[2]". */
static void where(const env *e, char *out, size_t cap) {
    out[0] = 0;
    for (int i = e->nloop - 1; i >= 0; i--)
        if (e->loops[i]->a && e->loops[i]->a->type == E_NAME) {
            snprintf(out, cap, " (at %s[%zu])", e->loops[i]->a->name, e->loop_at[i]);
            return;
        }
}

static int err(env *e, const jnode *n, const char *fmt, ...) {
    if (e->rc != QF_OK) return e->rc;
    char msg[300], at[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    where(e, at, sizeof at);
    e->rc = n ? qf_fail(QF_EINVAL, "chat template line %d: %s%s", n->line, msg, at) : qf_fail(QF_EINVAL, "chat template: %s%s", msg, at);
    return e->rc;
}

static void put(env *e, sbuf *b, const char *s, size_t n) {
    if (e->rc != QF_OK) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *ns = b->n + n > MAX_OUT ? NULL : realloc(b->s, cap);
        if (!ns) return (void)err(e, NULL, "the output would pass %zu MiB", MAX_OUT >> 20);
        b->s = ns, b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}
static void puts_(env *e, sbuf *b, const char *s) { put(e, b, s, strlen(s)); }

static val vj(json_t *j) { return j ? (val){VK_JSON, j, NULL} : UNDEF; } /* takes the reference */
static val vref(json_t *j) { return j ? vj(json_incref(j)) : UNDEF; }
static void vfree(val v) {
    if (v.k == VK_JSON) json_decref(v.j);
}
static val vstr(const char *s, size_t n) { return vj(json_stringn(s, n)); }

/* ---- Python's str(), repr() and json.dumps ---- */

/* repr(float): the shortest digits that read back, fixed from 1e-4 to 1e16, else d.ddde+XX */
static void py_float(env *e, sbuf *b, double v) {
    char d[40], out[64];
    if (isnan(v) || isinf(v)) return puts_(e, b, isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
    int p = 1;
    for (; p < 17; p++) {
        snprintf(d, sizeof d, "%.*e", p - 1, v);
        if (strtod(d, NULL) == v) break;
    }
    snprintf(d, sizeof d, "%.*e", p - 1, v);
    char *ep = strchr(d, 'e'), digits[24];
    int exp = atoi(ep + 1), nd = 0, neg = d[0] == '-';
    for (char *c = d + neg; c < ep; c++)
        if (isdigit((unsigned char)*c)) digits[nd++] = *c;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    size_t o = 0;
    if (neg) out[o++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            o += (size_t)snprintf(out + o, sizeof out - o, "0.");
            for (int i = 0; i < -exp - 1; i++) out[o++] = '0';
            o += (size_t)snprintf(out + o, sizeof out - o, "%s", digits);
        } else {
            for (int i = 0; i <= exp; i++) out[o++] = i < nd ? digits[i] : '0';
            out[o++] = '.';
            if (nd > exp + 1) o += (size_t)snprintf(out + o, sizeof out - o, "%s", digits + exp + 1);
            else out[o++] = '0';
        }
    } else {
        out[o++] = digits[0];
        if (nd > 1) out[o++] = '.', o += (size_t)snprintf(out + o, sizeof out - o, "%s", digits + 1);
        o += (size_t)snprintf(out + o, sizeof out - o, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
    put(e, b, out, o);
}

static void py_repr_str(env *e, sbuf *b, const char *s, size_t n) {
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    put(e, b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == (unsigned char)q || c == '\\') esc[0] = '\\', esc[1] = (char)c, put(e, b, esc, 2);
        else if (c == '\n') puts_(e, b, "\\n");
        else if (c == '\t') puts_(e, b, "\\t");
        else if (c == '\r') puts_(e, b, "\\r");
        else if (c < 0x20 || c == 0x7f) snprintf(esc, sizeof esc, "\\x%02x", c), puts_(e, b, esc);
        else put(e, b, (const char *)&c, 1);
    }
    put(e, b, &q, 1);
}

static void py_str(env *e, sbuf *b, json_t *j, int repr) {
    char num[32];
    switch (json_typeof(j)) {
    case JSON_STRING:
        if (repr) py_repr_str(e, b, json_string_value(j), json_string_length(j));
        else put(e, b, json_string_value(j), json_string_length(j));
        break;
    case JSON_INTEGER: snprintf(num, sizeof num, "%lld", (long long)json_integer_value(j)), puts_(e, b, num); break;
    case JSON_REAL: py_float(e, b, json_real_value(j)); break;
    case JSON_TRUE: puts_(e, b, "True"); break;
    case JSON_FALSE: puts_(e, b, "False"); break;
    case JSON_NULL: puts_(e, b, "None"); break;
    case JSON_ARRAY: {
        size_t i;
        json_t *x;
        puts_(e, b, "[");
        json_array_foreach(j, i, x) {
            if (i) puts_(e, b, ", ");
            py_str(e, b, x, 1);
        }
        puts_(e, b, "]");
        break;
    }
    case JSON_OBJECT: {
        const char *k;
        json_t *x;
        int first = 1;
        puts_(e, b, "{");
        json_object_foreach(j, k, x) {
            if (!first) puts_(e, b, ", ");
            first = 0;
            py_repr_str(e, b, k, strlen(k));
            puts_(e, b, ": ");
            py_str(e, b, x, 1);
        }
        puts_(e, b, "}");
        break;
    }
    }
}

static void json_str(env *e, sbuf *b, const char *s, size_t n) {
    puts_(e, b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') esc[0] = '\\', esc[1] = (char)c, put(e, b, esc, 2);
        else if (c == '\n') puts_(e, b, "\\n");
        else if (c == '\r') puts_(e, b, "\\r");
        else if (c == '\t') puts_(e, b, "\\t");
        else if (c == '\b') puts_(e, b, "\\b");
        else if (c == '\f') puts_(e, b, "\\f");
        else if (c < 0x20) snprintf(esc, sizeof esc, "\\u%04x", c), puts_(e, b, esc);
        else put(e, b, (const char *)&c, 1);
    }
    puts_(e, b, "\"");
}

static void newline_indent(env *e, sbuf *b, int indent, int level) {
    puts_(e, b, "\n");
    for (int i = 0; i < indent * level; i++) puts_(e, b, " ");
}

/* json.dumps(j, ensure_ascii=False[, indent]) */
static void to_json(env *e, sbuf *b, json_t *j, int indent, int level) {
    if (json_is_string(j)) return json_str(e, b, json_string_value(j), json_string_length(j));
    if (json_is_true(j) || json_is_false(j) || json_is_null(j)) return puts_(e, b, json_is_true(j) ? "true" : json_is_false(j) ? "false" : "null");
    if (json_is_number(j)) return py_str(e, b, j, 0);
    int arr = json_is_array(j), n = (int)(arr ? json_array_size(j) : json_object_size(j)), i = 0;
    puts_(e, b, arr ? "[" : "{");
    if (arr) {
        size_t k;
        json_t *x;
        json_array_foreach(j, k, x) {
            if (i++) puts_(e, b, indent ? "," : ", ");
            if (indent) newline_indent(e, b, indent, level + 1);
            to_json(e, b, x, indent, level + 1);
        }
    } else {
        const char *k;
        json_t *x;
        json_object_foreach(j, k, x) {
            if (i++) puts_(e, b, indent ? "," : ", ");
            if (indent) newline_indent(e, b, indent, level + 1);
            json_str(e, b, k, strlen(k));
            puts_(e, b, ": ");
            to_json(e, b, x, indent, level + 1);
        }
    }
    if (indent && n) newline_indent(e, b, indent, level);
    puts_(e, b, arr ? "]" : "}");
}

/* str(v) as a new string value (Undefined: ""). */
static val to_str(env *e, val v) {
    if (v.k == VK_JSON && json_is_string(v.j)) return vref(v.j);
    sbuf b = {0};
    if (v.k == VK_JSON) py_str(e, &b, v.j, 0);
    val r = vstr(b.s ? b.s : "", b.n);
    free(b.s);
    return r;
}

/* ---- truth, equality, order ---- */

static int truth(val v) {
    if (v.k == VK_MACRO) return 1;
    if (v.k != VK_JSON) return 0;
    json_t *j = v.j;
    switch (json_typeof(j)) {
    case JSON_STRING: return json_string_length(j) > 0;
    case JSON_INTEGER: return json_integer_value(j) != 0;
    case JSON_REAL: return json_real_value(j) != 0.0;
    case JSON_TRUE: return 1;
    case JSON_ARRAY: return json_array_size(j) > 0;
    case JSON_OBJECT: return json_object_size(j) > 0;
    default: return 0;
    }
}

static int is_num(json_t *j) { return json_is_number(j) || json_is_boolean(j); }
static double num(json_t *j) { return json_is_boolean(j) ? (json_is_true(j) ? 1.0 : 0.0) : json_number_value(j); }

static int equal(val a, val b) {
    if (a.k != VK_JSON || b.k != VK_JSON) return a.k == b.k && a.k == VK_UNDEF;
    if (is_num(a.j) && is_num(b.j)) return num(a.j) == num(b.j);
    return json_equal(a.j, b.j);
}

/* a < b (-1 when they do not order) */
static int less(env *e, const jnode *n, val a, val b) {
    if (a.k == VK_JSON && b.k == VK_JSON && is_num(a.j) && is_num(b.j)) return num(a.j) < num(b.j);
    if (a.k == VK_JSON && b.k == VK_JSON && json_is_string(a.j) && json_is_string(b.j)) return strcmp(json_string_value(a.j), json_string_value(b.j)) < 0;
    return err(e, n, "these values do not order"), 0;
}

/* ---- variables ---- */

static val lookup(env *e, const char *name) {
    for (int f = e->nf - 1; f >= e->base || f == 0; f--) {
        json_t *x = json_object_get(e->frames[f], name);
        if (x) return x == e->undef ? UNDEF : vref(x);
        if (f == e->base && f > 0) f = 1; /* a macro sees its own frames, then the template's globals */
    }
    for (int i = e->nmac - 1; i >= 0; i--)
        if (!strcmp(e->macros[i]->name, name)) return (val){VK_MACRO, NULL, e->macros[i]};
    return UNDEF;
}

static void assign(env *e, json_t *frame, const char *name, val v) {
    if (v.k == VK_MACRO) return (void)err(e, NULL, "a macro cannot be assigned to '%s'", name);
    json_object_set(frame, name, v.k == VK_JSON ? v.j : e->undef);
}

static int in_list(json_t *list, json_t *j) {
    size_t i;
    json_t *x;
    json_array_foreach(list, i, x) if (x == j) return 1;
    return 0;
}
static int is_ns(env *e, json_t *j) { return in_list(e->nss, j); }

/* A key of obj as the template sees it: an integer where a dict literal gave one. */
static json_t *key_of(env *e, json_t *obj, const char *k) { return in_list(e->intkeys, obj) ? json_integer(strtoll(k, NULL, 10)) : json_string(k); }

static val eval(env *e, const jnode *n);
static void exec(env *e, jnode *const *body, int nbody);

/* ---- attributes, items, slices ---- */

static val attr_of(env *e, const jnode *n, val o, const char *name) {
    if (o.k == VK_UNDEF) return err(e, n, "'%s' of an undefined value", name), UNDEF;
    if (o.k == VK_JSON && json_is_object(o.j)) return vref(json_object_get(o.j, name));
    return UNDEF;
}

static int utf8_count(const char *s, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xc0) != 0x80;
    return c;
}

/* byte offset of code point i */
static size_t utf8_at(const char *s, size_t n, int i) {
    size_t o = 0;
    for (int c = 0; o < n; o++) {
        if (((unsigned char)s[o] & 0xc0) != 0x80 && c++ == i) break;
    }
    return o;
}

static val item_of(env *e, const jnode *n, val o, val key) {
    if (o.k == VK_UNDEF) return err(e, n, "an item of an undefined value"), UNDEF;
    if (o.k != VK_JSON || key.k != VK_JSON) return UNDEF;
    if (json_is_object(o.j) && json_is_string(key.j)) return vref(json_object_get(o.j, json_string_value(key.j)));
    if (json_is_object(o.j) && json_is_integer(key.j)) { /* int keys of dict literals are kept as their digits */
        char k[24];
        snprintf(k, sizeof k, "%lld", (long long)json_integer_value(key.j));
        return vref(json_object_get(o.j, k));
    }
    if (!json_is_integer(key.j)) return UNDEF;
    long long i = json_integer_value(key.j);
    if (json_is_array(o.j)) {
        long long len = (long long)json_array_size(o.j);
        if (i < 0) i += len;
        return i >= 0 && i < len ? vref(json_array_get(o.j, (size_t)i)) : UNDEF;
    }
    if (json_is_string(o.j)) {
        const char *s = json_string_value(o.j);
        size_t len = json_string_length(o.j);
        int cps = utf8_count(s, len);
        if (i < 0) i += cps;
        if (i < 0 || i >= cps) return UNDEF;
        size_t a = utf8_at(s, len, (int)i), b = utf8_at(s, len, (int)i + 1);
        return vstr(s + a, b - a);
    }
    return UNDEF;
}

/* Python's slice indices for a sequence of len */
static void slice_range(long long len, val a, val b, long long step, long long *start, long long *stop) {
    long long lo = step > 0 ? 0 : -1, hi = step > 0 ? len : len - 1;
    long long s = a.k == VK_JSON && json_is_integer(a.j) ? json_integer_value(a.j) : (step > 0 ? lo : hi);
    long long t = b.k == VK_JSON && json_is_integer(b.j) ? json_integer_value(b.j) : (step > 0 ? hi : lo - len - 1);
    if (a.k == VK_JSON && json_is_integer(a.j)) s = s < 0 ? (s + len < lo ? lo : s + len) : (s > hi ? hi : s);
    if (b.k == VK_JSON && json_is_integer(b.j)) t = t < 0 ? (t + len < lo ? lo : t + len) : (t > hi ? hi : t);
    else if (step < 0) t = -1;
    *start = s, *stop = t;
}

static val slice_of(env *e, const jnode *n, val o, val a, val b, long long step) {
    if (step == 0) return err(e, n, "slice step cannot be zero"), UNDEF;
    if (o.k != VK_JSON || (!json_is_array(o.j) && !json_is_string(o.j))) return err(e, n, "only lists and strings slice"), UNDEF;
    int is_s = json_is_string(o.j);
    const char *s = is_s ? json_string_value(o.j) : NULL;
    size_t slen = is_s ? json_string_length(o.j) : 0;
    long long len = is_s ? utf8_count(s, slen) : (long long)json_array_size(o.j), start, stop;
    slice_range(len, a, b, step, &start, &stop);
    json_t *out = is_s ? NULL : json_array();
    sbuf sb = {0};
    for (long long i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (is_s) {
            size_t x = utf8_at(s, slen, (int)i), y = utf8_at(s, slen, (int)i + 1);
            put(e, &sb, s + x, y - x);
        } else {
            json_array_append(out, json_array_get(o.j, (size_t)i));
        }
    }
    if (!is_s) return vj(out);
    val r = vstr(sb.s ? sb.s : "", sb.n);
    free(sb.s);
    return r;
}

static json_t *iter_items(env *e, const jnode *n, val v);

#include "tokenizer/jinja_lib.inc"

/* ---- expressions ---- */

static val binop(env *e, const jnode *n, val a, val b) {
    int op = n->op;
    if (op == OP_CAT) {
        val x = to_str(e, a), y = to_str(e, b);
        sbuf s = {0};
        put(e, &s, json_string_value(x.j), json_string_length(x.j));
        put(e, &s, json_string_value(y.j), json_string_length(y.j));
        vfree(x), vfree(y);
        val r = vstr(s.s ? s.s : "", s.n);
        free(s.s);
        return r;
    }
    if (op == OP_EQ || op == OP_NE) return vj(json_boolean(equal(a, b) == (op == OP_EQ)));
    if (op == OP_IN || op == OP_NOTIN) return vj(json_boolean(contains(e, n, b, a) == (op == OP_IN)));
    if (op == OP_LT) return vj(json_boolean(less(e, n, a, b)));
    if (op == OP_GT) return vj(json_boolean(less(e, n, b, a)));
    if (op == OP_LE) return vj(json_boolean(!less(e, n, b, a)));
    if (op == OP_GE) return vj(json_boolean(!less(e, n, a, b)));
    return arith(e, n, op, a, b);
}

static val call(env *e, const jnode *n);

static val eval(env *e, const jnode *n) {
    if (e->rc != QF_OK || !n) return UNDEF;
    switch (n->type) {
    case E_LIT: return vj(json_deep_copy(n->lit)); /* renders on other threads share the template: each takes its own copy */
    case E_NAME: return lookup(e, n->name);
    case E_ATTR: {
        val o = eval(e, n->a), r = attr_of(e, n, o, n->name);
        vfree(o);
        return r;
    }
    case E_ITEM: {
        val o = eval(e, n->a), k = eval(e, n->b), r = item_of(e, n, o, k);
        vfree(o), vfree(k);
        return r;
    }
    case E_SLICE: {
        val o = eval(e, n->a), a = eval(e, n->b), b = eval(e, n->c), st = n->nargs ? eval(e, n->args[0]) : UNDEF;
        long long step = st.k == VK_JSON && json_is_integer(st.j) ? json_integer_value(st.j) : 1;
        val r = slice_of(e, n, o, a, b, step);
        vfree(o), vfree(a), vfree(b), vfree(st);
        return r;
    }
    case E_CALL: return call(e, n);
    case E_FILTER: return filter(e, n);
    case E_TEST: return vj(json_boolean(test(e, n) != n->neg));
    case E_NOT: {
        val a = eval(e, n->a);
        int t = truth(a);
        vfree(a);
        return vj(json_boolean(!t));
    }
    case E_NEG: {
        val a = eval(e, n->a), r = a.k == VK_JSON && json_is_integer(a.j) ? vj(json_integer(-json_integer_value(a.j)))
                                   : a.k == VK_JSON && json_is_number(a.j) ? vj(json_real(-json_number_value(a.j)))
                                                                           : (err(e, n, "only numbers negate"), UNDEF);
        vfree(a);
        return r;
    }
    case E_AND:
    case E_OR: {
        val a = eval(e, n->a);
        if (truth(a) == (n->type == E_OR)) return a;
        vfree(a);
        return eval(e, n->b);
    }
    case E_COND: {
        val c = eval(e, n->a);
        int t = truth(c);
        vfree(c);
        return t ? eval(e, n->b) : n->c ? eval(e, n->c) : UNDEF;
    }
    case E_BIN: {
        val a = eval(e, n->a), b = eval(e, n->b), r = binop(e, n, a, b);
        vfree(a), vfree(b);
        return r;
    }
    case E_LIST: {
        json_t *l = json_array();
        for (int i = 0; i < n->nargs; i++) {
            val x = eval(e, n->args[i]);
            json_array_append_new(l, x.k == VK_JSON ? x.j : json_null());
        }
        return vj(l);
    }
    case E_DICT: {
        json_t *d = json_object();
        int ints = 0;
        for (int i = 0; i + 1 < n->nargs; i += 2) {
            val k = eval(e, n->args[i]), v = eval(e, n->args[i + 1]), ks = k.k == VK_JSON && (json_is_string(k.j) || json_is_integer(k.j)) ? to_str(e, k) : UNDEF;
            ints |= k.k == VK_JSON && json_is_integer(k.j);
            if (ks.k == VK_JSON) json_object_set(d, json_string_value(ks.j), v.k == VK_JSON ? v.j : json_null()); /* an int key as its digits */
            else err(e, n, "dict keys must be strings or integers here");
            vfree(k), vfree(v), vfree(ks);
        }
        if (ints) json_array_append(e->intkeys, d);
        return vj(d);
    }
    }
    return err(e, n, "an expression of kind %d is not supported", n->type), UNDEF;
}

/* ---- macros and calls ---- */

static val call_macro(env *e, const jnode *call_n, const jnode *m) {
    if (e->depth >= MAX_DEPTH || e->nf + 1 >= MAX_FRAMES) return err(e, call_n, "calls nest deeper than %d", MAX_DEPTH), UNDEF;
    json_t *frame = json_object();
    int pos = 0;
    for (int i = 0; i < call_n->nargs; i++) {
        val v = eval(e, call_n->args[i]);
        const char *k = call_n->kw ? call_n->kw[i] : NULL;
        if (!k && pos < m->ntargets) k = m->targets[pos++];
        if (k) assign(e, frame, k, v);
        else err(e, call_n, "too many arguments to macro '%s'", m->name);
        vfree(v);
    }
    for (int i = 0; i < m->ntargets; i++)
        if (!json_object_get(frame, m->targets[i])) {
            val d = m->args[i] ? eval(e, m->args[i]) : UNDEF;
            assign(e, frame, m->targets[i], d);
            vfree(d);
        }
    sbuf b = {0}, *saved = e->out;
    int saved_base = e->base;
    e->frames[e->nf++] = frame, e->base = e->nf - 1, e->out = &b, e->depth++;
    exec(e, m->body, m->nbody);
    e->depth--, e->out = saved, e->base = saved_base;
    json_decref(e->frames[--e->nf]);
    val r = vstr(b.s ? b.s : "", b.n);
    free(b.s);
    return r;
}

static val call(env *e, const jnode *n) {
    if (n->a->type == E_ATTR) { /* a method */
        val o = eval(e, n->a->a), r = method(e, n, o, n->a->name);
        vfree(o);
        return r;
    }
    if (n->a->type == E_NAME) {
        val f = builtin(e, n, n->a->name);
        if (f.k != VK_UNDEF || e->rc != QF_OK || !strcmp(n->a->name, "raise_exception")) return f;
        val m = lookup(e, n->a->name);
        if (m.k == VK_MACRO) return call_macro(e, n, m.mac);
        vfree(m);
        return err(e, n, "'%s' is not a function or macro", n->a->name), UNDEF;
    }
    return err(e, n, "only names and methods can be called"), UNDEF;
}

/* ---- statements ---- */

static void out_val(env *e, val v) {
    if (v.k != VK_JSON) return;
    py_str(e, e->out, v.j, 0);
}

/* The loop variable of item i of n (previtem / nextitem only where they exist). */
static json_t *loop_obj(json_t *items, size_t i) {
    size_t n = json_array_size(items);
    json_t *l = json_pack("{s:I,s:I,s:I,s:I,s:b,s:b,s:I,s:i,s:i}", "index", (json_int_t)i + 1, "index0", (json_int_t)i, "revindex", (json_int_t)(n - i),
                          "revindex0", (json_int_t)(n - i - 1), "first", i == 0, "last", i + 1 == n, "length", (json_int_t)n, "depth", 1, "depth0", 0);
    if (l && i > 0) json_object_set(l, "previtem", json_array_get(items, i - 1));
    if (l && i + 1 < n) json_object_set(l, "nextitem", json_array_get(items, i + 1));
    return l;
}

/* The items a for walks: a list's, a dict's keys, a string's characters (an undefined: none). */
static json_t *iter_items(env *e, const jnode *n, val v) {
    if (v.k == VK_UNDEF) return json_array();
    if (v.k != VK_JSON) return err(e, n, "a macro is not iterable"), NULL;
    if (json_is_array(v.j)) return json_copy(v.j);
    json_t *out = json_array();
    if (json_is_object(v.j)) {
        const char *k;
        json_t *x;
        json_object_foreach(v.j, k, x) json_array_append_new(out, key_of(e, v.j, k));
    } else if (json_is_string(v.j)) {
        const char *s = json_string_value(v.j);
        size_t len = json_string_length(v.j);
        for (int i = 0, c = utf8_count(s, len); i < c; i++) {
            size_t a = utf8_at(s, len, i), b = utf8_at(s, len, i + 1);
            json_array_append_new(out, json_stringn(s + a, b - a));
        }
    } else {
        json_decref(out);
        return err(e, n, "this value is not iterable"), NULL;
    }
    return out;
}

static void bind_targets(env *e, const jnode *n, json_t *frame, json_t *item) {
    if (n->ntargets == 1) return (void)json_object_set(frame, n->targets[0], item);
    if (!json_is_array(item) || (int)json_array_size(item) != n->ntargets) return (void)err(e, n, "cannot unpack into %d names", n->ntargets);
    for (int t = 0; t < n->ntargets; t++) json_object_set(frame, n->targets[t], json_array_get(item, (size_t)t));
}

/* the items that pass a for's `if` (with the loop's names bound to each) */
static json_t *filtered(env *e, const jnode *n, json_t *items, json_t *frame) {
    json_t *out = json_array();
    size_t i;
    json_t *x;
    json_array_foreach(items, i, x) {
        bind_targets(e, n, frame, x);
        val c = eval(e, n->b);
        if (truth(c)) json_array_append(out, x);
        vfree(c);
    }
    json_decref(items);
    return out;
}

static void exec_for(env *e, const jnode *n) {
    val it = eval(e, n->a);
    json_t *items = iter_items(e, n, it);
    vfree(it);
    if (!items || e->nf + 1 >= MAX_FRAMES) return (void)(items ? err(e, n, "loops nest deeper than %d", MAX_FRAMES) : 0), json_decref(items);
    json_t *frame = json_object();
    e->frames[e->nf++] = frame;
    if (n->b) items = filtered(e, n, items, frame);
    size_t i;
    json_t *x;
    int li = e->nloop++;
    e->loops[li] = n;
    json_array_foreach(items, i, x) {
        if (e->rc != QF_OK || ++e->steps > MAX_STEPS) {
            err(e, n, "more than %ld loop steps", MAX_STEPS);
            break;
        }
        e->loop_at[li] = i;
        bind_targets(e, n, frame, x);
        json_object_set_new(frame, "loop", loop_obj(items, i));
        exec(e, n->body, n->nbody);
        if (e->brk == 1) break;
        e->brk = 0;
    }
    e->brk = 0;
    e->nloop--;
    if (json_array_size(items) == 0) exec(e, n->orelse, n->norelse);
    json_decref(items);
    json_decref(e->frames[--e->nf]);
}

static void exec_set(env *e, const jnode *n) {
    val v;
    if (n->type == N_SETBLOCK) {
        sbuf b = {0}, *saved = e->out;
        e->out = &b;
        exec(e, n->body, n->nbody);
        e->out = saved;
        v = vstr(b.s ? b.s : "", b.n);
        free(b.s);
    } else {
        v = eval(e, n->a);
    }
    if (!n->attr) {
        assign(e, e->frames[e->nf - 1], n->name, v);
    } else {
        val ns = lookup(e, n->name);
        if (ns.k == VK_JSON && is_ns(e, ns.j)) assign(e, ns.j, n->attr, v);
        else err(e, n, "cannot assign '%s.%s': '%s' is not a namespace", n->name, n->attr, n->name);
        vfree(ns);
    }
    vfree(v);
}

static void exec(env *e, jnode *const *body, int nbody) {
    for (int i = 0; i < nbody && e->rc == QF_OK && !e->brk; i++) {
        const jnode *n = body[i];
        switch (n->type) {
        case N_TEXT: put(e, e->out, n->text, n->len); break;
        case N_OUT: {
            val v = eval(e, n->a);
            out_val(e, v);
            vfree(v);
            break;
        }
        case N_IF: {
            val c = eval(e, n->a);
            int t = truth(c);
            vfree(c);
            if (t) exec(e, n->body, n->nbody);
            else exec(e, n->orelse, n->norelse);
            break;
        }
        case N_FOR: exec_for(e, n); break;
        case N_SET:
        case N_SETBLOCK: exec_set(e, n); break;
        case N_MACRO:
            if (e->nmac < 64) e->macros[e->nmac++] = n;
            else err(e, n, "more than 64 macros");
            break;
        case N_BREAK: e->brk = 1; break;
        case N_CONTINUE: e->brk = 2; break;
        case N_BLOCK: exec(e, n->body, n->nbody); break;
        default: err(e, n, "a statement of kind %d is not supported", n->type);
        }
    }
}

int qf_jinja_render_at(const qf_jinja *t, json_t *vars, long long now, char **out) {
    sbuf b = {0};
    env e = {.nf = 1, .out = &b, .rc = QF_OK, .now = (time_t)now};
    e.frames[0] = json_is_object(vars) ? json_copy(vars) : json_object();
    e.undef = json_object(), e.nss = json_array(), e.intkeys = json_array();
    exec(&e, t->body, t->nbody);
    json_decref(e.frames[0]), json_decref(e.undef), json_decref(e.nss), json_decref(e.intkeys);
    if (e.rc != QF_OK) {
        free(b.s);
        return e.rc;
    }
    *out = b.s ? b.s : calloc(1, 1);
    return *out ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
}

int qf_jinja_render(const qf_jinja *t, json_t *vars, char **out) { return qf_jinja_render_at(t, vars, (long long)time(NULL), out); }
