"""serve --draft: MTP speculative decoding through the server on the bundled model with its trained
head (tests/data/mtp, loaded as a second shard). Greedy text equals `qflash run` without drafts,
alone and with other requests drafting beside it in the same steps, drafts are made and most are
accepted (the metrics say so), and requests that cannot draft (sampling, logprobs) are served as
before."""
import concurrent.futures
import os
import re
import sys

import openai
import pytest

from qfserver import ROOT, Server, run_cli

sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_mtp_dir  # noqa: E402  (tools/: the bundled model with its head, also for gpu-check.sh spec)

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_files(path):",
           "def quicksort(xs):\n    if len(xs) <= 1:"]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    """The bundled model with the head as a second shard: mtp_num_hidden_layers 1 and an index."""
    d = tmp_path_factory.mktemp("mtp")
    make_mtp_dir.make(str(d))
    return str(d)


@pytest.fixture(scope="module")
def want():
    return {(p, n): run_cli(p, n) for p in PROMPTS for n in (48, 96)}


def complete(s, prompt, n=48, **kw):
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.completions.create(model="m", prompt=prompt, max_tokens=n, **kw)


def spec_counts(s):
    m = s.metrics()
    return m["qflash:spec_decode_draft_tokens_total"], m["qflash:spec_decode_accepted_tokens_total"], m["vllm:spec_decode_num_accepted_tokens_total"]


@pytest.mark.parametrize("draft", ["1", "3"])
def test_alone_equals_plain(mtp_dir, want, draft):
    with Server("--draft", draft, model=mtp_dir) as s:
        for p in PROMPTS:
            assert complete(s, p, temperature=0).choices[0].text == want[p, 48], p
        drafted, accepted, alias = spec_counts(s)
        assert drafted > 0 and accepted == alias
        assert accepted >= 0.35 * drafted, (drafted, accepted)  # the trained head: ~70% of single drafts, ~50% of 3 chained, on these prompts


def test_beside_others(mtp_dir, want):
    """Four at once: every decoding sequence's token and drafts go into the step's one forward (a
    refused draft's rows run again, together); every text is the plain one, and steps verified the
    drafts of several sequences at once."""
    with Server("--draft", "2", "--max-batch", "4", model=mtp_dir) as s:
        lens = [48, 48, 48, 96]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda a: complete(s, a[0], a[1], temperature=0).choices[0].text, zip(PROMPTS, lens)))
        for p, n, g in zip(PROMPTS, lens, got):
            assert g == want[p, n], p
        drafted, accepted, _ = spec_counts(s)
        assert drafted > 0 and accepted >= 0.35 * drafted, (drafted, accepted)
        steps = [re.search(r"(\d+) decode \+ \d+ prefill sequences, \d+ rows \((\d+) drafts", l) for l in s.log]
        assert any(m and int(m.group(1)) >= 2 and int(m.group(2)) >= 4 for m in steps), "no step drafted for several sequences"


def test_choices_and_prefix_reuse(mtp_dir, want):
    """n = 2 (the second choice adopts the first's state, which its head has not seen) and a prompt
    taken again from the prefix cache: the plain text each time."""
    with Server("--draft", "2", model=mtp_dir) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=48, temperature=0, n=2)
        assert [x.text for x in r.choices] == [want[PROMPTS[1], 48]] * 2
        for _ in range(2):
            assert complete(s, PROMPTS[2], temperature=0).choices[0].text == want[PROMPTS[2], 48]


def test_requests_that_do_not_draft(mtp_dir):
    with Server("--draft", "2", model=mtp_dir) as s:
        r = complete(s, PROMPTS[0], temperature=0.8, seed=7)
        assert r.usage.completion_tokens == 48
        r = complete(s, PROMPTS[0], temperature=0, logprobs=2)
        assert len(r.choices[0].logprobs.tokens) == 48
        assert spec_counts(s)[0] == 0


def test_draft_needs_a_head():
    s = Server("--draft", "2", wait_ready=False)
    assert s.proc.wait(30) == 1
    s.reader.join(5)
    assert any("--draft needs a model with an MTP head" in l for l in s.log), "".join(s.log)
