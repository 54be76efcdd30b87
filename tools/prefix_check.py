#!/usr/bin/env python3
"""A short conversation against a running `qflash serve` (standard library only, for machines
without the test packages): prints, per turn, the prompt and cached token counts and a digest of
the reply's text and logprobs, and for n=2 whether both greedy choices equal the n=1 reply.
Run it against a server with the prefix cache and one without: the digests must be equal.

  tools/prefix_check.py http://127.0.0.1:8080 [turns]
"""
import hashlib
import json
import sys
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))


def main():
    url, turns = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    msgs = [{"role": "system", "content": "You are a careful Python programmer. " * 8}]
    for t in range(turns):
        msgs.append({"role": "user", "content": "Write helper number %d." % t})
        r = post(url, {"messages": msgs, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3})
        ch = r["choices"][0]
        digest = hashlib.sha256(json.dumps([ch["message"]["content"], ch["logprobs"]]).encode()).hexdigest()[:16]
        print("turn %d: prompt %d cached %d reply %s" % (t, r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"], digest))
        msgs.append({"role": "assistant", "content": ch["message"]["content"]})
    two = post(url, {"messages": msgs[:2], "max_tokens": 12, "temperature": 0, "n": 2})
    one = post(url, {"messages": msgs[:2], "max_tokens": 12, "temperature": 0})
    print("n=2 choices equal n=1:", [c["message"]["content"] for c in two["choices"]] == [one["choices"][0]["message"]["content"]] * 2)


if __name__ == "__main__":
    main()
