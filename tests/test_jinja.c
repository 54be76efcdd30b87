/* The chat-template engine (tokenizer/jinja.h) on the corpus of real published templates
 * (tests/data/templates: each template x each conversation, against what Python's jinja2 renders
 * with transformers' settings): byte-identical output where jinja2 renders, a failure where it
 * raises. Every template must parse and match on every case. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mapfile.h"
#include "base/err.h"
#include "test_util.h"
#include "tokenizer/jinja.h"

int qf_jinja_render_at(const qf_jinja *t, json_t *vars, long long now, char **out);

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) free(s), s = NULL;
    if (s) s[n] = 0;
    fclose(f);
    return s;
}

static const char *const cases[] = {"multi_turn", "multi_turn_nogen", "reasoning_history", "reasoning_history_preserve", "reasoning_history_thinking_off",
                                    "sys_user", "sys_user_nogen", "thinking_off_gen", "tools_dict_args", "tools_dict_args_content_none",
                                    "tools_only_gen", "tools_str_args", "tools_str_args_null_content"};

/* One template on every case: the cases that match (out of those with an expectation). */
static int run_template(const char *root, const char *name, json_t *tokens, int *total) {
    char path[4096];
    snprintf(path, sizeof path, "%s/templates/%s.jinja", root, name);
    char *src = slurp(path);
    qf_jinja *t = NULL;
    int rc = src ? qf_jinja_parse(src, &t) : QF_EIO, ok = 0;
    CHECK(rc == QF_OK, "%s: %s", name, qf_last_error());
    for (size_t c = 0; rc == QF_OK && c < sizeof cases / sizeof *cases; c++) {
        snprintf(path, sizeof path, "%s/cases/%s.json", root, cases[c]);
        json_t *cs = json_load_file(path, 0, NULL), *ctx = json_deep_copy(json_object_get(cs, "template_context"));
        json_t *tk = json_object_get(tokens, name);
        const char *k;
        json_t *v;
        json_object_foreach(tk, k, v) json_object_set(ctx, k, v);
        snprintf(path, sizeof path, "%s/expected/%s__%s.txt", root, name, cases[c]);
        char *want = slurp(path), *got = NULL;
        int r = qf_jinja_render_at(t, ctx, 1721952000LL, &got); /* 2024-07-26, as the expectations */
        (*total)++;
        if (want) ok += r == QF_OK && !strcmp(got, want);
        else ok += r != QF_OK; /* jinja2 raised */
        if (getenv("QT_VERBOSE") && (want ? r != QF_OK || strcmp(got, want) : r == QF_OK))
            fprintf(stderr, "  %s / %s: %s\n", name, cases[c], r != QF_OK ? qf_last_error() : "output differs");
        if (getenv("QT_DUMP") && r == QF_OK && want && strcmp(got, want)) {
            snprintf(path, sizeof path, "/tmp/jinja-%s__%s.txt", name, cases[c]);
            FILE *f = fopen(path, "w");
            if (f) fputs(got, f), fclose(f);
        }
        free(want), free(got), json_decref(ctx), json_decref(cs);
    }
    qf_jinja_free(t);
    free(src);
    return ok;
}

/* src rendered with no variables: want (NULL: a failure whose message holds err) */
static void expect(const char *src, const char *want, const char *err) {
    qf_jinja *t = NULL;
    char *got = NULL;
    int rc = qf_jinja_parse(src, &t);
    json_t *vars = json_object();
    if (rc == QF_OK) rc = qf_jinja_render_at(t, vars, 0, &got);
    if (want) CHECK(rc == QF_OK && !strcmp(got, want), "%s -> [%s], want [%s] (%s)", src, got ? got : "", want, rc ? qf_last_error() : "");
    else CHECK(rc != QF_OK && strstr(qf_last_error(), err), "%s: wanted a failure with '%s', got %s", src, err, rc ? qf_last_error() : got);
    free(got), qf_jinja_free(t), json_decref(vars);
}

/* Templates over two messages, with the output jinja2 3.1 gives them (ImmutableSandboxedEnvironment,
 * trim_blocks, lstrip_blocks, loopcontrols). */
static void test_against_jinja2(void) {
    static const char *const pairs[][2] = {
        {"a\n  {% if true %}\n  b\n  {% endif %}\nc", "a\n  b\nc"},
        {"{{ 'a' if false }}|{{ none }}|{{ [] }}|{{ {} }}", "|None|[]|{}"},
        {"  {{- ' x ' -}}  \n y", " x y"},
        {"{# comment #}\n  {%- for i in range(2) -%}\n {{ i }} \n{%- endfor %}", "01"},
        {"{{ 'Hello World'.split() }}{{ 'a-b-c'.split('-', 1) }}", "['Hello', 'World']['a', 'b-c']"},
        {"{% for m in messages if m.role == 'assistant' %}{{ loop.length }}{{ m.content }}{% else %}none{% endfor %}", "1yo"},
        {"{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}", "[' hi ']"},
        {"{{ (messages|first).content|trim|tojson }}{{ messages[0]['content'] ~ 1 ~ none }}", "\"hi\" hi 1None"},
        /* undefined values as jinja2's Undefined treats them */
        {"{{ 'x' in nothing }}|{{ 'x' not in nothing }}|{{ nothing|default('d') }}|{{ nothing is defined }}", "False|True|d|False"},
        {"{% for m in nothing %}a{% else %}e{% endfor %}|{{ nothing|length }}|{{ nothing == none }}|{{ not nothing }}|{{ nothing|string }}|{% if nothing %}t{% else %}f{% endif %}",
         "e|0|False|True||f"},
        {"{{ (messages[0].get('x')) }}|{{ messages[0].get('x', 'd') }}", "None|d"},
    };
    json_t *vars = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \" hi \"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}", 0, NULL);
    for (size_t i = 0; i < sizeof pairs / sizeof *pairs; i++) {
        qf_jinja *t = NULL;
        char *got = NULL;
        int rc = qf_jinja_parse(pairs[i][0], &t);
        if (rc == QF_OK) rc = qf_jinja_render_at(t, vars, 0, &got);
        CHECK(rc == QF_OK && !strcmp(got, pairs[i][1]), "%s -> [%s], jinja2 [%s]", pairs[i][0], got ? got : qf_last_error(), pairs[i][1]);
        free(got), qf_jinja_free(t);
    }
    json_decref(vars);
}

/* Python's semantics where templates see them, and the limits on hostile templates. */
static void test_semantics(void) {
    expect("{{ 7 // -2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 * 3 }} {{ 'ab' * 2 }}", "-4 2 3.5 6 abab", NULL);
    expect("{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.0 }} {{ 1.5e-7 }} {{ 123456789.0 }}", "0.30000000000000004 1e+20 1.0 1.5e-07 123456789.0", NULL);
    expect("{{ [1, 'a', none, true, \"it's\"] }} {{ {'k': [1]} }}", "[1, 'a', None, True, \"it's\"] {'k': [1]}", NULL);
    expect("{{ {'a': 1, 'b': 'é\\n'}|tojson }} {{ [1, 2]|tojson(indent=2) }}", "{\"a\": 1, \"b\": \"é\\n\"} [\n  1,\n  2\n]", NULL);
    expect("{{ 'hello'[::-1] }} {{ [1,2,3,4][1:3] }} {{ 'a,b,,c'.split(',') }} {{ '  x '.strip() }}|", "olleh [2, 3] ['a', 'b', '', 'c'] x|", NULL);
    expect("{% for k, v in {'x': 1, 'y': 2}|items %}{{ loop.index }}{{ k }}={{ v }}{% if not loop.last %},{% endif %}{% endfor %}", "1x=1,2y=2", NULL);
    expect("{% set ns = namespace(n=0) %}{% for i in range(5) if i is odd %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", "4", NULL);
    expect("  {%- if true %}\n  a\n  {%- endif %}\n{% if false %}x{% else %}b{% endif %}\n", "  ab", NULL);
    expect("{{ undefined_thing }}|{{ undefined_thing is defined }}|{{ none is none }}", "|False|True", NULL);
    /* the globals transformers gives are defined, as a template may ask before calling one */
    expect("{{ strftime_now is defined }}|{{ raise_exception is undefined }}|{{ namespace is defined }}", "True|False|True", NULL);
    expect("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", NULL, "nest deeper");
    expect("{% for i in range(3000000) %}{% endfor %}", NULL, "range of");
    expect("{{ 'x' * 100000000 }}", NULL, "MiB");
    expect("{{ x.y }}", NULL, "undefined");
    expect("{% for message in [{'content': 'a'}, {'role': 'tool'}] %}{{ message.content + '!' }}{% endfor %}", NULL, "");
    expect("{% set messages = [{'content': 'a'}, {'role': 'tool'}] %}{% for message in messages %}{{ message['content'] + '!' }}{% endfor %}", NULL,
           "arithmetic on an undefined value: message['content'] (at messages[1])");
    expect("{{ 1 | nosuchfilter }}", NULL, "line 1: the filter 'nosuchfilter' is not supported");
    expect("a\n{{ 1 + }}", NULL, "line 2");
    expect("{% if true %}never closed", NULL, "'endif' is missing");
    expect("{{ [1].append(2) }}", NULL, "immutable");
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    test_semantics();
    test_against_jinja2();
    char root[1024], path[1200];
    snprintf(root, sizeof root, "%s", qt_path("tests/data/templates"));
    snprintf(path, sizeof path, "%s/templates/TOKENS.json", root);
    json_t *tokens = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/templates", root);
    DIR *d = opendir(path);
    CHECK(d && tokens, "the template corpus at %s", root);
    int all_ok = 0, all = 0, n_tmpl = 0;
    for (struct dirent *de; d && (de = readdir(d));) {
        size_t len = strlen(de->d_name);
        if (len < 7 || strcmp(de->d_name + len - 6, ".jinja")) continue;
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(len - 6), de->d_name);
        int total = 0, ok = run_template(root, name, tokens, &total);
        all_ok += ok, all += total, n_tmpl++;
        fprintf(stderr, "%-50s %2d / %d\n", name, ok, total);
        if (!strncmp(name, "Qwen-", 5)) CHECK(ok == total, "%s: %d of %d cases as jinja2", name, ok, total);
    }
    if (d) closedir(d);
    fprintf(stderr, "%d templates: %d of %d renders as jinja2\n", n_tmpl, all_ok, all);
    CHECK(n_tmpl >= 33 && all_ok == all, "%d of %d renders differ from jinja2's", all - all_ok, all);
    json_decref(tokens);
    return qt_finish();
}
