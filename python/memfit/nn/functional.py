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
            x2 = x.contiguous()
            relu = activation == "relu"
            y, pre = gemm.gemm(x2, w.contiguous(), trans_b=True, bias=b, activation=activation,
                                  save_pre=not relu)
            ctx.activation = activation
            ctx.has_bias = b is not None
            ctx.save_for_backward(x2, w, y if relu else pre)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, pre = ctx.saved_tensors
            dy = dy.contiguous()
            dpre = dy if pre is None else gemm.activation_backward(dy, pre, ctx.activation)
            k = x.shape[-1]
            x2 = x.reshape(-1, k)
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
    ``torch.nn.functional.linear`` does.

    >>> import torch, memfit.nn.functional as F  # doctest: +SKIP
    >>> F.linear(torch.randn(4, 8), torch.randn(16, 8), activation="gelu").shape  # doctest: +SKIP
    torch.Size([4, 16])
    """
    import torch

    global _LINEAR
    if _LINEAR is None:
        _LINEAR = _linear_function()
    gemm.activation_code(activation)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, w = x.to(dt), w.to(dt)
        b = None if b is None else b.to(dt)
    if w.dtype != x.dtype:
        raise TypeError(f"w: expected dtype {x.dtype} (the input's), got {w.dtype}")
    return _LINEAR.apply(x, w, b, activation)
