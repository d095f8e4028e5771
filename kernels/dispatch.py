"""The one dispatch rule of every kernel here: Triton on CUDA tensors; Triton's interpreter on CPU
tensors when the process runs with TRITON_INTERPRET=1 (the tests); plain torch everywhere else.

Triton decides when it decorates a function whether it is interpreted, so INTERPRET is read as the
kernels were decorated (TRITON_INTERPRET=1 must be set before anything imports triton).
"""

import torch
import triton

INTERPRET = triton.knobs.runtime.interpret


def use_triton(x: torch.Tensor) -> bool:
    """Run the Triton kernel for tensor `x`, or the torch path?"""
    return x.is_cuda or INTERPRET
