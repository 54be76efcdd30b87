#!/usr/bin/env python3
"""The request-level sampling controls against a running `qflash serve` (standard library only,
for the GPU machine): logit_bias forcing and banning a token, stop_token_ids and min_tokens, at
temperature 0 and on the sampled path. On a GPU these requests take the host pick; the checks
are the same as tests/server/test_serving.py asks of the CPU build. Prints a line per check and
exits non-zero when one fails.

  tools/serve_bias_check.py http://127.0.0.1:8080
"""
import json
import sys
import urllib.request


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))


def complete(url, **kw):
    return post(url, "/v1/completions", {"prompt": "def f():", **kw})["choices"][0]


def checks(url):
    five = post(url, "/detokenize", {"tokens": [5] * 4})["prompt"]
    yield "bias +100 forces token 5 (greedy)", complete(url, max_tokens=4, temperature=0, logit_bias={"5": 100})["text"] == five
    yield "bias +100 forces token 5 (sampled)", complete(url, max_tokens=4, temperature=0.9, seed=3, logit_bias={"5": 100})["text"] == five
    plain = complete(url, max_tokens=6, temperature=0)["text"]
    ids = post(url, "/tokenize", {"prompt": plain})["tokens"]
    first = post(url, "/detokenize", {"tokens": ids[:1]})["prompt"]
    banned = complete(url, max_tokens=1, temperature=0, logit_bias={str(ids[0]): -100})["text"]
    yield "bias -100 bans the greedy token", banned != first
    stopped = complete(url, max_tokens=6, temperature=0, stop_token_ids=[ids[2]])
    yield "stop_token_ids ends before the id", stopped["finish_reason"] == "stop" and stopped["text"] == post(url, "/detokenize", {"tokens": ids[:2]})["prompt"]
    held = post(url, "/v1/completions", {"prompt": "def f():", "max_tokens": 6, "temperature": 0, "stop_token_ids": [ids[0]], "min_tokens": 6})
    yield "min_tokens holds a stop id back", held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "length"


def main():
    failed = 0
    for name, ok in checks(sys.argv[1]):
        print(("ok   " if ok else "FAIL ") + name)
        failed += not ok
    print("bias: %d failed" % failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
