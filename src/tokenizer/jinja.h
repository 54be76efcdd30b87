/* The Jinja subset that chat templates use, rendered as Python's jinja2 does with the settings of
 * transformers' apply_chat_template (a sandbox with trim_blocks and lstrip_blocks, loop controls,
 * raise_exception and strftime_now, tojson as json.dumps with ensure_ascii off, lists immutable).
 * There is no maintained C Jinja library, so this is ours: small and bounded (output size, loop
 * iterations and call depth are capped).
 *
 * Statements: if/elif/else, for (one or two targets, loop.*, else, break/continue), set (a name,
 * a namespace attribute, or a block), macro (defaults), raw text with {%- -%} whitespace control.
 * Expressions: literals (strings, numbers, true/false/none, lists, dicts), names, .attr and [key],
 * slices, calls, filters, tests, if/else, and/or/not, in / not in, comparisons, + - * / // % ~.
 * Anything else fails to parse with the construct and the line named. */
#ifndef QF_TOKENIZER_JINJA_H
#define QF_TOKENIZER_JINJA_H

#include <jansson.h>

typedef struct qf_jinja qf_jinja;

/* Compiles a template (from a copy: the caller may free src at once); QF_EFORMAT / QF_EUNSUPPORTED with "line N: ..." on what it cannot take. */
int qf_jinja_parse(const char *src, qf_jinja **out);
/* Renders with vars (a JSON object: messages, tools, add_generation_prompt, bos_token, ...) into a
 * heap string the caller frees. raise_exception and runtime errors fail with their message. */
int qf_jinja_render(const qf_jinja *t, json_t *vars, char **out);
void qf_jinja_free(qf_jinja *t);

#endif
