#include "tokenizer/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

int qf_chat_tmpl_parse(qf_chat_tmpl *ct, const char *t) {
    memset(ct, 0, sizeof *ct);
    if (!t) return qf_fail(QF_EUNSUPPORTED, "the model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)");
    if (!strstr(t, "<|im_start|>") || !strstr(t, "<|im_end|>"))
        return qf_fail(QF_EUNSUPPORTED, "chat template is not ChatML (no <|im_start|>/<|im_end|>); qflash renders ChatML templates only");
    /* string literals inside the Jinja source, with their escapes as written */
    ct->thinking_switch = strstr(t, "enable_thinking") && strstr(t, "<think>\\n\\n</think>\\n\\n");
    ct->think_prompt = strstr(t, "<think>\\n'") || strstr(t, "<think>\\n\"");
    ct->reasoning_history = strstr(t, "reasoning_content") != NULL;
    return QF_OK;
}

typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void put(sbuf *b, const char *s, size_t len) {
    if (b->oom) return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = (b->n + len + 1) * 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = 0;
}

static void puts_(sbuf *b, const char *s) { put(b, s, strlen(s)); }

/* s without leading/trailing newlines (Jinja's strip('\n')) */
static void put_strip_nl(sbuf *b, const char *s) {
    size_t a = 0, e = strlen(s);
    while (a < e && s[a] == '\n') a++;
    while (e > a && s[e - 1] == '\n') e--;
    put(b, s + a, e - a);
}

int qf_chat_render(const qf_chat_tmpl *ct, const qf_chat_msg *msgs, int n, int add_gen, int enable_thinking, char **out) {
    *out = NULL;
    sbuf b = {0};
    int last_user = -1;
    for (int i = 0; i < n; i++) {
        if (!msgs[i].role || !msgs[i].content) return qf_fail(QF_EINVAL, "message %d has no role or content", i);
        if (!strcmp(msgs[i].role, "tool")) return qf_fail(QF_EUNSUPPORTED, "message %d: tool messages are not supported by the built-in template renderer", i);
        if (!strcmp(msgs[i].role, "user")) last_user = i;
    }
    puts_(&b, "");
    for (int i = 0; i < n; i++) {
        const qf_chat_msg *m = &msgs[i];
        puts_(&b, "<|im_start|>");
        puts_(&b, m->role);
        puts_(&b, "\n");
        if (ct->reasoning_history && !strcmp(m->role, "assistant") && i > last_user) {
            puts_(&b, "<think>\n");
            put_strip_nl(&b, m->reasoning ? m->reasoning : "");
            puts_(&b, "\n</think>\n\n");
            const char *c = m->content;
            while (*c == '\n') c++;
            puts_(&b, c);
        } else {
            puts_(&b, m->content);
        }
        puts_(&b, "<|im_end|>\n");
    }
    if (add_gen) {
        puts_(&b, "<|im_start|>assistant\n");
        if (ct->thinking_switch && !enable_thinking) puts_(&b, "<think>\n\n</think>\n\n");
        else if (ct->think_prompt) puts_(&b, "<think>\n");
    }
    if (b.oom) {
        free(b.p);
        return qf_fail(QF_ENOMEM, "out of memory");
    }
    *out = b.p;
    return QF_OK;
}
