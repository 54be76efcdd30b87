"""Malformed and hostile requests: each gets a 4xx with a JSON error (or libevent's own 4xx for
broken HTTP), and the server answers correctly afterwards."""
import concurrent.futures
import json
import os
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
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user"}]}), (CHAT, {"messages": [{"role": "user", "content": 123}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}),
    (CHAT, chat(temperature="hot")), (CHAT, chat(temperature=-1)), (CHAT, chat(temperature=1e308)),
    (CHAT, chat(top_p=0)), (CHAT, chat(top_p=2)), (CHAT, chat(top_k="5")), (CHAT, chat(top_k=-5)),
    (CHAT, chat(max_tokens=-1)), (CHAT, chat(max_tokens=0)), (CHAT, chat(max_tokens=1e12)),
    (CHAT, chat(max_tokens=99999999999999)), (CHAT, chat(max_tokens="10")), (CHAT, chat(max_tokens=True)),
    (CHAT, chat(max_completion_tokens=-7)), (CHAT, chat(n=1000)), (CHAT, chat(n=17)), (CHAT, chat(n=0)),
    (CHAT, chat(logprobs=True, top_logprobs=1e9)), (CHAT, chat(logprobs=True, top_logprobs=1000000000)),
    (CHAT, chat(top_logprobs=2)), (CHAT, chat(logprobs="yes")), (CHAT, chat(stop=5)), (CHAT, chat(stop=["a"] * 17)),
    (CHAT, chat(stop=[""])), (CHAT, chat(stop=["x" * 1000])), (CHAT, chat(stop=[1, 2])), (CHAT, chat(stream="true")),
    (CHAT, chat(stream_options=5)), (CHAT, chat(stream_options={"include_usage": "yes"})), (CHAT, chat(seed="abc")),
    (CHAT, chat(seed=1.5)), (CHAT, chat(seed=2 ** 70)), (CHAT, chat(presence_penalty=5)), (CHAT, chat(frequency_penalty=-3)),
    (CHAT, chat(repetition_penalty=0)), (CHAT, chat(min_p=2)), (CHAT, chat(chat_template_kwargs="x")),
    (CHAT, chat(chat_template_kwargs={"enable_thinking": "no"})),
    (CHAT, chat(tools="all")), (CHAT, chat(tools=[5])), (CHAT, chat(model=5)),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}})),
    (CHAT, chat(response_format={"type": "json_schema"})),
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


# Roles and tools are the chat template's to take or refuse: the bundled model's (Qwen3.6's own)
# renders tools, and raises on a role it does not know or a chat without a user query, which is a
# 400 carrying the template's own message.
ACCEPTED = [
    chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "x", "tool_call_id": "1"}], "max_tokens": 2},
]
TEMPLATE_REFUSED = [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}], "max_tokens": 2}, "Unexpected message role."),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}], "max_tokens": 2}, "No user query found in messages."),
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
        j = json.loads(payload)
        err = j["error"]
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert j["type"] == "error" and err["message"] and err["type"].endswith("_error"), j
        else:  # OpenAI's: param names the field, code a string or null
            assert err["message"] and err["type"] and "param" in err and (err["code"] is None or isinstance(err["code"], str)), j


@pytest.mark.parametrize("body", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_template_decides(server, body):
    reply = post_bytes(server.port, CHAT, json.dumps(body).encode())
    assert status_of(reply) == 200, reply[:300]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("body,message", TEMPLATE_REFUSED, ids=[str(i) for i in range(len(TEMPLATE_REFUSED))])
def test_template_refuses(server, body, message):
    reply = post_bytes(server.port, CHAT, json.dumps(body).encode())
    assert status_of(reply) == 400, reply[:300]
    assert message in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]


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
    """Tokenizing runs off the event loop: /health answers within 100 ms (or a quarter of the
    time the tokenizations took, where a sanitizer slows them) while four requests tokenize
    100,000 emoji each (the time they took is printed)."""
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
    # a loop blocked by a tokenization would hold /health for one tokenization at least, a quarter
    # of `took` or more; a sanitizer's slower tokenizing widens the bound with it
    assert max(waits) < max(0.1, took / 4)


def test_prompt_over_context_refused_unread(server):
    """A text prompt whose bytes cannot fit the context is refused before it is tokenized."""
    reply = post_bytes(server.port, COMPL, json.dumps(compl(prompt="a " * 400000)).encode())
    assert status_of(reply) == 400
    assert "bytes" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["message"]


# Framing two readers could disagree on (request smuggling behind a proxy), each a JSON 400 that
# names the problem; the connection closes after it.
SMUGGLING = [
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 13\r\nContent-Length: 30\r\n\r\n" + b'{"prompt":"a"}', "Content-Length"),
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: +14\r\n\r\n" + b'{"prompt":"a"}', "Content-Length"),
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 14\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "Transfer-Encoding"),
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n", "header name"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: a\r\n folded\r\n\r\n", "folding"),
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0x1e\r\n" + b"a" * 30 + b"\r\n0\r\n\r\n", "chunk size"),
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "Transfer-Encoding"),
    (b"POST /tokenize HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "HTTP/1.0"),
    (b"GET /health HTTP/1.1\nHost: x\n\n", "CRLF"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Ctl: a\x01b\r\n\r\n", "control character"),
    (b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", "request line"),
]


@pytest.mark.parametrize("data,word", SMUGGLING, ids=[str(i) for i in range(len(SMUGGLING))])
def test_strict_framing(server, data, word):
    reply = raw_request(server.port, data)
    assert status_of(reply) == 400, reply[:300]
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert b"Connection: close" in head
    err = json.loads(payload)["error"]
    assert err["type"] == "invalid_request_error" and word.lower() in err["message"].lower()


def test_chunked_bodies_accepted(server):
    """Valid chunked bodies, with chunk extensions and a trailer, reach the endpoint whole."""
    body = b'{"prompt": "def fib(n):"}'
    chunks = b"5;name=value\r\n" + body[:5] + b"\r\n" + b"%x\r\n" % (len(body) - 5) + body[5:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"
    reply = raw_request(server.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks)
    assert status_of(reply) == 200
    plain = post_bytes(server.port, "/tokenize", body)
    assert json.loads(reply.partition(b"\r\n\r\n")[2]) == json.loads(plain.partition(b"\r\n\r\n")[2])


def test_half_closed_client_keeps_its_stream(server):
    """A client that shuts its sending side after the request still gets the whole stream."""
    body = json.dumps({"prompt": "def fib(n):", "max_tokens": 40, "stream": True, "ignore_eos": True}).encode()
    reply = post_bytes(server.port, COMPL, body)  # raw_request shuts down SHUT_WR after sending
    assert status_of(reply) == 200
    events = [line for line in reply.partition(b"\r\n\r\n")[2].split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in b"".join(events)


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_slowloris_and_idle_flood():
    """200 connections sending a header byte a second, and twice the connection cap of idle ones:
    other clients are still served, and the server does not spin."""
    with Server("--max-conns", "64") as s:
        slow = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.sendall(b"GET /health HTTP/1.1\r\n")
            slow.append(c)
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(128)]
        cpu0 = cpu_seconds(s.proc.pid)
        for second in range(3):
            for c in slow:
                try:
                    c.sendall(b"X")
                except OSError:
                    pass  # closed to make room
            reply = post_bytes(s.port, COMPL, json.dumps({"prompt": "def fib(n):", "max_tokens": 4, "temperature": 0}).encode())
            assert status_of(reply) == 200
            assert status_of(raw_request(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
            time.sleep(1)
        busy = cpu_seconds(s.proc.pid) - cpu0
        for c in slow + idle:
            c.close()
        print("slowloris + idle flood: server CPU %.2f s over ~3 s" % busy)
        assert busy < 1.5


def test_out_of_descriptors_pauses_accepting():
    """With its descriptors exhausted the server pauses accepting (one log line a second at most,
    no spin) and serves again once connections close."""
    import resource

    def low_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    s = Server("--max-conns", "1000", preexec_fn=low_fds)
    try:
        held = []
        for _ in range(80):
            try:
                held.append(socket.create_connection(("127.0.0.1", s.port), timeout=2))
            except OSError:
                break
        cpu0 = cpu_seconds(s.proc.pid)
        time.sleep(2)
        busy = cpu_seconds(s.proc.pid) - cpu0
        for c in held:
            c.close()
        time.sleep(0.5)
        assert status_of(raw_request(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
        lines = [line for line in s.log if "accept:" in line]
        print("out of descriptors: %d log lines, CPU %.2f s over 2 s" % (len(lines), busy))
        assert 1 <= len(lines) <= 6 and busy < 0.5
    finally:
        s.stop()


def test_deadlines():
    """A head not finished in --header-timeout, a body not finished in --body-timeout and a kept-alive
    connection idle past --idle-timeout are closed; a reply that takes longer than all of them is not."""
    with Server("--header-timeout", "1", "--body-timeout", "1", "--idle-timeout", "1") as s:
        head = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        body = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        body.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        idle = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(idle.recv(65536)) == 200
        long_reply = post_bytes(s.port, COMPL, json.dumps({"prompt": "def fib(n):", "max_tokens": 300, "ignore_eos": True}).encode())
        time.sleep(2.5)
        for c in (head, body, idle):
            assert c.recv(65536) == b""  # closed by the server
            c.close()
        assert status_of(long_reply) == 200
