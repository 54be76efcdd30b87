/* The model's tool calls, parsed out of its text: the Qwen3-Coder XML form Qwen3.6 emits
 * (<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>, each value
 * converted to the type its tool's JSON schema gives the parameter) and the JSON-in-<tool_call>
 * form of earlier Qwen models ({"name": ..., "arguments": {...}}). */
#ifndef QF_SERVER_TOOLCALL_H
#define QF_SERVER_TOOLCALL_H

#include <jansson.h>
#include <stddef.h>

#define TC_OPEN "<tool_call>"

/* text[0..n): the content before the first <tool_call> (*content_len bytes, trailing whitespace
 * dropped) and, in *calls, OpenAI tool_calls ([{id, type, function: {name, arguments (a JSON
 * string)}}], ids "call_<id_base>_<i>"). A last block the reply ended inside (no </tool_call>, and not parseable) is
 * dropped: the calls before it stay, the content stops before the first block (with no call
 * before it, the whole text is content). Any other
 * malformed block: no calls (*calls NULL), the whole text is content. tools: the request's (for the parameters' types; may be NULL). */
void tc_parse(const char *text, size_t n, json_t *tools, const char *id_base, json_t **calls, size_t *content_len);

/* Where streamed content must stop being sent: the first <tool_call>, or a tail of text that may
 * be the start of one. */
size_t tc_safe_len(const char *text, size_t n);

#endif
