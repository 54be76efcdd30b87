/* Jinja chat templates (jinja.h): the lexer, with jinja2's whitespace rules as transformers sets
 * them (trim_blocks, lstrip_blocks, {%- -%}), and a recursive-descent parser into jinja_int.h's
 * tree. Precedence follows jinja2's parser: or < and < not < comparisons < + - < ~ < * / // % <
 * unary - < filters and tests < postfix (.attr, [key], calls). */
#include <ctype.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "tokenizer/jinja_int.h"

enum { T_TEXT, T_VBEG, T_VEND, T_BBEG, T_BEND, T_NAME, T_STR, T_NUM, T_OP, T_EOF };

typedef struct tok {
    int t, line;
    const char *s; /* T_NAME / T_OP / T_TEXT: the text; T_STR: the decoded string (owned) */
    size_t n;
    json_t *num;
} tok;

typedef struct parser {
    qf_jinja *t;
    const char *src;
    tok *toks;
    int n, cap, at, rc;
    char err[256];
} parser;

static void *grab(qf_jinja *t, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) return NULL;
    if (t->nmem == t->capmem) {
        int cap = t->capmem ? 2 * t->capmem : 256;
        void **m = realloc(t->mem, (size_t)cap * sizeof *m);
        if (!m) return free(p), NULL;
        t->mem = m, t->capmem = cap;
    }
    return t->mem[t->nmem++] = p;
}

static int fail(parser *p, int line, const char *fmt, ...) {
    if (p->rc != QF_OK) return p->rc;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->rc = qf_fail(QF_EFORMAT, "chat template line %d: %s", line, msg);
    return p->rc;
}

static tok *push(parser *p, int t, int line, const char *s, size_t n) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 256;
        tok *nt = realloc(p->toks, (size_t)cap * sizeof *nt);
        if (!nt) return fail(p, line, "out of memory"), NULL;
        p->toks = nt, p->cap = cap;
    }
    tok *k = &p->toks[p->n++];
    *k = (tok){t, line, s, n, NULL};
    return k;
}

static int lines_to(const char *a, const char *b) {
    int n = 0;
    for (; a < b; a++) n += *a == '\n';
    return n;
}

/* ---- lexer ---- */

/* A quoted string at s (its quote first) decoded into the template's memory; *end after it. */
static const char *lex_string(parser *p, const char *s, int line, const char **end, size_t *len) {
    char q = *s++, *out = grab(p->t, strlen(s) + 1);
    size_t n = 0;
    if (!out) return fail(p, line, "out of memory"), NULL;
    for (; *s && *s != q; s++) {
        if (*s != '\\' || !s[1]) {
            out[n++] = *s;
            continue;
        }
        s++;
        out[n++] = *s == 'n' ? '\n' : *s == 't' ? '\t' : *s == 'r' ? '\r' : *s;
    }
    if (*s != q) return fail(p, line, "a string is not closed"), NULL;
    *end = s + 1, *len = n;
    return out;
}

static const char *const ops3[] = {"//", "==", "!=", "<=", ">=", "**", NULL};

/* The expression tokens between s and e (a tag's inside). */
static void lex_expr(parser *p, const char *s, const char *e, int line) {
    while (s < e && p->rc == QF_OK) {
        if (isspace((unsigned char)*s)) {
            line += *s++ == '\n';
            continue;
        }
        if (isalpha((unsigned char)*s) || *s == '_') {
            const char *b = s;
            while (s < e && (isalnum((unsigned char)*s) || *s == '_')) s++;
            push(p, T_NAME, line, b, (size_t)(s - b));
        } else if (isdigit((unsigned char)*s)) {
            char *end;
            double v = strtod(s, &end);
            int is_int = 1;
            for (const char *c = s; c < end; c++) is_int &= isdigit((unsigned char)*c) != 0;
            tok *k = push(p, T_NUM, line, s, (size_t)(end - s));
            if (k) k->num = is_int ? json_integer(strtoll(s, NULL, 10)) : json_real(v);
            if (k && k->num && p->t->nlits < p->t->caplits) p->t->lits[p->t->nlits++] = k->num;
            s = end;
        } else if (*s == '\'' || *s == '"') {
            size_t n = 0;
            const char *str = lex_string(p, s, line, &s, &n);
            if (str) push(p, T_STR, line, str, n);
        } else {
            size_t n = 1;
            for (int i = 0; ops3[i]; i++)
                if (s + 1 < e && !strncmp(s, ops3[i], 2)) n = 2;
            if (!strchr("+-*/%~=!<>()[]{}.,:|", *s)) fail(p, line, "unexpected character '%c'", *s);
            push(p, T_OP, line, s, n);
            s += n;
        }
    }
}

/* The text between two tags, with the whitespace rules: a '-' beside a tag strips all the
 * whitespace on that side; after a block or comment tag one newline goes (trim_blocks); before a
 * block or comment tag the spaces and tabs since the line's start go (lstrip_blocks). */
static void lex_text(parser *p, const char *s, const char *e, int line, int left_dash, int after_block, int right_dash, int before_block) {
    if (left_dash)
        while (s < e && isspace((unsigned char)*s)) line += *s++ == '\n';
    else if (after_block && s < e && *s == '\n') s++, line++;
    else if (after_block && s + 1 < e && s[0] == '\r' && s[1] == '\n') s += 2, line++;
    if (right_dash) {
        while (e > s && isspace((unsigned char)e[-1])) e--;
    } else if (before_block) {
        const char *q = e;
        while (q > s && (q[-1] == ' ' || q[-1] == '\t')) q--;
        if (q > s ? q[-1] == '\n' : s == p->src || s[-1] == '\n') e = q; /* only from a line's start */
    }
    if (e > s) push(p, T_TEXT, line, s, (size_t)(e - s));
}

/* The end of a tag that opens at in: the first close outside quoted strings (NULL: none). */
static const char *tag_close(const char *in, const char *close) {
    for (const char *c = in; *c; c++) {
        if (*c == '\'' || *c == '"') {
            char q = *c;
            for (c++; *c && *c != q; c++) c += *c == '\\' && c[1];
            if (!*c) return NULL;
        } else if (c[0] == close[0] && c[1] == close[1]) {
            return c;
        }
    }
    return NULL;
}

static void lex(parser *p, const char *src) {
    const char *s = src;
    int left_dash = 0, after_block = 0, line = 1;
    while (p->rc == QF_OK) {
        const char *o = strstr(s, "{"), *tag = NULL;
        while (o && !tag) {
            if (o[1] == '{' || o[1] == '%' || o[1] == '#') tag = o;
            else o = strstr(o + 1, "{");
        }
        if (!tag) {
            lex_text(p, s, s + strlen(s), line, left_dash, after_block, 0, 0);
            break;
        }
        char kind = tag[1];
        int dash = tag[2] == '-', blockish = kind != '{';
        lex_text(p, s, tag, line, left_dash, after_block, dash, blockish && tag[2] != '+');
        line += lines_to(s, tag);
        const char *in = tag + 2 + (dash || tag[2] == '+');
        const char *close = kind == '#' ? strstr(in, "#}") : tag_close(in, kind == '{' ? "}}" : "%}");
        if (!close) {
            fail(p, line, "a tag is not closed");
            break;
        }
        int rdash = close > in && close[-1] == '-';
        if (kind != '#') {
            push(p, kind == '{' ? T_VBEG : T_BBEG, line, tag, 2);
            lex_expr(p, in, close - rdash, line);
            push(p, kind == '{' ? T_VEND : T_BEND, line, close, 2);
        }
        line += lines_to(tag, close);
        s = close + 2, left_dash = rdash, after_block = blockish;
    }
    push(p, T_EOF, line, s, 0);
}

/* ---- parser ---- */

static tok *cur(parser *p) { return &p->toks[p->at]; }
static int is_op(parser *p, const char *op) { return cur(p)->t == T_OP && cur(p)->n == strlen(op) && !strncmp(cur(p)->s, op, cur(p)->n); }
static int is_name(parser *p, const char *nm) { return cur(p)->t == T_NAME && cur(p)->n == strlen(nm) && !strncmp(cur(p)->s, nm, cur(p)->n); }
static int take_op(parser *p, const char *op) { return is_op(p, op) ? (p->at++, 1) : 0; }
static int take_name(parser *p, const char *nm) { return is_name(p, nm) ? (p->at++, 1) : 0; }

static void expect_op(parser *p, const char *op) {
    if (!take_op(p, op)) fail(p, cur(p)->line, "expected '%s' before '%.*s'", op, (int)cur(p)->n, cur(p)->s);
}

static char *name_of(parser *p) {
    tok *k = cur(p);
    if (k->t != T_NAME) return fail(p, k->line, "expected a name before '%.*s'", (int)k->n, k->s), NULL;
    char *s = grab(p->t, k->n + 1);
    if (s) memcpy(s, k->s, k->n);
    p->at++;
    return s;
}

static jnode *node(parser *p, int type) {
    jnode *n = grab(p->t, sizeof *n);
    if (!n) return fail(p, cur(p)->line, "out of memory"), NULL;
    n->type = type, n->line = cur(p)->line;
    return n;
}

/* Appends x to a growing array in the template's memory. */
static void add(parser *p, jnode ***arr, char ***kw, int *n, jnode *x, char *k) {
    if ((*n & (*n - 1)) == 0) { /* at powers of two: a new array twice the size */
        int cap = *n ? 2 * *n : 1;
        jnode **na = grab(p->t, (size_t)cap * sizeof *na);
        char **nk = kw ? grab(p->t, (size_t)cap * sizeof *nk) : NULL;
        if (!na || (kw && !nk)) return (void)fail(p, cur(p)->line, "out of memory");
        if (*n) memcpy(na, *arr, (size_t)*n * sizeof *na);
        if (kw && *n) memcpy(nk, *kw, (size_t)*n * sizeof *nk);
        *arr = na;
        if (kw) *kw = nk;
    }
    (*arr)[*n] = x;
    if (kw) (*kw)[*n] = k;
    (*n)++;
}

static void add_name(parser *p, char ***arr, int *n, char *s) {
    if ((*n & (*n - 1)) == 0) {
        int cap = *n ? 2 * *n : 1;
        char **na = grab(p->t, (size_t)cap * sizeof *na);
        if (!na) return (void)fail(p, cur(p)->line, "out of memory");
        if (*n) memcpy(na, *arr, (size_t)*n * sizeof *na);
        *arr = na;
    }
    (*arr)[(*n)++] = s;
}

static jnode *expr(parser *p);
static jnode *or_expr(parser *p);
static jnode *unary(parser *p, int with_filter);

/* (a, b=c, ...) after the '(' */
static void call_args(parser *p, jnode *n) {
    while (p->rc == QF_OK && !take_op(p, ")")) {
        char *k = NULL;
        if (cur(p)->t == T_NAME && p->toks[p->at + 1].t == T_OP && p->toks[p->at + 1].n == 1 && p->toks[p->at + 1].s[0] == '=') k = name_of(p), p->at++;
        add(p, &n->args, &n->kw, &n->nargs, expr(p), k);
        if (!is_op(p, ")")) expect_op(p, ",");
    }
}

static jnode *literal(parser *p, json_t *v) {
    jnode *n = node(p, E_LIT);
    if (!v) fail(p, cur(p)->line, "out of memory");
    if (n) n->lit = v;
    if (v && p->t->nlits < p->t->caplits) p->t->lits[p->t->nlits++] = v;
    return n;
}

static jnode *primary(parser *p) {
    tok *k = cur(p);
    if (k->t == T_STR) { /* adjacent strings join */
        size_t n = 0;
        for (int i = p->at; p->toks[i].t == T_STR; i++) n += p->toks[i].n;
        char *s = grab(p->t, n + 1);
        for (n = 0; s && cur(p)->t == T_STR; p->at++) memcpy(s + n, cur(p)->s, cur(p)->n), n += cur(p)->n;
        return s ? literal(p, json_stringn(s, n)) : NULL;
    }
    if (k->t == T_NUM) return p->at++, literal(p, json_incref(k->num));
    if (k->t == T_NAME) {
        if (take_name(p, "true") || take_name(p, "True")) return literal(p, json_true());
        if (take_name(p, "false") || take_name(p, "False")) return literal(p, json_false());
        if (take_name(p, "none") || take_name(p, "None")) return literal(p, json_null());
        jnode *n = node(p, E_NAME);
        if (n) n->name = name_of(p);
        return n;
    }
    if (take_op(p, "(")) {
        jnode *e = expr(p);
        if (is_op(p, ",")) { /* a tuple: a list here */
            jnode *l = node(p, E_LIST);
            if (l) add(p, &l->args, NULL, &l->nargs, e, NULL);
            while (l && take_op(p, ",") && !is_op(p, ")")) add(p, &l->args, NULL, &l->nargs, expr(p), NULL);
            e = l;
        }
        expect_op(p, ")");
        return e;
    }
    if (take_op(p, "[")) {
        jnode *l = node(p, E_LIST);
        while (l && p->rc == QF_OK && !take_op(p, "]")) {
            add(p, &l->args, NULL, &l->nargs, expr(p), NULL);
            if (!is_op(p, "]")) expect_op(p, ",");
        }
        return l;
    }
    if (take_op(p, "{")) {
        jnode *d = node(p, E_DICT);
        while (d && p->rc == QF_OK && !take_op(p, "}")) {
            add(p, &d->args, NULL, &d->nargs, expr(p), NULL);
            expect_op(p, ":");
            add(p, &d->args, NULL, &d->nargs, expr(p), NULL);
            if (!is_op(p, "}")) expect_op(p, ",");
        }
        return d;
    }
    fail(p, k->line, "unexpected '%.*s' in an expression", (int)k->n, k->s);
    return NULL;
}

/* [a], [a:b:c] (any part may be missing) after the '[' */
static jnode *subscript(parser *p, jnode *obj) {
    jnode *parts[3] = {NULL, NULL, NULL};
    int i = 0, slice = 0;
    while (p->rc == QF_OK && !take_op(p, "]")) {
        if (take_op(p, ":")) {
            slice = 1, i++;
            if (i > 2) return fail(p, cur(p)->line, "a slice has at most three parts"), NULL;
            continue;
        }
        parts[i] = expr(p);
    }
    jnode *n = node(p, slice ? E_SLICE : E_ITEM);
    if (n) n->a = obj, n->b = parts[0], n->c = parts[1], n->args = NULL;
    if (n && slice && parts[2]) add(p, &n->args, NULL, &n->nargs, parts[2], NULL);
    return n;
}

static jnode *postfix(parser *p, jnode *n) {
    while (n && p->rc == QF_OK) {
        if (take_op(p, ".")) {
            jnode *a = node(p, E_ATTR);
            if (a) a->a = n, a->name = name_of(p);
            n = a;
        } else if (take_op(p, "[")) {
            n = subscript(p, n);
        } else if (take_op(p, "(")) {
            jnode *c = node(p, E_CALL);
            if (c) c->a = n, call_args(p, c);
            n = c;
        } else {
            break;
        }
    }
    return n;
}

/* |filter(args) and `is [not] test(args)` after a value */
static jnode *filters(parser *p, jnode *n) {
    while (n && p->rc == QF_OK) {
        if (take_op(p, "|")) {
            jnode *f = node(p, E_FILTER);
            if (f) f->a = n, f->name = name_of(p);
            if (f && take_op(p, "(")) call_args(p, f);
            n = f;
        } else if (take_name(p, "is")) {
            jnode *t = node(p, E_TEST);
            if (t) t->a = n, t->neg = take_name(p, "not");
            if (t) t->name = name_of(p);
            if (t && take_op(p, "(")) call_args(p, t);
            else if (t && (cur(p)->t == T_NUM || cur(p)->t == T_STR)) add(p, &t->args, &t->kw, &t->nargs, primary(p), NULL);
            n = t;
        } else {
            break;
        }
    }
    return n;
}

static jnode *unary(parser *p, int with_filter) {
    jnode *n;
    if (take_op(p, "-")) {
        n = node(p, E_NEG);
        if (n) n->a = unary(p, 0);
    } else if (take_op(p, "+")) {
        n = unary(p, 0);
    } else {
        n = postfix(p, primary(p));
    }
    return with_filter ? filters(p, n) : n;
}

static jnode *bin(parser *p, int op, jnode *a, jnode *b) {
    jnode *n = node(p, E_BIN);
    if (n) n->op = op, n->a = a, n->b = b;
    return n;
}

static jnode *math2(parser *p) {
    jnode *n = unary(p, 1);
    for (;;) {
        int op = take_op(p, "//") ? OP_FDIV : take_op(p, "*") ? OP_MUL : take_op(p, "/") ? OP_DIV : take_op(p, "%") ? OP_MOD : -1;
        if (op < 0 || p->rc != QF_OK) return n;
        n = bin(p, op, n, unary(p, 1));
    }
}

static jnode *concat(parser *p) {
    jnode *n = math2(p);
    while (p->rc == QF_OK && take_op(p, "~")) n = bin(p, OP_CAT, n, math2(p));
    return n;
}

static jnode *math1(parser *p) {
    jnode *n = concat(p);
    for (;;) {
        int op = take_op(p, "+") ? OP_ADD : take_op(p, "-") ? OP_SUB : -1;
        if (op < 0 || p->rc != QF_OK) return n;
        n = bin(p, op, n, concat(p));
    }
}

static jnode *compare(parser *p) {
    jnode *n = math1(p);
    for (;;) {
        int op = take_op(p, "==") ? OP_EQ : take_op(p, "!=") ? OP_NE : take_op(p, "<=") ? OP_LE : take_op(p, ">=") ? OP_GE
               : take_op(p, "<") ? OP_LT : take_op(p, ">") ? OP_GT : take_name(p, "in") ? OP_IN : -1;
        if (op < 0 && is_name(p, "not") && p->toks[p->at + 1].t == T_NAME && p->toks[p->at + 1].n == 2 && !strncmp(p->toks[p->at + 1].s, "in", 2))
            p->at += 2, op = OP_NOTIN;
        if (op < 0 || p->rc != QF_OK) return n;
        n = bin(p, op, n, math1(p));
    }
}

static jnode *not_expr(parser *p) {
    if (take_name(p, "not")) {
        jnode *n = node(p, E_NOT);
        if (n) n->a = not_expr(p);
        return n;
    }
    return compare(p);
}

static jnode *and_expr(parser *p) {
    jnode *n = not_expr(p);
    while (p->rc == QF_OK && take_name(p, "and")) {
        jnode *a = node(p, E_AND);
        if (a) a->a = n, a->b = not_expr(p);
        n = a;
    }
    return n;
}

static jnode *or_expr(parser *p) {
    jnode *n = and_expr(p);
    while (p->rc == QF_OK && take_name(p, "or")) {
        jnode *o = node(p, E_OR);
        if (o) o->a = n, o->b = and_expr(p);
        n = o;
    }
    return n;
}

static jnode *expr(parser *p) {
    jnode *n = or_expr(p);
    if (p->rc == QF_OK && take_name(p, "if")) {
        jnode *c = node(p, E_COND);
        if (c) c->b = n, c->a = or_expr(p), c->c = take_name(p, "else") ? expr(p) : NULL;
        n = c;
    }
    return n;
}

/* ---- statements ---- */

static int body(parser *p, jnode ***out, int *n, const char *const *ends);

static void end_tag(parser *p) {
    if (cur(p)->t != T_BEND) fail(p, cur(p)->line, "unexpected '%.*s' in a tag", (int)cur(p)->n, cur(p)->s);
    else p->at++;
}

static jnode *stmt_if(parser *p) {
    jnode *n = node(p, N_IF);
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    if (!n) return NULL;
    n->a = expr(p);
    end_tag(p);
    int e = body(p, &n->body, &n->nbody, ends);
    if (e == 0) { /* elif: an if alone in the else */
        add(p, &n->orelse, NULL, &n->norelse, stmt_if(p), NULL);
        return n;
    }
    if (e == 1) {
        static const char *const endif[] = {"endif", NULL};
        end_tag(p);
        body(p, &n->orelse, &n->norelse, endif);
    }
    end_tag(p);
    return n;
}

static jnode *stmt_for(parser *p) {
    jnode *n = node(p, N_FOR);
    static const char *const ends[] = {"else", "endfor", NULL}, *const endfor[] = {"endfor", NULL};
    if (!n) return NULL;
    do add_name(p, &n->targets, &n->ntargets, name_of(p));
    while (p->rc == QF_OK && take_op(p, ","));
    if (!take_name(p, "in")) return fail(p, cur(p)->line, "expected 'in' in a for"), NULL;
    n->a = or_expr(p);
    if (take_name(p, "if")) n->b = or_expr(p);
    if (take_name(p, "recursive")) return fail(p, n->line, "recursive loops are not supported"), NULL;
    end_tag(p);
    if (body(p, &n->body, &n->nbody, ends) == 0) end_tag(p), body(p, &n->orelse, &n->norelse, endfor);
    end_tag(p);
    return n;
}

static jnode *stmt_set(parser *p) {
    jnode *n = node(p, N_SET);
    if (!n) return NULL;
    n->name = name_of(p);
    if (take_op(p, ".")) n->attr = name_of(p);
    if (is_op(p, ",")) return fail(p, n->line, "set with several targets is not supported"), NULL;
    if (cur(p)->t == T_BEND) { /* {% set x %}...{% endset %} */
        static const char *const ends[] = {"endset", NULL};
        n->type = N_SETBLOCK;
        end_tag(p);
        body(p, &n->body, &n->nbody, ends);
        end_tag(p);
        return n;
    }
    expect_op(p, "=");
    n->a = expr(p);
    end_tag(p);
    return n;
}

static jnode *stmt_macro(parser *p) {
    jnode *n = node(p, N_MACRO);
    static const char *const ends[] = {"endmacro", NULL};
    if (!n) return NULL;
    n->name = name_of(p);
    expect_op(p, "(");
    while (p->rc == QF_OK && !take_op(p, ")")) {
        add_name(p, &n->targets, &n->ntargets, name_of(p));
        add(p, &n->args, NULL, &n->nargs, take_op(p, "=") ? expr(p) : NULL, NULL);
        if (!is_op(p, ")")) expect_op(p, ",");
    }
    end_tag(p);
    body(p, &n->body, &n->nbody, ends);
    end_tag(p);
    return n;
}

/* {% generation %}...{% endgeneration %} (transformers' marker of assistant text): its body */
static jnode *stmt_block(parser *p, const char *end) {
    jnode *n = node(p, N_BLOCK);
    const char *ends[] = {end, NULL};
    if (!n) return NULL;
    end_tag(p);
    body(p, &n->body, &n->nbody, ends);
    end_tag(p);
    return n;
}

static jnode *statement(parser *p) {
    int line = cur(p)->line;
    if (take_name(p, "if")) return stmt_if(p);
    if (take_name(p, "for")) return stmt_for(p);
    if (take_name(p, "set")) return stmt_set(p);
    if (take_name(p, "macro")) return stmt_macro(p);
    if (take_name(p, "generation")) return stmt_block(p, "endgeneration");
    int brk = take_name(p, "break");
    if (brk || take_name(p, "continue")) {
        jnode *n = node(p, brk ? N_BREAK : N_CONTINUE);
        end_tag(p);
        return n;
    }
    fail(p, line, "the statement '%.*s' is not supported", (int)cur(p)->n, cur(p)->s);
    return NULL;
}

/* Nodes up to one of ends (the index of the one met, its tag's name taken) or the end (-1). */
static int body(parser *p, jnode ***out, int *n, const char *const *ends) {
    while (p->rc == QF_OK) {
        tok *k = cur(p);
        if (k->t == T_EOF) {
            int last = 0;
            while (ends && ends[last + 1]) last++;
            if (ends) fail(p, k->line, "'%s' is missing", ends[last]); /* the closing tag: the last of ends */
            return -1;
        }
        if (k->t == T_TEXT) {
            jnode *t = node(p, N_TEXT);
            if (t) t->text = (char *)k->s, t->len = k->n;
            p->at++;
            add(p, out, NULL, n, t, NULL);
        } else if (k->t == T_VBEG) {
            p->at++;
            jnode *o = node(p, N_OUT);
            if (o) o->a = expr(p);
            if (cur(p)->t != T_VEND) fail(p, cur(p)->line, "unexpected '%.*s' in {{ }}", (int)cur(p)->n, cur(p)->s);
            p->at++;
            add(p, out, NULL, n, o, NULL);
        } else if (k->t == T_BBEG) {
            p->at++;
            for (int i = 0; ends && ends[i]; i++)
                if (take_name(p, ends[i])) return i;
            if (cur(p)->t == T_NAME && !strncmp(cur(p)->s, "end", 3)) return fail(p, cur(p)->line, "unexpected '%.*s'", (int)cur(p)->n, cur(p)->s), -1;
            add(p, out, NULL, n, statement(p), NULL);
        } else {
            fail(p, k->line, "unexpected '%.*s'", (int)k->n, k->s);
        }
    }
    return -1;
}

int qf_jinja_parse(const char *text, qf_jinja **out) {
    qf_jinja *t = calloc(1, sizeof *t);
    if (!t) return qf_fail(QF_ENOMEM, "out of memory");
    t->src = strdup(text); /* the caller's buffer may go once this returns */
    const char *src = t->src ? t->src : "";
    t->caplits = 4096 + (int)strlen(src);
    t->lits = calloc((size_t)t->caplits, sizeof *t->lits);
    parser p = {t, src, NULL, 0, 0, 0, t->lits && t->src ? QF_OK : qf_fail(QF_ENOMEM, "out of memory"), {0}};
    if (p.rc == QF_OK) lex(&p, src);
    if (p.rc == QF_OK) body(&p, &t->body, &t->nbody, NULL);
    free(p.toks);
    if (p.rc != QF_OK) {
        qf_jinja_free(t);
        return p.rc;
    }
    *out = t;
    return QF_OK;
}

void qf_jinja_free(qf_jinja *t) {
    if (!t) return;
    for (int i = 0; i < t->nmem; i++) free(t->mem[i]);
    for (int i = 0; i < t->nlits; i++) json_decref(t->lits[i]);
    free(t->mem), free(t->lits), free(t->src), free(t);
}
