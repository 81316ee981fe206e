"""Arrays the bindings take (csrc/python/views.c) and dtype arguments (issue 24 section 4):
what NumPy, torch and DLPack producers can hand memfit that the kernels must refuse or
read correctly: NULL data pointers, lazy negation views, out= tensors that require
grad, big-endian arrays, and NumPy / ml_dtypes dtype objects."""

import ctypes

import ml_dtypes
import numpy as np
import pytest
import torch

import memfit
import memfit.amp as amp
import memfit.nn as mnn
import memfit.quant as q
from dlpack_ctypes import DLDataType, DLDevice, DLManagedTensor
from memfit import _arrays


class _ArrayInterface:
    """A NumPy-style producer with a hand-written __array_interface__."""

    def __init__(self, ptr, shape, typestr="<f4"):
        self.shape = shape
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                    "strides": None, "version": 3}


# ---- NULL data pointers ------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda x: memfit.cast(x, "float16"),
    lambda x: q.quantize_blockwise(x, block_size=64),
])
def test_array_interface_null_pointer_with_elements_is_refused(call):
    # used to segfault: the kernels read 4 floats at address 0
    with pytest.raises(ValueError, match=r"x: __array_interface__ has a NULL data pointer but 4 elements"):
        call(_ArrayInterface(0, (4,)))


def test_array_interface_null_pointer_without_elements_is_an_empty_array():
    out = memfit.cast(_ArrayInterface(0, (0, 3)), "float16")  # as NumPy takes it
    assert out.shape == (0, 3) and out.dtype == np.float16


def test_array_interface_negative_size_is_refused():
    buf, out = np.zeros(4, np.float32), np.zeros(4, np.float16)
    with pytest.raises(ValueError, match=r"x: invalid __array_interface__ shape \(size -4"):
        memfit._C.cast(_ArrayInterface(buf.ctypes.data, (-4,)), out, False, 0, 0)


class _NullDLPack:
    """A legacy DLPack producer of a float32 CPU tensor whose data pointer is NULL."""

    def __init__(self, n):
        self.shape = (n,)
        self._shape = (ctypes.c_int64 * 1)(n)
        self._m = DLManagedTensor()
        t = self._m.dl_tensor
        t.data, t.device, t.ndim = None, DLDevice(1, 0), 1
        t.dtype, t.shape, t.strides, t.byte_offset = DLDataType(2, 32, 1), self._shape, None, 0

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None):  # no max_version: memfit retries the legacy call
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._m), b"dltensor", None)


def test_dlpack_null_pointer_with_elements_is_refused():
    with pytest.raises(ValueError, match=r"x: DLPack tensor has a NULL data pointer but 5 elements"):
        memfit.cast(_NullDLPack(5), "float16")


# ---- lazy negation (the negative bit) ----------------------------------------------------

def _neg_views():
    x = torch.randn(8)
    c = torch.complex(torch.randn(1), torch.randn(1))
    return [(torch._neg_view(x), -x), (c.conj().imag, -c.imag)]


@pytest.mark.parametrize("i", [0, 1])
def test_negative_bit_input_is_refused_not_read_without_its_sign(i):
    view, _ = _neg_views()[i]
    assert view.is_neg()
    with pytest.raises(ValueError, match=r"x: the tensor has its negative bit set .*resolve_neg\(\)"):
        memfit.cast(view, torch.float16)
    with pytest.raises(ValueError, match=r"resolve_neg"):
        q.quantize_blockwise(view, block_size=64)


@pytest.mark.parametrize("i", [0, 1])
def test_negative_bit_resolved_gives_the_signed_values(i):
    view, expected = _neg_views()[i]
    assert torch.equal(memfit.cast(view.resolve_neg(), torch.float32), expected)


def test_negative_bit_output_is_refused_and_left_alone():
    out = torch._neg_view(torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out: the tensor has its negative bit set"):
        memfit.cast(torch.randn(8), torch.float16, out=out)
    assert torch.equal(out.resolve_neg(), torch.zeros(8, dtype=torch.float16))


# ---- out= tensors that require grad --------------------------------------------------------

def test_cast_out_that_requires_grad_raises_like_torch():
    out = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out=\.\.\. arguments don't support automatic differentiation"):
        memfit.cast(torch.ones(4), torch.float16, out=out)
    assert torch.equal(out.detach(), torch.zeros(4, dtype=torch.float16))  # not written
    with torch.no_grad():  # as torch: allowed where autograd does not record
        memfit.cast(torch.ones(4), torch.float16, out=out)
    assert torch.equal(out.detach(), torch.ones(4, dtype=torch.float16))


def test_dequantize_out_that_requires_grad_raises_like_torch():
    s = q.quantize_blockwise(torch.randn(256), block_size=64)
    out = torch.zeros(256, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"dequantize_blockwise\(\): functions with out="):
        q.dequantize_blockwise(s, out=out)
    assert not out.detach().any()


# ---- big-endian arrays ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [">f4", ">f2", np.dtype(ml_dtypes.bfloat16).newbyteorder(">")])
def test_big_endian_message_says_big_endian_and_how_to_convert(dtype):
    x = np.ones(64, dtype=dtype)
    with pytest.raises(TypeError, match=r"x: big-endian \w+ arrays .* x\.astype\(x\.dtype\.newbyteorder\('<'\)\)") as e:
        memfit.cast(x, "float32")
    assert "unsupported dtype" not in str(e.value)
    fixed = x.astype(x.dtype.newbyteorder("<"))  # what the message says works
    assert np.array_equal(memfit.cast(fixed, "float32"), np.ones(64, np.float32))


# ---- dtype arguments: NumPy scalar types, np.dtype, ml_dtypes ---------------------------------

_DTYPE_FORMS = [(np.float16, torch.float16), (np.dtype("float16"), torch.float16),
                (np.float32, torch.float32), (ml_dtypes.bfloat16, torch.bfloat16),
                (np.dtype(ml_dtypes.bfloat16), torch.bfloat16)]


@pytest.mark.parametrize("dtype,expected", _DTYPE_FORMS)
def test_cast_takes_numpy_and_ml_dtypes(dtype, expected):
    x = torch.randn(33)
    assert torch.equal(memfit.cast(x, dtype), x.to(expected))
    y = memfit.cast(x.numpy(), dtype)
    assert y.dtype == _arrays.numpy_dtype(_arrays.dtype_name(expected))


@pytest.mark.parametrize("dtype,expected", _DTYPE_FORMS)
def test_out_dtype_takes_numpy_and_ml_dtypes(dtype, expected):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    assert mnn.matmul(a, b, out_dtype=dtype).dtype == expected


@pytest.mark.parametrize("dtype,expected", _DTYPE_FORMS)
def test_linear_and_autocast_take_numpy_and_ml_dtypes(dtype, expected):
    assert mnn.Linear(8, 4, dtype=dtype).weight.dtype == expected
    if expected != torch.float32:
        assert amp.autocast("cpu", dtype=dtype).dtype == expected


def test_a_numpy_dtype_memfit_cannot_take_is_named():
    with pytest.raises(TypeError, match=r"dtype: expected float32, float16 or bfloat16 .*numpy.int8"):
        memfit.cast(torch.randn(3), np.int8)
