/* Tokenizer against the HF `tokenizers` library outputs in reference.json, and the round trip
 * decode(encode(x)) == NFC(x) on generated text. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "base/timer.h"
#include "base/utf8.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

/* Encodes case c's "text"; whether the ids are its "ids" (HF's). ids (NULL on an encoding error,
 * which is reported) and n are the caller's. */
static int case_matches(const qf_tokenizer *t, json_t *c, size_t i, int32_t **ids, int *n) {
    json_t *want = json_object_get(c, "ids");
    const char *text = json_string_value(json_object_get(c, "text"));
    if (qf_tok_encode(t, text, json_string_length(json_object_get(c, "text")), ids, n) != QF_OK) {
        CHECK(0, "case %zu: %s", i, qf_last_error());
        *ids = NULL;
        return 0;
    }
    int same = *n == (int)json_array_size(want);
    for (int k = 0; same && k < *n; k++) same = (*ids)[k] == json_integer_value(json_array_get(want, (size_t)k));
    return same;
}

static void check_cases(const qf_tokenizer *t) {
    json_error_t err;
    json_t *ref = json_load_file(qt_path("models/qwen36moe-code-14m/reference.json"), 0, &err);
    CHECK(ref != NULL, "reference.json: %s", err.text);
    json_t *cases = json_object_get(ref, "tokenizer_cases");
    CHECK(json_array_size(cases) >= 10, "only %zu tokenizer cases", json_array_size(cases));
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        int32_t *ids;
        int n;
        CHECK(case_matches(t, c, i, &ids, &n), "case %zu (%s): %d ids, want %zu", i, json_string_value(json_object_get(c, "text")), n,
              json_array_size(json_object_get(c, "ids")));
        free(ids);
    }
    json_decref(ref);
}

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static size_t put_utf8(char *dst, uint32_t cp) { return (size_t)utf8proc_encode_char((utf8proc_int32_t)cp, (utf8proc_uint8_t *)dst); }

/* Random text mixing the classes that stress the pre-tokenizer and BPE. */
static size_t gen_text(char *buf, size_t cap) {
    static const char *snippets[] = {"def f(x):\n    return x**2\n", "\t\t", "   ", "\r\n", "<|im_start", "<|im_end|>", "<think>",
                                     "</think", "<|endoftext|>", "'s", "'LL", "3.14e-10", "x = [1,2,3]  # c", "\n\n\n", "<|", "|>"};
    size_t o = 0;
    int parts = 1 + (int)rnd(12);
    for (int p = 0; p < parts && o + 64 < cap; p++) {
        uint32_t kind = rnd(8), n = 1 + rnd(6);
        for (uint32_t j = 0; j < n && o + 64 < cap; j++) {
            switch (kind) {
            case 0: buf[o++] = (char)(32 + rnd(95)); break;
            case 1: o += put_utf8(buf + o, 0x300 + rnd(0x70)); break; /* combining marks */
            case 2: o += put_utf8(buf + o, 0xc0 + rnd(0x180)); break; /* Latin letters */
            case 3: o += put_utf8(buf + o, 0x4e00 + rnd(0x5000)); break; /* CJK */
            case 4: o += put_utf8(buf + o, 0x1f300 + rnd(0x300)); break; /* emoji */
            case 5: buf[o++] = " \t\n\r"[rnd(4)]; break;
            case 6: {
                const char *s = snippets[rnd(sizeof snippets / sizeof *snippets)];
                memcpy(buf + o, s, strlen(s));
                o += strlen(s);
                break;
            }
            default: o += put_utf8(buf + o, 0x61 + rnd(26)); o += put_utf8(buf + o, 0x301 + rnd(3)); break;
            }
        }
    }
    buf[o] = 0;
    return o;
}

/* NFC of x, except that text is never composed across a special token: HF (and qflash) take
 * added tokens out of the raw text before normalising, so "<think>" + U+0338 keeps its '>' where
 * NFC(x) would fold it into U+226F. */
static char *expected_roundtrip(const qf_tokenizer *t, const char *x, int *differs_from_nfc) {
    static const char *specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"};
    size_t len = strlen(x), o = 0, seg = 0;
    char *out = malloc(len * 3 + 1);
    for (size_t i = 0; i <= len; i++) {
        size_t sl = 0;
        for (int k = 0; i < len && k < 7 && !sl; k++)
            if (strncmp(x + i, specials[k], strlen(specials[k])) == 0) sl = strlen(specials[k]);
        if (!sl && i < len) continue;
        char *part = strndup(x + seg, i - seg);
        utf8proc_uint8_t *n = utf8proc_NFC((const utf8proc_uint8_t *)part);
        o += (size_t)sprintf(out + o, "%s%.*s", (char *)n, (int)sl, x + i);
        free(n);
        free(part);
        i += sl ? sl - 1 : 0;
        seg = i + 1;
    }
    out[o] = 0;
    utf8proc_uint8_t *whole = utf8proc_NFC((const utf8proc_uint8_t *)x);
    *differs_from_nfc = strcmp((char *)whole, out) != 0;
    free(whole);
    (void)t;
    return out;
}

static void check_roundtrip(const qf_tokenizer *t) {
    char buf[2048];
    int bad = 0, boundary = 0;
    for (int i = 0; i < 500; i++) {
        size_t len = gen_text(buf, sizeof buf);
        int32_t *ids;
        int n, differs;
        char *dec = NULL;
        int rc = qf_tok_encode(t, buf, len, &ids, &n);
        CHECK(rc == QF_OK, "encode: %s", qf_last_error());
        if (rc) continue;
        CHECK(qf_tok_decode(t, ids, n, 0, &dec, NULL) == QF_OK, "%s", qf_last_error());
        char *want = expected_roundtrip(t, buf, &differs);
        boundary += differs;
        if (!dec || strcmp(dec, want) != 0) bad++;
        CHECK(dec && strcmp(dec, want) == 0, "round trip of case %d differs:\n  %s\n  %s", i, want, dec ? dec : "");
        free(want);
        free(dec);
        free(ids);
    }
    fprintf(stderr, "round trip: %d of 500 generated strings differ (%d where NFC would compose across a special token)\n", bad, boundary);
}

static void check_errors_and_stream(const qf_tokenizer *t) {
    int32_t *ids;
    int n;
    CHECK(qf_tok_encode(t, "ab\xff", 3, &ids, &n) == QF_EINVAL, "invalid UTF-8 accepted");
    CHECK(strstr(qf_last_error(), "byte 2") != NULL, "message: %s", qf_last_error());
    /* a 4-byte character split across pushes comes out whole, once */
    qf_utf8_stream s = {0};
    char out[64];
    const char *emoji = "\xf0\x9f\x99\x82";
    size_t o = qf_utf8_stream_push(&s, emoji, 1, out, sizeof out);
    o += qf_utf8_stream_push(&s, emoji + 1, 2, out + o, sizeof out - o);
    CHECK(o == 0, "emitted %zu bytes of half a character", o);
    o += qf_utf8_stream_push(&s, emoji + 3, 1, out + o, sizeof out - o);
    CHECK(o == 4 && memcmp(out, emoji, 4) == 0, "got %zu bytes", o);
    o = qf_utf8_stream_push(&s, "\xe2\x82" "a", 3, out, sizeof out);
    CHECK(o == 4 && memcmp(out, "\xef\xbf\xbd" "a", 4) == 0, "truncated sequence gives one U+FFFD (%zu bytes)", o);
    CHECK(qf_tok_lookup(t, "<|im_end|>") == 4002 && qf_tok_is_special(t, 4002), "special token lookup");
}

/* reps repeats of unit as one string (heap; the caller frees). */
static char *repeat(const char *unit, int reps, size_t *len) {
    size_t u = strlen(unit);
    char *s = malloc(u * (size_t)reps + 1);
    for (int i = 0; i < reps; i++) memcpy(s + u * (size_t)i, unit, u);
    s[u * (size_t)reps] = 0;
    *len = u * (size_t)reps;
    return s;
}

static int same_ids(const qf_tokenizer *t, const char *s, size_t len) {
    int32_t *a = NULL, *b = NULL;
    int na = 0, nb = 0;
    int ok = qf_tok_encode(t, s, len, &a, &na) == QF_OK && qf_tok_encode_plain(t, s, len, &b, &nb) == QF_OK && na == nb &&
             memcmp(a, b, (size_t)na * sizeof *a) == 0;
    free(a), free(b);
    return ok;
}

/* The heap merges against the plain loop: the generated strings, and long runs of one character
 * (the pieces whose merging was quadratic); then the heap's time for 10x longer runs, printed. */
static const char *const k_units[] = {"\xf0\x9f\x99\x82", " ", "\n", "\xe4\xb8\xad", "ab", "\t ", "0"};
#define N_UNITS (sizeof k_units / sizeof *k_units)

static void check_merges(const qf_tokenizer *t) {
    char buf[2048];
    int bad = 0;
    for (int i = 0; i < 300; i++) {
        size_t len = gen_text(buf, sizeof buf);
        bad += !same_ids(t, buf, len);
    }
    CHECK(bad == 0, "%d of 300 generated strings: heap merges differ from the plain loop", bad);
    int reps[] = {1, 2, 3, 7, 64, 65, 300, 1000};
    for (size_t u = 0; u < N_UNITS; u++)
        for (size_t r = 0; r < sizeof reps / sizeof *reps; r++) {
            size_t len;
            char *s = repeat(k_units[u], reps[r], &len);
            CHECK(same_ids(t, s, len), "%d repeats of unit %zu: heap merges differ from the plain loop", reps[r], u);
            free(s);
        }
    for (size_t u = 0; u < N_UNITS; u++) {
        double dt[2];
        for (int k = 0; k < 2; k++) {
            size_t len;
            char *s = repeat(k_units[u], k ? 100000 : 10000, &len);
            int32_t *ids = NULL;
            int n = 0;
            double t0 = qf_now();
            CHECK(qf_tok_encode(t, s, len, &ids, &n) == QF_OK, "%s", qf_last_error());
            dt[k] = qf_now() - t0;
            free(ids), free(s);
        }
        fprintf(stderr, "encode of unit %zu repeated: 10000x %.2f ms, 100000x %.2f ms (x%.1f)\n", u, dt[0] * 1e3, dt[1] * 1e3, dt[1] / (dt[0] > 0 ? dt[0] : 1e-9));
    }
}

/* `test_tokenizer ROOT --cases DIR CASES`: DIR's tokenizer against CASES (a JSON array of
 * {"text", "ids"} from HF `tokenizers`; tests/tokenizer/test_qwen_tokenizer.py makes both for the
 * real 248k Qwen3.5/3.6 vocabulary): the same ids, and decode(ids) == text. */
static int check_dir(const char *dir, const char *cases_path) {
    qf_tokenizer *t;
    double t0 = qf_now();
    int rc = qf_tok_load(&t, dir);
    CHECK(rc == QF_OK, "%s: %s", dir, qf_last_error());
    if (rc) return qt_finish();
    fprintf(stderr, "loaded %s (%d tokens) in %.2f s\n", dir, qf_tok_vocab_size(t), qf_now() - t0);
    json_error_t err;
    json_t *cases = json_load_file(cases_path, 0, &err);
    CHECK(cases && json_array_size(cases) > 0, "%s: %s", cases_path, err.text);
    int bad = 0;
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        int32_t *ids;
        int n, same = case_matches(t, c, i, &ids, &n);
        if (!ids) continue;
        char *dec = NULL;
        int round = qf_tok_decode(t, ids, n, 0, &dec, NULL) == QF_OK && strcmp(dec, json_string_value(json_object_get(c, "text"))) == 0;
        if ((!same || !round) && bad++ < 5) fprintf(stderr, "  case %zu%s%s\n", i, same ? "" : ": ids differ", round ? "" : ": decode differs");
        free(ids), free(dec);
    }
    CHECK(bad == 0, "%d of %zu cases differ from HF tokenizers", bad, json_array_size(cases));
    fprintf(stderr, "%zu cases against HF tokenizers: %d differ\n", json_array_size(cases), bad);
    json_decref(cases);
    qf_tok_free(t);
    return qt_finish();
}

int main(int argc, char **argv) {
    qt_init(argc, argv);
    if (argc == 5 && strcmp(argv[2], "--cases") == 0) return check_dir(argv[3], argv[4]);
    qf_tokenizer *t;
    int rc = qf_tok_load(&t, qt_path("models/qwen36moe-code-14m"));
    CHECK(rc == QF_OK, "%s", qf_last_error());
    if (rc) return qt_finish();
    CHECK(qf_tok_vocab_size(t) == 4007, "vocab %d", qf_tok_vocab_size(t));
    check_cases(t);
    check_roundtrip(t);
    check_merges(t);
    check_errors_and_stream(t);
    qf_tok_free(t);
    return qt_finish();
}
