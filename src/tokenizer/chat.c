/* Chat templates through the Jinja engine (chat.h). */
#include "tokenizer/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

static json_t *vars_of(const qf_chat_msg *msgs, int n, int add_gen, int enable_thinking) {
    json_t *m = json_array(), *v = json_object();
    for (int i = 0; i < n && m; i++) {
        json_t *x = json_pack("{s:s,s:s}", "role", msgs[i].role, "content", msgs[i].content);
        if (x && msgs[i].reasoning) json_object_set_new(x, "reasoning_content", json_string(msgs[i].reasoning));
        json_array_append_new(m, x);
    }
    json_object_set_new(v, "messages", m);
    json_object_set_new(v, "add_generation_prompt", json_boolean(add_gen));
    json_object_set_new(v, "enable_thinking", json_boolean(enable_thinking));
    json_object_set_new(v, "tools", json_null());
    return v;
}

int qf_chat_render_vars(const qf_chat_tmpl *ct, json_t *vars, char **out) {
    *out = NULL;
    if (!ct->j) return qf_fail(QF_EUNSUPPORTED, "the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
    if (!json_object_get(vars, "bos_token")) json_object_set_new(vars, "bos_token", json_string(ct->bos));
    if (!json_object_get(vars, "eos_token")) json_object_set_new(vars, "eos_token", json_string(ct->eos));
    return qf_jinja_render(ct->j, vars, out);
}

int qf_chat_render(const qf_chat_tmpl *ct, const qf_chat_msg *msgs, int n, int add_gen, int enable_thinking, char **out) {
    *out = NULL;
    if (!ct->j) return qf_fail(QF_EUNSUPPORTED, "the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
    for (int i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content) return qf_fail(QF_EINVAL, "message %d has no role or content", i);
    json_t *v = vars_of(msgs, n, add_gen, enable_thinking);
    int rc = v ? qf_chat_render_vars(ct, v, out) : qf_fail(QF_ENOMEM, "out of memory");
    json_decref(v);
    return rc;
}

int qf_chat_tmpl_parse(qf_chat_tmpl *ct, const char *t) {
    memset(ct, 0, sizeof *ct);
    if (!t) return qf_fail(QF_EUNSUPPORTED, "the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
    int rc = qf_jinja_parse(t, &ct->j);
    if (rc != QF_OK) return rc;
    qf_chat_msg probe = {"user", "hi", NULL};
    char *text = NULL;
    if (qf_chat_render(ct, &probe, 1, 1, 1, &text) == QF_OK) { /* a template may raise on so short a talk: then no think prompt */
        size_t n = strlen(text);
        ct->think_prompt = n >= 8 && !memcmp(text + n - 8, "<think>\n", 8);
    }
    free(text);
    return QF_OK;
}

void qf_chat_tmpl_tokens(qf_chat_tmpl *ct, const char *bos, const char *eos) {
    snprintf(ct->bos, sizeof ct->bos, "%s", bos ? bos : "");
    snprintf(ct->eos, sizeof ct->eos, "%s", eos ? eos : "");
}

void qf_chat_tmpl_free(qf_chat_tmpl *ct) {
    qf_jinja_free(ct->j);
    ct->j = NULL;
}
