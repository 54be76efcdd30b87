#include "grammar/jc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

/* ---- tool calls ---- */

/* Free raw text: text ::= [^<] text | "<" [^/<t] text | empty (no tag closes or opens in it). */
static int xml_text(jc *c) {
    if (c->xtext >= 0) return c->xtext;
    int r = c->xtext = gj_newrule(c);
    qf_gseq q = {0};
    qf_cset s = gj_cset_range(0x01, 0xff);
    gj_cset_del(&s, '<');
    qf_gseq_set(c->b, &q, &s);
    qf_gseq_ref(&q, r);
    gj_add_alt(c, r, &q);
    gj_cset_del(&s, '/');
    gj_cset_del(&s, 't');
    qf_gseq_byte(c->b, &q, '<');
    qf_gseq_set(c->b, &q, &s);
    qf_gseq_ref(&q, r);
    gj_add_alt(c, r, &q);
    qf_gb_alt(c->b, r, &q);
    qf_gseq_free(&q);
    return r;
}

/* A parameter's value in the XML form, as the parser reads it back: JSON for a parameter whose
 * type is given and is not "string"; else raw text (an enum's or const's values as written, a
 * pattern's text unquoted). */
static int xml_value(jc *c, json_t *sch, const char *path) {
    if (!(sch = gj_chain_end(c, sch, path))) return -1;
    json_t *t = json_is_object(sch) ? json_object_get(sch, "type") : NULL;
    if (json_is_string(t) && strcmp(json_string_value(t), "string")) return gj_compile(c, sch, path);
    json_t *en = json_is_object(sch) ? json_object_get(sch, "enum") : NULL, *cn = json_is_object(sch) ? json_object_get(sch, "const") : NULL;
    json_t *pat = json_is_object(sch) ? json_object_get(sch, "pattern") : NULL, *fmt = json_is_object(sch) ? json_object_get(sch, "format") : NULL;
    const char *fp = json_is_string(fmt) ? gj_format_pattern(json_string_value(fmt)) : NULL;
    if (json_is_string(pat) || fp) return gj_pattern_rule(c, json_is_string(pat) ? json_string_value(pat) : fp, path, 0);
    if (!json_is_array(en) && !cn) return xml_text(c);
    int r = gj_newrule(c);
    qf_gseq q = {0};
    size_t n = cn ? 1 : json_array_size(en);
    for (size_t i = 0; i < n; i++) {
        json_t *v = cn ? cn : json_array_get(en, i);
        char *text = json_is_string(v) ? strdup(json_string_value(v)) : json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (text) qf_gseq_lit(c->b, &q, text);
        free(text);
        gj_add_alt(c, r, &q);
    }
    qf_gseq_free(&q);
    return r;
}

static int xml_params(jc *c, json_t *params, const char *path) {
    if (params && !(params = gj_chain_end(c, params, path))) return -1;
    json_t *props = json_is_object(params) ? json_object_get(params, "properties") : NULL, *req = json_is_object(params) ? json_object_get(params, "required") : NULL;
    qf_gseq q = {0};
    int next = gj_newrule(c);
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
        gj_subpath(sub, sizeof sub, path, keys[i]);
        int val = xml_value(c, schs[i], sub), r = gj_newrule(c);
        snprintf(open, sizeof open, "<parameter=%s>\n", keys[i]);
        qf_gseq_lit(c->b, &q, open);
        qf_gseq_ref(&q, val);
        qf_gseq_lit(c->b, &q, "\n</parameter>\n");
        qf_gseq_ref(&q, next);
        gj_add_alt(c, r, &q);
        if (!json_is_array(req) || !gj_is_required(req, keys[i])) {
            qf_gseq_ref(&q, next);
            gj_add_alt(c, r, &q);
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
    if (!name) return gj_jfail(c, path, "a tool has no function name");
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
        int args = params ? gj_compile(c, params, path) : gj_any_container(c, 1, gj_any_value(c));
        qf_gseq_lit(c->b, &q, head);
        qf_gseq_ref(&q, args);
        qf_gseq_lit(c->b, &q, "}\n</tool_call>");
    }
    int r = gj_rule_of(c, &q);
    qf_gseq_free(&q);
    return c->failed ? -1 : r;
}

const char *qf_tool_param_type(json_t *params, const char *key) {
    jc c;
    memset(&c, 0, sizeof c); /* no builder: only references are followed */
    c.root = params;
    json_t *ps = gj_chain_end(&c, params, "");
    json_t *sch = gj_chain_end(&c, json_object_get(json_object_get(ps, "properties"), key), "");
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
    gj_init(&c, NULL);
    qf_gbuild *b = c.b;
    int call = c.failed ? -1 : gj_newrule(&c), found = 0;
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
        gj_add_alt(&c, call, &q);
        found++;
    }
    int root = -1;
    if (!found && !c.failed) gj_jfail(&c, "tools", name ? "no tool is named '%s'" : "no tools%s", name ? name : "");
    else if (!c.failed) {
        /* the calls after the first, unrolled so that the count is bounded: more_k ::= empty |
         * "\n" call more_(k+1), and the last allows only the end */
        int most = parallel ? qf_tool_calls_max(found) : 1, more = gj_newrule(&c);
        qf_gb_alt(b, more, &q);
        for (int k = most - 1; k > 0 && !c.failed; k--) {
            int prev = more;
            more = gj_newrule(&c);
            qf_gb_alt(b, more, &q);
            qf_gseq_byte(b, &q, '\n');
            qf_gseq_ref(&q, call);
            qf_gseq_ref(&q, prev);
            gj_add_alt(&c, more, &q);
        }
        qf_gseq_ref(&q, call);
        qf_gseq_ref(&q, more);
        root = gj_rule_of(&c, &q);
        qf_gb_special(b, "<tool_call>");
        qf_gb_special(b, "</tool_call>");
    }
    qf_gseq_free(&q);
    return gj_finish(&c, root, out);
}
