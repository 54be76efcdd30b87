"""Malformed and hostile requests: each gets a 4xx with a JSON error (or libevent's own 4xx for
broken HTTP), and the server answers correctly afterwards."""
import concurrent.futures
import json
import socket
import time

import pytest

from qfserver import Server, run_cli

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
OK_MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return dict({"messages": OK_MSGS, "max_tokens": 4}, **kw)


def compl(**kw):
    return dict({"prompt": "x", "max_tokens": 4}, **kw)


CASES = [
    (CHAT, b"{"), (CHAT, b""), (CHAT, b"[]"), (CHAT, b"null"), (CHAT, b'"str"'), (CHAT, b"{}"),
    (CHAT, {"messages": "hi"}), (CHAT, {"messages": []}), (CHAT, {"messages": [1]}),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}), (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user"}]}), (CHAT, {"messages": [{"role": "user", "content": 123}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}),
    (CHAT, chat(temperature="hot")), (CHAT, chat(temperature=-1)), (CHAT, chat(temperature=1e308)),
    (CHAT, chat(top_p=0)), (CHAT, chat(top_p=2)), (CHAT, chat(top_k="5")), (CHAT, chat(top_k=-5)),
    (CHAT, chat(max_tokens=-1)), (CHAT, chat(max_tokens=0)), (CHAT, chat(max_tokens=1e12)),
    (CHAT, chat(max_tokens=99999999999999)), (CHAT, chat(max_tokens="10")), (CHAT, chat(max_tokens=True)),
    (CHAT, chat(max_completion_tokens=-7)), (CHAT, chat(n=1000)), (CHAT, chat(n=2)), (CHAT, chat(n=0)),
    (CHAT, chat(logprobs=True, top_logprobs=1e9)), (CHAT, chat(logprobs=True, top_logprobs=1000000000)),
    (CHAT, chat(top_logprobs=2)), (CHAT, chat(logprobs="yes")), (CHAT, chat(stop=5)), (CHAT, chat(stop=["a"] * 17)),
    (CHAT, chat(stop=[""])), (CHAT, chat(stop=["x" * 1000])), (CHAT, chat(stop=[1, 2])), (CHAT, chat(stream="true")),
    (CHAT, chat(stream_options=5)), (CHAT, chat(stream_options={"include_usage": "yes"})), (CHAT, chat(seed="abc")),
    (CHAT, chat(seed=1.5)), (CHAT, chat(seed=2 ** 70)), (CHAT, chat(presence_penalty=5)), (CHAT, chat(frequency_penalty=-3)),
    (CHAT, chat(repetition_penalty=0)), (CHAT, chat(min_p=2)), (CHAT, chat(chat_template_kwargs="x")),
    (CHAT, chat(chat_template_kwargs={"enable_thinking": "no"})),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
    (CHAT, chat(response_format={"type": "json_object"})),
    (CHAT, b'{"messages":[{"role":"user","content":"\xff\xfe bad utf-8"}]}'),
    (CHAT, b'{"messages":[{"role":"user","content":"nul \\u0000 inside"}]}'),
    (CHAT, b'{"messages":[{"role":"user","content":"a"}],"messages":[]}'),
    (CHAT, b"[" * 100000 + b"]" * 100000), (CHAT, b'{"messages":[{"role":"user","content":"x"}],"temperature":1e400}'),
    (CHAT, {"messages": [{"role": "user", "content": "x = 1\n" * 3000}]}),
    (COMPL, compl(prompt=[-1])), (COMPL, compl(prompt=[999999999])), (COMPL, compl(prompt=[1.5])), (COMPL, compl(prompt="")),
    (COMPL, compl(prompt={})), (COMPL, compl(prompt=["a", "b"])), (COMPL, compl(prompt=[])), (COMPL, compl(prompt=None)),
    (COMPL, compl(echo=True)), (COMPL, compl(suffix="x")), (COMPL, compl(best_of=3)), (COMPL, compl(logprobs=100)),
    (COMPL, compl(logprobs=-2)), (COMPL, compl(prompt=[[1, 2], [3]])), (COMPL, compl(prompt=list(range(5000)))),
    ("/generate", {"prompt": 42}), ("/generate", {"prompt": "x", "temperature": "warm"}),
    ("/detokenize", {"tokens": [-5]}), ("/detokenize", {"tokens": "abc"}), ("/detokenize", {"tokens": [10 ** 12]}),
    ("/tokenize", {"prompt": 5}), ("/tokenize", {}), ("/tokenize", b"\xff"),
]


def raw_request(port, data, timeout=30):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered (413, 400) or closed before reading it all
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except OSError:
                break
            if not b:
                break
            out += b
        return out
    finally:
        s.close()


def status_of(reply):
    line = reply.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 1 else 0


def post_bytes(port, path, body, extra=b""):
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n%sContent-Length: %d\r\n\r\n" % (
        path.encode(), extra, len(body))
    return raw_request(port, head + body)


@pytest.fixture(scope="module")
def server():
    with Server("--ctx", "1024", "--max-body", "1") as s:
        yield s


def test_enough_cases():
    assert len(CASES) + len(HTTP_CASES) >= 50


@pytest.mark.parametrize("path,body", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_body(server, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = post_bytes(server.port, path, data)
    code = status_of(reply)
    assert 400 <= code < 500, reply[:300]
    head, _, payload = reply.partition(b"\r\n\r\n")
    if code != 413:
        err = json.loads(payload)["error"]
        assert err["message"] and err["type"] and err["code"] == code


HTTP_CASES = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n" + b" " * 2000000,
    b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
]
# Not listed: an unknown method (BREW) gets libevent's 501, which RFC 9110 asks for.


@pytest.mark.parametrize("data", HTTP_CASES, ids=[str(i) for i in range(len(HTTP_CASES))])
def test_bad_http(server, data):
    code = status_of(raw_request(server.port, data))
    assert 400 <= code < 500 or code == 0  # 0: libevent closed a request it could not parse


def test_still_correct_afterwards(server):
    for path, body in CASES[:5]:
        post_bytes(server.port, path, body if isinstance(body, bytes) else json.dumps(body).encode())
    reply = post_bytes(server.port, COMPL, json.dumps({"prompt": "def fib(n):", "max_tokens": 24, "temperature": 0}).encode())
    assert status_of(reply) == 200
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == run_cli("def fib(n):", 24)
    m = server.metrics()
    assert m["qflash:num_requests_running"] == 0 and m["qflash:kv_cache_pages_used"] == 0
    assert server.proc.poll() is None


def timed_get(port, path):
    t0 = time.monotonic()
    reply = raw_request(port, b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    return status_of(reply), time.monotonic() - t0


def test_health_while_huge_tokenize(server):
    """Tokenizing runs off the event loop: /health answers within 100 ms while four requests
    tokenize 100,000 emoji each (the time they took is printed)."""
    body = json.dumps({"prompt": "\U0001F642" * 100000}, ensure_ascii=False).encode()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        jobs = [ex.submit(post_bytes, server.port, "/tokenize", body) for _ in range(4)]
        waits = []
        while not all(j.done() for j in jobs) or not waits:
            code, dt = timed_get(server.port, "/health")
            assert code == 200
            waits.append(dt)
        replies = [j.result() for j in jobs]
    took = time.monotonic() - t0
    print("4 x /tokenize of 100,000 emoji: %.2f s; /health answered %d times, slowest %.1f ms" % (took, len(waits), 1e3 * max(waits)))
    assert all(status_of(r) == 200 and json.loads(r.partition(b"\r\n\r\n")[2])["count"] > 0 for r in replies)
    assert max(waits) < 0.1


def test_prompt_over_context_refused_unread(server):
    """A text prompt whose bytes cannot fit the context is refused before it is tokenized."""
    reply = post_bytes(server.port, COMPL, json.dumps(compl(prompt="a " * 400000)).encode())
    assert status_of(reply) == 400
    assert "bytes" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]
