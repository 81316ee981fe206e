/* Bindings for blockwise quantization (csrc/core/quant.c, cuda/quant.cu). Outputs
 * are allocated by the Python layer in the caller's framework and passed in. */
#include "bindings.h"
#include "memfit/quant.h"

/* quantize_blockwise(x, code, codes, absmax, block_size, stochastic, seed, stream) */
static PyObject *py_quantize_blockwise(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ox, *ocode, *ocodes, *oabsmax;
  long long block_size;
  int stochastic;
  unsigned long long seed, stream;
  if (!PyArg_ParseTuple(args, "OOOOLpKK", &ox, &ocode, &ocodes, &oabsmax, &block_size,
                        &stochastic, &seed, &stream))
    return NULL;
  PyObject *result = NULL;
  mf_py_view x, code, codes, absmax;
  int have = 0;
  if (mf_py_view_get(ox, "x", 0, (uintptr_t)stream, &x)) goto finish;
  have = 1;
  if (mf_py_view_get(ocode, "code", 0, (uintptr_t)stream, &code)) goto finish;
  have = 2;
  if (mf_py_view_get(ocodes, "codes", 1, (uintptr_t)stream, &codes)) goto finish;
  have = 3;
  if (mf_py_view_get(oabsmax, "absmax", 1, (uintptr_t)stream, &absmax)) goto finish;
  have = 4;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_quantize_blockwise(&x.t, &code.t, &codes.t, &absmax.t, (int64_t)block_size,
                             stochastic ? MF_ROUND_STOCHASTIC : MF_ROUND_NEAREST, seed,
                             (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 4) mf_py_view_release(&absmax);
  if (have >= 3) mf_py_view_release(&codes);
  if (have >= 2) mf_py_view_release(&code);
  if (have >= 1) mf_py_view_release(&x);
  return result;
}

/* dequantize_blockwise(codes, absmax, code, out, block_size, stream) */
static PyObject *py_dequantize_blockwise(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *ocodes, *oabsmax, *ocode, *oout;
  long long block_size;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "OOOOLK", &ocodes, &oabsmax, &ocode, &oout, &block_size, &stream))
    return NULL;
  PyObject *result = NULL;
  mf_py_view codes, absmax, code, out;
  int have = 0;
  if (mf_py_view_get(ocodes, "codes", 0, (uintptr_t)stream, &codes)) goto finish;
  have = 1;
  if (mf_py_view_get(oabsmax, "absmax", 0, (uintptr_t)stream, &absmax)) goto finish;
  have = 2;
  if (mf_py_view_get(ocode, "code", 0, (uintptr_t)stream, &code)) goto finish;
  have = 3;
  if (mf_py_view_get(oout, "out", 1, (uintptr_t)stream, &out)) goto finish;
  have = 4;
  mf_status st;
  Py_BEGIN_ALLOW_THREADS
  st = mf_dequantize_blockwise(&codes.t, &absmax.t, &code.t, &out.t, (int64_t)block_size,
                               (void *)(uintptr_t)stream);
  Py_END_ALLOW_THREADS
  if (st) {
    mf_py_raise(st);
    goto finish;
  }
  result = Py_NewRef(Py_None);
finish:
  if (have >= 4) mf_py_view_release(&out);
  if (have >= 3) mf_py_view_release(&code);
  if (have >= 2) mf_py_view_release(&absmax);
  if (have >= 1) mf_py_view_release(&codes);
  return result;
}

/* Fills a float32 CPU array with a code table. */
static PyObject *fill_map(PyObject *oout, int is_signed, int total_bits, int max_exp, int dynamic) {
  mf_py_view out;
  if (mf_py_view_get(oout, "out", 1, 0, &out)) return NULL;
  mf_status st;
  if (out.t.dtype != MF_FLOAT32 || out.t.device != MF_CPU)
    st = mf_error(MF_ERR_TYPE, "out: expected a float32 CPU array");
  else if (dynamic)
    st = mf_dynamic_map((float *)out.t.data, out.t.numel, is_signed, total_bits, max_exp);
  else
    st = mf_linear_map((float *)out.t.data, out.t.numel, is_signed, total_bits);
  mf_py_view_release(&out);
  if (st) return mf_py_raise(st);
  Py_RETURN_NONE;
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

PyMethodDef mf_quant_methods[] = {
    {"quantize_blockwise", py_quantize_blockwise, METH_VARARGS,
     "quantize_blockwise(x, code, codes, absmax, block_size, stochastic, seed, stream)"},
    {"dequantize_blockwise", py_dequantize_blockwise, METH_VARARGS,
     "dequantize_blockwise(codes, absmax, code, out, block_size, stream)"},
    {"dynamic_map", py_dynamic_map, METH_VARARGS,
     "dynamic_map(out, signed, total_bits, max_exponent_bits)"},
    {"linear_map", py_linear_map, METH_VARARGS, "linear_map(out, signed, total_bits)"},
    {NULL, NULL, 0, NULL}};
