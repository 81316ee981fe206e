/* One-line hints for the CUDA errors a rebuild fixes (memfit/cuda_hint.h). */
#include "memfit/cuda_hint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How to rebuild, the same words in every hint. */
#define MF_REBUILD "pip install --no-cache-dir --force-reinstall <memfit source>"

int mf_cuda_min_driver(int runtime) {
  switch (runtime / 1000) {
    case 13: return 580;
    case 12: return 525;
  }
  return 0;
}

/* Each entry of "75-real,90a,80-virtual": its number (75), whether it is arch-specific
 * ('a'/'f') and what it carries. */
int mf_cuda_archs_run_on(const char *archs, int cc_major, int cc_minor) {
  if (!archs || !archs[0]) return 0;
  if (!strcmp(archs, "emulated")) return 1;
  const int cc = cc_major * 10 + cc_minor;
  const char *p = archs;
  while (*p) {
    char *end;
    const long num = strtol(p, &end, 10);
    if (end == p) break; /* not a number: nothing more to read */
    const int specific = *end == 'a' || *end == 'f';
    if (specific) end++;
    int sass = 1, ptx = 1; /* a plain entry carries both */
    if (!strncmp(end, "-real", 5)) {
      ptx = 0;
      end += 5;
    } else if (!strncmp(end, "-virtual", 8)) {
      sass = 0;
      end += 8;
    }
    if (sass && (specific ? num == cc : num / 10 == cc_major && num % 10 <= cc_minor)) return 1;
    if (ptx && !specific && num <= cc) return 1;
    p = end;
    while (*p == ',' || *p == ';' || *p == ' ') p++;
  }
  return 0;
}

int mf_cuda_hint(int cuda_error, int driver, int runtime, const char *archs, int cc_major,
                 int cc_minor, char *buf, size_t len) {
  if (len == 0) return 0;
  buf[0] = '\0';
  const int dmaj = driver / 1000, dmin = driver % 1000 / 10;
  const int rmaj = runtime / 1000, rmin = runtime % 1000 / 10;
  if (!archs) archs = "";
  char gpu[64];
  if (cc_major > 0)
    snprintf(gpu, sizeof gpu, "this GPU (compute capability %d.%d)", cc_major, cc_minor);
  else
    snprintf(gpu, sizeof gpu, "this GPU");
  char arch_fix[160];
  if (cc_major > 0)
    snprintf(arch_fix, sizeof arch_fix, "MEMFIT_CUDA_ARCHS=%d%d", cc_major, cc_minor);
  else
    snprintf(arch_fix, sizeof arch_fix,
             "MEMFIT_CUDA_ARCHS=<its compute capability, nvidia-smi --query-gpu=compute_cap>");
  switch (cuda_error) {
    case MF_CUDA_ERR_INSUFFICIENT_DRIVER:
      if (driver <= 0) {
        snprintf(buf, len, "no NVIDIA driver is installed (libcuda.so.1 not found)");
      } else {
        snprintf(buf, len,
                 "the NVIDIA driver supports CUDA %d.%d, but this memfit was built with CUDA "
                 "%d.%d, which needs driver >= %d: rebuild memfit with an nvcc no newer than "
                 "%d.%d (CUDACXX=/usr/local/cuda-%d.%d/bin/nvcc " MF_REBUILD
                 ") or update the driver",
                 dmaj, dmin, rmaj, rmin, mf_cuda_min_driver(runtime), dmaj, dmin, dmaj, dmin);
      }
      return 1;
    case MF_CUDA_ERR_NO_KERNEL_IMAGE:
      snprintf(buf, len,
               "%s has no kernels in this memfit build (architectures %s): rebuild on this "
               "machine with MEMFIT_CUDA_ARCHS unset (the build reads the GPUs from nvidia-smi) "
               "or with %s " MF_REBUILD,
               gpu, archs[0] ? archs : "unknown", arch_fix);
      return 1;
    case MF_CUDA_ERR_UNSUPPORTED_PTX:
      snprintf(buf, len,
               "%s runs this memfit build only from PTX of CUDA %d.%d (architectures %s), which "
               "the driver (CUDA %d.%d) cannot compile: rebuild with %s (code for this GPU) or "
               "with an nvcc no newer than %d.%d: " MF_REBUILD,
               gpu, rmaj, rmin, archs[0] ? archs : "unknown", dmaj, dmin, arch_fix, dmaj, dmin);
      return 1;
  }
  return 0;
}
