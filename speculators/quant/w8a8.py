"""w8a8: int8 weights as the int8 scheme's, and each row (token) of x rounded at run time to 129 levels:
a[m] = max_k |x[m, k]|, x ~ p (2/127) a[m] with p = round(x / a[m] / (2/127)) in -64..64, so the integer
matmul does the work (speculators/quant/modules.py DynamicInt8Linear; module doc of speculators/quant)."""

from speculators.quant.modules import DynamicInt8Linear, WeightOnlyInt8Linear
from speculators.quant.scheme import Scheme


class W8A8Scheme(Scheme):
    name = "w8a8"

    def convert(self, name, weight, bias, cpu_matmul):
        return DynamicInt8Linear(weight, bias)

    def convert_table(self, name, weight):
        return WeightOnlyInt8Linear(weight, None)  # lookups have no activations to round
