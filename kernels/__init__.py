"""Triton kernels for the hot paths of training and verification, each beside a plain-torch
reference of the same math.

One dispatch rule, `use_triton` (kernels/dispatch.py): Triton on CUDA tensors; Triton's interpreter on CPU tensors
when the process runs with TRITON_INTERPRET=1 (the tests); plain torch everywhere else.
Where the rule says torch, the quantized matmul also has a C++ CPU kernel for few rows
(quant_matmul_cpu.cpp; when it serves: kernels.quant_matmul).
Triton decides when it decorates a function whether it is interpreted, and it decorates its own
tl.sum, tl.max, ... when it is imported, so TRITON_INTERPRET=1 must be in the environment
before anything imports triton. `use_triton` reads the value our kernels were decorated with.
"""

import common  # noqa: F401  refuses, in one line, an environment where Hugging Face's kernels shares this import name
from kernels.dispatch import INTERPRET, use_triton
from kernels.distill import (
    distill_loss,
    distill_loss_chunked,
    distill_loss_reference,
    distill_loss_triton,
)
from kernels.quant_matmul import (
    dense_matmul,
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_triton,
)
from kernels.verify import (
    verify_greedy,
    verify_greedy_reference,
    verify_greedy_triton,
    verify_relaxed,
    verify_sampling,
    verify_sampling_reference,
    verify_sampling_triton,
)

__all__ = [
    "INTERPRET", "use_triton",
    "distill_loss", "distill_loss_chunked", "distill_loss_reference", "distill_loss_triton",
    "dense_matmul", "quant_matmul", "quant_matmul_reference", "quant_matmul_triton",
    "verify_greedy", "verify_greedy_reference", "verify_greedy_triton", "verify_relaxed",
    "verify_sampling", "verify_sampling_reference", "verify_sampling_triton",
]
