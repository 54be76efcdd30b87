/* Chat templates as the model publishes them (tokenizer_config.json chat_template or
 * chat_template.jinja), rendered by the Jinja engine (tokenizer/jinja.h) with the variables
 * transformers' apply_chat_template gives: messages, add_generation_prompt, enable_thinking,
 * tools (none so far), bos_token / eos_token. */
#ifndef QF_TOKENIZER_CHAT_H
#define QF_TOKENIZER_CHAT_H

#include "tokenizer/jinja.h"

typedef struct qf_chat_msg {
    const char *role;
    const char *content;
    const char *reasoning; /* assistant turns only (reasoning_content); may be NULL */
} qf_chat_msg;

typedef struct qf_chat_tmpl {
    qf_jinja *j;
    int think_prompt; /* the generation prompt opens "<think>\n" (with thinking on) */
    char bos[64], eos[64];
} qf_chat_tmpl;

/* Compiles the template (NULL: the model has none); a construct the engine does not take fails
 * with it and its line named. qf_chat_tmpl_free releases it. */
int qf_chat_tmpl_parse(qf_chat_tmpl *ct, const char *template_text);
void qf_chat_tmpl_free(qf_chat_tmpl *ct);
/* The bos_token / eos_token texts the template sees (tokenizer_config.json's; "" by default). */
void qf_chat_tmpl_tokens(qf_chat_tmpl *ct, const char *bos, const char *eos);
/* Renders vars (messages, tools, add_generation_prompt, the caller's template kwargs; bos_token
 * and eos_token added) into a heap string the caller frees. */
int qf_chat_render_vars(const qf_chat_tmpl *ct, json_t *vars, char **out);
/* Renders into a heap string the caller frees; the template's raise_exception fails with its message. */
int qf_chat_render(const qf_chat_tmpl *ct, const qf_chat_msg *msgs, int n, int add_generation_prompt,
                   int enable_thinking, char **out);

#endif
