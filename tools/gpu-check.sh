#!/bin/bash
# GPU checks in one device call (the H200 machine), binaries built here and carried in the
# ignored gpu/ (a device call carries at most 64 MiB):
#   cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DQFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DCMAKE_CUDA_FLAGS=--compress-mode=size
#   (90-real: SASS alone, no PTX; the fatbins compressed for size: the four binaries pack to 6.6 MB instead
#   of 14, so they and a reference build's qflash fit one call beside the 48.7 MiB of tracked files)
#   cmake --build build-cuda -j --target qflash-cli test_cuda test_model test_experts
#   mkdir -p gpu && cp build-cuda/qflash build-cuda/tests/test_{cuda,model,experts} gpu/ && strip gpu/qflash gpu/test_*
#   nvcc -O2 -arch=sm_90 bench/gpu_copy_probe.cu -o gpu/copy_probe
#   (cd gpu && tar cf - qflash test_cuda test_model test_experts copy_probe | xz -9e -T0 > bins.txz && rm qflash test_* copy_probe)
# Several modes in one call (each mode's output is also kept in $OUT/log-MODE.txt, so a call cut at
# its limit still brings back what ran): for m in batch spec streams; do bash tools/gpu-check.sh $m; done
# A reference build (another commit) may travel as gpu/old/bins.txz holding its qflash: every
# bench then runs it beside the new one, alternating, so both are measured in the same minutes.
#   bash tools/gpu-check.sh tests     the GPU tests (test_cuda, test_model in both precisions, test_experts)
#   bash tools/gpu-check.sh slice8    batch 1 on 8 full-size layers, new and old twice each
#   bash tools/gpu-check.sh whole     batch 1 on the whole synthetic Qwen3.6-35B-A3B, new and old twice each
#   bash tools/gpu-check.sh whole22   the same with --gpu-mem 22G (experts streamed), new and old twice each
#   bash tools/gpu-check.sh ab        batch 1 all resident and at --gpu-mem 22G, new then old once each (load times too)
#   bash tools/gpu-check.sh streams   batch 1, 8 to 64 streams, an 8K and a 32K prompt (new only)
#   bash tools/gpu-check.sh serve-sharegpt  the server under a ShareGPT-like load at 1/16/64 in flight
#   bash tools/gpu-check.sh sparsity ARGS  batch 1 at sparsity levels (ARGS: --levels 0,0.3,... and e.g. --gpu-mem 22G)
#   bash tools/gpu-check.sh flash [ARGS]  bench with ARGS (e.g. --gpu-mem 22G) while nvidia-smi
#                                     traces device memory every 100 ms into $OUT/mem-*.csv
#   bash tools/gpu-check.sh batch     the bundled model served on the GPU with CUDA graphs and without,
#                                     64 greedy completions 12 at a time (tools/serve_batch_check.py):
#                                     the texts must be the same; and the bench's 1-64 streams' ids
#   bash tools/gpu-check.sh bias      the bundled model served on the GPU: logit_bias, stop_token_ids and
#                                     min_tokens (tools/serve_bias_check.py, the checks test_serving.py asks)
#   bash tools/gpu-check.sh spec      --draft 1..3 on the GPU: the bundled model with its trained head
#                                     (tools/make_mtp_dir.py) and the synthetic 35B-A3B with a head of the
#                                     release's shapes: step cost, drafts accepted, ids as plain or not
#   bash tools/gpu-check.sh prefix    the bundled model served on the GPU with and without prefix
#                                     snapshots (tools/prefix_check.py: digests must match), and
#                                     qflash chat's snapshot restore after /reset
#   bash tools/gpu-check.sh trunk8    the int8 trunk: test_cuda's fused int8 products (QUICK=9, with their
#                                     time beside bf16), then batch 1 on the whole synthetic model with int4
#                                     experts and a bf16 / int8 trunk alternating, int8 experts + int8 trunk,
#                                     and int4 + int8 trunk in a 12G budget
#   bash tools/gpu-check.sh draw      the token draw on the device: test_cuda's draws against the host sampler
#                                     (QUICK=10) and test_model's DRAW steps on the GPU
#   bash tools/gpu-check.sh chain     test_model's chain checks (verifies against one token a step), with the
#                                     tensor-core threshold raised and each one-row kernel off in turn (the
#                                     kernels off are lab options: binaries of a -DQFLASH_LAB=ON build)
#   bash tools/gpu-check.sh spec-profile  one draft on the synthetic model with every kernel timed: a verify's cost
#   bash tools/gpu-check.sh prefill-profile  an 8K prompt in 2048-token chunks with every kernel timed
#                                     (option profile=1): where the prefill's time goes
#   bash tools/gpu-check.sh flash-serve [ARGS]  serve the synthetic model (the bundled tokenizer) with
#                                     ARGS, 16 streams of 64 tokens from bench/serve_load.py, memory traced
# Results land in $OUT.
set -u
OUT=${OUT:-/tmp/qflash-check}
mkdir -p "$OUT"
[ -f gpu/bins.txz ] && [ ! -x gpu/qflash ] && tar xJf gpu/bins.txz -C gpu
[ -f gpu/old/bins.txz ] && [ ! -x gpu/old/qflash ] && tar xJf gpu/old/bins.txz -C gpu/old
exec > >(tee -a "$OUT/log-$1.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
# the roofline is this card's measured copy (bench/gpu_copy_probe.cu, carried as gpu/copy_probe)
BW=$([ -x gpu/copy_probe ] && gpu/copy_probe)
BW=${BW:-4300}
echo "roofline: device copy $BW GB/s"
B="bench --synthetic qwen3.6-35b-a3b --device cuda --bw $BW"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|replayed|load:|peak|decoded ids'
new() { echo "== new | $*"; timeout 150 gpu/qflash $B --cuda-opt steptime=1 "$@" 2>&1 | grep -E "$show"; }
old() { [ -x gpu/old/qflash ] || return 0; echo "== old | $*"; QFLASH_CUDA_STEPTIME=1 timeout 150 gpu/old/qflash $B "$@" 2>&1 | grep -E "$show"; }
case "$1" in
prefix)
    M=models/qwen36moe-code-14m
    printf 'hello\nwrite code\n/reset\nhello\n' | timeout 120 gpu/qflash chat -m $M --device cuda -n 16 --temp 0 >"$OUT/chat.txt" 2>"$OUT/chat.err"
    echo "== chat (the first and the third reply must be the same)"; cat "$OUT/chat.txt"; grep -E "prompt tokens|rror" "$OUT/chat.err"
    for mem in 256 0 256g; do # 256g: under a device budget, the snapshots' DeltaNet copies in pinned host memory
        budget=; [ $mem = 256g ] && budget="--gpu-mem 2G"
        gpu/qflash serve -m $M --device cuda --port 18080 --prefill-chunk 32 --prefix-cache-mem ${mem%g} $budget >"$OUT/serve-$mem.log" 2>&1 &
        pid=$!
        for i in $(seq 60); do curl -sf localhost:18080/health >/dev/null && break; sleep 1; done
        echo "== prefix-cache-mem $mem $budget"; grep -o "prefix snapshots[^;]*" "$OUT/serve-$mem.log"; timeout 120 python3 tools/prefix_check.py http://127.0.0.1:18080 6
        kill $pid; wait $pid 2>/dev/null
    done
    ;;
spec)
    python3 tools/make_mtp_dir.py /tmp/mtp14m
    echo "== bundled, --draft 3"
    timeout 120 gpu/qflash bench -m /tmp/mtp14m --device cuda --prompt-len 64 --gen-len 128 --concurrency 1 --runs 2 --draft 3 2>&1 | grep -E "draft|rror"
    echo "== synthetic 35B-A3B, --draft 3"
    timeout 300 gpu/qflash $B --prompt-len 128 --gen-len 64 --concurrency 1 --runs 1 --draft 3 2>&1 | grep -E "draft|rror|$show"
    ;;
batch)
    M=models/qwen36moe-code-14m
    for g in 1 0; do
        gpu/qflash serve -m $M --device cuda --port 18091 --max-batch 8 --cuda-opt graphs=$g >"$OUT/batch-$g.log" 2>&1 &
        pid=$!
        for i in $(seq 60); do curl -sf localhost:18091/health >/dev/null && break; sleep 1; done
        echo "== graphs=$g"; timeout 120 python3 tools/serve_batch_check.py http://127.0.0.1:18091 64 12 >"$OUT/batch-$g.txt"; tail -1 "$OUT/batch-$g.txt"
        kill $pid; wait $pid 2>/dev/null
    done
    cmp -s "$OUT/batch-1.txt" "$OUT/batch-0.txt" && echo "batch: graphs and eager steps give the same texts" || echo "batch: FAIL, the texts differ"
    for g in 1 0; do # the bench's streams (different prompts): the same ids recorded and eager
        echo "== bench graphs=$g"
        timeout 120 gpu/qflash bench -m $M --device cuda --prompt-len 64 --gen-len 64 --concurrency 1,8,16,64 --runs 1 --cuda-opt graphs=$g 2>&1 | grep -E "decoded ids|rror"
    done
    ;;
bias)
    gpu/qflash serve -m models/qwen36moe-code-14m --device cuda --port 18092 >"$OUT/bias-serve.log" 2>&1 &
    pid=$!
    for i in $(seq 60); do curl -sf localhost:18092/health >/dev/null && break; sleep 1; done
    timeout 120 python3 tools/serve_bias_check.py http://127.0.0.1:18092
    kill $pid; wait $pid 2>/dev/null
    ;;
tests)
    timeout 500 gpu/test_cuda . >"$OUT/test_cuda.log" 2>&1; echo "test_cuda rc=$?"  # parts alone: QFLASH_TEST_QUICK=1..8 (test_cuda.c)
    grep -E "FAIL|checks|rror|^with" "$OUT/test_cuda.log" | head -60
    QFLASH_TEST_DEVICE=cuda timeout 120 gpu/test_model . 2>&1 | grep -E "FAIL|checks|largest|rror|draws|verify"
    timeout 120 gpu/test_experts . 2>&1 | grep -E "FAIL|checks|skipped" | head -20
    ;;
slice8)
    S="--prompt-len 128 --layers 8 --gen-len 64 --concurrency 1 --runs 1"
    for i in 1 2; do new $S; old $S; done
    ;;
whole)
    W="--prompt-len 128 --gen-len 64 --concurrency 1 --runs 2"
    new $W --json "$OUT/c1-new.json"; old $W; new $W; old $W
    ;;
ab)
    W="--prompt-len 128 --gen-len 64 --concurrency 1 --runs 1"
    new $W; old $W; new $W --gpu-mem 22G; old $W --gpu-mem 22G
    ;;
whole22)
    W="--prompt-len 128 --gen-len 64 --concurrency 1 --runs 1 --gpu-mem 22G"
    new $W; old $W; new $W; old $W
    ;;
sparsity)
    shift
    echo "== sparsity | $*"
    timeout 500 gpu/qflash $B --prompt-len 128 --gen-len 64 --concurrency 1 --runs 2 "$@" 2>&1 | grep -E "$show|plan|level|calibrated|conc"
    ;;
flash)
    shift
    tag=$(echo "$*" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-60)
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/mem-$tag.csv" &
    smi=$!
    echo "== flash | $*"
    timeout 400 gpu/qflash $B "$@" 2>&1 | grep -E "$show|plan|slots|expert cache|spread|conc"
    kill $smi
    ;;
flash-serve)
    shift
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/mem-serve.csv" &
    smi=$!
    gpu/qflash serve -m models/qwen36moe-code-14m --synthetic qwen3.6-35b-a3b --device cuda --port 8099 --max-batch 16 "$@" > "$OUT/serve.log" 2>&1 &
    srv=$!
    for i in $(seq 1 120); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8099/health')" 2>/dev/null && break
        sleep 2
    done
    timeout 300 python3 bench/serve_load.py --url http://127.0.0.1:8099 --concurrency 1,16 --gen 64 --prompt-len 64 --runs 1
    curl -s http://127.0.0.1:8099/metrics 2>/dev/null | grep expert_cache || python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8099/metrics').read().decode())" | grep expert_cache
    kill $srv; wait $srv; kill $smi
    grep -E "plan|slots|rror" "$OUT/serve.log" | head
    ;;
draw)
    QFLASH_TEST_QUICK=10 timeout 200 gpu/test_cuda . 2>&1 | grep -E "FAIL|checks|rror|dec draw"
    QFLASH_TEST_DEVICE=cuda timeout 200 gpu/test_model . 2>&1 | grep -E "FAIL|checks|draws|verify|rror"
    ;;
chain)
    for o in "" graphs=0 pdl=0 comb=0 dec_tc=64 bulk=0 moe1=0 pw1=0 early=0 gdn_gn=0 att1=0 att_gate=0 route=2 bulk=0,moe1=0,pw1=0,early=0,gdn_gn=0,att1=0,att_gate=0; do
        echo "== QFLASH_CUDA_OPTS=$o"
        QFLASH_CUDA_OPTS=$o QFLASH_TEST_DEVICE=cuda-chain timeout 60 gpu/test_model . 2>&1 | grep -E "verif|rror|FAIL|checks"
    done
    ;;
spec-profile)
    timeout 200 gpu/qflash $B --prompt-len 128 --gen-len 32 --concurrency 1 --runs 1 --draft 1 --cuda-opt profile=1 2>&1 |
        grep -E "draft|rror|profile|^ +[a-z_]+.* ms" | head -60
    ;;
trunk8)
    QFLASH_TEST_QUICK=9 timeout 200 gpu/test_cuda . >"$OUT/test_cuda9.log" 2>&1; echo "test_cuda (int8 trunk) rc=$?"
    grep -E "FAIL|checks|rror|dec matmul.*us" "$OUT/test_cuda9.log" | head -40
    W="--prompt-len 128 --gen-len 64 --concurrency 1 --runs 2"
    for i in 1 2; do new $W --experts int4; new $W --experts int4 --trunk int8; done
    new $W --experts int8 --trunk int8
    new $W --experts int4 --trunk int8 --gpu-mem 12G
    ;;
prefill-profile)
    timeout 200 gpu/qflash $B --prompt-len 8192 --gen-len 2 --prefill-chunk 2048 --concurrency 1 --runs 1 --warmup 0 --cuda-opt profile=1 2>&1 |
        grep -E "$show|profile|^ +[a-z_]+.* ms" | head -60
    ;;
streams)
    new --prompt-len 128 --gen-len 64 --concurrency 1 --runs 2
    new --prompt-len 128 --gen-len 32 --concurrency 8,16,32,64 --runs 1 --json "$OUT/c8-64.json"
    new --prompt-len 8192 --gen-len 4 --concurrency 1 --runs 1 --json "$OUT/8k.json"
    new --prompt-len 32768 --gen-len 2 --prefill-chunk 2048 --concurrency 1 --runs 1 --json "$OUT/32k.json"
    ;;
serve-sharegpt)
    # the server under bench/serve_load.py's ShareGPT-like mix at 1 / 16 / 64 requests in flight; the
    # synthetic model streams text with the real 248k tokenizer (gpu/tok: tools/make_qwen_tokenizer.py's
    # output, carried as gpu/tok.txz)
    [ -f gpu/tok.txz ] && mkdir -p gpu/tok && tar xJf gpu/tok.txz -C gpu/tok
    gpu/qflash serve --synthetic qwen3.6-35b-a3b -m gpu/tok --device cuda --port 8099 --max-batch 64 --ctx 2048 > "$OUT/serve.log" 2>&1 &
    srv=$!
    for i in $(seq 1 80); do grep -q "listening on" "$OUT/serve.log" && break; sleep 1; done
    L="python3 bench/serve_load.py --url http://127.0.0.1:8099 --mix sharegpt --rate inf"
    timeout 60 $L --num-prompts 8 --concurrency 1 --json "$OUT/sg1.json" | tail -2
    timeout 60 $L --num-prompts 48 --concurrency 16 --json "$OUT/sg16.json" | tail -1
    timeout 90 $L --num-prompts 128 --concurrency 64 --json "$OUT/sg64.json" | tail -1
    echo "== sampled (0.7, top-p 0.8, top-k 20: drawn on the device), 64 in flight"
    timeout 90 $L --num-prompts 128 --concurrency 64 --temperature 0.7 --top-p 0.8 --top-k 20 --json "$OUT/sg64s.json" | tail -1
    kill $srv; wait $srv
    ;;
esac
