"""Prefix reuse across requests on the hybrid model: a conversation's turns prefill only their new
tokens (DeltaNet snapshots + shared KV pages) and give the same logits, bit for bit, as a server
without the cache; conversations sharing a system prompt share its prefill; the byte budget and
the KV pool are respected."""
import concurrent.futures
import json
import http.client

import openai
import pytest

from qfserver import NO_THINK, Server, wait_for

SYSTEM = ("You are a careful Python programmer. You answer with short, correct code, you name things clearly, you write "
          "docstrings, you prefer the standard library, and you never use global state. ") * 3


def client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def warm():
    with Server("--max-batch", "16", "--ctx", "2048", "--prefill-chunk", "32") as s:
        yield s


@pytest.fixture(scope="module")
def cold():
    with Server("--max-batch", "16", "--ctx", "2048", "--prefill-chunk", "32", "--prefix-cache-mem", "0") as s:
        yield s


def ask(c, msgs, n=12, think=True):
    r = c.chat.completions.create(model="m", messages=msgs, max_tokens=n, temperature=0, logprobs=True, top_logprobs=5,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": think}})
    lp = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]
    return r, lp


def n_tokens(s, msgs, think, gen=True):
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    body = {"messages": msgs, "add_generation_prompt": gen, "chat_template_kwargs": {"enable_thinking": think}}
    conn.request("POST", "/tokenize", json.dumps(body), {"Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())["count"]


@pytest.mark.parametrize("think", [False, True], ids=["no_think", "think"])
def test_ten_turns(warm, cold, think):
    """The bundled model's template is Qwen3.6's: a prompt ends in the generation prompt (with an
    empty or open reasoning block) that the next turn renders differently, so a turn reuses
    everything before its generation prompt (a snapshot where the last turn begins) and prefills
    only the reply, the new user turn and the generation prompt."""
    cw, cc = client(warm), client(cold)
    msgs = [{"role": "system", "content": SYSTEM}]
    prev = None
    for turn in range(10):
        msgs.append({"role": "user", "content": "Write helper number %d; it adds %d to its argument." % (turn, turn)})
        rw, lw = ask(cw, msgs, think=think)
        rc, lc = ask(cc, msgs, think=think)
        assert rw.choices[0].message.content == rc.choices[0].message.content
        assert lw == lc, "turn %d: logprobs differ from a cold prefill" % turn
        cached = rw.usage.prompt_tokens_details.cached_tokens
        assert rc.usage.prompt_tokens_details.cached_tokens == 0
        gen_prompt = n_tokens(warm, msgs, think) - n_tokens(warm, msgs, think, gen=False)
        # <|im_start|> ass ist ant \n <think> \n (+ \n\n </think> \n\n for thinking off: 9)
        assert gen_prompt == (9 if not think else 7)
        if prev:
            # new: the reply as the template now renders it, the user turn, the generation prompt
            new_turn = rw.usage.prompt_tokens - prev.usage.prompt_tokens
            assert rw.usage.prompt_tokens - cached <= new_turn + gen_prompt, (turn, cached, rw.usage.prompt_tokens, new_turn)
        prev = rw
        msgs.append({"role": "assistant", "content": rw.choices[0].message.content or ""})
    m = warm.metrics()
    assert m["qflash:prefix_cache_hits_total"] >= 9 and m["qflash:prefix_cache_tokens_total"] > 0


def test_chat_ten_turns():
    """qflash chat, thinking on and off: each turn prefills only the reply, the new user turn and
    the generation prompt (the "(N new)" of its status line)."""
    import re
    import subprocess
    from qfserver import BIN, MODEL
    for flags, gen_prompt in (([], 7), (["--no-think"], 9)):  # as test_ten_turns counts them
        lines = "".join("Write helper number %d; it adds %d to its argument.\n" % (t, t) for t in range(10)) + "/exit\n"
        p = subprocess.run([BIN, "chat", "-m", MODEL, "-n", "12", "--temp", "0", "-t", "2", *flags], input=lines,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-500:]
        turns = [(int(a), int(b)) for a, b in re.findall(r"\[(\d+) prompt tokens \((\d+) new\)", p.stderr)]
        assert len(turns) == 10, p.stderr[-800:]
        assert turns[0][1] == turns[0][0]
        for (n0, _), (n1, new) in zip(turns, turns[1:]):
            assert new <= (n1 - n0) + gen_prompt, (flags, turns)


def test_shared_system_prompt(warm, cold):
    cw, cc = client(warm), client(cold)
    users = ["Task %d: write a function that returns %d squared." % (i, i) for i in range(16)]
    conv = lambda u: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]
    conn = http.client.HTTPConnection("127.0.0.1", warm.port, timeout=30)
    toks = []
    for u in users[:2]:
        conn.request("POST", "/tokenize", json.dumps({"messages": conv(u)}), {"Content-Type": "application/json"})
        toks.append(json.loads(conn.getresponse().read())["tokens"])
    common = next(i for i, (a, b) in enumerate(zip(*toks)) if a != b)
    ask(cw, conv("A first conversation, so the system prompt is in the cache."))
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        warm_r = list(ex.map(lambda u: ask(cw, conv(u)), users))
        cold_r = list(ex.map(lambda u: ask(cc, conv(u)), users))
    for (rw, lw), (rc, lc) in zip(warm_r, cold_r):
        assert rw.choices[0].message.content == rc.choices[0].message.content and lw == lc
        assert rw.usage.prompt_tokens_details.cached_tokens >= common // 32 * 32 > 0


def test_budget_and_kv_pool():
    """A 3 MiB budget (a few snapshots of this model) and a KV pool of 48 pages: snapshots are
    dropped for the budget and for the pages running sequences need; nothing fails."""
    with Server("--max-batch", "4", "--ctx", "512", "--kv-pages", "48", "--prefill-chunk", "32", "--prefix-cache-mem", "3") as s:
        c = client(s)
        budget = s.metrics()["qflash:prefix_cache_budget_bytes"]
        assert budget == 3 * 1048576

        def one(i):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Question %d." % i}]
            return c.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0)

        for round_ in range(3):
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                for r in ex.map(one, range(round_ * 8, round_ * 8 + 8)):
                    assert r.choices[0].finish_reason in ("stop", "length")
            m = s.metrics()
            assert m["qflash:prefix_cache_bytes"] <= budget
        assert m["qflash:prefix_cache_evictions_total"] > 0 and m["qflash:prefix_cache_hits_total"] > 0
        assert wait_for(lambda: s.metrics()["qflash:kv_cache_pages_used"] == 0)  # stats are published after the step
        assert m["qflash:kv_cache_pages_cached"] <= m["qflash:kv_cache_pages_total"]


def test_n_choices():
    """n > 1: one prefill of the prompt (the others start from the first's copy, even with the
    prefix cache off), each choice sampled with its own seed; streams carry every index."""
    with Server("--max-batch", "8", "--ctx", "1024", "--prefix-cache-mem", "0") as s:
        c = client(s)
        msgs = [{"role": "user", "content": "def fib(n):"}]
        whole = c.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0.9, seed=5, n=3, extra_body=NO_THINK)
        assert [ch.index for ch in whole.choices] == [0, 1, 2]
        assert len({ch.message.content for ch in whole.choices}) > 1
        chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0.9, seed=5, n=3, stream=True, extra_body=NO_THINK,
                                                stream_options={"include_usage": True}))
        text = {}
        for ch in chunks:
            for x in ch.choices:
                text[x.index] = text.get(x.index, "") + (x.delta.content or "")
        assert [text[i] for i in range(3)] == [ch.message.content for ch in whole.choices]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
        assert sorted(x.index for ch in chunks for x in ch.choices if x.finish_reason) == [0, 1, 2]  # every choice ends once
        greedy = c.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0, n=2, extra_body=NO_THINK)
        assert greedy.choices[0].message.content == greedy.choices[1].message.content
        cp = c.completions.create(model="m", prompt="import os\n", max_tokens=8, temperature=0.7, n=2, seed=1)
        assert [x.index for x in cp.choices] == [0, 1] and cp.usage.completion_tokens <= 16
        admitted = [l for l in s.log if "admitted" in l]
        reused = [int(l.split("(")[1].split()[0]) for l in admitted]
        # per request: the first choice prefills everything, every other one only the last token
        assert reused.count(0) == 4 and len(reused) == 10
        assert {r for r in reused if r} == {whole.usage.prompt_tokens - 1, cp.usage.prompt_tokens - 1}
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="m", messages=msgs, max_tokens=4, n=17)
