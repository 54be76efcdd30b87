#!/usr/bin/env python3
"""Many greedy completions at once against a running `qflash serve` (standard library only, for
machines without the test packages): N requests of different prompts and lengths from C threads,
so the server's batches keep changing; prints one line per request (its digest) and a digest of
all. Run it against a server with CUDA graphs and one without (`--cuda-opt graphs=0`), or against
the CPU: the texts must be the same.

  tools/serve_batch_check.py http://127.0.0.1:8080 [N] [C]
"""
import hashlib
import json
import sys
import threading
import urllib.request


def complete(url, i):
    body = {"prompt": "def helper_%d(x):\n    # step %d of %d\n" % (i, i % 7, i % 5 + 3), "max_tokens": 8 + (i * 13) % 41, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]["text"]


def main():
    url = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    conc = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    out, todo, lock = [None] * n, list(range(n)), threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                out[i] = complete(url, i)
            except Exception as e:  # a failed request shows in its line and in the total digest
                out[i] = "ERROR %s" % e

    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, t in enumerate(out):
        print("%3d %s%s" % (i, hashlib.sha256(t.encode()).hexdigest()[:12], " " + t if t.startswith("ERROR") else ""))
    print("all:", hashlib.sha256(json.dumps(out).encode()).hexdigest()[:16], "errors:", sum(t.startswith("ERROR") for t in out))


if __name__ == "__main__":
    main()
