/* ChatML chat templates (Qwen2/3/3.5/3.6 family) rendered without a Jinja engine.
 *
 * Supported: any sequence of system/user/assistant(/other role) turns rendered as
 * "<|im_start|>ROLE\nCONTENT<|im_end|>\n"; the generation prompt "<|im_start|>assistant\n";
 * enable_thinking=false as "<think>\n\n</think>\n\n" when the template has that switch; a
 * thinking generation prompt ("<think>\n") when the template opens one; Qwen3.5-style reasoning
 * in assistant turns after the last user message when the template reads reasoning_content.
 * Not supported (a clear error): templates that are not ChatML; tools and tool calls. */
#ifndef QF_TOKENIZER_CHAT_H
#define QF_TOKENIZER_CHAT_H

typedef struct qf_chat_msg {
    const char *role;
    const char *content;
    const char *reasoning; /* assistant turns only; may be NULL */
} qf_chat_msg;

typedef struct qf_chat_tmpl {
    int think_prompt;      /* generation prompt opens "<think>\n" */
    int thinking_switch;   /* enable_thinking=false emits an empty think block */
    int reasoning_history; /* assistant turns carry <think>reasoning</think> */
} qf_chat_tmpl;

/* Recognises the template's features; QF_EUNSUPPORTED (with a message) when it is not ChatML. */
int qf_chat_tmpl_parse(qf_chat_tmpl *ct, const char *template_text);
/* Renders into a heap string the caller frees. */
int qf_chat_render(const qf_chat_tmpl *ct, const qf_chat_msg *msgs, int n, int add_generation_prompt,
                   int enable_thinking, char **out);

#endif
