/* Byte-level BPE tokenizer from a Hugging Face tokenizer.json (Qwen2/Qwen3/Qwen3.5 style):
 * added tokens matched in the raw text first, NFC (utf8proc), the Split regex run by PCRE2 with
 * Unicode properties, the GPT-2 byte map, merges by rank. */
#ifndef QF_TOKENIZER_TOKENIZER_H
#define QF_TOKENIZER_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct qf_tokenizer qf_tokenizer;

/* Loads dir/tokenizer.json (and the chat template from dir/tokenizer_config.json or
 * dir/chat_template.jinja when present). */
int qf_tok_load(qf_tokenizer **out, const char *dir);
void qf_tok_free(qf_tokenizer *t);

/* Encodes UTF-8 text (special tokens written in the text are recognised). *ids is a heap array
 * the caller frees. Invalid UTF-8 is an error naming the byte offset. */
int qf_tok_encode(const qf_tokenizer *t, const char *text, size_t len, int32_t **ids, int *n_ids);
/* The same with the plain, quadratic merge loop: the reference qf_tok_encode is tested against. */
int qf_tok_encode_plain(const qf_tokenizer *t, const char *text, size_t len, int32_t **ids, int *n_ids);

/* The bytes a token stands for (added tokens: their text). NULL for an id with no token. */
const char *qf_tok_piece(const qf_tokenizer *t, int32_t id, size_t *len);
/* Decodes ids to a heap NUL-terminated string (invalid UTF-8 -> U+FFFD); skip_special drops
 * special added tokens. out_len (may be NULL): its length, NUL bytes inside it counted (the byte
 * token 0 decodes to one). QF_EINVAL naming an id that has no token. */
int qf_tok_decode(const qf_tokenizer *t, const int32_t *ids, int n, int skip_special, char **out, size_t *out_len);

int qf_tok_vocab_size(const qf_tokenizer *t); /* highest id + 1 */
size_t qf_tok_max_piece_len(const qf_tokenizer *t); /* longest qf_tok_piece, in bytes */
int qf_tok_lookup(const qf_tokenizer *t, const char *token); /* id of an exact token, or -1 */
int qf_tok_is_special(const qf_tokenizer *t, int32_t id);
/* Where a chat prompt's last turn begins: the last <|im_start|> past position 0 (0: none). A
 * conversation's next prompt shares everything before it, while the turn itself is rendered
 * again differently (the template drops its reasoning block). */
int qf_tok_turn_start(const qf_tokenizer *t, const int32_t *ids, int n);
/* The chat template text, or NULL when the checkpoint has none. */
const char *qf_tok_chat_template(const qf_tokenizer *t);
/* tokenizer_config.json's bos_token / eos_token text, as templates get them ("" when absent). */
const char *qf_tok_bos_text(const qf_tokenizer *t);
const char *qf_tok_eos_text(const qf_tokenizer *t);

#endif
