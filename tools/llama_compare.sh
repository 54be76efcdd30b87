#!/bin/bash
# qflash beside llama.cpp on the CPU, on the bundled model, in one sitting (alternating runs):
# prompt (512 tokens) and decode (128 tokens) speed at -t 1, decode at -t 2 while two busy
# processes hold both cores, and peak RSS. llama.cpp is built from the PyPI sdist of
# llama-cpp-python (which vendors it) in $WORK, never in this repository; its converter makes the
# GGUF (bf16, then Q8_0 and Q4_K_M by llama-quantize). Needs network access to PyPI.
#   bash tools/llama_compare.sh [WORK (default /tmp/llama-compare)]
set -eu
WORK=${1:-/tmp/llama-compare}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
M=$ROOT/models/qwen36moe-code-14m
Q=$ROOT/build/qflash
mkdir -p "$WORK"
cd "$WORK"
if [ ! -d src ]; then
    pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d dl
    mkdir src && tar xzf dl/llama_cpp_python-0.3.36.tar.gz -C src --strip-components=1
fi
L=$WORK/src/vendor/llama.cpp
if [ ! -x "$L/build/bin/llama-bench" ]; then
    cmake -S "$L" -B "$L/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
    cmake --build "$L/build" -j"$(nproc)" --target llama-bench llama-quantize >/dev/null
fi
if [ ! -f model-bf16.gguf ]; then
    [ -x venv/bin/python ] || { python3 -m venv venv && venv/bin/pip install -q numpy sentencepiece safetensors transformers torch; }
    # the bundled tokenizer's pre-split hash is not in the converter's table: take qwen2's (llama-bench
    # feeds token ids, so the split does not matter to what is measured)
    cat > conv.py <<'EOF'
import runpy, sys
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
EOF
    (cd "$L" && PYTHONPATH=gguf-py:. "$WORK/venv/bin/python" "$WORK/conv.py" "$M" --no-mtp --outtype bf16 --outfile "$WORK/model-bf16.gguf" >/dev/null 2>&1)
    for t in Q8_0 Q4_K_M; do "$L/build/bin/llama-quantize" model-bf16.gguf "model-$t.gguf" $t >/dev/null 2>&1; done
fi
lb() { "$L/build/bin/llama-bench" -m "$1" -p 512 -n 128 -t "$2" -r 3 -o csv 2>/dev/null | awk -F, 'NR > 1 {gsub(/"/, ""); printf "%s %s t/s  ", ($0 ~ /,512,0,/ ? "pp512" : "tg128"), $(NF-1)}'; echo; }
qb() { "$Q" bench -m "$M" --prompt-len 512 --gen-len 128 --concurrency 1 --runs 3 -t "$1" 2>&1 | grep -E '^ +1 +512' | awk '{printf "prefill %s t/s  decode %s t/s\n", $6, $13}'; }
rss() { /usr/bin/time -v "$@" 2>&1 >/dev/null | awk '/Maximum resident/ {print $6 " KiB"}'; }
for round in 1 2; do
    echo "== round $round, -t 1"
    echo "qflash bf16:        $(qb 1)"
    for t in bf16 Q8_0 Q4_K_M; do echo "llama.cpp $t: $(lb model-$t.gguf 1)"; done
done
echo "== -t 2 with two busy processes on the cores"
yes >/dev/null & y1=$!; yes >/dev/null & y2=$!
for round in 1 2; do
    echo "qflash bf16:        $(qb 2)"
    echo "llama.cpp bf16: $(lb model-bf16.gguf 2)"
done
kill $y1 $y2
echo "== peak RSS, 512-token prompt and 128 tokens"
head -c 2400 "$M/heldout.txt" > prompt.txt
echo "qflash run:        $(rss "$Q" run -m "$M" -f prompt.txt -n 128 --temp 0 -t 1)"
echo "llama.cpp bench bf16: $(rss "$L/build/bin/llama-bench" -m model-bf16.gguf -p 512 -n 128 -t 1 -r 1)"
