"""Starts `qflash serve` on a free port for the tests and stops it again."""
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("QFLASH_BIN", os.path.join(ROOT, "build", "qflash"))
MODEL = os.environ.get("QFLASH_TEST_MODEL", os.path.join(ROOT, "models", "qwen36moe-code-14m"))
# the real Qwen3.6 template (tools, thinking), served with --chat-template by the tool-calling tests
QWEN36_TEMPLATE = os.path.join(ROOT, "tests", "data", "templates", "templates", "Qwen-Qwen3.6-35B-A3B.jinja")
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


class Server:
    def __init__(self, *args, env=None, wait_ready=True, model=MODEL, preexec_fn=None):
        names = [] if "--served-model-name" in args or "--model-name" in args else \
            ["--served-model-name", os.path.basename(os.path.normpath(str(model))) + ",m"]  # the tests call it "m"
        self.args = [BIN, "serve", "-m", model, "--port", "0", "-t", "2", "--verbose", *names, *args]
        self.log = []
        self.port = None
        self.ready = threading.Event()
        self.bound = threading.Event()
        full_env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(self.args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=full_env, text=True, errors="replace",
                                     preexec_fn=preexec_fn)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.bound.wait(30):
            self.stop()
            raise RuntimeError("server did not bind:\n" + "".join(self.log))
        if wait_ready and not self.ready.wait(60):
            self.stop()
            raise RuntimeError("server did not load:\n" + "".join(self.log))

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"bound to [^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.bound.set()
            if "listening on" in line:
                self.ready.set()

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self.port

    def metrics(self):
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
                if name.endswith('"}') and name.count("=") == 1 and '{model_name="' in name:  # vLLM's series: also by the bare name
                    out[name.split("{", 1)[0]] = float(value)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        self.reader.join(5)


def run_cli(prompt, n, *extra):
    """`qflash run` greedy output for the same model: the reference for the server."""
    r = subprocess.run([BIN, "run", "-m", MODEL, "-p", prompt, "-n", str(n), "--temp", "0", "-t", "2", *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def wait_for(pred, timeout=10.0, step=0.05):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
