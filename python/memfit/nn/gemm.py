"""Matrix products with float32 accumulation (memfit.nn.matmul, memfit.nn.functional.linear;
also reachable under their old names memfit.amp.matmul and memfit._matmul).

Framework-neutral: takes torch, NumPy (bfloat16 via ml_dtypes), CuPy or JAX arrays and
returns results in the same framework on the same device. On the CPU the product runs
in memfit's blocked C kernel; on CUDA in cuBLASLt (loaded at run time, tensor cores,
fused epilogues) when it is found and takes the case, else in memfit's portable tiled
kernel: :func:`gemm_backend` says which, and why.
"""

from __future__ import annotations

import glob
import os
import sys

from memfit import _C, _arrays
from memfit._C import MemfitTypeError, MemfitValueError

# "gelu" is the exact erf form (torch's default); "gelu_tanh" is torch's
# approximate="tanh", the form cuBLASLt's GELU epilogue computes.
ACTIVATIONS = {None: 0, "none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3}
_FLOATS = ("float32", "float16", "bfloat16")
BACKENDS = ("auto", "portable", "cublaslt")


def activation_code(activation) -> int:
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise MemfitValueError(
            f"activation: expected None, 'relu', 'gelu' or 'gelu_tanh', got {activation!r}") from None


# ---- the CUDA backend: cuBLASLt or the portable kernel ----------------------------------

_paths_offered = False


def cublaslt_candidates() -> list[str]:
    """libcublasLt files of NVIDIA's pip wheels on sys.path, newest CUDA first:
    ``nvidia/cu13/lib`` (nvidia-cublas 13) and ``nvidia/cublas/lib`` (nvidia-cublas-cu12,
    which torch's CUDA 12 wheels install)."""
    found = []
    for root in dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)):
        found += glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublasLt.so.*"))
    found = [f for f in dict.fromkeys(found) if f.rsplit(".so.", 1)[-1].isdigit()]
    return sorted(found, key=lambda f: -int(f.rsplit(".so.", 1)[-1]))


def _offer_cublaslt_paths() -> None:
    """Hands the pip wheels' libcublasLt files to the C loader, once, before the first
    CUDA product loads the library (a copy already loaded in the process, e.g. by
    torch, is still preferred; MEMFIT_CUBLASLT overrides both)."""
    global _paths_offered
    if _paths_offered:
        return
    _paths_offered = True
    if _C.build_info()["cuda"]:
        for path in cublaslt_candidates():
            _C.cublaslt_add_path(path)


def set_gemm_backend(backend: str) -> None:
    """Choose what runs CUDA matrix products: ``"auto"`` (cuBLASLt when it loads and
    takes the case, else the portable kernel; the default), ``"portable"`` (always
    memfit's tiled kernel) or ``"cublaslt"`` (cuBLASLt, or an error saying why not).
    Overrides the environment variable ``MEMFIT_GEMM_BACKEND``; CPU arrays always use
    the CPU kernel."""
    if backend not in BACKENDS:
        raise MemfitValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    _C.gemm_set_backend(BACKENDS.index(backend))


def gemm_backend(device=None) -> dict:
    """Which implementation runs matrix products on ``device``, and why.

    ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device`` or an int
    (CUDA index); None means ``"cuda"`` when a GPU is visible, else ``"cpu"``. For a
    CUDA device this loads cuBLASLt if it was not loaded yet (no product is run).
    Returns a dict:

    - ``backend``: ``"cpu"``, ``"cublaslt"`` or ``"portable"`` (what a product on
      this device would use; a case cuBLASLt declines still falls back, see ``last``)
    - ``reason``: why not cuBLASLt (``""`` when it is used or on the CPU)
    - ``mode``: ``"auto"``, ``"portable"`` or ``"cublaslt"`` (:func:`set_gemm_backend`)
    - ``cublaslt``: ``{"loaded", "version" (e.g. "12.9.3"), "path", "reason"}``
    - ``last``: ``{"backend", "reason"}`` of this thread's last product (any device)

    >>> memfit.nn.gemm_backend("cpu")["backend"]  # doctest: +SKIP
    'cpu'
    """
    kind, index = _device_of(device)
    mode = BACKENDS[_C.gemm_get_backend()]
    env = os.environ.get("MEMFIT_GEMM_BACKEND")
    if kind == "cuda":
        _offer_cublaslt_paths()
    info = _C.cublaslt_info(kind == "cuda")
    v = info["version"]
    lt = {"loaded": info["loaded"], "version": f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else None,
          "path": info["path"] or None, "reason": info["reason"] or None}
    last_backend, last_reason = _C.gemm_last_backend()
    out = {"device": kind if index is None else f"{kind}:{index}", "backend": "cpu", "reason": "",
           "mode": mode, "cublaslt": lt, "last": {"backend": last_backend or None, "reason": last_reason}}
    if env and env not in BACKENDS:
        out["warning"] = f"MEMFIT_GEMM_BACKEND={env!r} is not one of {', '.join(BACKENDS)}; using 'auto'"
    if kind == "cpu":
        return out
    if not _C.build_info()["cuda"]:
        out.update(backend=None, reason="memfit was built without CUDA support")
        return out
    usable, why = _C.cublaslt_device(index or 0)
    if mode == "portable":
        out.update(backend="portable", reason="the GEMM backend is set to portable")
    elif usable:
        out.update(backend="cublaslt")
    else:
        out.update(backend=None if mode == "cublaslt" else "portable", reason=why)
    return out


def _device_of(device):
    if device is None:
        return ("cuda", 0) if _C.cuda_device_count() else ("cpu", None)
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda", device
    text = str(device)
    kind, _, idx = text.partition(":")
    if kind not in ("cpu", "cuda") or (idx and not idx.isdigit()) or (kind == "cpu" and idx):
        raise MemfitValueError(f"device: expected 'cpu', 'cuda', 'cuda:N' or an int, got {device!r}")
    if kind == "cpu":
        return "cpu", None
    return "cuda", int(idx) if idx else 0


def _out_dtype(out_dtype, like_name: str) -> str:
    if out_dtype is None:
        return like_name
    name = _arrays.dtype_name(out_dtype)
    if name not in _FLOATS:
        raise MemfitTypeError(f"out_dtype: expected float32, float16 or bfloat16 (a name, a torch "
                              f"or NumPy dtype, ml_dtypes.bfloat16), got {out_dtype!r}")
    return name


def gemm(a, b, *, trans_a=False, trans_b=False, bias=None, activation=None, out_dtype=None,
         save_pre=False):
    """op(a)[m, k] @ op(b)[k, n] (+ bias) (-> activation), float32 accumulation.

    ``a`` may have leading batch dimensions when not transposed (they are flattened
    into m). Returns ``(out, pre)`` where ``pre`` is the pre-activation (or None)."""
    act = activation_code(activation)
    _arrays.framework(a)
    _arrays.framework(b)
    if len(b.shape) != 2:
        raise MemfitValueError(f"b: expected a 2-D array, got shape {tuple(b.shape)}")
    if trans_a and len(a.shape) != 2:
        raise MemfitValueError(f"a: a transposed operand must be 2-D, got shape {tuple(a.shape)}")
    if len(a.shape) < 1:
        raise MemfitValueError("a: expected at least 1 dimension")
    if trans_a:
        k, m = a.shape
        lead = (m,)
    else:
        k = a.shape[-1]
        lead = tuple(a.shape[:-1])
        m = 1
        for s in lead:
            m *= int(s)
    kb, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    if kb != k:
        raise MemfitValueError(
            f"a and b: inner dimensions differ ({k} vs {kb}) for shapes {tuple(a.shape)} and {tuple(b.shape)}"
            + (" (b is used transposed)" if trans_b else ""))
    if bias is not None and tuple(bias.shape) != (n,):
        raise MemfitValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
    src_a, src_b = _arrays.as_input(a), _arrays.as_input(b)
    if not _paths_offered and _arrays.is_cuda(src_a):
        _offer_cublaslt_paths()
    name = _out_dtype(out_dtype, _arrays.dtype_name(a.dtype))
    out = _arrays.empty(src_a, lead + (n,), name)
    pre = _arrays.empty(src_a, lead + (n,), name) if save_pre and act else None
    _C.gemm(src_a, bool(trans_a), src_b, bool(trans_b), out, int(m), int(n), int(k),
            None if bias is None else _arrays.as_input(bias), act, pre, _arrays.stream_of(src_a))
    return _arrays.finish(out, a), (None if pre is None else _arrays.finish(pre, a))


def matmul(a, b, out_dtype=None):
    """``a @ b`` with float16/bfloat16 (or float32) inputs and float32 accumulation.

    Args:
        a: array of shape ``[..., k]`` (leading dimensions are batch).
        b: array of shape ``[k, n]``, same dtype and device as ``a``.
        out_dtype: dtype of the result (default: the inputs' dtype).

    >>> import torch, memfit.nn  # doctest: +SKIP
    >>> memfit.nn.matmul(torch.randn(8, 64, dtype=torch.bfloat16),
    ...                   torch.randn(64, 32, dtype=torch.bfloat16)).shape  # doctest: +SKIP
    torch.Size([8, 32])
    """
    return gemm(a, b, out_dtype=out_dtype)[0]


def activation_backward(grad_output, pre, activation, out_dtype=None):
    """grad_output * activation'(pre), elementwise."""
    act = activation_code(activation)
    src = _arrays.as_input(grad_output)
    out = _arrays.empty(src, tuple(grad_output.shape), _out_dtype(out_dtype, _arrays.dtype_name(grad_output.dtype)))
    _C.act_backward(src, _arrays.as_input(pre), out, act, _arrays.stream_of(src))
    return _arrays.finish(out, grad_output)
