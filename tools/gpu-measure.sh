#!/bin/bash
# The issue-5 measurements in one device call (the H200 machine): tests, batch 1 with the default
# and the streamed kernels, 16/64 streams, an 8K prompt, and HF transformers side by side.
# Build here first (sm_90 only keeps it quick), then carry the binaries in the ignored gpu/:
#   cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DQFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
#   cmake --build build-cuda -j --target qflash-cli test_cuda test_model   # the app is qflash-cli
#   mkdir -p gpu && cp build-cuda/qflash build-cuda/tests/test_{cuda,model} gpu/ && strip gpu/*
# then run `bash tools/gpu-measure.sh` there with carry ["gpu"]; results land in $OUT.
set -u
OUT=${OUT:-/tmp/qflash-measure}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
gpu/test_cuda . 2>&1 | tee "$OUT/test_cuda.log" | grep -E "FAIL|checks|us,|invalid"
QFLASH_TEST_DEVICE=cuda gpu/test_model . 2>&1 | tail -4
QFLASH_CUDA_FP32=1 QFLASH_TEST_DEVICE=cuda gpu/test_model . 2>&1 | tail -4
B="gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|invalid|replayed|peak|load:'
for pdl in 0 1; do
    echo "== batch 1, QFLASH_CUDA_PDL=$pdl (1: programmatic launch and the streamed kernels)"
    QFLASH_CUDA_STEPTIME=1 QFLASH_CUDA_PDL=$pdl $B --prompt-len 128 --gen-len 64 --concurrency 1 --runs 2 --json "$OUT/c1-pdl$pdl.json" 2>&1 | grep -E "$show"
done
$B --prompt-len 128 --gen-len 64 --concurrency 16,64 --runs 2 --json "$OUT/c16-64.json" 2>&1 | grep -E "$show"
$B --prompt-len 8192 --gen-len 4 --concurrency 1 --runs 1 --json "$OUT/8k.json" 2>&1 | grep -E "$show"
$B --layers 4 --prompt-len 128 --gen-len 32 --concurrency 1 --runs 3 --json "$OUT/slice4.json" 2>&1 | grep -E "$show"
PYTHONUNBUFFERED=1 timeout 150 python3 tools/hf_side_by_side.py --layers 4 --prompt-len 128 --gen-len 32 --runs 3 --qflash "$OUT/slice4.json" 2>&1 | grep -v Warning | tail -4
