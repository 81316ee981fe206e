/*
 * The parts of the DLPack ABI (https://dmlc.github.io/dlpack/latest/, v1.x) that
 * memfit's bindings consume: enough to read a producer's tensor and call its deleter.
 * Layouts follow the DLPack specification field for field; memfit never produces
 * DLPack capsules itself (results are allocated by the caller's framework).
 */
#ifndef MEMFIT_DLPACK_ABI_H
#define MEMFIT_DLPACK_ABI_H

#include <stdint.h>

enum { MF_DL_CPU = 1, MF_DL_CUDA = 2, MF_DL_CUDA_HOST = 3, MF_DL_CUDA_MANAGED = 13 };
enum { MF_DL_INT = 0, MF_DL_UINT = 1, MF_DL_FLOAT = 2, MF_DL_BFLOAT = 4 };
#define MF_DL_FLAG_READ_ONLY 1ull

typedef struct {
  int32_t device_type;
  int32_t device_id;
} mf_dl_device;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} mf_dl_dtype;

typedef struct {
  void *data;
  mf_dl_device device;
  int32_t ndim;
  mf_dl_dtype dtype;
  int64_t *shape;
  int64_t *strides; /* in elements; NULL means compact row-major */
  uint64_t byte_offset;
} mf_dl_tensor;

/* Legacy capsule "dltensor". */
typedef struct mf_dl_managed {
  mf_dl_tensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct mf_dl_managed *self);
} mf_dl_managed;

/* Versioned capsule "dltensor_versioned" (DLPack >= 1.0). */
typedef struct mf_dl_managed_versioned {
  struct {
    uint32_t major, minor;
  } version;
  void *manager_ctx;
  void (*deleter)(struct mf_dl_managed_versioned *self);
  uint64_t flags;
  mf_dl_tensor dl_tensor;
} mf_dl_managed_versioned;

#endif /* MEMFIT_DLPACK_ABI_H */
