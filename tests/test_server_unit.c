/* Server pieces that need no socket: the reasoning split, the tool-call parser. */
#include <stdio.h>
#include <string.h>

#include "server/think.h"
#include "server/toolcall.h"
#include "test_util.h"

typedef struct acc {
    char r[256], c[256];
} acc;

static void emit(void *ud, int reasoning, const char *p, size_t n) {
    acc *a = ud;
    strncat(reasoning ? a->r : a->c, p, n);
}

/* Feeds the text in pieces of `step` bytes, as tokens arrive. */
static void split(const char *text, int start_inside, size_t step, acc *a) {
    think_split t = {0};
    t.in_think = start_inside;
    memset(a, 0, sizeof *a);
    size_t n = strlen(text);
    for (size_t i = 0; i < n; i += step) think_feed(&t, text + i, n - i < step ? n - i : step, 0, emit, a);
    think_feed(&t, "", 0, 1, emit, a);
}

/* text's tool calls as compact JSON (or "none") and its content */
static void calls_of(const char *text, json_t *tools, char *out, size_t cap, char *content, size_t ccap) {
    json_t *calls;
    size_t clen;
    tc_parse(text, strlen(text), tools, "t", &calls, &clen);
    char *s = calls ? json_dumps(calls, JSON_COMPACT) : NULL;
    snprintf(out, cap, "%s", s ? s : "none");
    snprintf(content, ccap, "%.*s", (int)clen, text);
    free(s), json_decref(calls);
}

/* Recorded Qwen3.6-style outputs: the XML form with values typed by the tool's schema, parallel
 * calls, the JSON form, and malformed ones (all content, never an error); and how much of a
 * streamed text may go out before a call could start. */
static void test_tool_calls(void) {
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\",\"properties\":"
                               "{\"location\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"},\"metric\":{\"type\":\"boolean\"},"
                               "\"opts\":{\"type\":\"object\"}}}}}]", 0, NULL);
    char got[1024], content[256];
    calls_of("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
             "<parameter=metric>\ntrue\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>",
             tools, got, sizeof got, content, sizeof content);
    CHECK(!strcmp(got, "[{\"id\":\"call_t_0\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":"
                       "\"{\\\"location\\\":\\\"Paris\\\",\\\"days\\\":3,\\\"metric\\\":true,\\\"opts\\\":{\\\"a\\\":[1]}}\"}}]") &&
              !strcmp(content, "Let me check."),
          "typed call: %s / [%s]", got, content);
    calls_of("<tool_call>\n<function=get_weather>\n<parameter=location>\nRome\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_weather>\n<parameter=location>\nOslo\n</parameter>\n</function>\n</tool_call>",
             tools, got, sizeof got, content, sizeof content);
    CHECK(strstr(got, "call_t_1") && strstr(got, "\\\"days\\\":\\\"three\\\"") && strstr(got, "Oslo") && !content[0], "parallel calls: %s", got);
    calls_of("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Lima\"}}\n</tool_call>", tools, got, sizeof got, content, sizeof content);
    CHECK(strstr(got, "\"name\":\"get_weather\"") && strstr(got, "Lima"), "JSON form: %s", got);
    calls_of("<tool_call>\n<function=get_weather>\n<parameter=location>\nRome\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_weather>\n<parameter=loc",
             tools, got, sizeof got, content, sizeof content);
    CHECK(strstr(got, "Rome") && !strstr(got, "call_t_1") && !content[0], "a cut last call is dropped, the complete one kept: %s / [%s]", got, content);
    calls_of("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\n<",
             tools, got, sizeof got, content, sizeof content);
    CHECK(strstr(got, "call_t_1") && !content[0], "cut while opening a third call: the two complete ones kept: %s / [%s]", got, content);
    calls_of("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 3}}\n</tool", tools, got, sizeof got, content, sizeof content);
    CHECK(strstr(got, "\\\"days\\\":3") && !content[0], "a call cut inside its closing tag is complete: %s / [%s]", got, content);
    json_t *reft = json_loads("[{\"function\":{\"name\":\"f\",\"parameters\":{\"$ref\":\"#/$defs/p\",\"$defs\":{\"n\":{\"type\":\"integer\"},"
                              "\"p\":{\"type\":\"object\",\"properties\":{\"k\":{\"$ref\":\"#/$defs/n\"}}}}}}}]", 0, NULL);
    calls_of("<tool_call>\n<function=f>\n<parameter=k>\n7\n</parameter>\n</function>\n</tool_call>", reft, got, sizeof got, content, sizeof content);
    CHECK(strstr(got, "{\\\"k\\\":7}"), "a parameter's type through $refs: %s", got);
    json_decref(reft);
    const char *bad[] = {"<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n", "<tool_call>\n{\"name\": 5}\n</tool_call>",
                         "<tool_call>\n<function=f>\n</function>\n</tool_call>\nand then some text", "no calls at all"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        calls_of(bad[i], tools, got, sizeof got, content, sizeof content);
        CHECK(!strcmp(got, "none") && !strcmp(content, bad[i]), "malformed %zu: %s / [%s]", i, got, content);
    }
    CHECK(tc_safe_len("abc<tool", 8) == 3 && tc_safe_len("abc<tool_call>x", 15) == 3 && tc_safe_len("a<b", 3) == 3 && tc_safe_len("a<", 2) == 1 &&
              tc_safe_len("abc", 3) == 3,
          "safe lengths");
    json_decref(tools);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    test_tool_calls();
    acc a;
    for (size_t step = 1; step <= 9; step++) {
        split("Let me think.\n</think>\n\nThe answer is 4.", 1, step, &a);
        CHECK(!strcmp(a.r, "Let me think.\n") && !strcmp(a.c, "The answer is 4."), "prompt-opened think, step %zu: [%s] [%s]", step, a.r, a.c);
        split("<think>hmm</think>\n\nok", 0, step, &a);
        CHECK(!strcmp(a.r, "hmm") && !strcmp(a.c, "ok"), "model-opened think, step %zu: [%s] [%s]", step, a.r, a.c);
        split("plain answer with <think> later", 0, step, &a);
        CHECK(!a.r[0] && !strcmp(a.c, "plain answer with <think> later"), "late tag is text, step %zu: [%s]", step, a.c);
        split("cut off </thi", 1, step, &a);
        CHECK(!strcmp(a.r, "cut off </thi") && !a.c[0], "partial tag at the end is text, step %zu: [%s]", step, a.r);
        split("a < b </think>x </think>", 1, step, &a);
        CHECK(!strcmp(a.r, "a < b ") && !strcmp(a.c, "x </think>"), "only the first close counts, step %zu: [%s] [%s]", step, a.r, a.c);
    }
    return qt_finish();
}
