"""Old name of memfit.nn.gemm (matrix products), kept so existing imports keep working:
``memfit._matmul`` is the very same module object, so attributes set on one are seen
through the other."""

import sys

from memfit.nn import gemm

sys.modules[__name__] = gemm
