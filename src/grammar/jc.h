/* Shared by the JSON-schema and tool-call grammar compilers (blocks.c, regex.c, schema.c,
 * tools.c): the compile state and the building blocks each part uses. */
#ifndef QF_GRAMMAR_JC_H
#define QF_GRAMMAR_JC_H

#include <jansson.h>

#include "grammar/json.h"

#define MAX_UNROLL 1000   /* positions written out for a bounded count (items, characters) */
#define MAX_RULES 200000
#define NUM_DIGITS 15
#define MAX_INDENT 24

typedef struct memo {
    json_t *node;
    int rule;
} memo;

typedef struct jc {
    qf_gbuild *b;
    json_t *root;
    memo *memo;
    int n_memo, cap_memo;
    int ws, any, str, content, cchar, anychar, anyloop, esc, xtext, digit_opt[NUM_DIGITS + 1], failed, unrolled, empty_loops;
    char err[512];
} jc;

int gj_jfail(jc *c, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int gj_newrule(jc *c);
void gj_add_alt(jc *c, int r, qf_gseq *q);
int gj_rule_of(jc *c, qf_gseq *q);
int gj_lit_rule(jc *c, const char *text);
qf_cset gj_cset_range(int lo, int hi);
void gj_cset_del(qf_cset *s, int c);
int gj_digits_opt(jc *c, int k);
int gj_ws_rule(jc *c);
qf_cset gj_plain_bytes(void);
int gj_content_rule(jc *c);
int gj_string_rule(jc *c);
void gj_add_multibyte(jc *c, int r);
int gj_anychar_rule(jc *c);
int gj_cchar_rule(jc *c);
int gj_number_rule(jc *c, int integer, int sign);
int gj_int_range_rule(jc *c, long long lo, long long hi);
int gj_repeat(jc *c, qf_gseq *q, const qf_gseq *frag, int lo, int hi, const char *path);
int gj_pattern_rule(jc *c, const char *pat, const char *path, int quoted);
const char *gj_format_pattern(const char *f);
void gj_subpath(char *out, size_t n, const char *path, const char *key);
int gj_any_container(jc *c, int object, int value);
int gj_any_value(jc *c);
int gj_is_required(json_t *req, const char *key);
json_t *gj_chain_end(jc *c, json_t *node, const char *path);
int gj_compile(jc *c, json_t *node, const char *path);
void gj_init(jc *c, json_t *root);
int gj_finish(jc *c, int root, qf_grammar **out);

#endif
