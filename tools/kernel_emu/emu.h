// The emulator's state and the launch of a grid (tools/kernel_emu): blocks one after another, each
// with blockDim.x std::threads.
#pragma once
#include <functional>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_int.cuh"

thread_local dim threadIdx;
dim blockIdx, gridDim, blockDim;
std::barrier<> *g_bar;
std::barrier<> *w_bar[32];
uint64_t w_buf[32][32];
std::mutex g_mu;

// Blocks first .. first + count - 1 of a grid of `grid` (x only).
static void run_blocks(unsigned first, unsigned count, unsigned grid, unsigned threads, std::function<void()> body) {
    gridDim = {grid, 1, 1}, blockDim = {threads, 1, 1};
    for (unsigned b = first; b < first + count; b++) {
        blockIdx = {b, 0, 0};
        std::barrier<> bar(threads);
        g_bar = &bar;
        for (unsigned w = 0; w < threads / 32; w++) w_bar[w] = new std::barrier<>(32);
        std::vector<std::thread> th;
        for (unsigned t = 0; t < threads; t++) th.emplace_back([t, &body] { threadIdx = {t, 0, 0}; body(); });
        for (auto &x : th) x.join();
        for (unsigned w = 0; w < threads / 32; w++) delete w_bar[w];
    }
}

static void run_grid(unsigned grid, unsigned threads, std::function<void()> body) { run_blocks(0, grid, grid, threads, body); }

static uint64_t g_rs = 7;
static float frand() {
    g_rs = g_rs * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rs >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
}
