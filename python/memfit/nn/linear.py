"""memfit.nn.Linear: a drop-in torch.nn.Linear whose products run in memfit's kernels.
Imports torch."""

import torch

from memfit import _arrays
from memfit.nn import functional
from memfit.nn.gemm import activation_code


class Linear(torch.nn.Linear):
    """Drop-in for ``torch.nn.Linear`` (same arguments, parameters and state_dict keys)
    whose forward and backward run in memfit's matrix kernels, optionally with a
    fused activation: None, "relu", "gelu" (exact) or "gelu_tanh" (see
    :func:`memfit.nn.functional.linear`).

    >>> layer = Linear(64, 256, activation="gelu")
    >>> layer(torch.randn(8, 64)).shape
    torch.Size([8, 256])
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, activation=None):
        # torch.nn.Linear takes torch dtypes only; NumPy's and ml_dtypes' are read by name
        super().__init__(in_features, out_features, bias=bias, device=device,
                         dtype=_arrays.torch_dtype(dtype))
        activation_code(activation)
        self.activation = activation

    def forward(self, x):
        return functional.linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self):
        base = super().extra_repr()
        return base + (f", activation={self.activation!r}" if self.activation else "")

