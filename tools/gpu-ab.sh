#!/bin/bash
# A/B of decode settings in one device call (build and carry as tools/gpu-measure.sh says):
#   bash tools/gpu-ab.sh [--tests] [--whole] "ENV=1 ..." "" ...
# --tests: test_cuda and test_model (with each setting) first; every setting then runs batch 1 on
# 8 layers (slice8), and with --whole on the whole model too. "" is the defaults.
set -u
[ -f gpu/bins.txz ] && tar xJf gpu/bins.txz -C gpu
OUT=${OUT:-/tmp/qflash-ab}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
tests=0 whole=0
while [ "${1:-}" = --tests ] || [ "${1:-}" = --whole ]; do
    [ "$1" = --tests ] && tests=1
    [ "$1" = --whole ] && whole=1
    shift
done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ $tests = 1 ]; then
    timeout 320 gpu/test_cuda . 2>&1 | tee "$OUT/test_cuda.log" | grep -E "FAIL|checks|invalid|rror|us,|us per call|moe N=|gdn [0-9]|^with"
    for cfg in "$@"; do
        echo "== test_model $cfg"
        env $cfg QFLASH_TEST_DEVICE=cuda timeout 60 gpu/test_model . 2>&1 | grep -E "error|FAIL|failed" | tail -4
    done
fi
B="gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|invalid|replayed|decoded ids'
run() { echo "== $1 | $2"; env $1 QFLASH_CUDA_STEPTIME=1 timeout 120 $B $2 2>&1 | grep -E "$show"; }
for cfg in "$@"; do run "$cfg" "--prompt-len 128 --layers 8 --gen-len 64 --concurrency 1 --runs 1"; done
if [ $whole = 1 ]; then
    i=0
    for cfg in "$@"; do run "$cfg" "--prompt-len 128 --gen-len 64 --concurrency 1 --runs 2 --json $OUT/c1-$i.json"; i=$((i + 1)); done
fi
