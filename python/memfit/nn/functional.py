"""memfit.nn.functional: layers whose matrix products run in memfit's kernels."""

from __future__ import annotations

from memfit.nn import gemm

__all__ = ["linear"]


def _linear_function():
    import torch

    class _Linear(torch.autograd.Function):
        """y = act(x @ w.T + b); saves what act's derivative needs for the backward pass:
        the pre-activation for the GELUs, the output itself for relu (relu'(pre) equals
        relu'(y), so no second m x n tensor is kept and cuBLASLt fuses relu whole)."""

        @staticmethod
        def forward(ctx, x, w, b, activation):
            relu = activation == "relu"
            y, pre = gemm.gemm(x.contiguous(), w.contiguous(), trans_b=True, bias=b,
                               activation=activation, save_pre=not relu)
            ctx.activation = activation
            ctx.has_bias = b is not None
            # the inputs themselves (not copies): a double backward differentiates them
            ctx.save_for_backward(x, w, b, y if relu else pre)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, b, pre = ctx.saved_tensors
            if torch.is_grad_enabled():
                # create_graph=True (a gradient penalty): the gradient must itself be
                # differentiable, so it is composed from torch's differentiable ops
                return _differentiable_backward(ctx, x, w, b, dy) + (None,)
            dy = dy.contiguous()
            dpre = dy if pre is None else gemm.activation_backward(dy, pre, ctx.activation)
            k = x.shape[-1]
            x2 = x.contiguous().reshape(-1, k)
            d2 = dpre.reshape(-1, dpre.shape[-1])
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                dx = gemm.gemm(d2, w.contiguous(), out_dtype=x.dtype)[0].reshape(x.shape)
            if ctx.needs_input_grad[1]:
                dw = gemm.gemm(d2, x2, trans_a=True, out_dtype=w.dtype)[0]
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = d2.float().sum(0).to(dy.dtype)
            return dx, dw, db, None

    return _Linear


def _differentiable_backward(ctx, x, w, b, dy):
    """(dx, dw, db) of ``activation(x @ w.T + b)`` from torch's own ops, with the graph
    kept, so that a second backward (a WGAN-GP gradient penalty, a Hessian-vector
    product) differentiates the gradient. Used only when the backward runs with grad
    mode on (``create_graph=True``); the first-order backward stays in memfit's kernels."""
    import torch

    act = {None: lambda t: t, "none": lambda t: t, "relu": torch.relu,
           "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[ctx.activation]
    wanted = [(i, t) for i, t in enumerate((x, w, b)) if t is not None and ctx.needs_input_grad[i]]
    with torch.autocast(x.device.type, enabled=False):
        y = act(torch.nn.functional.linear(x, w, b))
        grads = torch.autograd.grad(y, [t for _, t in wanted], dy, create_graph=True,
                                    allow_unused=True)
    out = [None, None, None]
    for (i, _), g in zip(wanted, grads):
        out[i] = g
    return tuple(out)


def _check_tensor(name, t, optional=False):
    import torch

    if optional and t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name}: memfit.nn.functional.linear takes torch tensors (it is an autograd "
            f"function), got {type(t).__module__}.{type(t).__name__}; for NumPy, CuPy or "
            "JAX arrays use memfit.nn.matmul, or convert with torch.from_numpy()")


_LINEAR = None


def linear(x, w, b=None, activation=None):
    """``activation(x @ w.T + b)`` with memfit's matrix kernels, differentiable.

    Args:
        x: input ``[..., in_features]`` (float32, float16 or bfloat16).
        w: weight ``[out_features, in_features]``, same dtype as x.
        b: optional bias ``[out_features]``.
        activation: None, "relu", "gelu" (exact erf GELU, torch's default) or
            "gelu_tanh" (torch's ``gelu(approximate="tanh")``), applied in the product's
            epilogue; what its derivative needs is kept for the backward pass. On CUDA
            with cuBLASLt, "gelu_tanh" and "relu" are fused into the library's epilogue
            (one kernel); exact "gelu" takes one extra elementwise pass, since cuBLASLt
            only has the tanh form.

    Under ``torch.autocast`` the inputs are cast to the autocast dtype first, as
    ``torch.nn.functional.linear`` does. Double backward works: under
    ``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty) the backward
    is composed from torch's differentiable ops, so the gradient has a graph.

    >>> import torch, memfit.nn.functional as F  # doctest: +SKIP
    >>> F.linear(torch.randn(4, 8), torch.randn(16, 8), activation="gelu").shape  # doctest: +SKIP
    torch.Size([4, 16])
    """
    import torch

    global _LINEAR
    if _LINEAR is None:
        _LINEAR = _linear_function()
    _check_tensor("x", x)
    _check_tensor("w", w)
    _check_tensor("b", b, optional=True)
    gemm.activation_code(activation)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, w = x.to(dt), w.to(dt)
        b = None if b is None else b.to(dt)
    if w.dtype != x.dtype:
        raise TypeError(f"w: expected dtype {x.dtype} (the input's), got {w.dtype}")
    return _LINEAR.apply(x, w, b, activation)
