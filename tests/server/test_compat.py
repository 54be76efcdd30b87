"""/v1/responses through the official `openai` package and /v1/messages through the official
`anthropic` package: text, streams equal to whole replies, forced tool calls and a tool loop,
structured output, and the errors."""
import json
import os

import anthropic
import jsonschema
import openai
import pytest

from qfserver import ROOT, Server

TEMPLATE = os.path.join(ROOT, "tests", "data", "templates", "templates", "Qwen-Qwen3.6-35B-A3B.jinja")
KEY = "sk-test"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"]}


@pytest.fixture(scope="module")
def server():
    with Server("--max-batch", "8", "--ctx", "2048", "--chat-template", TEMPLATE, "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def chat_text(oa, messages, n, thinking=True):
    r = oa.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    return r.choices[0].message


# ---- Responses ----

def test_responses_text_equals_chat(oa):
    r = oa.responses.create(model="m", input="def fib(n):", instructions="You write Python.", max_output_tokens=24, temperature=0,
                            reasoning={"effort": "none"})
    ref = chat_text(oa, [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}], 24, thinking=False)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == ref.content and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 24 and r.usage.total_tokens == r.usage.input_tokens + 24


def test_responses_stream_equals_whole(oa):
    kw = dict(model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": "class Stack:"}]}], max_output_tokens=32, temperature=0)
    whole = oa.responses.create(**kw)
    events = list(oa.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == whole.output_text
    assert reasoning == "".join(c.text for it in whole.output if it.type == "reasoning" for c in it.content)


def test_responses_function_call_loop(oa):
    tools = [{"type": "function", "name": "add", "description": "Adds.", "parameters": ADD}]
    first = oa.responses.create(model="m", input="What is 2 + 3?", tools=tools, tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False,
                                max_output_tokens=100, temperature=0, reasoning={"effort": "none"})
    calls = [it for it in first.output if it.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "add"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, ADD)
    second = oa.responses.create(model="m", input=[{"role": "user", "content": "What is 2 + 3?"},
                                                   {"type": "function_call", "call_id": calls[0].call_id, "name": "add", "arguments": calls[0].arguments},
                                                   {"type": "function_call_output", "call_id": calls[0].call_id, "output": str(args["a"] + args["b"])}],
                                 tools=tools, max_output_tokens=16, temperature=0, reasoning={"effort": "none"})
    assert second.output_text and not [it for it in second.output if it.type == "function_call"]
    assert second.usage.input_tokens > first.usage.input_tokens


def test_responses_json_schema(oa):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["ok", "n"],
              "additionalProperties": False}
    r = oa.responses.create(model="m", input="JSON", text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
                            max_output_tokens=200, temperature=0, reasoning={"effort": "none"})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("extra,named", [({"previous_response_id": "resp_1"}, "previous_response_id"),
                                         ({"tools": [{"type": "web_search"}]}, "tools[0].type")])
def test_responses_refused(oa, extra, named):
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="m", input="hi", max_output_tokens=4, extra_body=extra)
    assert named in str(e.value)


# ---- Messages ----

def test_messages_text_equals_chat(an, oa):
    m = an.messages.create(model="m", max_tokens=24, system="You write Python.", messages=[{"role": "user", "content": "def fib(n):"}],
                           thinking={"type": "disabled"}, extra_body={"temperature": 0})
    ref = chat_text(oa, [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}], 24, thinking=False)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 24


def test_messages_stream_equals_whole(an):
    kw = dict(model="m", max_tokens=32, messages=[{"role": "user", "content": [{"type": "text", "text": "import os"}]}], extra_body={"temperature": 0})
    whole = an.messages.create(**kw)
    with an.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "message_stop" in kinds


def test_messages_tool_use_loop(an):
    tools = [{"name": "add", "description": "Adds.", "input_schema": ADD}]
    first = an.messages.create(model="m", max_tokens=100, messages=[{"role": "user", "content": "2 + 3?"}], tools=tools,
                               tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}, thinking={"type": "disabled"},
                               extra_body={"temperature": 0})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "add"
    jsonschema.validate(uses[0].input, ADD)
    with an.messages.stream(model="m", max_tokens=100, messages=[{"role": "user", "content": "2 + 3?"}], tools=tools,
                            tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}, thinking={"type": "disabled"},
                               extra_body={"temperature": 0}) as s:
        streamed = s.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [uses[0].input]
    second = an.messages.create(model="m", max_tokens=16, tools=tools, thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "add", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}]}])
    assert second.content and second.usage.input_tokens + second.usage.cache_read_input_tokens > first.usage.input_tokens


def test_messages_errors(server, an):
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="m", max_tokens=4, messages=[{"role": "system", "content": "x"}])
    assert "role" in str(e.value)
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
