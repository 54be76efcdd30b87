#!/bin/bash
# Session 5, last device call: tests, one-row products a warp per row (QFLASH_CUDA_PW1) side by
# side, the whole model at batch 1, and HF transformers beside a 4-layer slice.
set -u
OUT=${OUT:-/tmp/qflash-measure}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
timeout 150 gpu/test_cuda . 2>&1 | tee "$OUT/test_cuda.log" | grep -E "FAIL|checks|invalid|rror|us," | head -40
for cfg in "QFLASH_CUDA_PDL=1" "QFLASH_CUDA_FP32=1"; do
    echo "== test_model $cfg"
    env $cfg QFLASH_TEST_DEVICE=cuda timeout 60 gpu/test_model . 2>&1 | grep -E "error|FAIL|passed|failed" | tail -4
done
B="gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|invalid|replayed|load:|peak'
run() { echo "== $1 | $2"; env $1 QFLASH_CUDA_STEPTIME=1 timeout 120 $B $2 2>&1 | grep -E "$show"; }
for cfg in "QFLASH_CUDA_PW1=1" "QFLASH_CUDA_PW1=0"; do run "$cfg" "--prompt-len 128 --layers 8 --gen-len 64 --concurrency 1 --runs 1"; done
run "" "--prompt-len 128 --gen-len 64 --concurrency 1 --runs 2 --json $OUT/c1.json"
run "" "--layers 4 --prompt-len 128 --gen-len 32 --concurrency 1 --runs 3 --json $OUT/slice4.json"
PYTHONUNBUFFERED=1 timeout 170 python3 tools/hf_side_by_side.py --layers 4 --prompt-len 128 --gen-len 32 --runs 3 --qflash "$OUT/slice4.json" 2>&1 | grep -v Warning | tail -6
