#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/tokenizer.h"

#include <jansson.h>
#include <limits.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "base/err.h"
#include "base/hashmap.h"
#include "base/mapfile.h"
#include "base/utf8.h"
#include "format/config.h"

/* The GPT-2 pre-tokenizer, used when tokenizer.json asks ByteLevel to split by itself. */
static const char k_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef struct added_tok {
    const char *text;
    size_t len;
    int id, special, lstrip, rstrip;
} added_tok;

struct qf_tokenizer {
    int n_vocab;
    char *blob;            /* byte-level token strings, then decoded bytes */
    size_t *str_off, *dec_off;
    int *str_len, *dec_len; /* -1: no token with this id */
    unsigned char *special;
    qf_strmap vocab;       /* byte-level string -> id */
    qf_u64map merges;      /* (left << 32 | right) -> rank */
    int32_t *merge_result; /* rank -> merged id */
    int32_t byte_id[256];
    unsigned short byte_cp[256]; /* GPT-2 byte -> code point */
    short cp_byte[512];          /* code point -> byte, -1 if none */
    added_tok *added;      /* longest first */
    int n_added;
    pcre2_code *re;
    int nfc;
    char *chat_template;
    char bos[64], eos[64]; /* tokenizer_config.json's bos_token / eos_token texts ("" when absent) */
};

static void build_byte_map(qf_tokenizer *t) {
    int n = 0;
    for (int i = 0; i < 512; i++) t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        t->byte_cp[b] = (unsigned short)(keep ? b : 256 + n++);
        t->cp_byte[t->byte_cp[b]] = (short)b;
    }
}

static size_t put_cp(char *dst, unsigned cp) {
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    dst[0] = (char)(0xc0 | (cp >> 6));
    dst[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* Byte-level string of a token -> the raw bytes it stands for (in place: never longer). */
static int byte_level_decode(const qf_tokenizer *t, const char *s, int len, char *out) {
    int o = 0;
    for (int i = 0; i < len;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i, len - i, &cp);
        if (l <= 0) {
            out[o++] = s[i++];
            continue;
        }
        if (cp >= 0 && cp < 512 && t->cp_byte[cp] >= 0) out[o++] = (char)t->cp_byte[cp];
        else {
            memcpy(out + o, s + i, (size_t)l);
            o += (int)l;
        }
        i += (int)l;
    }
    return o;
}

static int max_id(json_t *vocab, json_t *added) {
    int m = -1;
    const char *k;
    json_t *v;
    json_object_foreach(vocab, k, v) if (json_integer_value(v) > m) m = (int)json_integer_value(v);
    for (size_t i = 0; i < json_array_size(added); i++) {
        int id = (int)json_integer_value(json_object_get(json_array_get(added, i), "id"));
        if (id > m) m = id;
    }
    return m;
}

static int alloc_tables(qf_tokenizer *t, size_t blob_bytes) {
    size_t n = (size_t)t->n_vocab;
    t->blob = malloc(blob_bytes ? blob_bytes : 1);
    t->str_off = calloc(n, sizeof *t->str_off);
    t->dec_off = calloc(n, sizeof *t->dec_off);
    t->str_len = malloc(n * sizeof *t->str_len);
    t->dec_len = malloc(n * sizeof *t->dec_len);
    t->special = calloc(n, 1);
    if (!t->blob || !t->str_off || !t->dec_off || !t->str_len || !t->dec_len || !t->special)
        return qf_fail(QF_ENOMEM, "out of memory (tokenizer)");
    for (size_t i = 0; i < n; i++) t->str_len[i] = t->dec_len[i] = -1;
    return qf_strmap_init(&t->vocab, n);
}

/* Stores a token's text and decoded bytes at the blob cursor. */
static int add_token(qf_tokenizer *t, const char *path, const char *s, size_t len, int id, int raw, size_t *cur) {
    if (id < 0 || id >= t->n_vocab) return qf_fail(QF_EFORMAT, "%s: token id %d out of range", path, id);
    char *str = t->blob + *cur;
    memcpy(str, s, len);
    t->str_off[id] = *cur;
    t->str_len[id] = (int)len;
    *cur += len;
    t->dec_off[id] = *cur;
    t->dec_len[id] = raw ? (int)len : byte_level_decode(t, s, (int)len, t->blob + *cur);
    if (raw) memcpy(t->blob + *cur, s, len);
    *cur += (size_t)t->dec_len[id];
    return qf_strmap_put(&t->vocab, str, len, id) < 0 ? QF_ENOMEM : QF_OK;
}

static int cmp_added(const void *a, const void *b) {
    const added_tok *x = a, *y = b;
    return x->len < y->len ? 1 : x->len > y->len ? -1 : 0;
}

static int load_vocab(qf_tokenizer *t, const char *path, json_t *model, json_t *added) {
    json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab)) return qf_fail(QF_EFORMAT, "%s: model.vocab missing", path);
    t->n_vocab = max_id(vocab, added) + 1;
    if (t->n_vocab <= 0 || t->n_vocab > (1 << 24)) return qf_fail(QF_EFORMAT, "%s: bad vocabulary size %d", path, t->n_vocab);
    size_t bytes = 0;
    const char *k;
    json_t *v;
    json_object_foreach(vocab, k, v) bytes += 2 * strlen(k);
    for (size_t i = 0; i < json_array_size(added); i++) bytes += 2 * strlen(json_string_value(json_object_get(json_array_get(added, i), "content")) ?: "");
    int rc = alloc_tables(t, bytes);
    size_t cur = 0;
    json_object_foreach(vocab, k, v) {
        if (rc != QF_OK) break;
        if (!json_is_integer(v)) return qf_fail(QF_EFORMAT, "%s: vocab entry '%s' has no integer id", path, k);
        rc = add_token(t, path, k, strlen(k), (int)json_integer_value(v), 0, &cur);
    }
    t->added = calloc(json_array_size(added) + 1, sizeof *t->added);
    if (!t->added) return qf_fail(QF_ENOMEM, "out of memory");
    for (size_t i = 0; rc == QF_OK && i < json_array_size(added); i++) {
        json_t *a = json_array_get(added, i);
        const char *content = json_string_value(json_object_get(a, "content"));
        json_t *jid = json_object_get(a, "id");
        if (!content || !*content || !json_is_integer(jid)) return qf_fail(QF_EFORMAT, "%s: added_tokens[%zu] needs content and id", path, i);
        int id = (int)json_integer_value(jid);
        rc = add_token(t, path, content, strlen(content), id, 1, &cur);
        added_tok *at = &t->added[t->n_added++];
        at->text = t->blob + t->str_off[id];
        at->len = strlen(content);
        at->id = id;
        at->special = t->special[id] = json_is_true(json_object_get(a, "special"));
        at->lstrip = json_is_true(json_object_get(a, "lstrip"));
        at->rstrip = json_is_true(json_object_get(a, "rstrip"));
    }
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added);
    for (int b = 0; rc == QF_OK && b < 256; b++) {
        char s[2];
        size_t l = put_cp(s, t->byte_cp[b]);
        t->byte_id[b] = qf_strmap_get(&t->vocab, s, l);
        if (t->byte_id[b] < 0) rc = qf_fail(QF_EFORMAT, "%s: byte 0x%02x has no token: not a byte-level BPE vocabulary", path, b);
    }
    return rc;
}

static int load_merges(qf_tokenizer *t, const char *path, json_t *model) {
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges)) return qf_fail(QF_EFORMAT, "%s: model.merges missing", path);
    size_t n = json_array_size(merges);
    t->merge_result = malloc((n ? n : 1) * sizeof *t->merge_result);
    if (!t->merge_result || qf_u64map_init(&t->merges, n) != QF_OK) return qf_fail(QF_ENOMEM, "out of memory");
    char buf[1024];
    for (size_t r = 0; r < n; r++) {
        json_t *m = json_array_get(merges, r);
        const char *a, *b;
        if (json_is_string(m)) {
            snprintf(buf, sizeof buf, "%s", json_string_value(m));
            char *sp = strchr(buf, ' ');
            if (!sp) return qf_fail(QF_EFORMAT, "%s: merge %zu '%s' has no space", path, r, buf);
            *sp = 0;
            a = buf;
            b = sp + 1;
        } else {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            if (!a || !b) return qf_fail(QF_EFORMAT, "%s: merge %zu is not a pair of strings", path, r);
        }
        int ia = qf_strmap_get(&t->vocab, a, strlen(a)), ib = qf_strmap_get(&t->vocab, b, strlen(b));
        char joined[2048];
        snprintf(joined, sizeof joined, "%s%s", a, b);
        int ij = qf_strmap_get(&t->vocab, joined, strlen(joined));
        if (ia < 0 || ib < 0 || ij < 0) return qf_fail(QF_EFORMAT, "%s: merge %zu ('%s' '%s') names a token not in the vocabulary", path, r, a, b);
        t->merge_result[r] = ij;
        qf_u64map_put(&t->merges, (uint64_t)ia << 32 | (uint32_t)ib, (int)r); /* first rank wins */
    }
    return QF_OK;
}

/* Finds the Split regex (or ByteLevel's own GPT-2 split) in the pre_tokenizer. */
static const char *find_pattern(json_t *pt, int *rc, const char *path) {
    if (!pt || json_is_null(pt)) return NULL;
    const char *type = json_string_value(json_object_get(pt, "type"));
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(pt, "pretokenizers");
        const char *found = NULL;
        for (size_t i = 0; i < json_array_size(list) && *rc == QF_OK; i++) {
            const char *p = find_pattern(json_array_get(list, i), rc, path);
            if (p) found = p;
        }
        return found;
    }
    if (type && strcmp(type, "Split") == 0) {
        const char *re = json_string_value(json_object_get(json_object_get(pt, "pattern"), "Regex"));
        const char *beh = json_string_value(json_object_get(pt, "behavior"));
        if (!re || (beh && strcmp(beh, "Isolated") != 0) || json_is_true(json_object_get(pt, "invert")))
            *rc = qf_fail(QF_EUNSUPPORTED, "%s: only an Isolated, non-inverted Split with a Regex pattern is supported", path);
        return re;
    }
    if (type && strcmp(type, "ByteLevel") == 0) {
        json_t *ur = json_object_get(pt, "use_regex");
        if (json_is_true(json_object_get(pt, "add_prefix_space")))
            *rc = qf_fail(QF_EUNSUPPORTED, "%s: ByteLevel add_prefix_space is not supported", path);
        return (!ur || json_is_true(ur)) ? k_gpt2_pattern : NULL;
    }
    *rc = qf_fail(QF_EUNSUPPORTED, "%s: pre_tokenizer type '%s' is not supported", path, type ? type : "?");
    return NULL;
}

static int load_normalizer(qf_tokenizer *t, json_t *nz, const char *path) {
    if (!nz || json_is_null(nz)) return QF_OK;
    const char *type = json_string_value(json_object_get(nz, "type"));
    if (type && strcmp(type, "NFC") == 0) {
        t->nfc = 1;
        return QF_OK;
    }
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(nz, "normalizers");
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = load_normalizer(t, json_array_get(list, i), path);
            if (rc != QF_OK) return rc;
        }
        return QF_OK;
    }
    return qf_fail(QF_EUNSUPPORTED, "%s: normalizer '%s' is not supported (NFC only)", path, type ? type : "?");
}

static int compile_regex(qf_tokenizer *t, const char *pattern, const char *path) {
    int err;
    PCRE2_SIZE off;
    t->re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, NULL);
    if (!t->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return qf_fail(QF_EFORMAT, "%s: pre-tokenizer regex does not compile at offset %zu: %s", path, (size_t)off, (char *)msg);
    }
    pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE); /* optional speed-up; the interpreter is the fallback */
    return QF_OK;
}

/* tokenizer_config.json's bos_token / eos_token: a string or {"content": ...} */
static void special_text(json_t *cfg, const char *key, char *out, size_t cap) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    snprintf(out, cap, "%s", json_is_string(v) ? json_string_value(v) : "");
}

static void load_chat_template(qf_tokenizer *t, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    json_t *cfg = json_load_file(path, 0, NULL);
    special_text(cfg, "bos_token", t->bos, sizeof t->bos);
    special_text(cfg, "eos_token", t->eos, sizeof t->eos);
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    char *text = NULL;
    if (qf_read_file(path, &text, NULL) == QF_OK) {
        t->chat_template = text;
        json_decref(cfg);
        return;
    }
    json_t *ct = json_object_get(cfg, "chat_template");
    const char *s = json_string_value(ct);
    for (size_t i = 0; !s && i < json_array_size(ct); i++) { /* [{name, template}], take "default" */
        json_t *e = json_array_get(ct, i);
        const char *name = json_string_value(json_object_get(e, "name"));
        if (name && strcmp(name, "default") == 0) s = json_string_value(json_object_get(e, "template"));
    }
    if (s) t->chat_template = strdup(s);
    json_decref(cfg);
}

int qf_tok_load(qf_tokenizer **out, const char *dir) {
    *out = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) return qf_fail_json(path, &jerr);
    qf_tokenizer *t = calloc(1, sizeof *t);
    int rc = t ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    json_t *model = json_object_get(root, "model");
    const char *type = json_string_value(json_object_get(model, "type"));
    if (rc == QF_OK && (!type || strcmp(type, "BPE") != 0))
        rc = qf_fail(QF_EUNSUPPORTED, "%s: model type '%s' is not supported (BPE only)", path, type ? type : "?");
    if (rc == QF_OK) {
        build_byte_map(t);
        rc = load_vocab(t, path, model, json_object_get(root, "added_tokens"));
    }
    if (rc == QF_OK) rc = load_merges(t, path, model);
    if (rc == QF_OK) rc = load_normalizer(t, json_object_get(root, "normalizer"), path);
    const char *pattern = rc == QF_OK ? find_pattern(json_object_get(root, "pre_tokenizer"), &rc, path) : NULL;
    if (rc == QF_OK) rc = compile_regex(t, pattern ? pattern : k_gpt2_pattern, path);
    json_decref(root);
    if (rc == QF_OK) load_chat_template(t, dir);
    if (rc != QF_OK) {
        qf_tok_free(t);
        return rc;
    }
    *out = t;
    return QF_OK;
}

void qf_tok_free(qf_tokenizer *t) {
    if (!t) return;
    free(t->blob);
    free(t->str_off);
    free(t->dec_off);
    free(t->str_len);
    free(t->dec_len);
    free(t->special);
    free(t->merge_result);
    free(t->added);
    free(t->chat_template);
    qf_strmap_free(&t->vocab);
    qf_u64map_free(&t->merges);
    if (t->re) pcre2_code_free(t->re);
    free(t);
}

/* ---- encoding ---- */

typedef struct idbuf {
    int32_t *v;
    int n, cap;
} idbuf;

static int push_id(idbuf *b, int32_t id) {
    if (b->n == b->cap) {
        int cap = b->cap ? b->cap * 2 : 256;
        int32_t *nv = realloc(b->v, (size_t)cap * sizeof *nv);
        if (!nv) return qf_fail(QF_ENOMEM, "out of memory");
        b->v = nv;
        b->cap = cap;
    }
    b->v[b->n++] = id;
    return QF_OK;
}

/* The merge rank of symbols a, b (-1: no merge). */
static int rank_of(const qf_tokenizer *t, int32_t a, int32_t b) { return qf_u64map_get(&t->merges, (uint64_t)a << 32 | (uint32_t)b); }

/* BPE over one pre-token, the plain way (the reference bpe_piece is tested against): start from
 * byte tokens, repeatedly merge the lowest-ranked adjacent pair, leftmost on ties (the order HF's
 * merge queue produces). Quadratic in the piece's length. */
static int bpe_piece_plain(const qf_tokenizer *t, const unsigned char *s, size_t len, idbuf *out) {
    int first = out->n;
    for (size_t i = 0; i < len; i++)
        if (push_id(out, t->byte_id[s[i]]) != QF_OK) return QF_ENOMEM;
    int32_t *sym = out->v + first;
    int n = out->n - first;
    for (;;) {
        int best = INT_MAX, at = -1;
        for (int i = 0; i + 1 < n; i++) {
            int r = rank_of(t, sym[i], sym[i + 1]);
            if (r >= 0 && r < best) best = r, at = i;
        }
        if (at < 0) break;
        sym[at] = t->merge_result[best];
        memmove(sym + at + 1, sym + at + 2, (size_t)(n - at - 2) * sizeof *sym);
        n--;
    }
    out->n = first + n;
    return QF_OK;
}

/* A candidate merge: symbols at positions i and j (j the next live one when it was made), rank r.
 * Ordered by rank, then position: the plain loop's choice. */
typedef struct cand {
    int r, i, j;
} cand;

static int cand_less(cand a, cand b) { return a.r < b.r || (a.r == b.r && a.i < b.i); }

static void heap_push(cand *h, int *n, cand c) {
    int k = (*n)++;
    for (; k > 0 && cand_less(c, h[(k - 1) / 2]); k = (k - 1) / 2) h[k] = h[(k - 1) / 2];
    h[k] = c;
}

static cand heap_pop(cand *h, int *n) {
    cand top = h[0], last = h[--*n];
    int k = 0;
    for (;;) {
        int c = 2 * k + 1;
        if (c >= *n) break;
        if (c + 1 < *n && cand_less(h[c + 1], h[c])) c++;
        if (!cand_less(h[c], last)) break;
        h[k] = h[c], k = c;
    }
    if (*n) h[k] = last;
    return top;
}

/* The same merges in O(n log n): the symbols as a linked list, candidate pairs in a heap; a popped
 * candidate whose symbols have changed since it was pushed is dropped. Each merge pushes at most
 * two candidates, so the heap holds fewer than 3n. */
static int bpe_piece(const qf_tokenizer *t, const unsigned char *s, size_t len, idbuf *out) {
    if (len < 2) return len ? push_id(out, t->byte_id[s[0]]) : QF_OK;
    if (len > INT_MAX / 4) return qf_fail(QF_EINVAL, "a piece of %zu bytes is too long to tokenize", len);
    enum { SMALL = 64 }; /* most pieces: their arrays on the stack */
    int32_t id_s[SMALL];
    int next_s[SMALL], prev_s[SMALL];
    cand h_s[3 * SMALL];
    int n = (int)len, nh = 0, small = n <= SMALL;
    int32_t *id = small ? id_s : malloc((size_t)n * sizeof *id);
    int *next = small ? next_s : malloc((size_t)n * sizeof *next), *prev = small ? prev_s : malloc((size_t)n * sizeof *prev);
    cand *h = small ? h_s : malloc((size_t)3 * n * sizeof *h);
    int rc = id && next && prev && h ? QF_OK : qf_fail(QF_ENOMEM, "out of memory tokenizing a piece of %zu bytes", len);
    for (int i = 0; rc == QF_OK && i < n; i++) {
        id[i] = t->byte_id[s[i]], next[i] = i + 1 < n ? i + 1 : -1, prev[i] = i - 1;
        int r = i ? rank_of(t, id[i - 1], id[i]) : -1;
        if (r >= 0) heap_push(h, &nh, (cand){r, i - 1, i});
    }
    while (rc == QF_OK && nh) {
        cand c = heap_pop(h, &nh);
        if (id[c.i] < 0 || next[c.i] != c.j || rank_of(t, id[c.i], id[c.j]) != c.r) continue; /* stale */
        id[c.i] = t->merge_result[c.r], id[c.j] = -1;
        next[c.i] = next[c.j];
        if (next[c.i] >= 0) prev[next[c.i]] = c.i;
        int r;
        if (prev[c.i] >= 0 && (r = rank_of(t, id[prev[c.i]], id[c.i])) >= 0) heap_push(h, &nh, (cand){r, prev[c.i], c.i});
        if (next[c.i] >= 0 && (r = rank_of(t, id[c.i], id[next[c.i]])) >= 0) heap_push(h, &nh, (cand){r, c.i, next[c.i]});
    }
    for (int i = 0; rc == QF_OK && i >= 0; i = next[i]) rc = push_id(out, id[i]);
    if (!small) free(id), free(next), free(prev), free(h);
    return rc;
}

/* NFC, then the Split regex (matches and the gaps between them are both pieces), then BPE. */
typedef int (*bpe_fn)(const qf_tokenizer *t, const unsigned char *s, size_t len, idbuf *out);

static int encode_text(const qf_tokenizer *t, const char *text, size_t len, bpe_fn bpe, idbuf *out) {
    if (!len) return QF_OK;
    utf8proc_uint8_t *norm = NULL;
    const char *s = text;
    if (t->nfc) {
        utf8proc_ssize_t nl = utf8proc_map((const utf8proc_uint8_t *)text, (utf8proc_ssize_t)len, &norm, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (nl < 0) return qf_fail(QF_EINVAL, "text cannot be normalised: %s", utf8proc_errmsg(nl));
        s = (const char *)norm;
        len = (size_t)nl;
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->re, NULL);
    int rc = md ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
    size_t off = 0;
    while (rc == QF_OK && off < len) {
        int m = pcre2_match(t->re, (PCRE2_SPTR)s, len, off, PCRE2_NO_UTF_CHECK, md, NULL);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = m >= 0 ? ov[0] : len, me = m >= 0 ? ov[1] : len;
        if (m < 0 && m != PCRE2_ERROR_NOMATCH) {
            rc = qf_fail(QF_EINVAL, "pre-tokenizer regex failed (%d) at byte %zu", m, off);
            break;
        }
        if (ms > off) rc = bpe(t, (const unsigned char *)s + off, ms - off, out);
        if (rc == QF_OK && me > ms) rc = bpe(t, (const unsigned char *)s + ms, me - ms, out);
        if (me == ms && m >= 0) { /* empty match: the next character joins the following gap */
            int l = qf_utf8_seq_len((const unsigned char *)s + me, len - me);
            rc = bpe(t, (const unsigned char *)s + me, (size_t)(l ? l : 1), out);
            me += (size_t)(l ? l : 1);
        }
        off = me;
    }
    if (md) pcre2_match_data_free(md);
    free(norm);
    return rc;
}

static const added_tok *added_at(const qf_tokenizer *t, const char *s, size_t len) {
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len <= len && memcmp(s, t->added[i].text, t->added[i].len) == 0) return &t->added[i];
    return NULL;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

static int encode(const qf_tokenizer *t, const char *text, size_t len, bpe_fn bpe, int32_t **ids, int *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    size_t bad = qf_utf8_valid_prefix(text, len);
    if (bad != len) return qf_fail(QF_EINVAL, "invalid UTF-8 in text at byte %zu", bad);
    idbuf out = {0};
    int rc = QF_OK;
    size_t seg = 0, i = 0;
    while (rc == QF_OK && i < len) {
        const added_tok *a = added_at(t, text + i, len - i);
        if (!a) {
            i++;
            continue;
        }
        size_t seg_end = i;
        if (a->lstrip)
            while (seg_end > seg && is_ws(text[seg_end - 1])) seg_end--;
        rc = encode_text(t, text + seg, seg_end - seg, bpe, &out);
        if (rc == QF_OK) rc = push_id(&out, a->id);
        i += a->len;
        if (a->rstrip)
            while (i < len && is_ws(text[i])) i++;
        seg = i;
    }
    if (rc == QF_OK) rc = encode_text(t, text + seg, len - seg, bpe, &out);
    if (rc != QF_OK) {
        free(out.v);
        return rc;
    }
    *ids = out.v ? out.v : malloc(sizeof(int32_t));
    *n_ids = out.n;
    return *ids ? QF_OK : qf_fail(QF_ENOMEM, "out of memory");
}

int qf_tok_encode(const qf_tokenizer *t, const char *text, size_t len, int32_t **ids, int *n_ids) {
    return encode(t, text, len, bpe_piece, ids, n_ids);
}

int qf_tok_encode_plain(const qf_tokenizer *t, const char *text, size_t len, int32_t **ids, int *n_ids) {
    return encode(t, text, len, bpe_piece_plain, ids, n_ids);
}

/* ---- decoding and lookups ---- */

const char *qf_tok_piece(const qf_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab || t->dec_len[id] < 0) return NULL;
    *len = (size_t)t->dec_len[id];
    return t->blob + t->dec_off[id];
}

int qf_tok_decode(const qf_tokenizer *t, const int32_t *ids, int n, int skip_special, char **out, size_t *out_len) {
    size_t cap = 64;
    for (int i = 0; i < n; i++) cap += ids[i] >= 0 && ids[i] < t->n_vocab && t->dec_len[ids[i]] > 0 ? (size_t)t->dec_len[ids[i]] * 3 : 0;
    char *buf = malloc(cap);
    if (!buf) return qf_fail(QF_ENOMEM, "out of memory");
    qf_utf8_stream us = {0};
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        size_t len;
        const char *p = qf_tok_piece(t, ids[i], &len);
        if (!p) {
            free(buf);
            return qf_fail(QF_EINVAL, "token id %d is not in the vocabulary", ids[i]);
        }
        if (skip_special && t->special[ids[i]]) continue;
        o += qf_utf8_stream_push(&us, p, len, buf + o, cap - o);
    }
    o += qf_utf8_stream_flush(&us, buf + o, cap - o);
    buf[o] = 0;
    *out = buf;
    if (out_len) *out_len = o;
    return QF_OK;
}

int qf_tok_vocab_size(const qf_tokenizer *t) { return t->n_vocab; }

size_t qf_tok_max_piece_len(const qf_tokenizer *t) {
    int m = 0;
    for (int i = 0; i < t->n_vocab; i++) m = t->dec_len[i] > m ? t->dec_len[i] : m;
    return (size_t)m;
}

int qf_tok_lookup(const qf_tokenizer *t, const char *token) { return qf_strmap_get(&t->vocab, token, strlen(token)); }

int qf_tok_is_special(const qf_tokenizer *t, int32_t id) { return id >= 0 && id < t->n_vocab && t->special[id]; }

int qf_tok_turn_start(const qf_tokenizer *t, const int32_t *ids, int n) {
    int32_t im_start = qf_tok_lookup(t, "<|im_start|>");
    int k = n - 1;
    while (im_start >= 0 && k > 0 && ids[k] != im_start) k--;
    return im_start >= 0 && k > 0 ? k : 0;
}

const char *qf_tok_chat_template(const qf_tokenizer *t) { return t->chat_template; }
const char *qf_tok_bos_text(const qf_tokenizer *t) { return t->bos; }
const char *qf_tok_eos_text(const qf_tokenizer *t) { return t->eos; }
