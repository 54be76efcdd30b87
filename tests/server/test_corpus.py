"""The shared template corpus (33 published templates x 13 conversations) through the server:
each template served with --chat-template, each case's apply_chat_template inputs sent to
/tokenize and the ids sent back to /detokenize must give jinja2's render byte for byte, and a
case jinja2 refuses must be a 400. Each template is served from a model directory of its own (the
bundled model's files, with a tokenizer_config.json holding that template and its bos/eos texts,
as the model's repository has them); the expectations' date (2024-07-26) becomes today's, which
the templates that call strftime_now ask for. The two cases that send a call's arguments as a JSON string (OpenAI's
wire form) expect what their dict twins render: the server parses the string, as vLLM does, and
drops null keys, as transformers 5 does."""
import datetime
import json
import os
import http.client


from qfserver import MODEL, ROOT, Server

CORPUS = os.path.join(ROOT, "tests", "data", "templates")
TEMPLATES = sorted(f[:-6] for f in os.listdir(os.path.join(CORPUS, "templates")) if f.endswith(".jinja"))
CASES = sorted(f[:-5] for f in os.listdir(os.path.join(CORPUS, "cases")) if f.endswith(".json"))
AS_SERVED = {"tools_str_args": "tools_dict_args", "tools_str_args_null_content": "tools_dict_args_content_none"}


def call(conn, path, body):
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def as_served(text, template):
    if "strftime_now" not in template:  # (Llama 3.x writes the date itself)
        return text
    today = datetime.datetime.now(datetime.timezone.utc)
    return text.replace("26 Jul 2024", today.strftime("%d %b %Y")).replace("2024-07-26", today.strftime("%Y-%m-%d"))


def model_dir_with(tmp, name, tokens):
    d = tmp / name
    d.mkdir()
    for f in os.listdir(MODEL):
        if f != "tokenizer_config.json":
            os.symlink(os.path.join(MODEL, f), d / f)
    cfg = json.load(open(os.path.join(MODEL, "tokenizer_config.json")))
    cfg.update({"bos_token": None, "eos_token": None, **tokens})
    cfg["chat_template"] = open(os.path.join(CORPUS, "templates", name + ".jinja"), encoding="utf-8").read()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return str(d)


def request_of(case):
    inputs = dict(json.load(open(os.path.join(CORPUS, "cases", case + ".json")))["apply_chat_template_inputs"])
    body = {"messages": inputs.pop("conversation"), "add_generation_prompt": inputs.pop("add_generation_prompt", False)}
    tools = inputs.pop("tools", None)
    if tools is not None:
        body["tools"] = tools
    if inputs:
        body["chat_template_kwargs"] = inputs
    return body


def test_corpus_through_tokenize_and_detokenize(tmp_path):
    all_tokens = json.load(open(os.path.join(CORPUS, "templates", "TOKENS.json")))
    ok, total, misses = 0, 0, []
    for name in TEMPLATES:
        source = open(os.path.join(CORPUS, "templates", name + ".jinja"), encoding="utf-8").read()
        with Server(model=model_dir_with(tmp_path, name, all_tokens.get(name, {}))) as s:
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            for case in CASES:
                expected = os.path.join(CORPUS, "expected", "%s__%s.txt" % (name, AS_SERVED.get(case, case)))
                status, out = call(conn, "/tokenize", request_of(case))
                total += 1
                if not os.path.exists(expected):  # jinja2 raised
                    ok += status == 400
                    if status != 400:
                        misses.append((name, case, "rendered where jinja2 raised"))
                    continue
                if status != 200:
                    misses.append((name, case, out.get("error", {}).get("message")))
                    continue
                _, back = call(conn, "/detokenize", {"tokens": out["tokens"]})
                want = as_served(open(expected, encoding="utf-8").read(), source)
                if back["prompt"] == want:
                    ok += 1
                else:
                    misses.append((name, case, "differs"))
    print("template corpus through /tokenize + /detokenize: %d of %d" % (ok, total))
    assert total == len(TEMPLATES) * len(CASES) == 33 * 13
    for m in misses:
        print("miss:", *m)
    assert ok == total, misses
