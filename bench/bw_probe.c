/* Single-thread streaming read bandwidth (the roofline in docs/notes.md).
 * Build: cc -O2 -march=native bench/bw_probe.c -o /tmp/bw_probe */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  size_t sizes[2]={256u<<20, 24u<<20};
  for(int s=0;s<2;s++){ size_t n=sizes[s]/sizeof(float); float *a=malloc(n*4); for(size_t i=0;i<n;i++)a[i]=i;
    double best=1e9; volatile float sink=0;
    for(int r=0;r<10;r++){ double t0=now(); float acc=0; for(size_t i=0;i<n;i+=16) acc+=a[i]+a[i+4]+a[i+8]+a[i+12]; sink+=acc; double t=now()-t0; if(t<best)best=t;}
    printf("read bandwidth %zu MiB: %.1f GB/s (1 thread)\n", sizes[s]>>20, sizes[s]/best/1e9); free(a);}
}
