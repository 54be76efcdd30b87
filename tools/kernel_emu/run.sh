#!/bin/bash
# Runs CUDA kernels' logic on the CPU (no device needed): each kernel is cut from its .cu file and
# compiled as C++ against shim/ (emu.h: blocks one after another, a std::thread a CUDA thread), then
# checked against the reference it is tested against on the GPU. Slow (seconds a block) and blind
# to speed, races between blocks and memory ordering: a check of indexing and arithmetic before a
# device run, not a substitute for test_cuda.
#   bash tools/kernel_emu/run.sh [DIR]    k_gemv_pre (int8 rows, the chained epilogue), k_gdn_head's
#                                         chain, k_draw and k_xc_resolve's hybrid split; built in DIR
#                                         (default /tmp/qflash-kernel-emu)
# Exits 77 (a skipped test for CTest) where no C++20 compiler is found.
set -eu
B=$(mkdir -p "${1:-/tmp/qflash-kernel-emu}" && cd "${1:-/tmp/qflash-kernel-emu}" && pwd)
cd "$(dirname "$0")"
ROOT=../..
echo '#include <barrier>' | g++ -std=c++20 -x c++ -fsyntax-only - 2>/dev/null || { echo "kernel_emu: skipped (no g++ with C++20)"; exit 77; }
cut() { # file, first marker, end marker, out, [sed script]
    python3 - "$ROOT/$1" "$2" "$3" "$B/$4" <<'PY'
import sys
src = open(sys.argv[1]).read()
a, b = src.index(sys.argv[2]), src.index(sys.argv[3])
k = src[a:b].replace('extern __shared__ float4 dyn[];', 'float4 *dyn = g_dyn;')
k = '\n'.join(l for l in k.split('\n') if 'asm volatile("prefetch' not in l)
open(sys.argv[4], 'w').write(k)
PY
}
cut src/backend/cuda/dec_gemv_cuda.cu '// Unit u of an int8 row' '// The share [*lo, *hi) of n items' gemv.inc
cut src/backend/cuda/dec_draw_cuda.cu '#define DR_T 1024' 'void dec_draw(qf_backend' draw.inc
cut src/backend/cuda/dec_gdn_cuda.cu '// One warp' '// Lanes per value column' gdn.inc
cut src/backend/cuda/xcache_cuda.cu '#define XC_MAX_E 512' '// Block r (a hybrid step' xcache.inc
C="gcc -std=c11 -O2 -I$ROOT/src -c"
$C $ROOT/src/base/quant.c -o "$B/quant.o" && $C $ROOT/src/base/err.c -o "$B/err.o" && $C $ROOT/src/runtime/sampler.c -o "$B/sampler.o"
$C $ROOT/src/experts/cache_policy.c -o "$B/cache_policy.o"
X="g++ -std=c++20 -O1 -Ishim -I$ROOT/src -I$B"
$X gemv_emu.cpp "$B/quant.o" "$B/err.o" -o "$B/gemv_emu" -lpthread
$X draw_emu.cpp "$B/sampler.o" "$B/err.o" -o "$B/draw_emu" -lpthread
$X gdn_emu.cpp "$B/err.o" -o "$B/gdn_emu" -lpthread
$X xcache_emu.cpp "$B/cache_policy.o" "$B/err.o" -o "$B/xcache_emu" -lpthread
"$B/gemv_emu"
"$B/gdn_emu"
"$B/xcache_emu"
"$B/draw_emu" 4096 2
