"""Framework adapters: allocate results in the caller's framework, on its device.

memfit's C core only ever sees views (DLPack or NumPy's array interface); it never
allocates user-visible arrays. This module decides, from an input array, how to make
outputs of the same kind: torch in -> torch out, NumPy in -> NumPy out (ml_dtypes for
bfloat16), CuPy in -> CuPy out, JAX in -> JAX out, on the input's device, and which
CUDA stream the kernels should run on (the framework's current stream).
"""

from __future__ import annotations

import numpy as np

_NUMPY_DTYPES = ("float32", "float16", "uint8")


def framework(x) -> str:
    """'torch', 'numpy', 'cupy', 'jax' or 'dlpack' (any other __dlpack__ producer)."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod in ("jax", "jaxlib"):
        return "jax"
    if hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__"):
        return "dlpack"
    raise TypeError(
        f"expected an array (torch.Tensor, numpy.ndarray, CuPy or JAX array), got {type(x).__name__}"
    )


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16', ... for a dtype as users write it: a name, a torch dtype,
    a NumPy dtype or scalar type (``np.float16``, ``np.dtype("float16")``),
    ``ml_dtypes.bfloat16``, a CuPy or JAX dtype.

    >>> dtype_name(np.float16), dtype_name(np.dtype("float32")), dtype_name("bfloat16")
    ('float16', 'float32', 'bfloat16')
    """
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, (type, np.dtype)):
        # NumPy scalar types and ml_dtypes' types print as "<class '...'>": ask NumPy
        try:
            return np.dtype(dtype).name
        except TypeError:
            pass
    return str(dtype).rsplit(".", 1)[-1]


def torch_dtype(dtype):
    """The torch dtype for any dtype :func:`dtype_name` reads (None stays None)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype_name(dtype)
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise TypeError(f"dtype: no torch dtype for {dtype!r}")
    return t


def check_out_grad(out, fn: str) -> None:
    """Refuses an ``out=`` tensor that requires grad while autograd records, as torch's
    ``out=`` operators do: writing into it would bypass autograd."""
    if framework(out) == "torch" and out.requires_grad:
        import torch

        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{fn}(): functions with out=... arguments don't support automatic "
                "differentiation, but out requires grad; pass a tensor that does not "
                "require grad, or call under torch.no_grad()")


def numpy_dtype(name: str):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TypeError("bfloat16 NumPy arrays need the ml_dtypes package") from e
        return np.dtype(ml_dtypes.bfloat16)
    if name in _NUMPY_DTYPES:
        return np.dtype(name)
    raise TypeError(f"unsupported dtype {name}")


def is_cuda(x) -> bool:
    fw = framework(x)
    if fw == "torch":
        return x.device.type == "cuda"
    if fw == "cupy":
        return True
    if hasattr(x, "__dlpack_device__"):
        return x.__dlpack_device__()[0] in (2, 13)
    return False


def as_input(x):
    """What to hand the C bindings: torch tensors detached (DLPack refuses tensors
    that require grad; detach() is a view, not a copy), JAX arrays as NumPy views."""
    fw = framework(x)
    if fw == "torch":
        return x.detach()
    if fw == "jax" and not is_cuda(x):
        return np.asarray(x)
    return x


def empty(like, shape, name: str):
    """An uninitialised array of `shape` and dtype `name`, in `like`'s framework and on
    `like`'s device."""
    shape = tuple(int(s) for s in shape)
    fw = framework(like)
    if fw == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, name), device=like.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=numpy_dtype(name))
    if fw in ("numpy", "jax", "dlpack"):
        if is_cuda(like):
            raise TypeError(
                f"{type(like).__name__} arrays on a GPU are not supported; pass torch or CuPy arrays"
            )
        return np.empty(shape, dtype=numpy_dtype(name))
    raise TypeError(f"cannot allocate an output like {type(like).__name__}")


def finish(result, like):
    """Converts a NumPy result back to `like`'s framework where that framework's
    arrays are immutable (JAX)."""
    if framework(like) == "jax":
        import jax.numpy as jnp

        return jnp.asarray(result)
    return result


def stream_of(x) -> int:
    """The CUDA stream (as an int) the caller's framework is using for x, 0 otherwise."""
    fw = framework(x)
    if fw == "torch" and x.device.type == "cuda":
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    if fw == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def to_like(array: np.ndarray, like):
    """A CPU NumPy array copied into `like`'s framework and device (for small tables
    such as quantization codes)."""
    fw = framework(like)
    if fw == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(array)).to(like.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(array)
    return array


def device_key(x):
    """A hashable (framework, device) key for caching per-device tables."""
    fw = framework(x)
    if fw == "torch":
        return ("torch", str(x.device))
    if fw == "cupy":
        return ("cupy", x.device.id)
    return ("numpy", "cpu")
