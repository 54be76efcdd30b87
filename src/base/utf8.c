#include "base/utf8.h"

#include <string.h>

int qf_utf8_seq_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    unsigned c = s[0];
    int len;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) len = 2, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef) len = 3, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4) len = 4, min = 0x10000;
    else return 0;
    if (n < (size_t)len) return 0;
    unsigned cp = c & (0x7f >> len);
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
}

size_t qf_utf8_valid_prefix(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        int l = qf_utf8_seq_len((const unsigned char *)s + i, n - i);
        if (!l) return i;
        i += (size_t)l;
    }
    return n;
}

/* Could bytes p[0..n) still grow into a valid sequence? */
static int is_valid_prefix_of_seq(const unsigned char *p, int n) {
    unsigned c = p[0];
    int len = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xc2 && c <= 0xdf ? 2 : 0;
    if (!len || n >= len) return 0;
    for (int i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80) return 0;
    if (n >= 2) { /* reject overlongs and surrogates early, as the full check would */
        if (c == 0xe0 && p[1] < 0xa0) return 0;
        if (c == 0xed && p[1] > 0x9f) return 0;
        if (c == 0xf0 && p[1] < 0x90) return 0;
        if (c == 0xf4 && p[1] > 0x8f) return 0;
    }
    return 1;
}

static const char k_repl[3] = {(char)0xef, (char)0xbf, (char)0xbd};

size_t qf_utf8_stream_push(qf_utf8_stream *s, const char *bytes, size_t len, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        s->pend[s->n_pend++] = (unsigned char)bytes[i];
        for (;;) {
            int l = qf_utf8_seq_len(s->pend, (size_t)s->n_pend);
            if (l) {
                if (o + (size_t)l <= cap) memcpy(out + o, s->pend, (size_t)l);
                o += (size_t)l;
                memmove(s->pend, s->pend + l, (size_t)(s->n_pend - l));
                s->n_pend -= l;
            } else if (s->n_pend && !is_valid_prefix_of_seq(s->pend, s->n_pend)) {
                /* one U+FFFD for the longest start that could have been a character (as Python's
                   errors="replace"), then rescan the rest */
                int k = 1;
                while (k < s->n_pend && is_valid_prefix_of_seq(s->pend, k + 1)) k++;
                if (o + 3 <= cap) memcpy(out + o, k_repl, 3);
                o += 3;
                memmove(s->pend, s->pend + k, (size_t)(s->n_pend - k));
                s->n_pend -= k;
            } else {
                break;
            }
            if (!s->n_pend) break;
        }
    }
    return o < cap ? o : cap;
}

size_t qf_utf8_stream_flush(qf_utf8_stream *s, char *out, size_t cap) {
    size_t o = 0;
    if (s->n_pend && cap >= 3) {
        memcpy(out, k_repl, 3);
        o = 3;
    }
    s->n_pend = 0;
    return o;
}
