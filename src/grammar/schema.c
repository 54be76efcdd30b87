#include "grammar/jc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

/* ---- schemas ---- */


void gj_subpath(char *out, size_t n, const char *path, const char *key) { snprintf(out, n, "%s/%s", path, key); }

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
    if (!text) return gj_jfail(c, path, "a value that cannot be written as JSON");
    int r = gj_lit_rule(c, text);
    free(text);
    return r;
}


/* "[" items "]" with any values, or "{" members "}" with any keys (value: the members' rule). */
int gj_any_container(jc *c, int object, int value) {
    int ws = gj_ws_rule(c), item = gj_newrule(c), loop = gj_newrule(c), body = gj_newrule(c), r = gj_newrule(c);
    qf_gseq q = {0};
    if (object) {
        qf_gseq_ref(&q, gj_string_rule(c));
        qf_gseq_ref(&q, ws);
        qf_gseq_byte(c->b, &q, ':');
        qf_gseq_ref(&q, ws);
    }
    qf_gseq_ref(&q, value);
    gj_add_alt(c, item, &q);
    qf_gseq_ref(&q, ws); /* loop ::= ws "," ws item loop | empty */
    qf_gseq_byte(c->b, &q, ',');
    qf_gseq_ref(&q, ws);
    qf_gseq_ref(&q, item);
    qf_gseq_ref(&q, loop);
    gj_add_alt(c, loop, &q);
    qf_gb_alt(c->b, loop, &q);
    qf_gb_alt(c->b, body, &q); /* body ::= item loop ws | empty */
    qf_gseq_ref(&q, item);
    qf_gseq_ref(&q, loop);
    qf_gseq_ref(&q, ws);
    gj_add_alt(c, body, &q);
    qf_gseq_byte(c->b, &q, object ? '{' : '[');
    qf_gseq_ref(&q, ws);
    qf_gseq_ref(&q, body);
    qf_gseq_byte(c->b, &q, object ? '}' : ']');
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    return r;
}

int gj_any_value(jc *c) {
    if (c->any >= 0) return c->any;
    int r = c->any = gj_newrule(c);
    qf_gseq q = {0};
    int parts[] = {gj_any_container(c, 1, r), gj_any_container(c, 0, r), gj_string_rule(c), gj_number_rule(c, 0, 1),
                   gj_lit_rule(c, "true"), gj_lit_rule(c, "false"), gj_lit_rule(c, "null")};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        qf_gseq_ref(&q, parts[i]);
        gj_add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
    return r;
}

static int get_count(jc *c, json_t *node, const char *key, long long dflt, long long *out, const char *path) {
    json_t *v = json_object_get(node, key);
    *out = dflt;
    if (!v) return 0;
    if (!json_is_integer(v) && !(json_is_real(v) && json_real_value(v) == floor(json_real_value(v))))
        return gj_jfail(c, path, "'%s' must be an integer", key);
    *out = json_is_integer(v) ? json_integer_value(v) : (long long)json_real_value(v);
    if (*out < 0) return gj_jfail(c, path, "'%s' must not be negative", key);
    return 0;
}

/* '"', lo characters, then up to hi - lo more bytes without escapes (a run the masks take at once;
 * as characters are never fewer than bytes, every reply keeps to maxLength), then '"'. */
static int counted_string(jc *c, long long lo, long long hi, const char *path) {
    if (lo > MAX_UNROLL || hi > MAX_UNROLL) return gj_jfail(c, path, "minLength / maxLength over %d are not supported", MAX_UNROLL);
    qf_gseq q = {0}, ch = {0};
    qf_gseq_ref(&ch, gj_cchar_rule(c));
    qf_gseq_byte(c->b, &q, '"');
    gj_repeat(c, &q, &ch, (int)lo, (int)lo, path);
    if (hi < 0) qf_gseq_ref(&q, gj_content_rule(c));
    else {
        qf_gseq plain = {0};
        qf_cset s = gj_plain_bytes();
        qf_gseq_set(c->b, &plain, &s);
        gj_repeat(c, &q, &plain, 0, (int)(hi - lo), path);
        qf_gseq_free(&plain);
    }
    qf_gseq_byte(c->b, &q, '"');
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    qf_gseq_free(&ch);
    return c->failed ? -1 : r;
}

static int type_string(jc *c, json_t *node, const char *path) {
    long long lo, hi;
    if (get_count(c, node, "minLength", 0, &lo, path) < 0 || get_count(c, node, "maxLength", -1, &hi, path) < 0) return -1;
    json_t *pat = json_object_get(node, "pattern"), *fmt = json_object_get(node, "format");
    const char *fp = json_is_string(fmt) ? gj_format_pattern(json_string_value(fmt)) : NULL;
    if (pat && !json_is_string(pat)) return gj_jfail(c, path, "'pattern' must be a string");
    if ((pat || fp) && (lo > 0 || hi >= 0)) return gj_jfail(c, path, "'pattern' or 'format' together with minLength / maxLength is not supported");
    if (pat && fp) return gj_jfail(c, path, "'pattern' together with a 'format' is not supported");
    if (hi >= 0 && hi < lo) return gj_jfail(c, path, "maxLength is below minLength");
    if (pat || fp) return gj_pattern_rule(c, pat ? json_string_value(pat) : fp, path, 1);
    if (lo > 0 || hi >= 0) return counted_string(c, lo, hi, path);
    return gj_string_rule(c);
}

/* An integer bound (minimum, exclusive...) as a whole number; 0 when absent. */
static int int_bound(jc *c, json_t *node, const char *key, long long *out, int integral, const char *path) {
    json_t *v = json_object_get(node, key);
    if (!v) return 0;
    if (!json_is_number(v)) return gj_jfail(c, path, "'%s' must be a number", key);
    double d = json_number_value(v), lim = 1e15 - 1;
    if (d != floor(d)) {
        if (!integral) return gj_jfail(c, path, "a non-integer '%s' on a number is not supported", key);
        d = strstr(key, "inimum") ? ceil(d) : floor(d); /* the integers within a fractional bound */
    }
    int lower = strstr(key, "inimum") != NULL; /* clamping the other side only narrows what is generated */
    if ((lower && d > lim) || (!lower && d < -lim))
        return gj_jfail(c, path, "'%s' %g lies beyond the 15 digits integers are generated with: no value could meet it", key, d);
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
    if (json_object_get(node, "multipleOf")) return gj_jfail(c, path, "'multipleOf' is not supported");
    if (!any) return gj_number_rule(c, integer, 1);
    if (lo > hi) return gj_jfail(c, path, "the bounds leave no %s", integer ? "integer" : "number");
    if (integer) return gj_int_range_rule(c, lo, hi);
    /* numbers: a fraction only where the integer part leaves room for it both ways */
    qf_gseq q = {0};
    int r = gj_newrule(c), whole = gj_int_range_rule(c, lo, hi);
    qf_gseq_ref(&q, whole);
    gj_add_alt(c, r, &q);
    long long flo = (any & 3) ? lo + 1 : lo, fhi = (any & 12) ? hi - 1 : hi;
    if ((any & 3) && lo <= 0 && hi >= 0 && !(any & 2)) flo = 0; /* 0.x >= 0 */
    if (flo <= fhi) {
        qf_cset d = gj_cset_range('0', '9');
        qf_gseq_ref(&q, gj_int_range_rule(c, flo, fhi));
        qf_gseq_byte(c->b, &q, '.');
        qf_gseq_set(c->b, &q, &d);
        qf_gseq_ref(&q, gj_digits_opt(c, NUM_DIGITS - 1));
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

int gj_is_required(json_t *req, const char *key) {
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
    int kr = literal_rule(c, k, path), vr = m->schema ? gj_compile(c, m->schema, sub) : gj_any_value(c);
    json_decref(k);
    if (kr < 0 || vr < 0) return -1;
    qf_gseq q = {0};
    qf_gseq_ref(&q, kr);
    qf_gseq_ref(&q, gj_ws_rule(c));
    qf_gseq_byte(c->b, &q, ':');
    qf_gseq_ref(&q, gj_ws_rule(c));
    qf_gseq_ref(&q, vr);
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

/* The declared members in order, optional ones may be left out, separated by commas. */
static int members_rule(jc *c, const member *m, int n, const char *path) {
    int rest = gj_newrule(c), first = gj_newrule(c); /* after the last member: nothing */
    qf_gseq q = {0};
    qf_gb_alt(c->b, rest, &q);
    qf_gb_alt(c->b, first, &q);
    for (int k = n - 1; k >= 0 && !c->failed; k--) {
        int mr = member_rule(c, &m[k], path);
        if (mr < 0) break;
        int rest_k = gj_newrule(c), first_k = gj_newrule(c);
        qf_gseq_ref(&q, gj_ws_rule(c)); /* rest_k ::= ws "," ws member_k rest_k+1 | rest_k+1 (optional) */
        qf_gseq_byte(c->b, &q, ',');
        qf_gseq_ref(&q, gj_ws_rule(c));
        qf_gseq_ref(&q, mr);
        qf_gseq_ref(&q, rest);
        gj_add_alt(c, rest_k, &q);
        qf_gseq_ref(&q, mr); /* first_k ::= member_k rest_k+1 | first_k+1 (optional) */
        qf_gseq_ref(&q, rest);
        gj_add_alt(c, first_k, &q);
        if (!m[k].required) {
            qf_gseq_ref(&q, rest);
            gj_add_alt(c, rest_k, &q);
            qf_gseq_ref(&q, first);
            gj_add_alt(c, first_k, &q);
        }
        rest = rest_k, first = first_k;
    }
    qf_gseq_free(&q);
    return c->failed ? -1 : first;
}

static int type_object(jc *c, json_t *node, const char *path) {
    json_t *props = json_object_get(node, "properties"), *req = json_object_get(node, "required");
    json_t *add = json_object_get(node, "additionalProperties");
    if (props && !json_is_object(props)) return gj_jfail(c, path, "'properties' must be an object");
    if (req && !json_is_array(req)) return gj_jfail(c, path, "'required' must be an array");
    if (add && !json_is_boolean(add) && !json_is_object(add)) return gj_jfail(c, path, "'additionalProperties' must be a boolean or a schema");
    json_t *extra = add && json_is_object(add) ? add : NULL;
    size_t n_props = props ? json_object_size(props) : 0, n_req = req ? json_array_size(req) : 0;
    if (!n_props && !n_req && !json_is_false(add)) {
        int v = extra ? gj_compile(c, extra, path) : gj_any_value(c);
        return v < 0 ? -1 : gj_any_container(c, 1, v);
    }
    member *m = calloc(n_props + n_req + 1, sizeof *m);
    if (!m) return gj_jfail(c, path, "out of memory");
    int n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(props, key, v) m[n++] = (member){key, v, req && gj_is_required(req, key)};
    for (size_t i = 0; i < n_req; i++) { /* required but not declared: any value (or additionalProperties') */
        json_t *k = json_array_get(req, i);
        if (!json_is_string(k)) {
            free(m);
            return gj_jfail(c, path, "'required' must list strings");
        }
        if (!props || !json_object_get(props, json_string_value(k))) {
            if (json_is_false(add)) { /* no object can hold it */
                free(m);
                return gj_jfail(c, path, "'required' names '%s', which 'additionalProperties': false with no such property forbids", json_string_value(k));
            }
            m[n++] = (member){json_string_value(k), extra, 1};
        }
    }
    int body = members_rule(c, m, n, path);
    free(m);
    if (body < 0) return -1;
    qf_gseq q = {0};
    qf_gseq_byte(c->b, &q, '{');
    qf_gseq_ref(&q, gj_ws_rule(c));
    qf_gseq_ref(&q, body);
    qf_gseq_ref(&q, gj_ws_rule(c));
    qf_gseq_byte(c->b, &q, '}');
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

/* Position i's item, with the separator before it. */
static int item_rule(jc *c, json_t *sch, int i, const char *path) {
    int v = sch ? gj_compile(c, sch, path) : gj_any_value(c);
    if (v < 0) return -1;
    qf_gseq q = {0};
    if (i > 0) {
        qf_gseq_ref(&q, gj_ws_rule(c));
        qf_gseq_byte(c->b, &q, ',');
        qf_gseq_ref(&q, gj_ws_rule(c));
    }
    qf_gseq_ref(&q, v);
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return r;
}

static int type_array(jc *c, json_t *node, const char *path) {
    json_t *items = json_object_get(node, "items"), *pre = json_object_get(node, "prefixItems");
    long long lo, hi;
    if (get_count(c, node, "minItems", 0, &lo, path) < 0 || get_count(c, node, "maxItems", -1, &hi, path) < 0) return -1;
    if (pre && !json_is_array(pre)) return gj_jfail(c, path, "'prefixItems' must be an array");
    if (items && !json_is_object(items) && !json_is_boolean(items)) return gj_jfail(c, path, "'items' must be a schema");
    if (json_object_get(node, "uniqueItems") && json_is_true(json_object_get(node, "uniqueItems"))) return gj_jfail(c, path, "'uniqueItems' is not supported");
    long long np = pre ? (long long)json_array_size(pre) : 0;
    if (json_is_false(items)) hi = hi < 0 || hi > np ? np : hi;
    if (hi >= 0 && hi < lo) return gj_jfail(c, path, "the item counts leave no array");
    long long explicit_n = hi >= 0 ? hi : (lo > np ? lo : np);
    if (explicit_n > MAX_UNROLL || (c->unrolled += (int)explicit_n) > 20 * MAX_UNROLL) return gj_jfail(c, path, "minItems / maxItems / prefixItems over %d are not supported", MAX_UNROLL);
    json_t *each = json_is_object(items) ? items : NULL;
    char sub[512];
    gj_subpath(sub, sizeof sub, path, "items");
    qf_gseq q = {0};
    int next = gj_newrule(c); /* after the written-out positions: more items, or nothing */
    if (hi < 0) {
        int it0 = item_rule(c, each, (int)explicit_n, sub), loop = explicit_n > 0 ? next : gj_newrule(c);
        if (explicit_n == 0) { /* first ::= item loop | empty; loop ::= sep item loop | empty */
            int it = item_rule(c, each, 1, sub);
            qf_gseq_ref(&q, it);
            qf_gseq_ref(&q, loop);
            gj_add_alt(c, loop, &q);
            qf_gb_alt(c->b, loop, &q);
        }
        qf_gseq_ref(&q, it0);
        qf_gseq_ref(&q, loop);
        gj_add_alt(c, next, &q);
        if (explicit_n == 0 || lo <= explicit_n) qf_gb_alt(c->b, next, &q);
    } else qf_gb_alt(c->b, next, &q);
    for (long long i = explicit_n - 1; i >= 0 && !c->failed; i--) {
        json_t *s = i < np ? json_array_get(pre, (size_t)i) : each;
        int node_i = gj_newrule(c), it = item_rule(c, s, (int)i, sub);
        qf_gseq_ref(&q, it);
        qf_gseq_ref(&q, next);
        gj_add_alt(c, node_i, &q);
        if (i >= lo) qf_gb_alt(c->b, node_i, &q);
        next = node_i;
    }
    qf_gseq_byte(c->b, &q, '[');
    qf_gseq_ref(&q, gj_ws_rule(c));
    qf_gseq_ref(&q, next);
    qf_gseq_ref(&q, gj_ws_rule(c));
    qf_gseq_byte(c->b, &q, ']');
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return c->failed ? -1 : r;
}

static int type_rule(jc *c, const char *t, json_t *node, const char *path) {
    if (!strcmp(t, "string")) return type_string(c, node, path);
    if (!strcmp(t, "integer")) return type_number(c, node, 1, path);
    if (!strcmp(t, "number")) return type_number(c, node, 0, path);
    if (!strcmp(t, "boolean")) {
        int r = gj_newrule(c);
        qf_gseq q = {0};
        qf_gseq_ref(&q, gj_lit_rule(c, "true"));
        gj_add_alt(c, r, &q);
        qf_gseq_ref(&q, gj_lit_rule(c, "false"));
        qf_gb_alt(c->b, r, &q);
        qf_gseq_free(&q);
        return r;
    }
    if (!strcmp(t, "null")) return gj_lit_rule(c, "null");
    if (!strcmp(t, "object")) return type_object(c, node, path);
    if (!strcmp(t, "array")) return type_array(c, node, path);
    return gj_jfail(c, path, "unknown type '%s'", t);
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
        if (i == n) return gj_jfail(c, path, "the schema keyword '%s' is not supported", key);
    }
    return 0;
}

static json_t *resolve_ref(jc *c, const char *ref, const char *path) {
    if (ref[0] != '#') return gj_jfail(c, path, "only local $ref (#...) are supported, not '%s'", ref), NULL;
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
    if (!at || *p) return gj_jfail(c, path, "$ref '%s' points at nothing", ref), NULL;
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
    if (json_is_true(node) || (json_is_object(node) && !json_object_size(node))) sub = gj_any_value(c);
    else if (!json_is_object(node)) return gj_jfail(c, path, json_is_false(node) ? "the schema 'false' allows nothing" : "a schema must be an object");
    else if (check_keys(c, node, path) < 0) return -1;
    json_t *v, *t = NULL;
    char sp[512];
    if (sub >= 0) {
    } else if ((v = json_object_get(node, "$ref"))) {
        if (!json_is_string(v)) return gj_jfail(c, path, "'$ref' must be a string");
        json_t *to = resolve_ref(c, json_string_value(v), path);
        sub = to ? gj_compile(c, to, json_string_value(v)) : -1;
    } else if ((v = json_object_get(node, "const"))) {
        sub = literal_rule(c, v, path);
    } else if ((v = json_object_get(node, "enum"))) {
        if (!json_is_array(v) || !json_array_size(v)) return gj_jfail(c, path, "'enum' must be a non-empty array");
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            qf_gseq_ref(&q, literal_rule(c, e, path));
            gj_add_alt(c, r, &q);
        }
    } else if ((v = json_object_get(node, "anyOf")) || (v = json_object_get(node, "oneOf")) || (v = json_object_get(node, "allOf"))) {
        const char *kw = v == json_object_get(node, "anyOf") ? "anyOf" : v == json_object_get(node, "oneOf") ? "oneOf" : "allOf";
        if (!json_is_array(v) || !json_array_size(v)) return gj_jfail(c, path, "'%s' must be a non-empty array", kw);
        if (!strcmp(kw, "allOf") && json_array_size(v) > 1) return gj_jfail(c, path, "'allOf' of more than one schema is not supported");
        size_t i;
        json_t *e;
        int seen[64], n_seen = 0;
        json_array_foreach(v, i, e) {
            char idx[32];
            snprintf(idx, sizeof idx, "%s/%zu", kw, i);
            gj_subpath(sp, sizeof sp, path, idx);
            int a = gj_compile(c, e, sp);
            if (a < 0) break;
            if (same_alt(v, i, a, seen, n_seen)) continue; /* a repeated alternative would double the parses at every level */
            if (n_seen < 64) seen[n_seen++] = a;
            qf_gseq_ref(&q, a);
            gj_add_alt(c, r, &q);
        }
    } else if ((t = json_object_get(node, "type")) && json_is_array(t)) {
        size_t i;
        json_t *e;
        json_array_foreach(t, i, e) {
            if (!json_is_string(e)) return gj_jfail(c, path, "'type' must name types");
            qf_gseq_ref(&q, type_rule(c, json_string_value(e), node, path));
            gj_add_alt(c, r, &q);
        }
    } else if (t) {
        if (!json_is_string(t)) return gj_jfail(c, path, "'type' must be a string or a list");
        sub = type_rule(c, json_string_value(t), node, path);
    } else if (json_object_get(node, "properties") || json_object_get(node, "required") || json_object_get(node, "additionalProperties")) {
        sub = type_object(c, node, path);
    } else if (json_object_get(node, "items") || json_object_get(node, "prefixItems") || json_object_get(node, "minItems") || json_object_get(node, "maxItems")) {
        sub = type_array(c, node, path);
    } else if (json_object_get(node, "pattern") || json_object_get(node, "minLength") || json_object_get(node, "maxLength") || json_object_get(node, "format")) {
        sub = type_string(c, node, path);
    } else sub = gj_any_value(c);
    if (sub >= 0) {
        qf_gseq_ref(&q, sub);
        gj_add_alt(c, r, &q);
    }
    if (json_is_object(node) && json_is_true(json_object_get(node, "nullable"))) {
        qf_gseq_ref(&q, gj_lit_rule(c, "null"));
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
json_t *gj_chain_end(jc *c, json_t *node, const char *path) {
    json_t *chain[64];
    for (int hops = 0; json_is_object(node); hops++) {
        json_t *to = plain_ref(c, node, path);
        if (!to) break;
        chain[hops] = node;
        int cycle = hops == 63;
        for (int k = 0; k <= hops && !cycle; k++) cycle = chain[k] == to;
        if (cycle) return gj_jfail(c, path, "'$ref' '%s' is a cycle of references that never reaches a schema", json_string_value(json_object_get(node, "$ref"))), NULL;
        node = to;
    }
    return c->failed ? NULL : node;
}

int gj_compile(jc *c, json_t *node, const char *path) {
    int r = memo_find(c, node);
    if (r >= 0) return r;
    if (!(node = gj_chain_end(c, node, path))) return -1;
    if ((r = memo_find(c, node)) >= 0) return r;
    r = gj_newrule(c);
    if (r < 0) return -1;
    memo_add(c, node, r);
    return compile_into(c, node, r, path) < 0 ? -1 : r;
}

void gj_init(jc *c, json_t *root) {
    memset(c, 0, sizeof *c);
    c->root = root;
    c->ws = c->any = c->str = c->content = c->cchar = c->anychar = c->anyloop = c->esc = c->xtext = -1;
    for (int i = 0; i <= NUM_DIGITS; i++) c->digit_opt[i] = -1;
    c->b = qf_gb_create();
    if (!c->b) c->failed = 1, snprintf(c->err, sizeof c->err, "out of memory");
}

/* The grammar of start rule root, or the compiler's message. */
int gj_finish(jc *c, int root, qf_grammar **out) {
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
    gj_init(&c, schema);
    int root = -1;
    if (!c.failed) {
        if (schema) root = gj_compile(&c, schema, "");
        else {
            json_t *obj = json_pack("{s:s}", "type", "object");
            root = obj ? gj_compile(&c, obj, "") : -1;
            json_decref(obj);
        }
    }
    if (root >= 0) { /* the value, then nothing but white space */
        qf_gseq q = {0};
        qf_gseq_ref(&q, root);
        qf_gseq_ref(&q, gj_ws_rule(&c));
        root = gj_rule_of(&c, &q);
        qf_gseq_free(&q);
    }
    return gj_finish(&c, root, out);
}
