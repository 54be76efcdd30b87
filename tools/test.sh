#!/bin/sh
# Builds qflash twice (optimised, and with AddressSanitizer + UBSan) and runs every test in both.
set -e
cd "$(dirname "$0")/.."
tools/check_deps.sh
python3 tools/include_cycles.py
JOBS=$(nproc 2>/dev/null || echo 2)
# The release build compiles the CUDA backend too where a CUDA toolkit is installed, for sm_90
# only (once is enough to catch what does not compile; its GPU test is skipped without a GPU);
# the sanitizer build is CPU-only.
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
fi
CUDA="-DQFLASH_CUDA=OFF"
if [ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null; then CUDA="-DQFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"; fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release $CUDA >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DQFLASH_SANITIZE=ON -DQFLASH_CUDA=OFF >/dev/null
cmake --build build-asan -j "$JOBS"
# (kernel_emu builds its own programs: once, in the release run, is enough; the suites run side by side,
# one a core: none asserts a time)
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -LE emu -j "$JOBS"
# ThreadSanitizer over the server (its event loop, preparation workers and scheduler thread): a
# report ends the server (halt_on_error), which fails the suite; and over the RAM expert cache's
# reader thread.
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQFLASH_TSAN=ON -DQFLASH_CUDA=OFF >/dev/null
cmake --build build-tsan -j "$JOBS" --target qflash-cli test_experts
TSAN_OPTIONS="halt_on_error=1 exitcode=66" ./build-tsan/tests/test_experts .
(cd tests/server && TSAN_OPTIONS="halt_on_error=1 exitcode=66" QFLASH_BIN=../../build-tsan/qflash PYTHONDONTWRITEBYTECODE=1 \
    python3 -m pytest -q -p no:cacheprovider test_api.py test_serving.py)
echo "test.sh: all tests passed (release, ASan/UBSan and TSan builds)"
