#!/bin/bash
# The issue-5 measurements in one device call (the H200 machine): tests, batch 1 with the
# defaults and with each decode switch off, what each kind of decode kernel costs in place
# (QFLASH_CUDA_SKIP), 16/64 streams, an 8K prompt, and HF transformers side by side.
# Build here first (sm_90 only keeps it quick), then carry the binaries in the ignored gpu/:
#   cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DQFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
#   cmake --build build-cuda -j --target qflash-cli test_cuda test_model   # the app is qflash-cli
#   mkdir -p gpu && cp build-cuda/qflash build-cuda/tests/test_{cuda,model} gpu/ && strip gpu/qflash gpu/test_*
#   (cd gpu && tar cf - qflash test_cuda test_model | xz -9e -T0 > bins.txz && rm qflash test_cuda test_model)
# (xz -9: its 64 MiB window finds the three binaries' shared device code: ~7 MiB, where -6 left ~21;
# the tree is ~43 MiB and a device call carries at most 64 MiB)
# then run `bash tools/gpu-measure.sh [quick]` there with carry ["gpu"]; results land in $OUT.
# A build with -DQFLASH_CUDA_TRACE=ON adds QFLASH_CUDA_TRACE=1 (one replayed step's timeline); its
# stamps cost ~5% even when off, so measure speed with a normal build.
# It takes ~9 minutes (quick: tests, the switches on 8 layers and batch 1, ~4 minutes; rest: only
# 16/64 streams, the 8K prompt and the HF side by side, ~4 minutes, after tools/gpu-ab.sh in the same call).
set -u
[ -f gpu/bins.txz ] && [ ! -x gpu/qflash ] && tar xJf gpu/bins.txz -C gpu
OUT=${OUT:-/tmp/qflash-measure}
mkdir -p "$OUT"
B="gpu/qflash bench --synthetic qwen3.6-35b-a3b --device cuda --bw 4300"
show='^ +[0-9]+ +[0-9]+ +[0-9]+ \||rror|invalid|replayed|load:|peak|decoded ids'
run() { echo "== $1 | $2"; env $1 QFLASH_CUDA_STEPTIME=1 timeout 120 $B $2 2>&1 | grep -E "$show"; }
rest() {
    run "" "--prompt-len 128 --gen-len 64 --concurrency 16,64 --runs 2 --json $OUT/c16-64.json"
    run "" "--prompt-len 8192 --gen-len 4 --concurrency 1 --runs 1 --json $OUT/8k.json"
    run "" "--layers 4 --prompt-len 128 --gen-len 32 --concurrency 1 --runs 3 --json $OUT/slice4.json"
    PYTHONUNBUFFERED=1 timeout 170 python3 tools/hf_side_by_side.py --layers 4 --prompt-len 128 --gen-len 32 --runs 3 --qflash "$OUT/slice4.json" 2>&1 | grep -v Warning | tail -6
}
if [ "${1:-}" = rest ]; then
    exec > >(tee "$OUT/rest.txt") 2>&1
    rest
    exit 0
fi
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 320 gpu/test_cuda . 2>&1 | tee "$OUT/test_cuda.log" | grep -E "FAIL|checks|invalid|rror|us,|us per call"
for cfg in "QFLASH_CUDA_PDL=1" "QFLASH_CUDA_PDL=0 QFLASH_CUDA_EARLY=0" "QFLASH_CUDA_FP32=1"; do
    echo "== test_model $cfg"
    env $cfg QFLASH_TEST_DEVICE=cuda timeout 60 gpu/test_model . 2>&1 | grep -E "error|FAIL|failed" | tail -4
done
S8="--prompt-len 128 --layers 8 --gen-len 64 --concurrency 1 --runs 1"
for cfg in "" "QFLASH_CUDA_PDL=0" "QFLASH_CUDA_EARLY=0" "QFLASH_CUDA_PW1=0" "QFLASH_CUDA_GDN_LPC=2" "QFLASH_CUDA_MOE1=0" "QFLASH_CUDA_WIDE=1" \
    "QFLASH_CUDA_ROUTE=0" "QFLASH_CUDA_ROUTE=1" "QFLASH_CUDA_BULK=0" "QFLASH_CUDA_TAIL=1" ""; do run "$cfg" "$S8"; done
run "" "--prompt-len 128 --gen-len 64 --concurrency 1 --runs 2 --json $OUT/c1.json"
[ "${1:-}" = quick ] && exit 0
# with the one-kernel MoE, 64 and 128 skip its gate/up and down parts (192: both; routing still runs)
for m in 1 2 4 8 16 32 64 128 192 256 511; do run "QFLASH_CUDA_SKIP=$m" "$S8"; done
rest
