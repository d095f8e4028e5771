"""A quantization scheme written the way a user adds one: this file, nothing else (tests/test_new_quant.py
serves a target with `quant.scheme=toyquant`). Defining the Scheme subclass registers the scheme `toyquant`;
its module has the same name, so `quant.scheme=toyquant` finds it on the Python path.

The scheme: per output channel n, s[n] = max_k |W[n, k]| / 127 and q = round(W / s) in int8, stored as q and s
and multiplied in plain torch: W ~ q s.
"""

import torch

from speculators.quant import QuantizedLinear, Scheme


class RowInt8Linear(QuantizedLinear):
    precision = "int8"

    def __init__(self, weight, bias):
        super().__init__(weight, bias)
        w = weight.detach().float()
        scales = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        self.register_buffer("q", torch.round(w / scales).to(torch.int8))
        self.register_buffer("scales", scales)

    def matmul(self, x):
        return x @ self.rows(slice(None)).to(x.dtype).T

    def rows(self, ids):
        return self.q[ids].float() * self.scales[ids]

    def cpu_op(self) -> str:
        return "dequantize + matmul"


class ToyQuant(Scheme):
    name = "toyquant"

    def convert(self, name, weight, bias, cpu_matmul):
        return RowInt8Linear(weight, bias)
