#include "server/think.h"

#include <stdlib.h>
#include <string.h>

static void out(think_split *t, int reasoning, const char *p, size_t n, think_emit emit, void *ud) {
    if (!reasoning && t->after_think) {
        while (n && (*p == '\n' || *p == '\r')) p++, n--;
        if (!n) return;
        t->after_think = 0;
    }
    if (!n) return;
    t->seen_text = 1;
    emit(ud, reasoning, p, n);
}

/* Longest suffix of p[0..n) that is a proper prefix of tag. */
static size_t tag_partial(const char *p, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && memcmp(p + n - k, tag, k) == 0) return k;
    return 0;
}

int think_feed(think_split *t, const char *text, size_t n, int final, think_emit emit, void *ud) {
    size_t tot = t->pend_len + n;
    char *buf = malloc(tot + 1);
    if (!buf) return -1;
    memcpy(buf, t->pend, t->pend_len);
    if (n) memcpy(buf + t->pend_len, text, n);
    t->pend_len = 0;
    size_t at = 0;
    for (;;) {
        /* an opening tag only counts before any text */
        const char *tag = t->in_think ? "</think>" : !t->seen_text ? "<think>" : NULL;
        const char *hit = tag ? memmem(buf + at, tot - at, tag, strlen(tag)) : NULL;
        if (hit) {
            out(t, t->in_think, buf + at, (size_t)(hit - (buf + at)), emit, ud);
            at = (size_t)(hit - buf) + strlen(tag);
            t->after_think = t->in_think;
            t->in_think = !t->in_think;
            t->seen_text = 1;
            continue;
        }
        size_t keep = tag && !final ? tag_partial(buf + at, tot - at, tag) : 0;
        out(t, t->in_think, buf + at, tot - at - keep, emit, ud);
        memcpy(t->pend, buf + tot - keep, keep);
        t->pend_len = keep;
        break;
    }
    free(buf);
    return 0;
}
