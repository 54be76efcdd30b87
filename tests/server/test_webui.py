"""The chat page in headless Chromium (Debian's chromium + chromium-driver): type a message, see a
streamed reply that equals the API's reply, stop a long one with the stop button; Markdown,
live reasoning and the request's controls against a scripted stream."""
import json
import os
import shutil
import urllib.request

import pytest

from qfserver import Server, wait_for

selenium = pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
BROWSER = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(DRIVER) or not os.path.exists(BROWSER):
        pytest.fail("chromium and chromium-driver are needed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = BROWSER
    for a in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]:
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def api_reply(url, text):
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 64, "temperature": 0,
                       "chat_template_kwargs": {"enable_thinking": False}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"]


def test_type_and_see_streamed_reply(browser):
    # greedy and short, so the page's reply can be compared with the API's
    with Server("--ctx", "512") as s:
        browser.get(s.url + "/")
        WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "model").text == "qwen36moe-code-14m")
        # the page sends the server's default sampling; make it greedy for a comparable answer
        browser.execute_script("""
            const f = window.fetch;
            window.fetch = (u, o) => { if (o && o.body) { const b = JSON.parse(o.body); b.temperature = 0; b.max_tokens = 64;
                                                          o.body = JSON.stringify(b); } return f(u, o); };""")
        browser.find_element(By.ID, "think").click()  # the answer itself, not reasoning
        box = browser.find_element(By.ID, "input")
        box.send_keys("write fib in python")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .content"))
        # the usage chunk at the end of the stream fills in the stats line
        WebDriverWait(browser, 60).until(lambda d: "tokens" in d.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text)
        assert browser.find_element(By.ID, "stop").get_attribute("disabled")
        shown = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content").get_attribute("data-raw")
        stats = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").get_attribute("textContent")
        assert len(shown) > 10 and shown == api_reply(s.url, "write fib in python")
        assert stats.startswith("64 tokens")


def test_stop_button_cancels(browser):
    # 8,000 tokens take the CPU seconds, so the click comes while the server still generates (a
    # generation that ended first would leave nothing to stop)
    with Server("--ctx", "8192") as s:
        browser.get(s.url + "/")
        browser.execute_script("""
            const f = window.fetch;
            window.fetch = (u, o) => { if (o && o.body) { const b = JSON.parse(o.body); b.max_tokens = 8000; b.ignore_eos = true;
                                                          o.body = JSON.stringify(b); } return f(u, o); };""")
        browser.find_element(By.ID, "think").click()
        browser.find_element(By.ID, "input").send_keys("class Stack:")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 60, poll_frequency=0.05).until(
            lambda d: len(d.find_element(By.CSS_SELECTOR, ".msg.assistant .content").get_attribute("textContent")) > 20)
        browser.find_element(By.ID, "stop").click()
        WebDriverWait(browser, 20).until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text == "stopped")
        assert wait_for(lambda: s.metrics()["qflash:num_requests_running"] == 0, timeout=10)
        assert s.metrics()["qflash:requests_cancelled_total"] == 1


SCRIPTED = r"""
window.sent = [];
window.fetch = (u, o) => {
  if (!o || !o.body) return Promise.resolve(new Response(JSON.stringify({data: [{id: "scripted"}]})));
  window.sent.push(JSON.parse(o.body));
  const parts = [{reasoning_content: "Let me think"}, {reasoning_content: " about it."}, "# Plan\n\nUse `sorted` and **care**:\n\n",
                 "```python\nprint(1 < 2)\n```\n\n- one\n- two\n\n<b>not bold</b> [docs](https://docs.python.org)"];
  const enc = new TextEncoder();
  let i = 0;
  const body = new ReadableStream({ pull(ctl) {
    return new Promise((res) => setTimeout(res, 400)).then(() => {
      if (i < parts.length) {
        const p = parts[i++], d = typeof p === "string" ? {content: p} : p;
        ctl.enqueue(enc.encode("data: " + JSON.stringify({choices: [{index: 0, delta: d}]}) + "\n\n"));
      } else {
        ctl.enqueue(enc.encode("data: " + JSON.stringify({choices: [], usage: {completion_tokens: 9}}) + "\n\ndata: [DONE]\n\n"));
        ctl.close();
      }
    });
  }});
  return Promise.resolve(new Response(body, {status: 200}));
};
"""


def test_markdown_reasoning_and_controls(browser):
    with Server("--ctx", "512") as s:
        browser.get(s.url + "/")
        browser.execute_script(SCRIPTED)
        browser.find_element(By.ID, "input").send_keys("sort a list")
        browser.find_element(By.ID, "send").click()
        # the reasoning shows while it streams, before any answer
        WebDriverWait(browser, 20).until(lambda d: "about it" in d.find_element(By.CSS_SELECTOR, ".msg.assistant .reasoning").text)
        assert browser.find_element(By.CSS_SELECTOR, ".msg.assistant details").get_attribute("open") is not None
        WebDriverWait(browser, 20).until(lambda d: "tokens" in d.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text)
        content = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content")
        assert content.find_element(By.TAG_NAME, "h1").text == "Plan"
        assert content.find_element(By.CSS_SELECTOR, "pre code.lang-python").get_attribute("textContent") == "print(1 < 2)"
        assert [li.text for li in content.find_elements(By.TAG_NAME, "li")] == ["one", "two"]
        assert content.find_element(By.CSS_SELECTOR, "p code").text == "sorted"
        assert content.find_element(By.TAG_NAME, "strong").text == "care"
        assert not content.find_elements(By.TAG_NAME, "b")  # model text never becomes markup
        assert "<b>not bold</b>" in content.text
        assert content.find_element(By.TAG_NAME, "a").get_attribute("href") == "https://docs.python.org/"
        assert browser.find_element(By.CSS_SELECTOR, ".msg.assistant details").get_attribute("open") is None  # folded once the answer came
        sent = browser.execute_script("return window.sent")
        assert sent[0]["max_tokens"] == 1024 and "temperature" not in sent[0]
        # the controls go into the next request
        for id_, v in (("maxtok", "77"), ("temp", "0.3")):
            el = browser.find_element(By.ID, id_)
            el.clear()
            el.send_keys(v)
        browser.find_element(By.ID, "input").send_keys("again")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 20).until(lambda d: len(d.execute_script("return window.sent")) == 2)
        sent = browser.execute_script("return window.sent")
        assert sent[1]["max_tokens"] == 77 and sent[1]["temperature"] == 0.3
        assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
