"""int8, weight-only: per output channel n, s[n] = max_k |W[n, k]| / 127, q = round(W / s), W ~ q s. It also
stores fused MoE expert weights as int8 (speculators/quant/experts.py), and serves quant.activations=int8."""

from speculators.quant.modules import WeightOnlyInt8Linear
from speculators.quant.scheme import Scheme


class Int8Scheme(Scheme):
    name = "int8"
    activations = ("exact", "int8")
    quantizes_experts = True

    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyInt8Linear(weight, bias, cpu_matmul, int8_activations=self.cfg.int8_activations)
