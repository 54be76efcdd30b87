/* Tool calls in generated text (toolcall.h). */
#include "server/toolcall.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/json.h"

/* s[0..n) found in text[0..len) from `from`, or NULL */
static const char *find(const char *text, size_t len, size_t from, const char *s) {
    size_t k = strlen(s);
    for (size_t i = from; i + k <= len; i++)
        if (!memcmp(text + i, s, k)) return text + i;
    return NULL;
}

static int is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/* The JSON schema type of tool `name`'s parameter `key`, or NULL. */
static const char *param_type(json_t *tools, const char *name, const char *key) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        if (!fn) fn = t;
        if (!json_is_string(json_object_get(fn, "name")) || strcmp(json_string_value(json_object_get(fn, "name")), name)) continue;
        return qf_tool_param_type(json_object_get(fn, "parameters"), key);
    }
    return NULL;
}

/* A parameter's value: a string as written, or the JSON its type asks for when it parses as one. */
static json_t *param_value(const char *v, size_t n, const char *type) {
    if (n && v[0] == '\n') v++, n--; /* the format puts a newline each side */
    if (n && v[n - 1] == '\n') n--;
    if (!type || !strcmp(type, "string")) return json_stringn(v, n);
    json_t *j = json_loadb(v, n, JSON_DECODE_ANY, NULL);
    int ok = j && ((!strcmp(type, "integer") && json_is_integer(j)) || (!strcmp(type, "number") && json_is_number(j)) ||
                   (!strcmp(type, "boolean") && json_is_boolean(j)) || (!strcmp(type, "object") && json_is_object(j)) ||
                   (!strcmp(type, "array") && json_is_array(j)) || (!strcmp(type, "null") && json_is_null(j)));
    if (ok) return j;
    json_decref(j);
    return json_stringn(v, n);
}

/* <function=NAME> ... </function> inside b[0..n): name and arguments (an object), or -1. */
static int parse_xml(const char *b, size_t n, json_t *tools, char *name, size_t name_cap, json_t *args) {
    const char *f = find(b, n, 0, "<function="), *e = f ? memchr(f, '>', n - (size_t)(f - b)) : NULL, *end = find(b, n, 0, "</function>");
    if (!f || !e || !end || e > end) return -1;
    size_t nl = (size_t)(e - f) - 10;
    if (nl == 0 || nl >= name_cap) return -1;
    memcpy(name, f + 10, nl), name[nl] = 0;
    size_t at = (size_t)(e + 1 - b);
    for (;;) {
        const char *p = find(b, (size_t)(end - b), at, "<parameter=");
        if (!p) break;
        const char *pe = memchr(p, '>', (size_t)(end - p)), *close = pe ? find(b, (size_t)(end - b), (size_t)(pe - b), "</parameter>") : NULL;
        if (!pe || !close) return -1;
        char key[256];
        size_t kl = (size_t)(pe - p) - 11;
        if (kl == 0 || kl >= sizeof key) return -1;
        memcpy(key, p + 11, kl), key[kl] = 0;
        json_object_set_new(args, key, param_value(pe + 1, (size_t)(close - pe - 1), param_type(tools, name, key)));
        at = (size_t)(close - b) + 12;
    }
    return 0;
}

/* {"name": ..., "arguments": {...}} inside b[0..n) */
static int parse_json(const char *b, size_t n, char *name, size_t name_cap, json_t **args) {
    json_t *j = json_loadb(b, n, 0, NULL), *nm = json_object_get(j, "name"), *a = json_object_get(j, "arguments");
    int ok = json_is_string(nm) && json_string_length(nm) < name_cap && (!a || json_is_object(a));
    if (ok) snprintf(name, name_cap, "%s", json_string_value(nm)), *args = a ? json_incref(a) : json_object();
    json_decref(j);
    return ok ? 0 : -1;
}

/* One <tool_call> block's body: an OpenAI tool call, or NULL when malformed. */
static json_t *one_call(const char *b, size_t n, json_t *tools, const char *id) {
    while (n && is_ws(*b)) b++, n--;
    while (n && is_ws(b[n - 1])) n--;
    char name[256];
    json_t *args = NULL;
    int rc;
    if (n && b[0] == '{') {
        rc = parse_json(b, n, name, sizeof name, &args); /* sets args only when it parses */
    } else {
        args = json_object();
        rc = parse_xml(b, n, tools, name, sizeof name, args);
    }
    if (rc != 0) return json_decref(args), NULL;
    char *s = json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY);
    json_t *call = s ? json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function", "function", "name", name, "arguments", s) : NULL;
    free(s);
    json_decref(args);
    return call;
}

/* The reply was cut while it opened one more call: a start of "<tool_call>" and nothing else. */
static int is_cut_open(const char *t, size_t n) { return n < strlen(TC_OPEN) && !memcmp(t, TC_OPEN, n); }

void tc_parse(const char *text, size_t n, json_t *tools, const char *id_base, json_t **calls, size_t *content_len) {
    *calls = NULL, *content_len = n;
    const char *first = find(text, n, 0, TC_OPEN);
    if (!first) return;
    json_t *out = json_array();
    size_t at = (size_t)(first - text);
    while (out) {
        const char *open = find(text, n, at, TC_OPEN);
        if (!open) break;
        const char *body = open + strlen(TC_OPEN), *close = find(text, n, (size_t)(body - text), "</tool_call>");
        size_t bl = close ? (size_t)(close - body) : n - (size_t)(body - text); /* the last may be cut at the stop */
        for (size_t k = sizeof "</tool_call>" - 2; !close && k > 0; k--) /* ... even inside its closing tag */
            if (bl >= k && !memcmp(body + bl - k, "</tool_call>", k)) {
                bl -= k;
                break;
            }
        char id[96];
        snprintf(id, sizeof id, "call_%s_%zu", id_base, json_array_size(out));
        json_t *call = one_call(body, bl, tools, id);
        if (!call && !close) break; /* the reply was cut inside its last call: that one is dropped */
        if (!call) return json_decref(out); /* malformed: all of it is content */
        json_array_append_new(out, call);
        at = close ? (size_t)(close - text) + 12 : n;
        while (at < n && is_ws(text[at])) at++;
        if (at < n && !find(text, n, at, TC_OPEN) && !is_cut_open(text + at, n - at))
            return json_decref(out); /* text after the calls: not a tool-call answer */
    }
    if (!json_array_size(out)) return json_decref(out); /* only a cut call: the text stays content */
    size_t c = (size_t)(first - text);
    while (c && is_ws(text[c - 1])) c--;
    *calls = out, *content_len = c;
}

size_t tc_safe_len(const char *text, size_t n) {
    const char *f = find(text, n, 0, TC_OPEN);
    if (f) return (size_t)(f - text);
    size_t k = strlen(TC_OPEN);
    for (size_t keep = k - 1; keep > 0; keep--) /* a tail that is a start of <tool_call> waits */
        if (keep <= n && !memcmp(text + n - keep, TC_OPEN, keep)) return n - keep;
    return n;
}
