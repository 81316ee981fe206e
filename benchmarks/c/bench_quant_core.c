/*
 * Single-thread cost of the CPU quantize_blockwise / dequantize_blockwise loops, in
 * thread CPU time (so other jobs on a shared machine do not count): 262144 elements
 * (in L2), block 256, dynamic map, min and median of 301 calls, ns per element. For
 * an A/B of two commits, build the core of each and link this file against both:
 *
 *   cmake -S . -B /tmp/core -DMEMFIT_PYTHON=OFF -DMEMFIT_CUDA=OFF && make -C /tmp/core memfit_core
 *   gcc -O2 -fopenmp -Icsrc/include benchmarks/c/bench_quant_core.c /tmp/core/libmemfit_core.a -lm -o /tmp/bq
 *   OMP_NUM_THREADS=1 /tmp/bq
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <math.h>
#include "memfit/quant.h"
static double now(void){struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}
static int cmpd(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return (x>y)-(x<y);}
int main(void) {
  int64_t n = 262144, bs = 256; int reps = 301;
  float *x = malloc(n*4); uint16_t *xb = malloc(n*2); uint8_t *c = malloc(n); float *am = malloc(n/64*4+64);
  float *y = malloc(n*4); uint16_t *yb = malloc(n*2); float code[256];
  mf_dynamic_map(code,256,1,8,7);
  srand(1); for (int64_t i=0;i<n;i++){ float u=(rand()+1.0f)/RAND_MAX, v=rand()/(float)RAND_MAX; x[i]=sqrtf(-2*logf(u))*cosf(6.2831853f*v); xb[i]=mf_f32_to_bf16(x[i]);}
  mf_tensor tx=mf_cpu_tensor(x,n,MF_FLOAT32), txb=mf_cpu_tensor(xb,n,MF_BFLOAT16), tcode=mf_cpu_tensor(code,256,MF_FLOAT32),
    tc=mf_cpu_tensor(c,n,MF_UINT8), tam=mf_cpu_tensor(am,n/bs,MF_FLOAT32), ty=mf_cpu_tensor(y,n,MF_FLOAT32), tyb=mf_cpu_tensor(yb,n,MF_BFLOAT16);
  const char *names[4]={"quantize f32","quantize bf16","dequantize f32","dequantize bf16"};
  for (int k=0;k<4;k++){
    double *t=malloc(reps*sizeof(double));
    for(int r=0;r<reps;r++){ double t0=now(); mf_status st;
      if(k==0) st=mf_quantize_blockwise(&tx,&tcode,&tc,&tam,bs,MF_ROUND_NEAREST,0,NULL);
      else if(k==1) st=mf_quantize_blockwise(&txb,&tcode,&tc,&tam,bs,MF_ROUND_NEAREST,0,NULL);
      else if(k==2) st=mf_dequantize_blockwise(&tc,&tam,&tcode,&ty,bs,NULL);
      else st=mf_dequantize_blockwise(&tc,&tam,&tcode,&tyb,bs,NULL);
      if(st){printf("error\n");return 1;} t[r]=now()-t0; }
    qsort(t,reps,sizeof(double),cmpd);
    printf("%-16s min %.3f ns/el  median %.3f ns/el\n",names[k],t[0]/n*1e9,t[reps/2]/n*1e9);
    free(t);
  }
  return 0;
}
