/* Splits generated text into reasoning and answer at <think> / </think>, as Qwen3.x emits them:
 * the chat template usually opens <think> in the prompt (start inside), older models emit it
 * first. A tag cut across chunks is held back until it is whole; the blank line after </think>
 * is formatting and dropped. */
#ifndef QF_SERVER_THINK_H
#define QF_SERVER_THINK_H

#include <stddef.h>

typedef struct think_split {
    int in_think, seen_text, after_think;
    char pend[16];
    size_t pend_len;
} think_split;

typedef void (*think_emit)(void *ud, int reasoning, const char *p, size_t n);

/* final: no more text follows, so a held-back partial tag is plain text. 0, or -1 on OOM. */
int think_feed(think_split *t, const char *p, size_t n, int final, think_emit emit, void *ud);

#endif
