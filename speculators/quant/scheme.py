"""Quantization schemes by name (`quant.scheme=<name>`): one file each in this folder, a handler class per
scheme (gpt-fast's pattern). Subclassing `Scheme` with a `name` registers it (SCHEMES); a scheme's name is
also its module: an unknown name imports speculators/quant/<name>.py, or a module `<name>` of your own on the
Python path, the first time it is asked for. docs/new_quant_scheme.md says how to add one.

A handler checks every layer before any changes (`check`), may read the model once (`prepare`: GPTQ's
calibration), and builds each replacement: `convert` for an nn.Linear, `convert_table` for an embedding
table (looked up row by row, never multiplied). `speculators.quant.quantize` swaps them in."""

from pathlib import Path

from torch import nn

from common.config import UserError
from common.registry import import_built_in, look_up
from forge_kernels.quant_matmul import ACT_BLOCK

BUILT_IN = ("int8", "int4", "gptq", "fp8", "w8a8", "gguf", "fp4")  # modules: gptq is gptq_int4, fp4 mxfp4 and nvfp4
SCHEMES: dict[str, type] = {}


class Scheme:
    name: str  # quant.scheme's value; defining a subclass with one registers it
    activations: tuple[str, ...] = ("exact",)  # the quant.activations it serves (int8: x rounded in blocks)
    from_file = False  # its weights come from target.gguf_file, which says which tensors are quantized
    quantizes_experts = False  # it also stores fused MoE expert weights quantized (speculators/quant/experts.py)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            SCHEMES[cls.name] = cls

    def __init__(self, cfg, gguf_file: Path | None = None):
        self.cfg = cfg

    def check(self, name: str, width: int) -> None:
        """Refuse a layer this scheme cannot hold (input width `width`), in one line."""
        if self.cfg.int8_activations and width % ACT_BLOCK:
            raise UserError(f"quant.activations=int8 rounds x in blocks of {ACT_BLOCK} columns: the input width {width} "
                            f"of {name} is not a multiple; use quant.activations=exact")

    def prepare(self, model: nn.Module, chosen: list[tuple[str, nn.Module]], tokenizer) -> None:
        """Read the model once before any layer is converted (round to nearest needs nothing but the weights)."""

    def convert(self, name: str, weight, bias, cpu_matmul: str) -> nn.Module | None:
        """The replacement of linear layer `name` (None: it stays as loaded)."""
        raise NotImplementedError

    def convert_table(self, name: str, weight) -> nn.Module | None:
        """An embedding table: looked up row by row, never multiplied."""
        return self.convert(name, weight, None, cpu_matmul="dequantize")


def scheme(name: str, key: str = "quant.scheme") -> type:
    """The handler class of scheme `name` (the value of `key`), importing its module when it is not registered yet."""
    return look_up(SCHEMES, name, "speculators.quant", key, before=("none",))


import_built_in("speculators.quant", BUILT_IN)
