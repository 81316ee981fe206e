/*
 * What the CPU is, for advice (memfit.hardware: the precision rule, `memfit doctor`):
 * model name, vendor and native bfloat16 compute, from CPUID (x86) or HWCAP2 (aarch64).
 * Not used to pick kernels: that is cpu_isa.c.
 */
#include "memfit/common.h"

#include <stdatomic.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <cpuid.h>

/* XCR0: which register states the OS saves on a context switch. An extension the CPU has
 * but the OS does not enable (AVX-512's opmask/ZMM, AMX's tile registers) cannot run. */
static unsigned long long xcr0(void) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return 0; /* OSXSAVE */
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}

static const char *detect_bf16_features(void) {
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid_max(0, NULL) < 7) return "";
  unsigned long long x = xcr0();
  int avx512_os = (x & 0xe6) == 0xe6;         /* XMM, YMM, opmask, ZMM_Hi256, Hi16_ZMM */
  int amx_os = (x & 0x60000) == 0x60000;      /* XTILECFG, XTILEDATA */
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  int amx_bf16 = amx_os && (edx & (1u << 22)) && (edx & (1u << 24)); /* AMX-BF16, AMX-TILE */
  int avx512f = avx512_os && (ebx & (1u << 16));
  int max_sub = (int)eax;
  int avx512_bf16 = 0;
  if (max_sub >= 1) {
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    avx512_bf16 = avx512f && (eax & (1u << 5));
  }
  if (amx_bf16 && avx512_bf16) return "amx-bf16 avx512-bf16";
  if (amx_bf16) return "amx-bf16";
  if (avx512_bf16) return "avx512-bf16";
  return "";
}

/* The brand string of CPUID leaves 0x80000002..4 (e.g. "AMD EPYC 7B13 64-Core Processor"),
 * without the blanks that pad it; "" when the CPU has none. */
static void detect_model_name(char out[49]) {
  unsigned regs[12] = {0};
  out[0] = 0;
  if (__get_cpuid_max(0x80000000u, NULL) < 0x80000004u) return;
  for (unsigned i = 0; i < 3; i++)
    __cpuid(0x80000002u + i, regs[4 * i], regs[4 * i + 1], regs[4 * i + 2], regs[4 * i + 3]);
  char raw[49];
  memcpy(raw, regs, 48);
  raw[48] = 0;
  const char *s = raw;
  while (*s == ' ') s++;
  size_t n = strlen(s);
  while (n > 0 && s[n - 1] == ' ') n--;
  memcpy(out, s, n);
  out[n] = 0;
}

static void detect_vendor(char out[13]) {
  unsigned eax, regs[3];
  __cpuid(0, eax, regs[0], regs[2], regs[1]); /* vendor is EBX, EDX, ECX */
  memcpy(out, regs, 12);
  out[12] = 0;
}
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>

/* FEAT_BF16 (BFDOT, BFMMLA; Graviton 3, Grace): the kernel reports it in HWCAP2. */
static const char *detect_bf16_features(void) {
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1ul << 14)
#endif
  return (getauxval(AT_HWCAP2) & HWCAP2_BF16) ? "bf16" : "";
}

/* aarch64 has no brand string in user space: memfit.hardware reads /proc/cpuinfo. */
static void detect_model_name(char out[49]) { out[0] = 0; }
static void detect_vendor(char out[13]) { out[0] = 0; }
#else
static const char *detect_bf16_features(void) { return ""; }
static void detect_model_name(char out[49]) { out[0] = 0; }
static void detect_vendor(char out[13]) { out[0] = 0; }
#endif

/* Computed once: the first caller fills it in (microseconds of CPUID), later ones wait
 * for it to finish, so nobody reads a half-written string. */
static struct {
  _Atomic int state; /* 0: not started, 1: being filled in, 2: ready */
  const char *bf16;
  char model[49];
  char vendor[13];
} cpu_facts;

static void cpu_facts_init(void) {
  if (atomic_load_explicit(&cpu_facts.state, memory_order_acquire) == 2) return;
  int expected = 0;
  if (atomic_compare_exchange_strong(&cpu_facts.state, &expected, 1)) {
    cpu_facts.bf16 = detect_bf16_features();
    detect_model_name(cpu_facts.model);
    detect_vendor(cpu_facts.vendor);
    atomic_store_explicit(&cpu_facts.state, 2, memory_order_release);
    return;
  }
  while (atomic_load_explicit(&cpu_facts.state, memory_order_acquire) != 2) {
  }
}

const char *mf_cpu_bf16_features(void) {
  cpu_facts_init();
  return cpu_facts.bf16;
}

const char *mf_cpu_model_name(void) {
  cpu_facts_init();
  return cpu_facts.model;
}

const char *mf_cpu_vendor(void) {
  cpu_facts_init();
  return cpu_facts.vendor;
}
