/* Bindings for blockwise quantization (csrc/core/quant.c, cuda/quant.cu). Outputs
 * are allocated by the Python layer in the caller's framework and passed in. */
#include "bindings.h"
#include "memfit/optim.h"
#include "memfit/quant.h"

/* quantize_blockwise(x, code, codes, absmax, block_size, stochastic, seed, stream) */
static PyObject *py_quantize_blockwise(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *o[4];
  long long block_size;
  int stochastic;
  unsigned long long seed, stream;
  if (!PyArg_ParseTuple(args, "OOOOLpKK", &o[0], &o[1], &o[2], &o[3], &block_size, &stochastic,
                        &seed, &stream))
    return NULL;
  static const char *const names[] = {"x", "code", "codes", "absmax"};
  static const int flags[] = {MF_PY_READ, MF_PY_READ, MF_PY_WRITABLE, MF_PY_WRITABLE};
  mf_py_view v[4];
  if (mf_py_views_get(4, o, names, flags, (uintptr_t)stream, v)) return NULL;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_quantize_blockwise(&v[0].t, &v[1].t, &v[2].t, &v[3].t, (int64_t)block_size,
                             stochastic ? MF_ROUND_STOCHASTIC : MF_ROUND_NEAREST, seed,
                             (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  mf_py_views_release(4, v);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

/* dequantize_blockwise(codes, absmax, code, out, block_size, stream) */
static PyObject *py_dequantize_blockwise(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *o[4];
  long long block_size;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOOLK", &o[0], &o[1], &o[2], &o[3], &block_size, &stream))
    return NULL;
  static const char *const names[] = {"codes", "absmax", "code", "out"};
  static const int flags[] = {MF_PY_READ, MF_PY_READ, MF_PY_READ, MF_PY_WRITABLE};
  mf_py_view v[4];
  if (mf_py_views_get(4, o, names, flags, (uintptr_t)stream, v)) return NULL;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_dequantize_blockwise(&v[0].t, &v[1].t, &v[2].t, &v[3].t, (int64_t)block_size,
                               (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  mf_py_views_release(4, v);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
}

/* code_quantize(code, x, out, keep_positive=0): out[i] = index of the entry of `code`
 * (16 or 256 sorted float32 values) nearest to x[i] (with keep_positive, a positive
 * x[i] never takes an entry <= 0: the rule of non-negative states), by the optimizer
 * kernels' own exact search (mf_optim_quantize_fast), so that states quantized outside
 * a step carry the bits a step would give them. x: the values already brought to
 * [-1, 1] (mf_block_normalize). CPU float32 arrays and a uint8 out of x's size, all
 * contiguous. */
static PyObject *py_code_quantize(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *o[3];
  int keep_positive = 0;
  if (!PyArg_ParseTuple(args, "OOO|p", &o[0], &o[1], &o[2], &keep_positive)) return NULL;
  static const char *const names[] = {"code", "x", "out"};
  static const int flags[] = {MF_PY_READ, MF_PY_READ, MF_PY_WRITABLE};
  mf_py_view v[3];
  if (mf_py_views_get(3, o, names, flags, 0, v)) return NULL;
  mf_status st = MF_OK;
  for (int i = 0; i < 3 && st == MF_OK; i++)
    if (v[i].t.device != MF_CPU)
      st = mf_error(MF_ERR_VALUE, "%s: expected a CPU array", names[i]);
  if (st) goto finish;
  if (v[0].t.dtype != MF_FLOAT32 || (v[0].t.numel != MF_CODE_SIZE && v[0].t.numel != MF_CODE4_SIZE))
    st = mf_error(MF_ERR_VALUE, "code: expected 16 or 256 float32 values, got %lld of %s",
                  (long long)v[0].t.numel, mf_dtype_name(v[0].t.dtype));
  else if (v[1].t.dtype != MF_FLOAT32)
    st = mf_error(MF_ERR_TYPE, "x: expected float32, got %s", mf_dtype_name(v[1].t.dtype));
  else if (v[2].t.dtype != MF_UINT8)
    st = mf_error(MF_ERR_TYPE, "out: expected uint8, got %s", mf_dtype_name(v[2].t.dtype));
  else if (v[2].t.numel != v[1].t.numel)
    st = mf_error(MF_ERR_VALUE, "out: expected %lld elements (those of x), got %lld",
                  (long long)v[1].t.numel, (long long)v[2].t.numel);
  if (st) goto finish;
  Py_BEGIN_ALLOW_THREADS
  st = mf_optim_quantize_fast((const float *)v[0].t.data, (int)v[0].t.numel, keep_positive,
                              (const float *)v[1].t.data, v[1].t.numel, (uint8_t *)v[2].t.data);
  Py_END_ALLOW_THREADS
finish:
  mf_py_views_release(3, v);
  return mf_py_result(st);
}

/* Fills a float32 CPU array with a code table. */
static PyObject *fill_map(PyObject *oout, int is_signed, int total_bits, int max_exp, int dynamic) {
  mf_py_view out = {0};
  mf_status st = MF_OK;
  if (mf_py_view_get(oout, "out", -1, MF_PY_WRITABLE, 0, &out)) goto finish;
  if (out.t.dtype != MF_FLOAT32 || out.t.device != MF_CPU)
    st = mf_error(MF_ERR_TYPE, "out: expected a float32 CPU array");
  else if (dynamic)
    st = mf_dynamic_map((float *)out.t.data, out.t.numel, is_signed, total_bits, max_exp);
  else
    st = mf_linear_map((float *)out.t.data, out.t.numel, is_signed, total_bits);
finish:
  mf_py_view_release(&out);
  return mf_py_result(st);
}

static PyObject *py_dynamic_map(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *out;
  int is_signed, total_bits, max_exp;
  if (!PyArg_ParseTuple(args, "Opii", &out, &is_signed, &total_bits, &max_exp)) return NULL;
  return fill_map(out, is_signed, total_bits, max_exp, 1);
}

static PyObject *py_linear_map(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *out;
  int is_signed, total_bits;
  if (!PyArg_ParseTuple(args, "Opi", &out, &is_signed, &total_bits)) return NULL;
  return fill_map(out, is_signed, total_bits, 0, 0);
}

/* quant_block_sizes() -> the block sizes the kernels accept (mf_quant_block_size_ok). */
static PyObject *py_quant_block_sizes(PyObject *self, PyObject *noargs) {
  (void)self;
  (void)noargs;
  PyObject *sizes = PyList_New(0);
  for (int64_t b = MF_QUANT_MIN_BLOCK; sizes && b <= MF_QUANT_MAX_BLOCK; b *= 2) {
    if (!mf_quant_block_size_ok(b)) continue;
    PyObject *v = PyLong_FromLongLong((long long)b);
    if (!v || PyList_Append(sizes, v)) Py_CLEAR(sizes);
    Py_XDECREF(v);
  }
  PyObject *t = sizes ? PyList_AsTuple(sizes) : NULL;
  Py_XDECREF(sizes);
  return t;
}

PyMethodDef mf_quant_methods[] = {
    {"quant_block_sizes", py_quant_block_sizes, METH_NOARGS,
     "quant_block_sizes(): the block sizes the kernels accept"},
    {"quantize_blockwise", py_quantize_blockwise, METH_VARARGS,
     "quantize_blockwise(x, code, codes, absmax, block_size, stochastic, seed, stream)"},
    {"dequantize_blockwise", py_dequantize_blockwise, METH_VARARGS,
     "dequantize_blockwise(codes, absmax, code, out, block_size, stream)"},
    {"code_quantize", py_code_quantize, METH_VARARGS,
     "code_quantize(code, x, out, keep_positive=False): the optimizer kernels' code index of each x (16- or 256-entry code)"},
    {"dynamic_map", py_dynamic_map, METH_VARARGS,
     "dynamic_map(out, signed, total_bits, max_exponent_bits)"},
    {"linear_map", py_linear_map, METH_VARARGS, "linear_map(out, signed, total_bits)"},
    {NULL, NULL, 0, NULL}};
