"""fp8, weight-only: per output channel, s[n] = max_k |W[n, k]| / 448 (the largest e4m3 value), q = e4m3(W / s).
It always dequantizes (PyTorch has no weight-only fp8 CPU operator)."""

from speculators.quant.modules import WeightOnlyFp8Linear
from speculators.quant.scheme import Scheme


class Fp8Scheme(Scheme):
    name = "fp8"

    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyFp8Linear(weight, bias)
