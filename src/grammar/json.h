/* Grammars for structured output: JSON from a JSON schema, and tool calls in the forms the Qwen
 * templates teach.
 *
 * Supported schema keywords: type (one or a list), enum, const, anyOf / oneOf (as alternatives),
 * allOf of one schema, $ref within the document (#, #/$defs/..., #/definitions/..., recursion
 * allowed), properties / required / additionalProperties (declared properties come in their
 * order, optional ones may be left out; extra properties are generated only for an object with no
 * declared properties), items, prefixItems, minItems / maxItems, minLength / maxLength (past
 * minLength characters, maxLength counts bytes and takes no escapes: a subset that always
 * validates, and one the masks take fast), pattern
 * (a regular-expression subset: literals, escapes \d \w \s \D \W \S, classes, ., groups,
 * alternation, * + ? {n} {n,} {n,m}, ^ and $), format date / time / date-time / uuid / ipv4 /
 * email, integer minimum / maximum / exclusiveMinimum / exclusiveMaximum, and number bounds that
 * are integers. Annotations (title, description, default, examples, $schema, $id, $comment,
 * deprecated, readOnly, writeOnly) are ignored; any other keyword is refused, naming it and
 * where it is (a JSON pointer). Numbers have at most 15 integer and 15 fraction digits; white
 * space between tokens is at most a newline and 24 spaces, so a reply cannot run on in blanks. */
#ifndef QF_GRAMMAR_JSON_H
#define QF_GRAMMAR_JSON_H

#include <jansson.h>

#include "grammar/grammar.h"

/* schema NULL: any JSON object (response_format json_object). QF_EINVAL names what is refused. */
int qf_grammar_json(qf_grammar **out, json_t *schema);

enum { QF_TOOLS_XML, QF_TOOLS_JSON };

/* A forced reply's parallel calls are bounded, so that a model that would call tools without end
 * still ends (every call complete) within a few calls: at most QF_TOOL_CALLS_PER_TOOL calls per
 * tool the grammar allows, and never more than QF_TOOL_CALLS_MOST; past them only the end. */
#define QF_TOOL_CALLS_PER_TOOL 4
#define QF_TOOL_CALLS_MOST 64
int qf_tool_calls_max(int n_tools);

/* One or more tool calls (parallel: up to qf_tool_calls_max of the tools allowed), nothing else: tools is the request's
 * array ({type: function, function: {name, parameters}}), name restricts to one function
 * (NULL: any). XML: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
 * </function>\n</tool_call>, a string value as raw text without "</" or "<t" (so no tag closes
 * or opens inside it); JSON:
 * <tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>. */
int qf_grammar_tools(qf_grammar **out, json_t *tools, const char *name, int form, int parallel);
/* The JSON type an XML call's parameter `key` carries (through plain $refs), as the grammar
 * above writes it; NULL: raw text (a string, or no type given). */
const char *qf_tool_param_type(json_t *params, const char *key);

#endif
