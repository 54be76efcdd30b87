#!/usr/bin/env python3
"""Load generator for `qflash serve` (or any OpenAI-compatible server). Standard library only.

Two modes:

  --mix fixed (default): C concurrent streaming completions of G tokens each (ignore_eos), for
  each C in --concurrency; prints total tokens/s, per-stream tokens/s, TTFT and inter-token
  latency (mean, p50, p99).
    bench/serve_load.py --url http://127.0.0.1:8080 --concurrency 1,4,16 --gen 128 --prompt-len 64
    bench/serve_load.py ... --response-format json_object (or a JSON schema file): constrained output,
    which ends where the grammar is complete (compare per-stream tok/s and ITL, not totals)

  --mix sharegpt: the way vLLM's benchmark_serving drives a server: --num-prompts requests whose
  input and output lengths follow a ShareGPT-like mix (log-normal, input median 130 and output
  median 132 tokens, means ~215 and ~198, clipped to 4..1024 and to the context), sent as a Poisson
  process at --rate requests/s (inf: all at once) with at most C in flight for each C in
  --concurrency; prompts are token-id windows of a tokenized text (the server's /tokenize), each
  request streams greedy tokens with ignore_eos and reports its usage. Prints completed requests,
  request/input/output/total throughput, TTFT, TPOT (time per output token after the first), ITL
  and end-to-end latency (mean, p50, p99), and the steady output rate (tok/s from the C-th send to
  the last one, while every slot is busy: the whole-run figure also holds the drain, where the
  longest outputs run nearly alone); --json FILE writes them too.
    bench/serve_load.py --mix sharegpt --num-prompts 200 --rate 8 --concurrency 1,16,64

  --mix long: C streams decode (--gen tokens each, ignore_eos); once each has its first token, one
  prompt of --long-len token ids arrives (one token asked). Prints its time to the first token and
  the streams' inter-token latency (p50, p99, max) while it was in the server and outside it.
    bench/serve_load.py --mix long --concurrency 4 --long-len 8192 --gen 256
"""
import argparse
import math
import random
import http.client
import json
import statistics
import threading
import time
import urllib.parse


RESPONSE_FORMAT = None
SAMPLING = {"temperature": 0}  # --temperature / --top-p / --top-k (greedy unless given)


def one_stream(url, prompt, gen, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = dict(SAMPLING, prompt=prompt, max_tokens=gen, stream=True, ignore_eos=True)
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


BASE_TEXT = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "The quick brown fox jumps over the lazy dog. Serving a language model means many users at once: their prompts are\n"
    "prefilled in chunks beside the running decodes, and every step reads the weights once for all of them.\n"
    "import json\nwith open('data.json') as f:\n    rows = json.load(f)\nprint(sum(r['value'] for r in rows if r['ok']))\n")


def post(url, path, body, timeout=600):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError("%s: HTTP %d %s" % (path, resp.status, data[:200]))
    return json.loads(data)


def sharegpt_lengths(n, seed, ctx):
    """A ShareGPT-like (input, output) token-length mix: log-normal, input median 130 (sigma 1.0),
    output median 132 (sigma 0.9), each clipped to 4..1024 and the pair to the context."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = min(1024, max(4, int(round(rng.lognormvariate(math.log(130), 1.0)))))
        o = min(1024, max(4, int(round(rng.lognormvariate(math.log(132), 0.9)))))
        if i + o > ctx - 1:
            i = max(4, min(i, (ctx - 1) // 2))
            o = max(1, ctx - 1 - i)
        out.append((i, o))
    return out


def one_request(url, ids, gen, rec):
    """One streamed completion of token ids (SAMPLING's settings); rec gets the send time, each
    chunk's arrival and the usage the server reports."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = dict(SAMPLING, prompt=ids, max_tokens=gen, stream=True, ignore_eos=True, stream_options={"include_usage": True})
    rec["t0"] = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = "HTTP %d" % resp.status
            return
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                rec["usage"] = ev["usage"]
            if ev.get("choices") and ev["choices"][0].get("text"):
                rec["stamps"].append(time.perf_counter())
    except OSError as e:
        rec["error"] = str(e)
    finally:
        rec["t1"] = time.perf_counter()
        conn.close()


def sharegpt_run(url, pairs, corpus, rate, conc, seed):
    """Sends the requests as a Poisson process at `rate` (inf: at once), at most `conc` in flight."""
    rng = random.Random(seed + 1)
    gate = threading.Semaphore(conc)
    recs, threads = [], []
    start = time.perf_counter()
    due = start
    for k, (n_in, n_out) in enumerate(pairs):
        if rate != float("inf"):
            due += rng.expovariate(rate)
            time.sleep(max(0.0, due - time.perf_counter()))
        gate.acquire()
        off = (k * 7919) % len(corpus)
        ids = (corpus * (n_in // len(corpus) + 2))[off:off + n_in]
        rec = {"stamps": [], "n_in": n_in, "n_out": n_out}
        recs.append(rec)

        def work(ids=ids, n_out=n_out, rec=rec):
            try:
                one_request(url, ids, n_out, rec)
            finally:
                gate.release()
        t = threading.Thread(target=work)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return recs, time.perf_counter() - start


def steady_rate(ok, conc):
    """Output tok/s while the server held `conc` requests: from the conc-th request's send to the
    last one's (after that the run drains and its tail, the longest outputs, runs nearly alone).
    A request's chunks in the window count its tokens per chunk. None when there is no such window."""
    sends = sorted(r["t0"] for r in ok)
    if len(sends) <= conc:
        return None
    t_a, t_b = sends[conc - 1], sends[-1]
    if t_b <= t_a:
        return None
    n = 0.0
    for r in ok:
        if r["stamps"]:
            per = (r["usage"]["completion_tokens"] if r.get("usage") else r["n_out"]) / len(r["stamps"])
            n += per * sum(t_a <= t < t_b for t in r["stamps"])
    return n / (t_b - t_a)


def sharegpt_report(recs, wall, conc, rate):
    ok = [r for r in recs if "error" not in r]
    n_in = sum(r["usage"]["prompt_tokens"] if r.get("usage") else r["n_in"] for r in ok)
    n_out = sum(r["usage"]["completion_tokens"] if r.get("usage") else r["n_out"] for r in ok)
    ttft = [r["stamps"][0] - r["t0"] for r in ok if r["stamps"]]
    e2e = [r["t1"] - r["t0"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = []
    for r in ok:
        n = r["usage"]["completion_tokens"] if r.get("usage") else r["n_out"]
        if r["stamps"] and n > 1:
            tpot.append((r["stamps"][-1] - r["stamps"][0]) / (n - 1))

    def stats(xs):
        return {"mean_ms": 1e3 * statistics.mean(xs) if xs else float("nan"), "p50_ms": 1e3 * pct(xs, 50), "p99_ms": 1e3 * pct(xs, 99)}
    return {"max_concurrency": conc, "request_rate": rate, "completed": len(ok), "failed": len(recs) - len(ok), "duration_s": wall,
            "input_tokens": n_in, "output_tokens": n_out, "request_throughput": len(ok) / wall, "input_tok_s": n_in / wall,
            "output_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall, "steady_output_tok_s": steady_rate(ok, conc),
            "ttft": stats(ttft), "tpot": stats(tpot),
            "itl": stats(itl), "e2el": stats(e2e)}


def sharegpt_main(a):
    tok = post(a.url, "/tokenize", {"prompt": BASE_TEXT * 8})
    corpus, ctx = tok["tokens"], int(tok.get("max_model_len") or 4096)
    pairs = sharegpt_lengths(a.num_prompts, a.seed, ctx)
    rate = float(a.rate)
    one_request(a.url, corpus[:8], 4, {"stamps": []})  # warm-up
    results = []
    print("ShareGPT-like mix: %d requests, %d input and %d output tokens requested, request rate %s/s" % (
        len(pairs), sum(i for i, _ in pairs), sum(o for _, o in pairs), a.rate))
    print("%5s %6s %9s %9s %9s %10s %10s | %8s %8s %8s | %7s %7s %7s | %7s %7s | %8s" % (
        "conc", "done", "req/s", "out tok/s", "steady/s", "total/s", "dur s", "ttft ms", "p50", "p99", "tpot ms", "p50", "p99", "itl p50", "p99", "e2e p50"))
    for c in [int(x) for x in a.concurrency.split(",")]:
        recs, wall = sharegpt_run(a.url, pairs, corpus, rate, c, a.seed)
        r = sharegpt_report(recs, wall, c, a.rate)
        results.append(r)
        steady = "%9.1f" % r["steady_output_tok_s"] if r["steady_output_tok_s"] else "%9s" % "-"
        print("%5d %6d %9.2f %9.1f %s %10.1f %10.1f | %8.1f %8.1f %8.1f | %7.2f %7.2f %7.2f | %7.2f %7.2f | %8.0f%s" % (
            c, r["completed"], r["request_throughput"], r["output_tok_s"], steady, r["total_tok_s"], r["duration_s"], r["ttft"]["mean_ms"],
            r["ttft"]["p50_ms"], r["ttft"]["p99_ms"], r["tpot"]["mean_ms"], r["tpot"]["p50_ms"], r["tpot"]["p99_ms"], r["itl"]["p50_ms"],
            r["itl"]["p99_ms"], r["e2el"]["p50_ms"], "  (%d failed)" % r["failed"] if r["failed"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mix": "sharegpt", "num_prompts": len(pairs), "seed": a.seed, "results": results}, f, indent=1)


def long_main(a):
    tok = post(a.url, "/tokenize", {"prompt": BASE_TEXT * (a.long_len // 200 + 2)})
    corpus = tok["tokens"]
    ids = (corpus * (a.long_len // len(corpus) + 1))[:a.long_len]
    one_request(a.url, corpus[:8], 4, {"stamps": []})  # warm-up
    for c in [int(x) for x in a.concurrency.split(",")]:
        recs = [{"stamps": []} for _ in range(c)]
        threads = [threading.Thread(target=one_request, args=(a.url, corpus[k:k + 16], a.gen, recs[k])) for k in range(c)]
        for t in threads:
            t.start()
        while not all(r["stamps"] or "error" in r for r in recs):
            time.sleep(0.005)
        big = {"stamps": []}
        one_request(a.url, ids, 1, big)
        for t in threads:
            t.join()
        if "error" in big or not big["stamps"]:
            print("the long prompt failed: %s" % big.get("error"))
            continue
        t_a, t_b = big["t0"], big["stamps"][0]
        inside, outside = [], []
        for r in recs:
            for x, y in zip(r["stamps"], r["stamps"][1:]):
                (inside if y > t_a and x < t_b else outside).append(y - x)
        n_in = big["usage"]["prompt_tokens"] if big.get("usage") else a.long_len

        def f(xs):
            return "p50 %.1f p99 %.1f max %.1f ms (%d)" % (1e3 * pct(xs, 50), 1e3 * pct(xs, 99), 1e3 * max(xs), len(xs)) if xs else "-"
        print("%d streams decoding: a %d-token prompt's first token in %.3f s; their ITL while it ran: %s; else: %s; "
              "errors %d" % (c, n_in, t_b - t_a, f(inside), f(outside), sum("error" in r for r in recs)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--mix", choices=["fixed", "sharegpt", "long"], default="fixed")
    ap.add_argument("--long-len", type=int, default=8192, help="long: the long prompt's tokens")
    ap.add_argument("--concurrency", default="1,4,16", help="fixed: streams at once; sharegpt: requests in flight at most")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64, help="approximate prompt tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--response-format", help="json_object, or a JSON schema file")
    ap.add_argument("--num-prompts", type=int, default=200, help="sharegpt: requests a run")
    ap.add_argument("--rate", default="inf", help="sharegpt: requests a second (Poisson), or inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling (0: greedy); e.g. Qwen's 0.7 with --top-p 0.8 --top-k 20")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--json", help="sharegpt: write the results here")
    a = ap.parse_args()
    if a.temperature > 0:
        SAMPLING.update(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.mix == "sharegpt":
        sharegpt_main(a)
        return
    if a.mix == "long":
        long_main(a)
        return
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
