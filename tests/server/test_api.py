"""The server through the official `openai` package, plus what the package cannot reach."""
import concurrent.futures
import http.client
import json
import os
import signal

import openai
import pytest

from qfserver import MODEL, NO_THINK, Server, run_cli, wait_for

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Stack:\n", "# sort a list\n", "for i in range(10):",
           "def read_file(path):", "import os\nimport sys\n", "x = [", "def main():\n    ", "while True:",
           "try:\n    ", "def add(a, b):", "# TODO", "print(", "with open(", "return "]


@pytest.fixture(scope="module")
def server():
    with Server("--max-batch", "16", "--ctx", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen36moe-code-14m"]


def test_completion_equals_cli(client):
    for prompt in PROMPTS[:3]:
        r = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == run_cli(prompt, 24)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_completion_token_ids_prompt(client, server):
    ids = json.loads(post(server, "/tokenize", {"prompt": "def fib(n):"})[2])["tokens"]
    a = client.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0)
    b = client.completions.create(model="m", prompt="def fib(n):", max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)


def test_chat_stream_matches_non_stream(client):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    whole = client.chat.completions.create(model="m", messages=msgs, max_tokens=32, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=32, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert whole.usage.prompt_tokens > 0 and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_chat_content_parts(client):
    a = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "def fib(n):"}], max_tokens=8, temperature=0)
    b = client.chat.completions.create(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "def fib"},
                                                                                           {"type": "text", "text": "(n):"}]}],
                                       max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_strings(client):
    full = client.completions.create(model="m", prompt="def fib(n):", max_tokens=30, temperature=0).choices[0].text
    cut = full[10:14]
    first = full.index(cut)
    r = client.completions.create(model="m", prompt="def fib(n):", max_tokens=30, temperature=0, stop=["zzzz-never", cut])
    assert r.choices[0].text == full[:first] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="m", prompt="def fib(n):", max_tokens=30, temperature=0, stop=cut, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:first]


def test_seed_reproducible(client):
    kw = dict(model="m", prompt="import numpy as np\n", max_tokens=24, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = [client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)]
    assert a == b
    assert any(x != a for x in c)


def test_detokenize_edges(server):
    """Ids past the tokenizer (the model's padding rows) are a 400 naming the range; the byte
    token 0 decodes to a NUL character, not to an empty string."""
    with open(os.path.join(MODEL, "tokenizer.json")) as f:
        tok = json.load(f)
    size = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    status, _, body = post(server, "/detokenize", {"tokens": [size + 3]})
    assert status == 400 and "tokens" in json.loads(body)["error"]["message"]
    status, _, body = post(server, "/detokenize", {"tokens": [tok["model"]["vocab"]["\u0100"]]})
    assert status == 200 and json.loads(body)["prompt"] == "\x00"


def test_enable_thinking_false(client, server):
    msgs = [{"role": "user", "content": "def fib(n):"}]
    on = json.loads(post(server, "/tokenize", {"messages": msgs})[2])["count"]
    off = json.loads(post(server, "/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})[2])
    assert off["count"] > on
    text = json.loads(post(server, "/detokenize", {"tokens": off["tokens"]})[2])["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n")
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == off["count"]
    assert r.choices[0].message.content is not None


def test_logprobs(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x = ["}], max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens or len(lp) == r.usage.completion_tokens - 1  # a final eos has no entry
    for e in lp:
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert e.token == e.top_logprobs[0].token and abs(e.logprob - tops[0]) < 1e-6  # greedy takes the best
    assert "".join(e.token for e in lp) == r.choices[0].message.content
    c = client.completions.create(model="m", prompt="x = [", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 4 and all(len(t) == 2 for t in c.choices[0].logprobs.top_logprobs)


def test_concurrent_streams_equal_alone(client):
    def one(prompt):
        chunks = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    alone = [one(p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(one, PROMPTS))
    assert together == alone


def test_disconnect_frees_slot(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": "def fib(n):", "max_tokens": 3000, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()  # the first event
    assert wait_for(lambda: server.metrics()["qflash:num_requests_running"] == 1)
    conn.sock.close()
    conn.close()
    assert wait_for(lambda: server.metrics()["qflash:num_requests_running"] == 0, timeout=10)
    m = server.metrics()
    assert m["qflash:kv_cache_pages_used"] == 0 and m["qflash:requests_cancelled_total"] >= 1


def post(server, path, body, headers=None, raw=None, method="POST", timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request(method, path, data, dict({"Content-Type": "application/json"}, **(headers or {})))
    r = conn.getresponse()
    out = (r.status, dict(r.getheaders()), r.read().decode("utf-8", "replace"))
    conn.close()
    return out


def test_wire_format_exact(server):
    """The bytes of a stream: data: {json}\\n\\n per event, [DONE] last."""
    status, headers, body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                                  "temperature": 0, "stream": True})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: {") and "\n" not in e
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_prompt_over_context(server):
    status, _, body = post(server, "/v1/completions", {"prompt": "x = 1\n" * 600, "max_tokens": 4})
    err = json.loads(body)["error"]
    assert status == 400 and "1024" in err["message"] and err["type"] == "invalid_request_error"
    n = json.loads(post(server, "/tokenize", {"prompt": "x = 1\n" * 600})[2])["count"]
    assert str(n) in err["message"]


def test_generate_native(server):
    status, headers, body = post(server, "/generate", {"prompt": "def fib(n):", "max_tokens": 24, "temperature": 0})
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert body == run_cli("def fib(n):", 24)


def test_health_and_errors(server):
    assert post(server, "/health", None, method="GET", raw=b"")[0] == 200
    assert post(server, "/nope", {})[0] == 404
    status, headers, _ = post(server, "/v1/chat/completions", None, method="GET", raw=b"")
    assert status == 405 and headers["Allow"] == "POST"
    m = server.metrics()
    for name in ["qflash:requests_total", "qflash:prompt_tokens_total", "qflash:generation_tokens_total", "qflash:num_requests_waiting",
                 "qflash:time_to_first_token_seconds_count", "qflash:inter_token_latency_seconds_bucket{le=\"+Inf\"}",
                 "qflash:kv_cache_pages_total"]:
        assert name in m


def test_api_key():
    with Server("--api-key", "s3cret") as s:
        assert post(s, "/v1/models", None, method="GET", raw=b"")[0] == 401
        assert post(s, "/v1/models", None, method="GET", raw=b"", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert post(s, "/v1/models", None, method="GET", raw=b"", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert post(s, "/health", None, method="GET", raw=b"")[0] == 200
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_health_503_while_loading(tmp_path):
    """The load is held at its first read: the model's config.json is a named pipe the test fills
    once it has seen the loading state."""
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(MODEL):
        if name != "config.json":
            os.symlink(os.path.join(MODEL, name), model / name)
    os.mkfifo(model / "config.json")
    with Server(wait_ready=False, model=str(model)) as s:
        status, headers, body = post(s, "/health", None, method="GET", raw=b"")
        assert status == 503 and json.loads(body)["error"]["message"] == "Loading model" and "Retry-After" in headers
        assert post(s, "/v1/completions", {"prompt": "x"})[0] == 503
        with open(model / "config.json", "w") as pipe, open(os.path.join(MODEL, "config.json")) as cfg:
            pipe.write(cfg.read())
        assert s.ready.wait(30)
        assert post(s, "/health", None, method="GET", raw=b"")[0] == 200


def test_queue_full_503():
    """One running, one waiting, and the next is refused: ordered by watching the metrics, so the
    test does not depend on how fast the scheduler admits."""
    with Server("--max-batch", "1", "--max-queue", "1") as s:
        body = {"prompt": "def fib(n):", "max_tokens": 1500, "ignore_eos": True}  # long enough to watch
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            # 3000 tokens one after another: minutes on a loaded 2-core box under the sanitizers
            first = ex.submit(post, s, "/v1/completions", body, timeout=600)
            assert wait_for(lambda: s.metrics()["qflash:num_requests_running"] == 1)
            second = ex.submit(post, s, "/v1/completions", body, timeout=600)
            assert wait_for(lambda: s.metrics()["qflash:num_requests_waiting"] == 1)
            busy = post(s, "/v1/completions", body)
            assert busy[0] == 503 and busy[1].get("Retry-After") and json.loads(busy[2])["error"]["type"] == "unavailable_error"
            assert first.result()[0] == 200 and second.result()[0] == 200


def test_preemption_gives_same_tokens():
    """A pool of 8 pages of 16 tokens for 4 sequences: they preempt one another and still agree."""
    prompts = PROMPTS[:4]
    with Server("--max-batch", "4", "--ctx", "128", "--kv-pages", "8") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        one = lambda p: c.completions.create(model="m", prompt=p, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        alone = [one(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            together = list(ex.map(one, prompts))
        assert together == alone
        assert s.metrics()["qflash:preemptions_total"] > 0


def test_sigterm_finishes_in_flight():
    s = Server()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "def f():", "max_tokens": 200, "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()
    s.proc.send_signal(signal.SIGTERM)
    body = resp.read().decode()
    assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in body
    assert s.proc.wait(30) == 0
    s.reader.join(5)


def test_verbose_scheduler_log(server):
    """--verbose: batch composition per step, pages allocated and freed."""
    post(server, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 20, "temperature": 0})
    wait_for(lambda: "pages freed" in "".join(server.log))  # stderr is read by another thread
    log = "".join(server.log)
    assert "[FLASH-SCHEDULER] step " in log and " decode + " in log and " prefill sequences" in log
    assert "KV pages allocated" in log and "pages freed" in log


def test_sigterm_timeout_aborts_streams_and_refuses_new():
    """Past --shutdown-timeout a stream still running ends with finish_reason "abort" and [DONE];
    a request on a kept-alive connection after the signal gets 503 with Retry-After."""
    s = Server("--shutdown-timeout", "1")
    idle = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    idle.request("GET", "/health")
    assert idle.getresponse().read() and True
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "def f():", "max_tokens": 100000, "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()
    s.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: any("no new requests" in line for line in s.log))
    idle.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}), {"Content-Type": "application/json"})
    late = idle.getresponse()
    assert late.status == 503 and late.getheader("Retry-After") and json.loads(late.read())["error"]["type"] == "unavailable_error"
    body = resp.read().decode()
    assert '"finish_reason":"abort"' in body and body.rstrip().endswith("data: [DONE]")
    assert s.proc.wait(30) == 0
    s.reader.join(5)


def test_sparsity_level_per_request(server):
    """qflash's sparsity_level field: checked like the other numbers, and it reaches the model (the
    token logprobs move off the dense ones) while a request without it stays dense."""
    body = {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    st, _, txt = post(server, "/v1/completions", dict(body, sparsity_level=1.5))
    assert st == 400 and "'sparsity_level' must be between 0 and 1" in json.loads(txt)["error"]["message"]
    st, _, txt = post(server, "/v1/completions", dict(body, sparsity_level="high"))
    assert st == 400 and "'sparsity_level' must be a number" in json.loads(txt)["error"]["message"]
    runs = []
    for level in (None, 0.7, None, 0):
        b = dict(body) if level is None else dict(body, sparsity_level=level)
        st, _, txt = post(server, "/v1/completions", b)
        assert st == 200
        runs.append(json.loads(txt)["choices"][0]["logprobs"]["token_logprobs"])
    assert runs[0] == runs[2] == runs[3] and runs[1] != runs[0]


def test_expert_cache_serves_the_same():
    """--expert-cache: the same greedy completion as all experts resident, and the cache's loads
    counted in /metrics."""
    with Server("--expert-cache", "1.5M") as s:
        r = post(s, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 24, "temperature": 0})
        assert r[0] == 200 and json.loads(r[2])["choices"][0]["text"] == run_cli("def fib(n):", 24)
        m = s.metrics()
        assert m["qflash:expert_cache_misses_total"] > 0 and m["qflash:expert_cache_hits_total"] > 0
        assert m["qflash:expert_cache_bytes_loaded_total"] >= m["qflash:expert_cache_misses_total"] * 36864
        assert any("expert cache: 4 of 64 experts a layer" in line for line in s.log)
        assert any("[FLASH-SCHEDULER] step" in line and "experts missed" in line and "MB over the link" in line for line in s.log)


def test_expert_cache_long_prompt_reads_each_expert_about_once():
    """A ~2,600-token prompt under a RAM expert cache of 4 slots a layer and 256-token chunks: its
    MoE runs a layer at a time over the whole prompt, so the cache reads the routed experts about
    once (at most 1.5 passes over the 8 layers' 64 experts of 36,864 bytes), not once a chunk; the
    completion is all resident's."""
    prompt = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(150))
    passes_bytes = 8 * 64 * 36864
    with Server("--expert-cache", "1.5M", "--prefill-chunk", "256") as s:
        r = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r[0] == 200, r[2]
        body = json.loads(r[2])
        assert body["usage"]["prompt_tokens"] > 2400
        assert body["choices"][0]["text"] == run_cli(prompt, 8)
        loaded = s.metrics()["qflash:expert_cache_bytes_loaded_total"]
        assert 0.5 * passes_bytes < loaded <= 1.5 * passes_bytes


def test_long_prompt_takes_turns_with_decoding_streams():
    """Under a RAM expert cache a long prompt arriving while two streams decode runs alone in one
    step (each layer's experts read once for the whole prompt: at most 1.5 passes in that step),
    the two streams' steps before and after it; every completion is `qflash run`'s."""
    prompt = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(150))
    shorts = ["def fib(n):", "class Stack:\n"]
    with Server("--expert-cache", "1.5M", "--prefill-chunk", "256") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = {}

        def stream(k):
            text = ""
            for c in client.completions.create(model="m", prompt=shorts[k], max_tokens=120, temperature=0, stream=True):
                text += c.choices[0].text if c.choices else ""
                got[k] = text
            return text

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(stream, k) for k in range(2)]
            assert wait_for(lambda: len(got) == 2, timeout=60)
            r = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
            texts = [f.result() for f in futs]
        assert r[0] == 200, r[2]
        body = json.loads(r[2])
        n = body["usage"]["prompt_tokens"]
        assert n > 2400 and body["choices"][0]["text"] == run_cli(prompt, 4)
        assert texts == [run_cli(p, 120) for p in shorts]
        steps = [line for line in s.log if "[FLASH-SCHEDULER] step" in line and "sequences," in line]
        lone = [i for i, line in enumerate(steps) if f"0 decode + 1 prefill sequences, {n} rows" in line]
        assert len(lone) == 1, "".join(steps)
        assert "2 decode + 0 prefill" in steps[lone[0] - 1] and "3 decode + 0 prefill" in steps[lone[0] + 1]
        no = steps[lone[0]].split(":")[0].split()[-1]
        mb = [float(line.split(" MB over")[0].split()[-1]) for line in s.log if f"step {no}: " in line and "MB over the link" in line]
        assert len(mb) == 1 and mb[0] <= 1.5 * 8 * 64 * 36864 / 1e6


def test_tools_through_qwen36_template(tmp_path):
    """With Qwen3.6's published template, a request with tools, an assistant tool call whose
    arguments come as the JSON string OpenAI clients send, and a tool result renders as Python's
    jinja2 renders the same talk with the arguments as an object (jinja2 itself raises on the
    string: the template iterates it with |items), token for token."""
    from qfserver import ROOT
    d = tmp_path / "m"
    d.mkdir()
    for f in os.listdir(MODEL):
        if f != "tokenizer_config.json":
            os.symlink(os.path.join(MODEL, f), d / f)
    corpus = os.path.join(ROOT, "tests", "data", "templates")
    with open(os.path.join(MODEL, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(corpus, "templates", "Qwen-Qwen3.6-35B-A3B.jinja")) as f:
        cfg["chat_template"] = f.read()
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(corpus, "cases", "tools_str_args.json")) as f:
        inputs = json.load(f)["apply_chat_template_inputs"]
    with open(os.path.join(corpus, "expected", "Qwen-Qwen3.6-35B-A3B__tools_dict_args.txt")) as f:
        want = f.read()
    with Server(model=str(d)) as s:
        code, _, got = post(s, "/tokenize", {"messages": inputs["conversation"], "tools": inputs["tools"]})
        assert code == 200, got
        code, _, ref = post(s, "/tokenize", {"prompt": want})
        assert code == 200 and json.loads(got)["tokens"] == json.loads(ref)["tokens"]
        code, _, err = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}], "max_tokens": 2})
        assert code == 400 and "Unexpected message role." in json.loads(err)["error"]["message"]


def test_tools_without_a_call(client):
    """Tools in the request and a reply that calls none (the bundled model's template ignores tools,
    so the prompt is the same): the same content, streamed (held back only where a call could
    start) and whole, as without tools, and finish_reason stop, no tool_calls."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]
    kw = dict(model="m", messages=[{"role": "user", "content": "Write a function that adds two numbers."}], max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**kw)
    whole = client.chat.completions.create(tools=tools, **kw)
    parts, finish, calls = [], None, False
    for ev in client.chat.completions.create(tools=tools, stream=True, **kw):
        for ch in ev.choices:
            parts.append(ch.delta.content or "")
            calls |= bool(ch.delta.tool_calls)
            finish = ch.finish_reason or finish
    assert whole.choices[0].message.content == plain.choices[0].message.content == "".join(parts)
    assert whole.choices[0].message.tool_calls is None and not calls
    assert whole.choices[0].finish_reason == finish == plain.choices[0].finish_reason


def test_chat_ctrl_c_stops_the_reply():
    """qflash chat: Ctrl-C stops the reply being written and the session goes on (/exit ends it)."""
    import subprocess
    import time
    from qfserver import BIN
    p = subprocess.Popen([BIN, "chat", "-m", MODEL, "-n", "100000", "--temp", "0", "-t", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdin.write("Write a very long program.\n")
    p.stdin.flush()
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.stdin.write("/reset\n/exit\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "[stopped: Ctrl-C]" in err and "(conversation reset)" in err, err[-500:]
