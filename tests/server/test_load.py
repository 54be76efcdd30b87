"""bench/serve_load.py's ShareGPT-like mode against the bundled model: every request completes, the
server's usage equals the lengths the mix asked for (ignore_eos), and the latencies are consistent."""
import json
import os
import subprocess
import sys

from qfserver import ROOT, Server

sys.path.insert(0, os.path.join(ROOT, "bench"))
import serve_load  # noqa: E402


def test_mix_is_seeded_and_bounded():
    a, b = serve_load.sharegpt_lengths(500, 3, 2048), serve_load.sharegpt_lengths(500, 3, 2048)
    assert a == b and a != serve_load.sharegpt_lengths(500, 4, 2048)
    assert all(4 <= i <= 1024 and 1 <= o <= 1024 and i + o <= 2047 for i, o in a)
    mean_in, mean_out = sum(i for i, _ in a) / len(a), sum(o for _, o in a) / len(a)
    assert 150 < mean_in < 280 and 140 < mean_out < 260, (mean_in, mean_out)
    assert all(i + o <= 255 for i, o in serve_load.sharegpt_lengths(200, 0, 256))


def test_sharegpt_run(tmp_path):
    with Server("--max-batch", "8", "--ctx", "2048") as s:
        out = tmp_path / "r.json"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_load.py"), "--url", s.url, "--mix", "sharegpt",
                            "--num-prompts", "12", "--rate", "50", "--concurrency", "3,8", "--seed", "5", "--json", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        res = json.loads(out.read_text())["results"]
    pairs = serve_load.sharegpt_lengths(12, 5, 2048)
    assert [x["max_concurrency"] for x in res] == [3, 8]
    for x in res:
        assert x["completed"] == 12 and x["failed"] == 0
        assert x["input_tokens"] == sum(i for i, _ in pairs) and x["output_tokens"] == sum(o for _, o in pairs)
        assert 0 < x["ttft"]["p50_ms"] <= x["ttft"]["p99_ms"] <= x["e2el"]["p99_ms"]
        assert 0 < x["tpot"]["mean_ms"] and 0 < x["itl"]["p50_ms"] <= x["itl"]["p99_ms"]
        assert abs(x["total_tok_s"] * x["duration_s"] - x["input_tokens"] - x["output_tokens"]) < 1e-6 * x["total_tok_s"] + 1
        if x["max_concurrency"] == 3:  # 12 requests, 3 in flight: a window with every slot busy (the 3rd send to the last)
            assert x["steady_output_tok_s"] and 0 < x["steady_output_tok_s"]
