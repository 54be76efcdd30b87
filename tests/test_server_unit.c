/* Server pieces that need no socket: the reasoning split. */
#include <stdio.h>
#include <string.h>

#include "server/think.h"
#include "test_util.h"

typedef struct acc {
    char r[256], c[256];
} acc;

static void emit(void *ud, int reasoning, const char *p, size_t n) {
    acc *a = ud;
    strncat(reasoning ? a->r : a->c, p, n);
}

/* Feeds the text in pieces of `step` bytes, as tokens arrive. */
static void split(const char *text, int start_inside, size_t step, acc *a) {
    think_split t = {0};
    t.in_think = start_inside;
    memset(a, 0, sizeof *a);
    size_t n = strlen(text);
    for (size_t i = 0; i < n; i += step) think_feed(&t, text + i, n - i < step ? n - i : step, 0, emit, a);
    think_feed(&t, "", 0, 1, emit, a);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    acc a;
    for (size_t step = 1; step <= 9; step++) {
        split("Let me think.\n</think>\n\nThe answer is 4.", 1, step, &a);
        CHECK(!strcmp(a.r, "Let me think.\n") && !strcmp(a.c, "The answer is 4."), "prompt-opened think, step %zu: [%s] [%s]", step, a.r, a.c);
        split("<think>hmm</think>\n\nok", 0, step, &a);
        CHECK(!strcmp(a.r, "hmm") && !strcmp(a.c, "ok"), "model-opened think, step %zu: [%s] [%s]", step, a.r, a.c);
        split("plain answer with <think> later", 0, step, &a);
        CHECK(!a.r[0] && !strcmp(a.c, "plain answer with <think> later"), "late tag is text, step %zu: [%s]", step, a.c);
        split("cut off </thi", 1, step, &a);
        CHECK(!strcmp(a.r, "cut off </thi") && !a.c[0], "partial tag at the end is text, step %zu: [%s]", step, a.r);
        split("a < b </think>x </think>", 1, step, &a);
        CHECK(!strcmp(a.r, "a < b ") && !strcmp(a.c, "x </think>"), "only the first close counts, step %zu: [%s] [%s]", step, a.r, a.c);
    }
    return qt_finish();
}
