"""Agent serving through the official `openai` package: structured output (json_object,
json_schema over 60 schemas validated by `jsonschema`), tool choice (auto, required, named, none),
parallel calls and an agent loop on the bundled model as shipped (its template is Qwen3.6's own).

The bundled model is not trained for tools or JSON: what it emits here is forced by the grammar,
which is the point (the parsers meet real model output shaped only by the constraint)."""
import json

import jsonschema
import openai
import pytest

from qfserver import NO_THINK, Server
from schemas import TOOLS, schemas

ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def server():
    with Server("--max-batch", "8", "--ctx", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def validates(text, schema):
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_json_schema_always_validates(client, server):
    """Every complete reply validates. A reply cut by max_tokens (finish_reason length) is not
    complete JSON; the untrained model sometimes runs on inside a free string, so such a schema is
    asked again with a sampled path, and every schema must end in a complete, valid reply."""
    before = server.metrics()
    complete = 0
    for i, schema in enumerate(schemas()):
        fmt = {"type": "json_schema", "json_schema": {"name": "s%d" % i, "schema": schema, "strict": True}}
        for attempt in range(6):
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=400,
                                               temperature=0 if attempt == 0 else 0.8, seed=attempt, response_format=fmt, extra_body=NO_THINK)
            ch = r.choices[0]
            if ch.finish_reason == "stop":
                validates(ch.message.content, schema)
                complete += 1
                break
            assert ch.finish_reason == "length"
        else:
            pytest.fail("schema %d never completed in 6 tries: %s" % (i, json.dumps(schema)))
    assert complete == len(schemas()) >= 50
    after = server.metrics()
    assert after["qflash:grammar_masks_total"] > before["qflash:grammar_masks_total"]


def test_json_object_stream(client):
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"}, extra_body=NO_THINK)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=200, temperature=0,
                                                 response_format={"type": "json_object"}, extra_body=NO_THINK, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict)


def test_completions_take_response_format(client):
    r = client.completions.create(model="m", prompt="x = ", max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), int)


@pytest.mark.parametrize("schema,named", [
    ({"type": "object", "not": {}}, "'not'"),
    ({"type": "string", "pattern": "(?=x)"}, "lookaround"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}, "/properties/a"),
    ({"$ref": "#/$defs/none"}, "#/$defs/none"),
])
def test_unsupported_schema_is_400(client, schema, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert named in str(e.value)


def one_call(client, choice, think=False, **kw):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, extra_body={} if think else NO_THINK, **kw)
    return r


def check_call(tc, name=None):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert tc.type == "function" and tc.id.startswith("call_")
    assert name is None or tc.function.name == name
    jsonschema.validate(json.loads(tc.function.arguments), spec[tc.function.name])


def test_tool_choice_required(client):
    r = one_call(client, "required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    assert not ch.message.content
    check_call(ch.message.tool_calls[0])


def test_tool_choice_named(client):
    for name in ("add", "get_weather"):
        r = one_call(client, {"type": "function", "function": {"name": name}})
        assert r.choices[0].finish_reason == "tool_calls"
        check_call(r.choices[0].message.tool_calls[0], name)


def test_tool_choice_none_and_auto(client):
    r = one_call(client, "none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = one_call(client, "auto")  # the untrained model writes text; whatever it writes comes back without a 500
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_calls_stream_like_whole(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = one_call(client, choice).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice=choice,
                                                 parallel_tool_calls=False, extra_body=NO_THINK, stream=True))
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_parallel_tool_calls(client):
    """With parallel calls allowed the model may go on calling; the reply cut right after its
    second call (max_tokens from the token texts of a first run) holds two parsed calls."""
    choice = {"type": "function", "function": {"name": "add"}}
    first = client.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice=choice,
                                           logprobs=True, extra_body=NO_THINK)
    text, cut, ends = "", None, 0
    for i, t in enumerate(first.choices[0].logprobs.content):
        text += t.token
        if text.endswith("</tool_call>"):
            ends += 1
            if ends == 2:
                cut = i + 1
                break
    assert cut, "the model made fewer than two calls: %r" % text
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=cut, temperature=0, tools=TOOLS, tool_choice=choice, extra_body=NO_THINK)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 2 and calls[0].id != calls[1].id
    for c in calls:
        check_call(c, "add")


@pytest.mark.parametrize("think", [False, True], ids=["no_think", "think"])
def test_agent_loop(client, server, think):
    """tool call -> tool result -> final answer with the OpenAI SDK, the history rendered by the
    model's own template; with thinking on (the template's default) the forced call comes after
    the reasoning, which the default budget (half of max_tokens) ends in time."""
    r = one_call(client, "required", think=think)
    call = r.choices[0].message
    assert call.tool_calls and r.choices[0].finish_reason == "tool_calls", r
    assert bool(call.reasoning_content) == think
    check_call(call.tool_calls[0])
    history = ASK + [
        {"role": "assistant", "content": call.content or "", "tool_calls": [tc.model_dump() for tc in call.tool_calls]},
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    ]
    final = client.chat.completions.create(model="m", messages=history, max_tokens=24, temperature=0, tools=TOOLS, tool_choice="none",
                                           extra_body=NO_THINK)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/tokenize", json.dumps({"messages": history, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}),
                 {"Content-Type": "application/json"})
    ids = json.loads(conn.getresponse().read())["tokens"]
    conn.request("POST", "/detokenize", json.dumps({"tokens": ids}), {"Content-Type": "application/json"})
    prompt = json.loads(conn.getresponse().read())["prompt"]
    args = json.loads(call.tool_calls[0].function.arguments)
    assert "<tool_response>\n{\"temperature\": 21, \"sky\": \"clear\"}\n</tool_response>" in prompt
    fn = call.tool_calls[0].function
    shown = "".join("<parameter=%s>\n%s\n</parameter>\n" % (k, v if isinstance(v, str) else json.dumps(v)) for k, v in args.items())
    assert "<function=%s>\n%s</function>" % (fn.name, shown) in prompt, prompt
    assert final.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("body,named", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_tool_choice_is_400(client, body, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=5, extra_body=body)
    assert named in str(e.value)
