/* UTF-8 helpers: validation and a streaming decoder that never emits half a character. */
#ifndef QF_BASE_UTF8_H
#define QF_BASE_UTF8_H

#include <stddef.h>

/* Length of the valid UTF-8 sequence starting at s (1..4), or 0 if s[0..n) does not start with
 * one (including a truncated sequence). */
int qf_utf8_seq_len(const unsigned char *s, size_t n);
/* Offset of the first invalid byte, or n when all of s is valid. */
size_t qf_utf8_valid_prefix(const char *s, size_t n);

/* Token bytes go in, whole characters come out; an invalid sequence becomes U+FFFD, as HF
 * decode(errors="replace") does. */
typedef struct qf_utf8_stream {
    unsigned char pend[4];
    int n_pend;
} qf_utf8_stream;

/* Appends the complete characters of pend+bytes to out (cap bytes; needs len + 8 room) and
 * returns the number of bytes written. */
size_t qf_utf8_stream_push(qf_utf8_stream *s, const char *bytes, size_t len, char *out, size_t cap);
/* Flushes what is left (a truncated tail becomes U+FFFD). */
size_t qf_utf8_stream_flush(qf_utf8_stream *s, char *out, size_t cap);

#endif
