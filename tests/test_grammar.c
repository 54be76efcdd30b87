/* Constrained decoding: JSON-schema and tool-call grammars accept exactly what they should, and
 * the token masks equal a brute-force check of every token. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "grammar/json.h"
#include "test_util.h"

static qf_tokenizer *tok;
static qf_vocab_index *vix;
static int vocab;

static qf_grammar *schema_grammar(const char *schema) {
    json_error_t je;
    json_t *s = schema ? json_loads(schema, 0, &je) : NULL;
    qf_grammar *g = NULL;
    int rc = qf_grammar_json(&g, s);
    CHECK(rc == QF_OK, "schema %s: %s", schema ? schema : "(json_object)", qf_last_error());
    json_decref(s);
    return g;
}

/* Whether the whole text is a sentence of g. */
static int accepts(const qf_grammar *g, const char *text) {
    qf_gmatch *m = NULL;
    if (qf_gmatch_create(&m, g, vix, tok, -1) != QF_OK) return -1;
    int ok = qf_gmatch_accept_bytes(m, text, strlen(text)) == QF_OK && qf_gmatch_complete(m);
    qf_gmatch_free(m);
    return ok;
}

static void expect(const char *schema, const char *const *good, const char *const *bad) {
    qf_grammar *g = schema_grammar(schema);
    if (!g) return;
    for (int i = 0; good[i]; i++) CHECK(accepts(g, good[i]) == 1, "%s should accept %s", schema ? schema : "json_object", good[i]);
    for (int i = 0; bad[i]; i++) CHECK(accepts(g, bad[i]) == 0, "%s should refuse %s", schema ? schema : "json_object", bad[i]);
    qf_grammar_free(g);
}

static void test_schemas(void) {
    expect(NULL, (const char *[]){"{}", "{\"a\": [1, 2.5e3, \"x\", null, true, {\"b\": {}}]}", "{\n  \"k\": \"v\\n\\u00e9\"\n}", NULL},
           (const char *[]){"[]", "{\"a\" 1}", "{\"a\": 01}", "{\"a\": tru}", "{\"a\": \"\x01\"}", "{}{}", NULL});
    const char *person = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
                         "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},\"maxItems\":2}},\"required\":[\"name\"]}";
    expect(person, (const char *[]){"{\"name\": \"Al\"}", "{\"name\":\"Al\",\"age\":150}", "{\"name\": \"Al\", \"tags\": [\"a\", \"b\"]}", "{\"name\": \"\", \"age\": 0, \"tags\": []}", NULL},
           (const char *[]){"{}", "{\"age\": 3}", "{\"name\": \"Al\", \"age\": 151}", "{\"name\": \"Al\", \"age\": -1}", "{\"name\": \"Al\", \"tags\": [\"a\", \"b\", \"a\"]}",
                            "{\"name\": \"Al\", \"tags\": [\"c\"]}", "{\"age\": 3, \"name\": \"Al\"}", "{\"name\": \"Al\", \"x\": 1}", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3}$\"}", (const char *[]){"\"AB-123\"", NULL}, (const char *[]){"\"AB-12\"", "\"ab-123\"", "\"AB-1234\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"cat|dog\"}", (const char *[]){"\"a cat!\"", "\"dog\"", NULL}, (const char *[]){"\"cow\"", NULL});
    /* past minLength, maxLength counts bytes without escapes */
    expect("{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", (const char *[]){"\"ab\"", "\"\xc3\xa9\xc3\xa9\"", "\"a\\nb\"", "\"\xc3\xa9\xc3\xa9x\"", NULL},
           (const char *[]){"\"a\"", "\"abcd\"", "\"\xc3\xa9\xc3\xa9\xc3\xa9\"", "\"ab\\n\"", NULL});
    expect("{\"type\":\"string\",\"format\":\"date\"}", (const char *[]){"\"2026-12-04\"", NULL}, (const char *[]){"\"2026-13-04\"", "\"26-12-04\"", NULL});
    expect("{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"null\"}]}", (const char *[]){"12", "null", NULL}, (const char *[]){"1.5", "\"1\"", NULL});
    expect("{\"type\":[\"number\",\"boolean\"],\"minimum\":-2,\"maximum\":3}", (const char *[]){"-2", "2.75", "3", "true", "0.5", NULL},
           (const char *[]){"3.5", "-2.5", "4", NULL});
    expect("{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"next\"]}},"
           "\"$ref\":\"#/$defs/node\"}",
           (const char *[]){"{\"next\": null}", "{\"next\": {\"next\": {\"next\": null}}}", NULL}, (const char *[]){"{}", "{\"next\": {}}", NULL});
    expect("{\"type\":\"array\",\"prefixItems\":[{\"const\":1},{\"type\":\"string\"}],\"items\":false,\"minItems\":1}", (const char *[]){"[1]", "[1, \"x\"]", NULL},
           (const char *[]){"[]", "[2]", "[1, \"x\", 3]", NULL});
    expect("{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}", (const char *[]){"{\"a\": 1, \"b\": 2}", "{}", NULL}, (const char *[]){"{\"a\": \"1\"}", NULL});
    expect("{\"type\":\"string\",\"format\":\"uuid\"}", (const char *[]){"\"123e4567-e89b-12d3-a456-426614174000\"", NULL}, (const char *[]){"\"123e4567\"", NULL});
    /* white space is bounded: a reply cannot run on in blanks */
    expect("{\"type\":\"array\"}", (const char *[]){"[1,\n    2]", "[ ]", NULL}, (const char *[]){"[1,\n\n 2]", "[1,                                  2]", NULL});
}

/* Loops over a body that may be empty, and ambiguous nesting: the same language as the regex, and
 * a long text still matched (parses that meet again share one stack). */
static void test_nested_quantifiers(void) {
    char long_a[420] = "\"";
    memset(long_a + 1, 'a', 400);
    strcpy(long_a + 401, "c\"");
    const char *longs[] = {long_a, NULL};
    expect("{\"type\":\"string\",\"pattern\":\"^(a*)*$\"}", (const char *[]){"\"\"", "\"aaa\"", NULL}, (const char *[]){"\"b\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^((a|b)*)*c$\"}", (const char *[]){"\"c\"", "\"abbac\"", NULL}, (const char *[]){"\"ab\"", "\"cc\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^(a+)+c$\"}", longs, (const char *[]){"\"c\"", "\"aab\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^((a|b)+)*c$\"}", longs, (const char *[]){"\"abca\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^((a?b?)*c?)+d$\"}", (const char *[]){"\"d\"", "\"abcabd\"", "\"ccbd\"", NULL}, (const char *[]){"\"dd\"", "\"e\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^(a?){3,}b$\"}", (const char *[]){"\"b\"", "\"aaaaab\"", NULL}, (const char *[]){"\"ba\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^(()*)*x$\"}", (const char *[]){"\"x\"", NULL}, (const char *[]){"\"\"", "\"xx\"", NULL});
    expect("{\"type\":\"string\",\"pattern\":\"^(a|aa)+b$\"}", (const char *[]){"\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab\"", NULL}, (const char *[]){"\"ab b\"", NULL});
}

static void test_integer_ranges(void) {
    static const long long ranges[][2] = {{-13, 27}, {0, 9}, {5, 105}, {-250, -7}, {99, 1000}, {7, 7}};
    for (size_t k = 0; k < sizeof ranges / sizeof ranges[0]; k++) {
        char schema[128];
        snprintf(schema, sizeof schema, "{\"type\":\"integer\",\"minimum\":%lld,\"maximum\":%lld}", ranges[k][0], ranges[k][1]);
        qf_grammar *g = schema_grammar(schema);
        if (!g) continue;
        int wrong = 0;
        for (long long v = -1200; v <= 1200; v++) {
            char t[32];
            snprintf(t, sizeof t, "%lld", v);
            wrong += accepts(g, t) != (v >= ranges[k][0] && v <= ranges[k][1]);
        }
        CHECK(wrong == 0, "%s: %d integers in -1200..1200 judged wrongly", schema, wrong);
        CHECK(accepts(g, "007") == 0 || ranges[k][0] > 7, "leading zeros refused");
        qf_grammar_free(g);
    }
}

static void test_refused(void) {
    static const char *const cases[][2] = {
        {"{\"type\":\"object\",\"not\":{}}", "'not'"},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)b\"}", "lookaround"},
        {"{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "\\1"},
        {"{\"type\":\"number\",\"minimum\":0.5}", "non-integer 'minimum'"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems"},
        {"{\"$ref\":\"#/$defs/missing\"}", "points at nothing"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"strang\"}}}", "/a"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *s = json_loads(cases[i][0], 0, NULL);
        qf_grammar *g = NULL;
        int rc = qf_grammar_json(&g, s);
        CHECK(rc == QF_EINVAL && strstr(qf_last_error(), cases[i][1]), "%s: rc %d, '%s' should name %s", cases[i][0], rc, qf_last_error(), cases[i][1]);
        qf_grammar_free(g);
        json_decref(s);
    }
}

/* The mask at each prefix of text equals the tokens try_bytes accepts one by one (specials: the
 * grammar allows <tool_call> and </tool_call> as tokens). */
static void check_masks(const qf_grammar *g, const char *text, const char *what, int specials) {
    qf_gmatch *m = NULL;
    if (qf_gmatch_create(&m, g, vix, tok, -1) != QF_OK) return;
    float *lg = malloc((size_t)vocab * sizeof(float));
    size_t n = strlen(text);
    int diffs = 0, total = 0;
    for (size_t at = 0; at <= n && lg; at += 1 + at % 3) {
        for (int i = 0; i < vocab; i++) lg[i] = 0;
        int count = qf_gmatch_mask(m, lg);
        int brute = 0;
        for (int id = 0; id < vocab; id++) {
            size_t len = 0;
            const char *p = qf_tok_piece(tok, id, &len);
            int ok;
            if (id == 4000 || id == 4002) ok = qf_gmatch_complete(m);
            else if (qf_tok_is_special(tok, id)) ok = specials && (id == 4005 || id == 4006) && qf_gmatch_try_bytes(m, p, len);
            else ok = p && len && qf_gmatch_try_bytes(m, p, len);
            brute += ok;
            diffs += ok != (lg[id] == 0);
        }
        total += brute;
        CHECK(count == brute, "%s at %zu: the mask counts %d tokens, brute force %d", what, at, count, brute);
        size_t step = at + 1 + at % 3 <= n ? 1 + at % 3 : n - at;
        if (step && qf_gmatch_accept_bytes(m, text + at, step) != QF_OK) {
            CHECK(0, "%s: the text itself refused at %zu", what, at);
            break;
        }
        if (!step) break;
    }
    CHECK(diffs == 0 && total > 0, "%s: %d tokens masked differently from brute force", what, diffs);
    free(lg);
    qf_gmatch_free(m);
}

static void test_masks(void) {
    qf_grammar *g = schema_grammar(NULL);
    if (g) check_masks(g, "{\"code\": \"def f(x):\\n    return x\", \"n\": [1, -2.5e3, true], \"s\": \"\xc3\xa9t\xc3\xa9\"}", "json_object", 0);
    qf_grammar_free(g);
    g = schema_grammar("{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"pattern\":\"^[a-f0-9]{4,8}$\"},\"n\":{\"type\":\"integer\",\"minimum\":10,\"maximum\":999}},\"required\":[\"id\",\"n\"]}");
    if (g) check_masks(g, "{\"id\": \"beef01\", \"n\": 512}", "pattern and range", 0);
    qf_grammar_free(g);
    g = schema_grammar("{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":24},\"t\":{\"type\":\"string\",\"maxLength\":3}},\"required\":[\"s\",\"t\"]}");
    if (g) check_masks(g, "{\"s\": \"a bounded string, 24 b\", \"t\": \"abc\"}", "counted strings", 0);
    qf_grammar_free(g);
}

static void test_tools(void) {
    const char *tools_json = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\",\"properties\":"
                             "{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"}},\"required\":[\"city\"]}}},"
                             "{\"type\":\"function\",\"function\":{\"name\":\"now\",\"parameters\":{\"type\":\"object\",\"properties\":{}}}}]";
    json_t *tools = json_loads(tools_json, 0, NULL);
    qf_grammar *g = NULL;
    CHECK(qf_grammar_tools(&g, tools, NULL, QF_TOOLS_XML, 1) == QF_OK, "%s", qf_last_error());
    const char *one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <3\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    char two[512];
    snprintf(two, sizeof two, "%s\n<tool_call>\n<function=now>\n</function>\n</tool_call>", one);
    if (g) {
        CHECK(accepts(g, one) == 1, "one XML call");
        CHECK(accepts(g, two) == 1, "two parallel XML calls");
        CHECK(accepts(g, "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>") == 0, "a required parameter left out");
        CHECK(accepts(g, "<tool_call>\n<function=nope>\n</function>\n</tool_call>") == 0, "an unknown function");
        CHECK(accepts(g, "Sure! <tool_call>") == 0, "text before the call");
        check_masks(g, one, "XML tool call", 1);
    }
    qf_grammar_free(g);
    CHECK(qf_grammar_tools(&g, tools, "now", QF_TOOLS_JSON, 0) == QF_OK, "%s", qf_last_error());
    if (g) {
        CHECK(accepts(g, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>") == 1, "a JSON call");
        CHECK(accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}\n</tool_call>") == 0, "another function than the named one");
        CHECK(accepts(g, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>") == 0,
              "two calls when parallel calls are off");
    }
    qf_grammar_free(g);
    CHECK(qf_grammar_tools(&g, tools, "missing", QF_TOOLS_XML, 1) == QF_EINVAL && strstr(qf_last_error(), "missing"), "an unknown named tool: %s", qf_last_error());
    json_decref(tools);
}

/* Generation stays inside the grammar: the reasoning block first is free, then only JSON. */
static void test_free_until(void) {
    qf_grammar *g = schema_grammar("{\"type\":\"boolean\"}");
    qf_gmatch *m = NULL;
    if (!g || qf_gmatch_create(&m, g, vix, tok, 4004) != QF_OK) return;
    float *lg = calloc((size_t)vocab, sizeof(float));
    CHECK(qf_gmatch_mask(m, lg) == vocab, "everything allowed inside the reasoning block");
    CHECK(qf_gmatch_accept(m, 4004) == QF_OK && !qf_gmatch_complete(m), "the block ends");
    int n = qf_gmatch_mask(m, lg), t = qf_tok_lookup(tok, "t");
    CHECK(n > 0 && n < 10 && t >= 0 && lg[t] == 0 && lg[qf_tok_lookup(tok, "{")] < 0, "then only the start of true / false (%d tokens)", n);
    free(lg);
    qf_gmatch_free(m);
    qf_grammar_free(g);
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    if (qf_tok_load(&tok, qt_path("models/qwen36moe-code-14m")) != QF_OK) {
        fprintf(stderr, "tokenizer: %s\n", qf_last_error());
        return 1;
    }
    vocab = qf_tok_vocab_size(tok);
    int32_t eos[2] = {4000, 4002};
    if (qf_vocab_index_create(&vix, tok, vocab, eos, 2) != QF_OK) return 1;
    test_schemas();
    test_nested_quantifiers();
    test_integer_ranges();
    test_refused();
    test_masks();
    test_tools();
    test_free_until();
    qf_vocab_index_free(vix);
    qf_tok_free(tok);
    return qt_finish();
}
