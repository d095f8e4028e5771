"""Triton kernels for the hot paths of training and verification, each beside a plain-torch
reference of the same math. The code is in kernels/; its import name is forge_kernels, since Hugging Face's
`kernels` (which transformers requires) owns the name `kernels`. kernels/ is therefore a folder and not a package:
as a package it would shadow Hugging Face's wherever the checkout is on sys.path. In a checkout this package
reaches kernels/ through its __path__; the wheel puts those modules beside this file (setup.py).

One dispatch rule, `use_triton` (kernels/dispatch.py): Triton on CUDA tensors; Triton's interpreter on CPU tensors
when the process runs with TRITON_INTERPRET=1 (the tests); plain torch everywhere else.
Where the rule says torch, the quantized matmul also has a C++ CPU kernel for few rows
(quant_matmul_cpu.cpp; when it serves: kernels/quant_matmul.py), and for many rows a one-pass dequantization
(dequantize_cpu.cpp).
Triton decides when it decorates a function whether it is interpreted, and it decorates its own
tl.sum, tl.max, ... when it is imported, so TRITON_INTERPRET=1 must be in the environment
before anything imports triton. `use_triton` reads the value our kernels were decorated with.
"""

from pathlib import Path

import common  # noqa: F401  refuses, in one line, an environment where another project holds our import names

if not Path(__file__).with_name("quant_matmul.py").exists():  # a checkout: the modules are in kernels/
    __path__.append(str(Path(__file__).resolve().parent.parent / "kernels"))

from forge_kernels.dispatch import INTERPRET, use_triton
from forge_kernels.distill import (
    distill_loss,
    distill_loss_chunked,
    distill_loss_reference,
    distill_loss_triton,
)
from forge_kernels.quant_matmul import (
    dense_matmul,
    quant_matmul,
    quant_matmul_reference,
    quant_matmul_triton,
)
from forge_kernels.verify import (
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
