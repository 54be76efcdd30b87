"""Serving fidelity through the official SDKs: forced tool calls with default settings on all
three APIs, a reasoning budget, template variables as transformers passes them, literal template
text through --chat-template, every sampling field honoured or refused, and the API's shapes
(Anthropic usage and stop_sequence, count_tokens, models.retrieve, error bodies).

The bundled model is not trained for tools: with thinking on it never closes its reasoning, which
is what the budget is for."""
import json
import os
import tempfile

import anthropic
import openai
import pytest
import requests

from qfserver import NO_THINK, QWEN36_TEMPLATE as TEMPLATE, Server
from schemas import TOOLS

GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with Server("--max-batch", "4", "--ctx", "2048", "--chat-template", TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=120)


def detok(server, ids):
    return post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


def assert_calls(calls):
    assert calls, "no parsed tool calls"
    for c in calls:
        args = json.loads(c.function.arguments)
        assert c.function.name in ("get_weather", "add") and isinstance(args, dict)


# ---- forced tool calls (defaults: parallel_tool_calls on, thinking as the template has it) ----

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_chat(oa, choice):
    r = oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=160, temperature=0, extra_body=NO_THINK)
    assert_calls(r.choices[0].message.tool_calls)
    if isinstance(choice, dict):
        assert all(c.function.name == "add" for c in r.choices[0].message.tool_calls)


def test_forced_calls_bounded(oa):
    """The grammar ends after tools x 4 calls, so the reply stops by itself with every call parsed."""
    r = oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=1500, temperature=0, extra_body=NO_THINK)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and 1 <= len(ch.message.tool_calls) <= 8


def test_forced_calls_anthropic(an):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    m = an.messages.create(model="m", max_tokens=160, messages=ASK, tools=tools, tool_choice={"type": "any"}, extra_body=GREEDY,
                           thinking={"type": "disabled"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use" and all(u.name in ("get_weather", "add") for u in uses)


def test_forced_calls_responses(oa):
    tools = [dict(type="function", **t["function"]) for t in TOOLS]
    r = oa.responses.create(model="m", input="Weather in Paris?", tools=tools, tool_choice="required", max_output_tokens=160, temperature=0,
                            reasoning={"effort": "none"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name in ("get_weather", "add") and isinstance(json.loads(c.arguments), dict) for c in calls)


# ---- a reasoning budget ----

def test_reasoning_never_ends_without_a_budget(oa):
    """The premise: with thinking on and no room for a budget the untrained model reasons to the limit."""
    r = oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0,
                                   extra_body={"thinking_budget": 10000})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra", [{"thinking_budget": 12}, {"max_thinking_tokens": 12}, {}])
def test_reasoning_budget_lets_a_forced_call_through(oa, server, extra):
    """A budget (given, or half of max_tokens by default when a grammar waits) ends the reasoning."""
    r = oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0, extra_body=extra)
    msg = r.choices[0].message
    assert_calls(msg.tool_calls)
    reasoning = msg.model_extra.get("reasoning_content") or ""
    if extra:
        ids = post(server, "/tokenize", {"prompt": reasoning}).json()["tokens"]
        assert len(ids) <= 13, reasoning


def test_reasoning_budget_anthropic(an):
    tools = [{"name": "add", "input_schema": TOOLS[1]["function"]["parameters"]}]
    m = an.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "2+3?"}], tools=tools, tool_choice={"type": "any"},
                           extra_body=GREEDY, thinking={"type": "enabled", "budget_tokens": 10})
    assert [b for b in m.content if b.type == "tool_use"]


def test_json_schema_after_budget(oa):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
    r = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "A digit in JSON."}], max_tokens=120, temperature=0,
                                   response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}})
    assert r.choices[0].finish_reason == "stop" and 0 <= json.loads(r.choices[0].message.content)["n"] <= 9


# ---- template variables ----

def test_tokenize_generation_prompt_and_continue(server):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    full = detok(server, post(server, "/tokenize", {"messages": msgs[:1]}).json()["tokens"])
    bare = detok(server, post(server, "/tokenize", {"messages": msgs[:1], "add_generation_prompt": False}).json()["tokens"])
    assert full.endswith("<|im_start|>assistant\n<think>\n") and bare.endswith("hi<|im_end|>\n") and full.startswith(bare)
    cont = detok(server, post(server, "/tokenize", {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}).json()["tokens"])
    assert cont.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is"), cont
    both = post(server, "/tokenize", {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_anthropic_prefill_continues(an, oa):
    m = an.messages.create(model="m", max_tokens=8, extra_body=GREEDY, thinking={"type": "disabled"},
                           messages=[{"role": "user", "content": "def fib(n):"}, {"role": "assistant", "content": "    if n"}])
    r = oa.chat.completions.create(model="m", max_tokens=8, temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False, **NO_THINK},
                                   messages=[{"role": "user", "content": "def fib(n):"}, {"role": "assistant", "content": "    if n"}])
    assert m.content[0].text == r.choices[0].message.content and m.content[0].text


def write_template(text):
    f = tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False)
    f.write(text)
    f.close()
    return f.name


def test_chat_template_literal_text():
    """The template's literal text outlives its file's buffer (run under ASan by the sanitized build)."""
    path = write_template('Hello world{{ "!" }}<|im_start|>assistant\n')
    try:
        with Server("--chat-template", path) as s:
            r = post(s, "/tokenize", {"messages": ASK})
            assert r.status_code == 200, r.text
            assert detok(s, r.json()["tokens"]) == "Hello world!<|im_start|>assistant\n"
    finally:
        os.unlink(path)


def test_undefined_variables_stay_undefined():
    """enable_thinking is not defined unless the client sends it (Gemma 4 reads `is defined`)."""
    path = write_template("{% if enable_thinking is defined %}T{{ enable_thinking }}{% else %}U{% endif %}"
                          "{% if reasoning_effort is defined %}E{{ reasoning_effort }}{% endif %}|")
    try:
        with Server("--chat-template", path) as s:
            def render(extra):
                return detok(s, post(s, "/tokenize", {"messages": ASK, **extra}).json()["tokens"])
            assert render({}) == "U|"
            assert render({"chat_template_kwargs": {"enable_thinking": False}}) == "TFalse|"
            assert render({"reasoning_effort": "none"}) == "TFalseEnone|"
            assert render({"reasoning_effort": "high"}) == "UEhigh|"
    finally:
        os.unlink(path)


# ---- parameters honoured or refused ----

def test_logit_bias_forces_a_token(oa, server):
    r = oa.completions.create(model="m", prompt="def f():", max_tokens=4, temperature=0, logit_bias={"5": 100})
    assert r.choices[0].text == detok(server, [5] * 4)
    r = oa.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0.9, seed=3, logit_bias={"5": 100}, extra_body=NO_THINK)
    assert r.choices[0].message.content == detok(server, [5] * 3)


def test_logit_bias_bans_the_greedy_token(oa, server):
    base = oa.completions.create(model="m", prompt="def f():", max_tokens=1, temperature=0, logprobs=1)
    first = base.choices[0].logprobs.tokens[0]
    tid = post(server, "/tokenize", {"prompt": first}).json()["tokens"]
    r = oa.completions.create(model="m", prompt="def f():", max_tokens=1, temperature=0, logit_bias={str(tid[0]): -100})
    assert r.choices[0].text != first


def test_stop_token_ids_and_min_tokens(oa, server):
    plain = post(server, "/v1/completions", {"prompt": "def f():", "max_tokens": 6, "temperature": 0, "logprobs": 0}).json()["choices"][0]
    ids = post(server, "/tokenize", {"prompt": plain["text"]}).json()["tokens"]
    stopped = post(server, "/v1/completions", {"prompt": "def f():", "max_tokens": 6, "temperature": 0, "stop_token_ids": [ids[2]]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == detok(server, ids[:2])
    held = post(server, "/v1/completions", {"prompt": "def f():", "max_tokens": 6, "temperature": 0, "stop_token_ids": [ids[0]], "min_tokens": 6}).json()
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "length"


def test_completions_text_offset(oa):
    r = oa.completions.create(model="m", prompt="def f():", max_tokens=6, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == len(lp.tokens)
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(len(lp.tokens) - 1))


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"), ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities[1]"), ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids[0]"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_refused_fields_name_themselves(server, extra, param):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] is None, err


def test_informational_fields_accepted(server):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "user": "u", "metadata": {"a": "b"}, "store": False,
                                              "service_tier": "auto", "modalities": ["text"], **NO_THINK})
    assert r.status_code == 200, r.text


def test_completions_batch_prompt_refused(server):
    r = post(server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 400 and "one prompt per request" in r.json()["error"]["message"]


# ---- API shape ----

def test_models_retrieve_and_unknown_model(oa, server):
    assert oa.models.retrieve("m").id == "m"
    assert oa.models.retrieve("qwen36moe-code-14m").id == "qwen36moe-code-14m"
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_anthropic_stream_usage_and_count_tokens(an):
    msgs = [{"role": "user", "content": "def fib(n):"}]
    count = an.messages.count_tokens(model="m", messages=msgs).input_tokens
    events = list(an.messages.create(model="m", max_tokens=6, messages=msgs, extra_body=GREEDY, stream=True))
    start = [e for e in events if e.type == "message_start"][0]
    assert count > 0 and start.message.usage.input_tokens == count


def test_anthropic_stop_sequence(an):
    msgs = [{"role": "user", "content": "def fib(n):"}]
    whole = an.messages.create(model="m", max_tokens=16, messages=msgs, extra_body=GREEDY, thinking={"type": "disabled"}).content[0].text
    seq = whole[4:7]
    assert seq.strip(), whole
    m = an.messages.create(model="m", max_tokens=16, messages=msgs, extra_body=GREEDY, thinking={"type": "disabled"}, stop_sequences=["zzzq", seq])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == seq and m.content[0].text == whole[:whole.index(seq)]
    with an.messages.stream(model="m", max_tokens=16, messages=msgs, extra_body=GREEDY, thinking={"type": "disabled"}, stop_sequences=[seq]) as st:
        final = st.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == seq


def test_anthropic_error_shape(server):
    r = post(server, "/v1/messages", {"model": "m", "messages": ASK})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text


# The series the published vLLM Grafana dashboard queries (its panels' PromQL, by metric name;
# written here from the dashboard's queries, each filtered by model_name).
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
             "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
             "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
             "vllm:time_per_output_token_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
             "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:request_queue_time_seconds_bucket",
             "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
             "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:num_preemptions_total",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]


def test_metrics_public_with_vllm_names(server, oa):
    oa.chat.completions.create(model="m", messages=ASK, max_tokens=3, extra_body=NO_THINK)
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    series = {}
    for line in r.text.splitlines():
        if line.startswith("vllm:"):
            name, labels = line.split("{", 1) if "{" in line else (line.split(" ")[0], "")
            series.setdefault(name, []).append(labels)
            assert 'model_name="qwen36moe-code-14m"' in labels, line
    missing = [n for n in DASHBOARD if n not in series]
    assert not missing, missing
    assert any('finished_reason="length"' in l for l in series["vllm:request_success_total"])
    count = [l for l in r.text.splitlines() if l.startswith("vllm:e2e_request_latency_seconds_count")]
    assert float(count[0].rsplit(" ", 1)[1]) >= 1


def test_metrics_auth():
    with Server("--api-key", "k", "--metrics-auth") as s:
        assert requests.get(s.url + "/metrics", timeout=10).status_code == 401
        assert requests.get(s.url + "/metrics", headers={"Authorization": "Bearer k"}, timeout=10).status_code == 200
    with Server("--api-key", "k") as s:
        assert requests.get(s.url + "/metrics", timeout=10).status_code == 200


# ---- grammar attacks answered fast, the others unharmed ----

def ref_chain(n, note=False):
    d = {"d%d" % i: {"anyOf": [{"$ref": "#/$defs/d%d" % (i + 1)}, {"$ref": "#/$defs/d%d" % (i + 1), **({"description": "x"} if note else {})}]}
         for i in range(n)}
    d["d%d" % n] = {"type": "integer"}
    return {"$defs": d, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("note", [False, True])
def test_doubling_ref_chain_is_fast(server, note):
    """anyOf of the same $ref twice at every level (also in different words): once a doubling of the
    parses per level (depth 29: ~25 s, and every other request waited)."""
    import concurrent.futures
    import time
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": ref_chain(29, note)}}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        t0 = time.time()
        attack = ex.submit(post, server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "temperature": 0, "response_format": fmt, **NO_THINK})
        plain = ex.submit(post, server, "/v1/completions", {"prompt": "def f():", "max_tokens": 16, "temperature": 0})
        r = attack.result()
        t_attack = time.time() - t0
        assert plain.result().status_code == 200
    # A hang guard, not a speed figure: a blow-up in the grammar's compile or match runs for minutes.
    assert t_attack < 20.0, t_attack
    assert r.status_code == 400 or (r.status_code == 200 and (r.json()["choices"][0]["finish_reason"] == "length"
                                                               or isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), int))), r.text


@pytest.mark.parametrize("pattern", ["^((a|b)*)*c$", "^(a*)*$", "^(a+)+c$", "^((a?b?)*c?)+d$", "^(a|aa)+b$"])
def test_nested_quantifiers_fast_and_valid(server, pattern):
    """Loops over what may be empty, and nestings with many parses of one text: once a 500 ("the
    parse outgrew its limits"); now the regex's own language, answered at once beside others."""
    import concurrent.futures
    import re
    import time
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": pattern}}}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        t0 = time.time()
        attack = ex.submit(post, server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 48, "temperature": 0, "response_format": fmt, **NO_THINK})
        plain = ex.submit(post, server, "/v1/completions", {"prompt": "def f():", "max_tokens": 16, "temperature": 0})
        r = attack.result()
        t_attack = time.time() - t0
        assert plain.result().status_code == 200
    # A hang guard, not a speed figure: a backtracking blow-up on these patterns runs for minutes.
    assert r.status_code == 200 and t_attack < 20.0, (t_attack, r.text)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert re.fullmatch(pattern.strip("^$"), json.loads(choice["message"]["content"])), choice


@pytest.mark.parametrize("schema,words", [
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "cycle of references"),
    ({"$ref": "#"}, "cycle of references"),
    ({"type": "integer", "minimum": 1e300}, "'minimum' 1e+300 lies beyond"),
    ({"type": "number", "maximum": -1e300}, "'maximum' -1e+300 lies beyond"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, "'required' names 'b'"),
])
def test_schemas_that_cannot_be_honoured_are_refused(server, schema, words):
    """Refused before any reply (a 400 naming the keyword), never generated against (1e300 once gave 999999999999999)."""
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("template", [None, "Qwen-Qwen2.5-7B-Instruct.jinja"], ids=["xml_form", "json_form"])
def test_tool_with_a_root_cycle_refused(template):
    """Both tool-call forms (Qwen3.6's XML one, the bundled template's; Qwen2.5's JSON one) follow
    the parameters' references before the reply starts: a cycle is a 400, a parameter typed
    through $refs gets its type's JSON."""
    args = ["--chat-template", os.path.join(os.path.dirname(TEMPLATE), template)] if template else []
    with Server(*args) as s:
        r = post(s, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "tool_choice": "required", **NO_THINK,
                                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]})
        assert r.status_code == 400 and "cycle of references" in r.json()["error"]["message"], r.text
        params = {"$ref": "#/$defs/p", "$defs": {"p": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}, "required": ["k"]},
                                                 "n": {"type": "integer", "minimum": 3, "maximum": 9}}}
        r = post(s, "/v1/chat/completions", {"messages": ASK, "max_tokens": 40, "tool_choice": "required", **NO_THINK,
                                             "parallel_tool_calls": False,
                                             "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]})
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert r.status_code == 200 and len(calls) == 1, r.text
        k = json.loads(calls[0]["function"]["arguments"])["k"]
        assert isinstance(k, int) and 3 <= k <= 9, r.text


@pytest.mark.parametrize("pattern,ok", [("^[\\x41-\\x43]{3}$", "ABC"), ("^\\x41[\\x62]$", "Ab"), ("^[^\\sa-z]{2}$", None), ("^[\\S]{2}$", None)])
def test_pattern_escapes_and_classes(server, pattern, ok):
    import re
    schema = {"type": "string", "pattern": pattern}
    for seed in range(3):
        r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 12, "temperature": 1.0, "seed": seed, **NO_THINK,
                                                  "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
        assert r.status_code == 200, r.text
        text = json.loads(r.json()["choices"][0]["message"]["content"])
        assert re.search(pattern, text), (pattern, text)
        if ok:
            assert set(text) <= set(ok)


@pytest.mark.parametrize("pattern,words", [("^[^\\s\\S]$", "matches no character"), ("^\\x4$", "two hex digits"), ("^\\xE9$", "not an ASCII character")])
def test_patterns_refused(server, pattern, words):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4,
                                              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": pattern}}}})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_short_content_length_then_half_close(server):
    """Bytes past the Content-Length and then an EOF: the complete first request is still answered."""
    import socket
    body = json.dumps({"prompt": "def f():", "max_tokens": 4, "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
              + b"XYZ trailing bytes")
    s.shutdown(socket.SHUT_WR)
    s.settimeout(30)
    data = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
    s.close()
    assert data.startswith(b"HTTP/1.1 200") and b'"text_completion"' in data, data[:300]


def test_too_many_beginnings_refused_before_queueing(server):
    """More ways to begin than the matcher keeps (500 tools forced, a 1,000-value enum): a 400
    decided while the request is prepared, not a 500 from the scheduler."""
    tools = [{"type": "function", "function": {"name": "t%d" % i, "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
             for i in range(500)]
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "tool_choice": "required", "tools": tools, **NO_THINK})
    assert r.status_code == 400 and "ways to begin" in r.json()["error"]["message"] and r.json()["error"]["param"] == "tool_choice", r.text
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["v%d" % i for i in range(1000)]}}}
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "response_format": fmt, **NO_THINK})
    assert r.status_code == 400 and "ways to begin" in r.json()["error"]["message"], r.text
    ok = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "tool_choice": "required", "tools": tools[:20], **NO_THINK})
    assert ok.status_code == 200, ok.text
