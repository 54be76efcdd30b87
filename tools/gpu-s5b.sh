#!/bin/bash
# Session 5, third device call: tests with the new defaults (programmatic launch on), DeltaNet
# lanes per column, Nsight Compute on one decode step's kernels, then the figures.
set -u
OUT=${OUT:-/tmp/qflash-measure}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
timeout 150 gpu/test_cuda . 2>&1 | tee "$OUT/test_cuda.log" | grep -E "FAIL|checks|invalid|rror|us," | head -30
QFLASH_CUDA_GDN_LPC=8 timeout 150 gpu/test_cuda . 2>&1 | grep -E "FAIL|checks|invalid|rror" | head -5
for cfg in "QFLASH_CUDA_PDL=1" "QFLASH_CUDA_PDL=0" "QFLASH_CUDA_FP32=1"; do
    echo "== test_model $cfg"
    env $cfg QFLASH_TEST_DEVICE=cuda timeout 60 gpu/test_model . 2>&1 | grep -E "error|FAIL|passed|failed" | tail -4
done
B="gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|invalid|replayed|load:|peak'
run() { echo "== $1 | $2"; env $1 QFLASH_CUDA_STEPTIME=1 timeout 120 $B $2 2>&1 | grep -E "$show"; }
for cfg in "QFLASH_CUDA_GDN_LPC=2" "QFLASH_CUDA_GDN_LPC=4" "QFLASH_CUDA_GDN_LPC=8" "QFLASH_CUDA_PDL=0" "QFLASH_CUDA_EARLY=0"; do run "$cfg" "--prompt-len 128 --layers 8 --gen-len 64 --concurrency 1 --runs 1"; done
for m in 1 4 8 16 64 128; do run "QFLASH_CUDA_SKIP=$m" "--prompt-len 128 --layers 8 --gen-len 32 --concurrency 1 --runs 1"; done
QFLASH_CUDA_GRAPHS=0 timeout 150 ncu --clock-control base -k regex:'k_gdn_dec|k_moe_gu|k_moe_down|k_gemv_pre' -c 8 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
  gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --layers 4 --prompt-len 32 --gen-len 2 --runs 1 > "$OUT/ncu.txt" 2>&1
grep -E "^  k_|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Grid Size|stalled" "$OUT/ncu.txt" | cut -c1-200 | head -90
run "" "--prompt-len 128 --gen-len 64 --concurrency 1 --runs 2 --json $OUT/c1.json"
run "" "--prompt-len 128 --gen-len 64 --concurrency 16,64 --runs 2 --json $OUT/c16-64.json"
run "" "--prompt-len 8192 --gen-len 4 --concurrency 1 --runs 1 --json $OUT/8k.json"
