#!/usr/bin/env python3
"""Load generator for `qflash serve` (or any OpenAI-compatible server): C concurrent streaming
completions of G tokens each (ignore_eos), for each C in --concurrency; prints total tokens/s,
per-stream tokens/s, TTFT and inter-token latency (mean, p50, p99). Standard library only.

  bench/serve_load.py --url http://127.0.0.1:8080 --concurrency 1,4,16 --gen 128 --prompt-len 64
  bench/serve_load.py ... --response-format json_object (or a JSON schema file): constrained output,
  which ends where the grammar is complete (compare per-stream tok/s and ITL, not totals)
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


RESPONSE_FORMAT = None


def one_stream(url, prompt, gen, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True, "ignore_eos": True}
    if RESPONSE_FORMAT:
        body["response_format"] = RESPONSE_FORMAT
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps = []
    for line in resp:
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            if ev["choices"] and ev["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    conn.close()
    out.append((t0, stamps))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def run(url, c, gen, prompt):
    out = []
    threads = [threading.Thread(target=one_stream, args=(url, prompt, gen, out)) for _ in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # chunks may carry more than one token when the reader lags; count tokens from the request size
    ttft = [s[0] - t for t, s in out if s]
    itl = [b - a for _, s in out for a, b in zip(s, s[1:])]
    total = c * gen
    # a model whose tokens have no text (a synthetic one) streams no chunks: only totals then
    per_stream = [len(s) / (s[-1] - t) for t, s in out if s]
    return {"concurrency": c, "tokens": total, "wall_s": wall, "total_tok_s": total / wall,
            "per_stream_tok_s": statistics.mean(per_stream) if per_stream else float("nan"),
            "ttft_mean_ms": 1e3 * statistics.mean(ttft) if ttft else float("nan"), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_mean_ms": 1e3 * statistics.mean(itl) if itl else float("nan"), "itl_p50_ms": 1e3 * pct(itl, 50),
            "itl_p99_ms": 1e3 * pct(itl, 99)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64, help="approximate prompt tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--response-format", help="json_object, or a JSON schema file")
    a = ap.parse_args()
    global RESPONSE_FORMAT
    if a.response_format == "json_object":
        RESPONSE_FORMAT = {"type": "json_object"}
    elif a.response_format:
        with open(a.response_format) as f:
            RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": json.load(f)}}
    prompt = "def f(x):\n    return x + 1\n" * max(1, a.prompt_len // 12)
    run(a.url, 2, 8, prompt)  # warm-up
    print("%5s %9s %12s %10s %10s %10s %9s %9s %9s" % ("conc", "tokens", "total tok/s", "per-stream", "ttft ms", "ttft p99",
                                                       "itl ms", "itl p50", "itl p99"))
    for c in [int(x) for x in a.concurrency.split(",")]:
        rs = [run(a.url, c, a.gen, prompt) for _ in range(a.runs)]
        r = sorted(rs, key=lambda r: r["total_tok_s"])[len(rs) // 2]  # the median run
        spread = max(x["total_tok_s"] for x in rs) - min(x["total_tok_s"] for x in rs)
        print("%5d %9d %12.1f %10.1f %10.1f %10.1f %9.2f %9.2f %9.2f   (median of %d, spread %.1f tok/s)" % (
            c, r["tokens"], r["total_tok_s"], r["per_stream_tok_s"], r["ttft_mean_ms"], r["ttft_p99_ms"], r["itl_mean_ms"],
            r["itl_p50_ms"], r["itl_p99_ms"], a.runs, spread))


if __name__ == "__main__":
    main()
