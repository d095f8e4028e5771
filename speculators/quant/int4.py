"""int4, weight-only: per group of `group_size` input columns, s = (max - min) / 15, q = round((W - min) / s)
in 0..15, z = min + 8 s, W ~ (q - 8) s + z (PyTorch's int4 convention)."""

from common.config import UserError
from speculators.quant.modules import WeightOnlyInt4Linear
from speculators.quant.scheme import Scheme


class Int4Scheme(Scheme):
    name = "int4"
    activations = ("exact", "int8")

    def check(self, name, width):
        super().check(name, width)
        if width % self.cfg.group_size:
            raise UserError(f"quant.group_size={self.cfg.group_size} does not divide the input width {width} of "
                            f"{name}; choose a divisor of it")

    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyInt4Linear(weight, bias, self.cfg.group_size, cpu_matmul,
                                    int8_activations=self.cfg.int8_activations)
