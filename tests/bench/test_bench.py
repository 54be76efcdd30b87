"""`qflash bench`: every field of the JSON is there and the numbers agree with one another."""
import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("QFLASH_BIN", os.path.join(ROOT, "build", "qflash"))
MODEL = os.path.join(ROOT, "models", "qwen36moe-code-14m")


def bench(tmp_path, *args):
    out, svg = tmp_path / "b.json", tmp_path / "b.svg"
    r = subprocess.run([BIN, "bench", *args, "--json", str(out), "--plot", str(svg), "-t", "2"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), svg.read_text(), r.stdout


def close(a, b, rel=0.02, abs_=1e-3):
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_)


def check_report(j, svg, conc, prompt, gen, runs):
    assert j["device"] == "cpu" and j["peak_device_bytes"] is None
    assert j["machine"]["cores"] >= 1 and j["machine"]["threads"] >= 1 and j["machine"]["cpu"]
    assert j["methodology"]["warmup_runs"] == 1 and j["methodology"]["runs"] == runs and j["methodology"]["statistic"] == "median"
    assert j["methodology"]["prefill_chunk"] == max(512, max(conc))  # the default, widened to the largest batch
    assert j["load_seconds"] > 0 and j["bandwidth"]["gb_s"] > 0 and j["peak_rss_bytes"] > j["model"]["weight_bytes"] * 0.5
    assert [c["concurrency"] for c in j["configs"]] == conc
    for c in j["configs"]:
        C, steps = c["concurrency"], c["decode_steps"]
        assert c["prompt_len"] == prompt and c["gen_len"] == gen and steps == gen - 1 and c["runs"] == runs
        for k in ["prefill_ms", "prefill_tok_s", "ttft_ms", "decode_seconds", "decode_tok_s_total", "decode_tok_s_per_stream"]:
            s = c[k]
            assert 0 < s["min"] <= s["median"] <= s["max"], k
        # the run details are what the medians were taken of
        d = c["run_details"]
        assert len(d) == runs
        assert close(sorted(x["decode_seconds"] for x in d)[runs // 2], c["decode_seconds"]["median"], 1e-9)
        assert close(sorted(x["prefill_ms"] for x in d)[runs // 2], c["prefill_ms"]["median"], 1e-9)
        for x in d:
            assert x["ttft_ms"] >= x["prefill_ms"]
            # decode time = the steps' latencies (only the loop's bookkeeping is outside them)
            assert close(x["decode_seconds"], x["itl_sum_ms"] / 1e3, 0.05, 2e-3)
        itl = c["itl_ms"]
        assert itl["samples"] == runs * steps
        assert close(itl["mean"] * itl["samples"], sum(x["itl_sum_ms"] for x in d), 1e-6)
        assert 0 < itl["p50"] <= itl["p99"]
        assert close(c["decode_tok_s_total"]["median"], C * steps / c["decode_seconds"]["median"], 1e-6)
        assert close(c["decode_tok_s_per_stream"]["median"] * C, c["decode_tok_s_total"]["median"], 1e-6)
        assert close(c["prefill_tok_s"]["median"], C * prompt / (sorted(x["prefill_ms"] for x in d)[runs // 2] / 1e3), 1e-6)
        assert close(c["bytes_per_token"] * C, c["bytes_per_step"], 1e-9)
        assert close(c["roofline_tok_s"], j["bandwidth"]["gb_s"] * 1e9 / c["bytes_per_token"], 1e-6)
        assert close(c["roofline_pct"], 100 * c["decode_tok_s_total"]["median"] / c["roofline_tok_s"], 1e-6)
        assert len(c["decoded_ids_fnv1a"]) == 16 and int(c["decoded_ids_fnv1a"], 16) != 0
        if "streaming_loads" in c["not_active"]:
            assert c["streaming_loads"] == 0 and c["expert_cache_hit_rate"] == 0
        if "inactive_block_ratio" in c["not_active"]:
            assert c["inactive_block_ratio"] == {"experts": 0, "trunk": 0, "kv_pages": 0}
    trace = j["memory_trace"]
    assert len(trace) >= 2
    assert all(b["t"] >= a["t"] for a, b in zip(trace, trace[1:])) and all(m["rss_bytes"] > 0 for m in trace)
    assert {"load", "measure"} <= {m["phase"] for m in trace}
    assert svg.startswith("<svg") and "<polyline" in svg and "Inter-token latency" in svg and svg.rstrip().endswith("</svg>")


def test_bench_bundled_model(tmp_path):
    j, svg, out = bench(tmp_path, "-m", MODEL, "--prompt-len", "48", "--gen-len", "24", "--concurrency", "1,4", "--runs", "3")
    check_report(j, svg, [1, 4], 48, 24, 3)
    assert j["model"]["layers"] == 8 and j["model"]["experts_used"] == 4
    assert j["configs"][0]["experts_per_step"] == 8 * 4  # one token: top-4 in each of 8 layers
    assert "methodology" in out and "% roof" in out
    assert all(f"decoded ids: {c['decoded_ids_fnv1a']}" in out for c in j["configs"])


def test_bench_expert_cache(tmp_path):
    """--expert-cache: the decoded ids of the resident run, and the cache's loads, hit rate and bytes
    streamed per token counted (not the placeholders)."""
    args = ["-m", MODEL, "--prompt-len", "48", "--gen-len", "24", "--concurrency", "1,4", "--runs", "1"]
    resident, _, _ = bench(tmp_path, *args)
    j, svg, out = bench(tmp_path, *args, "--expert-cache", "3M")
    check_report(j, svg, [1, 4], 48, 24, 1)
    for c, r in zip(j["configs"], resident["configs"]):
        assert c["decoded_ids_fnv1a"] == r["decoded_ids_fnv1a"]
        assert c["not_active"] == ["inactive_block_ratio"] and c["streaming_loads"] > 0 and 0 < c["expert_cache_hit_rate"] < 1
        per_expert = 3 * 32 * 192 * 2  # bf16 gate, up, down of one expert
        tokens = c["concurrency"] * 23
        assert close(c["streamed_bytes_per_token"] * tokens, c["streaming_loads"] * per_expert, 1e-9)
    assert "expert cache:" in out and "computed on the host)" in out
    assert all(c["host_computed"] == 0 for c in j["configs"])  # no hybrid on the CPU


def test_bench_sparsity(tmp_path):
    """--sparsity-level: the routed experts dropped in the decode steps counted (no trunk thresholds
    in the bundled model's directory: no trunk entries zeroed), other ids than dense."""
    args = ["-m", MODEL, "--prompt-len", "48", "--gen-len", "24", "--concurrency", "1,4", "--runs", "1"]
    dense, _, _ = bench(tmp_path, *args)
    j, svg, out = bench(tmp_path, *args, "--sparsity-level", "0.7")
    check_report(j, svg, [1, 4], 48, 24, 1)
    for c, d in zip(j["configs"], dense["configs"]):
        assert "inactive_block_ratio" not in c["not_active"] and "inactive_block_ratio" in d["not_active"]
        assert 0 < c["inactive_block_ratio"]["experts"] <= 0.5 and c["inactive_block_ratio"]["trunk"] == 0
    assert "routed experts dropped" in out


def test_bench_fixed_bandwidth(tmp_path):
    j, _, _ = bench(tmp_path, "-m", MODEL, "--prompt-len", "8", "--gen-len", "4", "--concurrency", "2", "--runs", "1", "--bw", "10")
    assert j["bandwidth"] == {"gb_s": 10.0, "source": "--bw"}


@pytest.mark.skipif(os.environ.get("QFLASH_SANITIZE") == "1", reason="3.7 GB of generated weights: release build only")
def test_bench_synthetic_slice(tmp_path):
    j, svg, _ = bench(tmp_path, "--synthetic", "qwen3.6-35b-a3b", "--layers", "1", "--prompt-len", "16", "--gen-len", "4",
                      "--concurrency", "1", "--runs", "1")
    check_report(j, svg, [1], 16, 4, 1)
    m = j["model"]
    assert m["layers"] == 1 and m["experts"] == 256 and m["experts_used"] == 8 and m["source"] == "synthetic:qwen3.6-35b-a3b"
    # embedding + lm_head (248320 x 2048) + one DeltaNet layer with 256 experts of 3 x 512 x 2048, in bf16
    assert 3.6e9 < m["weight_bytes"] < 3.8e9
    assert j["configs"][0]["experts_per_step"] == 8


@pytest.mark.skipif(os.environ.get("QFLASH_SANITIZE") == "1", reason="generated full-size weights: release build only")
def test_bench_synthetic_mtp_slice(tmp_path):
    """The synthetic model's MTP head of the release's shapes runs on a one-layer slice: drafts are
    made and verified (random weights accept almost none), and the ids are the plain ones."""
    _, _, out = bench(tmp_path, "--synthetic", "qwen3.6-35b-a3b", "--layers", "1", "--prompt-len", "8", "--gen-len", "6",
                      "--concurrency", "1", "--runs", "1", "--warmup", "0", "--draft", "2")
    lines = [l for l in out.splitlines() if l.strip().startswith("--draft")]
    assert [l.split(":")[0].strip() for l in lines] == ["--draft 0", "--draft 1", "--draft 2"], out
    for l in lines[1:]:
        assert "ids as plain" in l and "drafts accepted" in l, l
        assert int(re.search(r"(\d+) of (\d+) drafts accepted", l).group(2)) > 0, l  # drafts were made


def test_bench_bad_arguments():
    for args in (["--synthetic", "qwen9-1t"], ["-m", MODEL, "--concurrency", "0"], ["-m", MODEL, "--synthetic", "qwen3.6-35b-a3b"], []):
        r = subprocess.run([BIN, "bench", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and ("error" in r.stderr or "usage" in r.stderr)
