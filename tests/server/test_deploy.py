"""deploy/: two `qflash serve` replicas of the bundled model behind nginx (least_conn), started by
deploy/replicas.sh on loopback: requests spread over both, every one is answered with the greedy
text `qflash run` gives, a replica killed while it holds requests is routed around and none is
lost; /ready and the vLLM-named metrics a router reads."""
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import sys
import subprocess
import time

import pytest

from qfserver import BIN, MODEL, ROOT, run_cli

PROMPT = "def fibonacci(n):"


def ports_free(*ports):
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            socks.append(s)
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def pick_ports():
    # below Linux's ephemeral range (32768 on), where the other suites' servers and clients, run
    # beside this one, take their ports: a port seen free here stays free until nginx binds it
    for base in range(10000 + os.getpid() % 20000, 32700, 7):
        if ports_free(base, base + 1, base + 2):
            return base, base + 1  # the front, then the replicas from base + 1
    raise RuntimeError("no free ports")


def call(port, method, path, body=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def complete(port, n, ignore_eos=False):
    st, body = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": ignore_eos})
    return st, json.loads(body) if st == 200 else body


def metrics(port):
    st, text = call(port, "GET", "/metrics")
    assert st == 200
    # vLLM's series carry a model_name label: keyed by the bare name too
    lines = [ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#")]
    out = {k: float(v) for k, v in lines}
    out.update({k.split("{")[0]: float(v) for k, v in lines if k.startswith("vllm:") and k.endswith('"}') and k.count("=") == 1})
    return out


@pytest.fixture
def cluster(tmp_path):
    front, first = pick_ports()
    args = ["sh", os.path.join(ROOT, "deploy", "replicas.sh"), "2", str(front), str(first), str(tmp_path), "--", "-m", MODEL, "-t", "1",
            "--max-batch", "4", "--ctx", "1024"]
    p = subprocess.Popen(args, env=dict(os.environ, QFLASH=BIN), start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if all(call(port, "GET", "/ready", timeout=2)[0] == 200 for port in (first, first + 1, front)):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("the replicas or nginx did not come up: " + " | ".join(
                open(tmp_path / f).read()[-500:] for f in os.listdir(tmp_path) if f.endswith(".log")))
        pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
        yield front, [first, first + 1], pids
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_spread_and_failover(cluster):
    front, replicas, pids = cluster
    want = run_cli(PROMPT, 24)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda _: complete(front, 24), range(12)))
    assert all(st == 200 and r["choices"][0]["text"] == want for st, r in got), got[:2]
    counts = [metrics(p)["qflash:requests_total"] for p in replicas]
    assert all(c >= 1 for c in counts) and sum(counts) >= 12, counts  # least_conn spread them
    m = metrics(replicas[0])
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert name in m, name
    assert m["vllm:num_requests_waiting"] == m["qflash:num_requests_waiting"] and 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0
    # long generations in flight on both; replica 0 dies holding some: nginx sends those again to replica 1
    before = metrics(replicas[1])["qflash:requests_total"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(complete, front, 900, True) for _ in range(6)]
        for _ in range(250):  # killed while it holds some (900 tokens take seconds at -t 1)
            if metrics(replicas[0])["qflash:num_requests_running"] >= 1:
                break
            time.sleep(0.02)
        os.kill(pids[0], signal.SIGKILL)
        done = [f.result() for f in futs]
    assert all(st == 200 and r["usage"]["completion_tokens"] == 900 for st, r in done), [d[1] if d[0] != 200 else d[0] for d in done]
    after = [complete(front, 24) for _ in range(4)]
    assert all(st == 200 and r["choices"][0]["text"] == want for st, r in after)
    served = metrics(replicas[1])["qflash:requests_total"] - before
    assert served >= 4 + 4, served  # least_conn gave it 3 of the 6; it also served what replica 0 dropped
    st, body = call(front, "GET", "/ready")
    assert st == 200 and json.loads(body)["status"] == "ready"


def test_ready_states(cluster):
    front, replicas, pids = cluster
    st, body = call(replicas[1], "GET", "/ready")
    assert st == 200 and json.loads(body) == {"status": "ready", "running": 0, "waiting": 0}
    os.kill(pids[1], signal.SIGTERM)  # draining: not ready while it finishes (or gone)
    try:
        st, body = call(replicas[1], "GET", "/ready", timeout=5)
        assert st == 503 and json.loads(body)["reason"] == "draining"
    except OSError:
        pass  # already closed: a router sees it gone
    assert complete(front, 8)[0] == 200


def test_replicas_in_one_process():
    """serve --dp 2: two engines and schedulers behind one endpoint; requests go to the less loaded,
    both serve, every answer is `qflash run`'s, and /metrics sums them and shows each."""
    from qfserver import Server
    want = run_cli(PROMPT, 24)
    with Server("--dp", "2", "--max-batch", "4", "--ctx", "1024") as s:
        port = s.port
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda _: complete(port, 24), range(16)))
        assert all(st == 200 and r["choices"][0]["text"] == want for st, r in got), got[:2]
        m = metrics(port)
        per = [m['qflash:replica_requests_total{replica="%d"}' % i] for i in range(2)]
        assert all(p >= 2 for p in per) and sum(per) == m["qflash:requests_total"] == 16, (per, m["qflash:requests_total"])
        st, body = call(port, "GET", "/ready")
        assert st == 200 and json.loads(body)["running"] == 0


def start_router(policy, workers):
    """vllm-router (PyPI) in front of the workers; its port once it answers."""
    port = pick_ports()[0]
    code = "import sys; from vllm_router.launch_router import main; sys.argv[0] = 'vllm-router'; sys.exit(main())"
    p = subprocess.Popen([sys.executable, "-c", code, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if complete(port, 1)[0] == 200:
                return p, port
        except OSError:
            pass
        time.sleep(0.3)
    os.killpg(p.pid, signal.SIGKILL)
    raise RuntimeError("vllm-router did not come up")


def test_vllm_router():
    """vllm-router from PyPI speaks to qflash replicas: round_robin spreads requests evenly; the
    prefix-aware cache_aware policy keeps a repeated prompt on one replica (where its prefix
    snapshots are); every answer is `qflash run`'s."""
    import vllm_router  # noqa: F401  (tools/deps-test.sh installs it)
    from qfserver import Server
    want = run_cli(PROMPT, 24)
    with Server("--max-batch", "4", "--ctx", "1024") as a, Server("--max-batch", "4", "--ctx", "1024") as b:
        workers = [a.url, b.url]
        for policy in ("round_robin", "cache_aware"):
            before = [metrics(s.port)["qflash:requests_total"] for s in (a, b)]
            p, port = start_router(policy, workers)
            try:
                got = [complete(port, 24) for _ in range(8)]
            finally:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            assert all(st == 200 and r["choices"][0]["text"] == want for st, r in got), got[:1]
            served = [metrics(s.port)["qflash:requests_total"] - n for s, n in zip((a, b), before)]
            if policy == "round_robin":
                assert abs(served[0] - served[1]) <= 1 and sum(served) >= 8, served  # (+1: the router's readiness probe)
            else:
                assert min(served) == 0 and max(served) >= 8, served
