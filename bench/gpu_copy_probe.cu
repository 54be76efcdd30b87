/* Device-to-device copy bandwidth: the GPU roofline `qflash bench --bw` takes (bytes read plus
 * bytes written per second, the best of 20 copies of 1 GiB). tools/gpu-check.sh runs it first so
 * every figure of a call is set against the card it ran on.
 * Build: nvcc -O2 -arch=sm_90 bench/gpu_copy_probe.cu -o gpu/copy_probe */
#include <cuda_runtime.h>
#include <stdio.h>

int main(void)
{
    const size_t n = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    cudaEvent_t t0, t1;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) {
        fprintf(stderr, "copy_probe: cannot allocate 2 GiB on the device\n");
        return 1;
    }
    cudaMemset(a, 1, n);
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    float best = 1e9f;
    for (int r = 0; r < 20; r++) {
        cudaEventRecord(t0, 0);
        cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, 0);
        cudaEventRecord(t1, 0);
        cudaEventSynchronize(t1);
        float ms = 0;
        cudaEventElapsedTime(&ms, t0, t1);
        if (ms < best) best = ms;
    }
    if (cudaGetLastError() != cudaSuccess) {
        fprintf(stderr, "copy_probe: a copy failed\n");
        return 1;
    }
    printf("%.0f\n", 2.0 * n / (best * 1e-3) / 1e9);
    return 0;
}
