#!/bin/bash
# Session 5's device call: tests, early loads and blocks per SM side by side, and what each kind
# of decode kernel costs in a replayed step (QFLASH_CUDA_SKIP). Build as tools/gpu-measure.sh says.
set -u
OUT=${OUT:-/tmp/qflash-measure}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 150 gpu/test_cuda . 2>&1 | tee "$OUT/test_cuda.log" | grep -E "FAIL|checks|invalid|rror" | head -20
for cfg in "QFLASH_CUDA_EARLY=1" "QFLASH_CUDA_EARLY=0" "QFLASH_CUDA_PDL=1 QFLASH_CUDA_STREAM=0" "QFLASH_CUDA_PDL=1 QFLASH_CUDA_STREAM=1"; do
    echo "== test_model $cfg"
    env $cfg QFLASH_TEST_DEVICE=cuda timeout 60 gpu/test_model . 2>&1 | grep -E "error|FAIL|passed|failed" | tail -4
done
B="gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300 --prompt-len 128 --concurrency 1 --runs 1"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|invalid|replayed|load:'
run() { echo "== $1 | $2"; env $1 QFLASH_CUDA_STEPTIME=1 timeout 90 $B $2 2>&1 | grep -E "$show"; }
A="QFLASH_CUDA_EARLY=0"; E="QFLASH_CUDA_EARLY=1"; P="QFLASH_CUDA_PDL=1 QFLASH_CUDA_STREAM=0"; P1="$P QFLASH_CUDA_BPS=1"
for cfg in "$E" "$P"; do run "$cfg" "--layers 8 --gen-len 64"; done
for m in 1 2 4 8 16 32 64 128; do run "$E QFLASH_CUDA_SKIP=$m" "--layers 8 --gen-len 32"; done
for cfg in "$E" "$P"; do run "$cfg" "--gen-len 64 --json $OUT/full-$(echo $cfg | tr -dc 'A-Z0-9=' | tr '=' '-').json"; done
