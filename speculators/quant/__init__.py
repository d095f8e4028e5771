"""Quantization of the frozen target, applied once at load (gpt-fast's pattern); its formats' arithmetic in
gptq.py (GPTQ levels), fp4.py (MXFP4/NVFP4) and gguf.py (a GGUF file's own blocks) beside this file, the
replacement layers in modules.py, fused MoE experts in experts.py, the precision breakdown in precision.py.

Each scheme is a handler that checks a layer and builds its replacement module; `quantize`
swaps the target's nn.Linear modules (exactly that type: subclasses such as Llama-4's router compute something
else) and, if asked, its embeddings and lm_head, in place. int8 also stores fused MoE expert weights as int8
(experts.py); the other schemes leave them as loaded, and a load that leaves most of the layers' weights
unquantized warns in one line with the breakdown (precision.py).
int8, int4, gptq_int4 and fp8 are weight-only: activations stay in the target's dtype. w8a8 quantizes both:
- int8: per output channel n, s[n] = max_k |W[n, k]| / 127, q = round(W / s), W ~ q s.
- int4: per group of `group_size` input columns, s = (max - min) / 15, q = round((W - min) / s)
  in 0..15, z = min + 8 s, W ~ (q - 8) s + z (PyTorch's int4 convention).
- gptq_int4: the int4 format, its levels chosen by GPTQ on calibration text (speculators/quant/gptq.py).
- fp8: per output channel, s[n] = max_k |W[n, k]| / 448 (the largest e4m3 value), q = e4m3(W / s).
- mxfp4, nvfp4: FP4 E2M1 values with a power-of-two scale per 32 columns (MXFP4) or an e4m3 scale per 16
  columns times a tensor scale (NVFP4), emulated (speculators/quant/fp4.py): accuracy, not speed.
- gguf: no rounding here: a GGUF file's own blocks (speculators/quant/gguf.py), Q4_1 as int4 in groups
  of 32 and Q8_0 as int8 with one scale per 32 columns, dequantizing bit for bit to the weights the
  target was converted with (speculators/gguf_file.py). Every tensor the file stores quantized is
  served from its blocks, embeddings and lm_head included (quantize_embeddings and quantize_lm_head do
  not apply); a tied embedding and lm_head share one module.
- w8a8: int8 weights as above, and each row (token) of x rounded at run time to 129 levels:
  a[m] = max_k |x[m, k]|, x ~ p (2/127) a[m] with p = round(x / a[m] / (2/127)) in -64..64, so the
  integer matmul does the work. About 7 bits, not 8: the x86 operator (fbgemm) multiplies uint8 by
  int8 in int16 pairs, which 8-bit activations could overflow (PyTorch's `reduce_range`).

Forward, one dispatch rule: the Triton kernel (kernels.quant_matmul) where kernels.use_triton
says so; else on the CPU by `cpu_matmul`:
- kernel (default): kernels.quant_matmul's CPU kernel (AVX2, reads the int8/int4 bytes) for up to
  32 rows of x, dequantize and one dense matmul for more (training batches, prefill).
- dequantize: always dequantize and one dense matmul.
- packed: PyTorch's packed weight-only CPU operators where they exist (aten._weight_int8pack_mm;
  aten._weight_int4pack_mm_for_cpu, which needs N % 16 == 0 and a group size of 32..256, and its own
  weight layout, chosen when the layer is quantized and undone when it leaves the CPU). Slower than a
  dense fp32 matmul for one row on the CPUs measured (results/pycode/quant_bench.json); measure yours
  with benchmarks.quant_bench.
fp8 always dequantizes (PyTorch has no weight-only fp8 CPU operator).
`activations` (int8, int4, gptq_int4, gguf): exact multiplies x as it is; int8 first rounds each block of
32 columns of each row of x to int8 levels with its own scale (kernels.quant_matmul.round_activation_blocks,
llama.cpp's Q8_0 arithmetic), on every path, so that the CPU kernel multiplies integers (faster than its
exact path: docs/real-target.md), what llama.cpp computes with the same file. Off by default, for its
price: the logits move (top-1 still agrees with the fp32 target almost everywhere), and, as with w8a8, rounding turns the 1e-7 differences between a 1-token and
a (k+1)-token forward (attention) into level steps that grow through the layers: there a 6-token pass
and six 1-token steps pick different argmaxes at 3 of 306 chat positions (exact: none), so greedy
speculation is lossless in distribution but not always token-identical to target-only decoding.
w8a8 on the CPU always runs fbgemm's dynamic int8 operator (quantized::linear_dynamic, its reason to exist:
results/pycode/quant_bench_370m_kernel.json), elsewhere (GPUs, CPUs without fbgemm)
the same math in torch: activations rounded as above, then kernels.quant_matmul. fbgemm picks one
activation scale for the whole batch; dividing each row by its own a[m] and appending one pinning row
[1, -1, 0, ...] fixes that scale at 2/127 (and its zero point), so a row's result never depends on
the other rows in the batch (else every verified token would depend on the drafts beside it). The
rest of the forward is not batch-invariant to the last bit (attention over 1 or k+1 queries sums in
another order), and rounding activations can turn such a 1e-7 difference into one level's step: so
greedy speculation over a w8a8 target is lossless in distribution but not always token-identical
to w8a8 target-only decoding (benchmarks.quant_report measures how often).
The quantized modules expose `weight`, the dequantized fp32 matrix, for code that copies the target's embeddings or lm_head (drafters' from_target).
"""

from dataclasses import dataclass
from pathlib import Path

from torch import nn
from tqdm import tqdm

from common.config import UserError, one_of, require
from kernels.quant_matmul import ACT_BLOCK, round_to_nearest_int4
from speculators.layers import DecodingLinear
from speculators.quant import fp4, gguf, gptq
from speculators.quant.experts import EXPERT_SCHEMES, quantize_experts
from speculators.quant.modules import (
    ACT_LEVELS,
    FBGEMM,
    INT4_OP,
    INT4_OP_GROUPS,
    INT4_PACK_OP,
    INT8_OP,
    DynamicInt8Linear,
    Fp4Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    WeightOnlyFp8Linear,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    round_activations,
    stack_linears,
)
from speculators.quant.precision import describe, precision_breakdown, warn_if_mostly_unquantized

__all__ = [  # the layers (speculators/quant/modules.py) and the precision breakdown, importable from here
    "ACT_LEVELS", "ACTIVATIONS", "CPU_MATMULS", "FBGEMM", "INT4_OP", "INT4_OP_GROUPS", "INT4_PACK_OP", "INT8_OP",
    "QUANT_SCHEMES", "DynamicInt8Linear", "Fp4Linear", "QuantConfig", "QuantizedEmbedding", "QuantizedLinear",
    "WeightOnlyFp8Linear", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "check_gguf_source", "describe", "fp4",
    "gguf", "gptq", "layers_to_quantize", "precision_breakdown", "quantize", "round_activations",
    "round_to_nearest_int4", "stack_linears", "weight_bytes",
]

QUANT_SCHEMES = ("none", "int8", "int4", "gptq_int4", "fp8", "w8a8", "gguf", "mxfp4", "nvfp4")
CPU_MATMULS = ("kernel", "dequantize", "packed")
ACTIVATIONS = ("exact", "int8")


@dataclass
class QuantConfig:
    scheme: str = "none"  # quantization of the target's linear layers: weight-only, or w8a8 (weights and activations)
    group_size: int = 32  # int4, gptq_int4: input columns sharing one scale and zero; must divide every quantized width
    quantize_embeddings: bool = False  # also the input embeddings (rows dequantized on lookup); gguf: as the file stores them
    quantize_lm_head: bool = False  # also the output projection; gguf: as the file stores it
    cpu_matmul: str = "kernel"  # on the CPU: our int8/int4 kernel for few rows, dequantize + dense matmul, or PyTorch's packed operators
    calibration_sequences: int = 32  # gptq_int4: 256-token pieces of the stdlib train split for GPTQ's statistics
    activations: str = "exact"  # int8, int4, gptq_int4, gguf: x as is (exact) or rounded to int8 per 32 columns (int8)

    def __post_init__(self):
        one_of("quant.scheme", self.scheme, QUANT_SCHEMES)
        one_of("quant.cpu_matmul", self.cpu_matmul, CPU_MATMULS)
        one_of("quant.activations", self.activations, ACTIVATIONS)
        require(self.activations != "int8" or self.scheme not in ("fp8", "w8a8", "mxfp4", "nvfp4"), "quant.activations",
                self.activations,
                f"exact with quant.scheme={self.scheme}")
        require(self.group_size >= 2 and self.group_size % 2 == 0, "quant.group_size", self.group_size,
                "an even number >= 2 (two int4 values share a byte)")
        require(isinstance(self.calibration_sequences, int) and self.calibration_sequences >= 1,
                "quant.calibration_sequences", self.calibration_sequences, "an integer >= 1")
        for key in ("quantize_embeddings", "quantize_lm_head"):
            require(isinstance(getattr(self, key), bool), f"quant.{key}", getattr(self, key), "true or false")

    @property
    def int8_activations(self) -> bool:
        """Whether weight-only layers round x to int8 blocks (`activations`, module doc)."""
        return self.activations == "int8"


# --- handlers: one per scheme ------------------------------------------------------------------


class Int8Handler:
    def __init__(self, cfg: QuantConfig):
        self.cfg = cfg

    def check(self, name: str, width: int) -> None:
        """Per channel: any width, unless x is rounded in blocks."""
        if self.cfg.int8_activations and width % ACT_BLOCK:
            raise UserError(f"quant.activations=int8 rounds x in blocks of {ACT_BLOCK} columns: the input width {width} "
                            f"of {name} is not a multiple; use quant.activations=exact")

    def prepare(self, model: nn.Module, chosen: list[tuple[str, nn.Module]], tokenizer) -> None:
        pass  # round to nearest needs nothing but the weights

    def convert(self, name: str, weight, bias, cpu_matmul: str) -> QuantizedLinear:
        return WeightOnlyInt8Linear(weight, bias, cpu_matmul, int8_activations=self.cfg.int8_activations)

    def convert_table(self, name: str, weight) -> QuantizedLinear:
        """An embedding table: looked up row by row, never multiplied."""
        return self.convert(name, weight, None, cpu_matmul="dequantize")


class Int4Handler(Int8Handler):
    def check(self, name, width):
        super().check(name, width)
        if width % self.cfg.group_size:
            raise UserError(f"quant.group_size={self.cfg.group_size} does not divide the input width {width} of "
                            f"{name}; choose a divisor of it")

    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyInt4Linear(weight, bias, self.cfg.group_size, cpu_matmul,
                                    int8_activations=self.cfg.int8_activations)


class GptqInt4Handler(Int4Handler):
    def prepare(self, model, chosen, tokenizer):
        if tokenizer is None:
            raise UserError("quant.scheme=gptq_int4 needs the target's tokenizer for its calibration text")
        ids = gptq.calibration_ids(tokenizer, self.cfg.calibration_sequences)
        linears = {name: m for name, m in chosen if isinstance(m, nn.Linear)}
        hessians = gptq.input_hessians(model, linears, ids)
        self.levels = {name: gptq.gptq_int4(m.weight, hessians.pop(name), self.cfg.group_size)
                       for name, m in tqdm(linears.items(), desc="GPTQ", unit="layer")}

    def convert_table(self, name, weight):
        return super().convert(name, weight, None, cpu_matmul="dequantize")  # no inputs to calibrate on: round to nearest

    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyInt4Linear(weight, bias, self.cfg.group_size, cpu_matmul, self.levels.pop(name),
                                    self.cfg.int8_activations)


class Fp8Handler(Int8Handler):
    def convert(self, name, weight, bias, cpu_matmul):
        return WeightOnlyFp8Linear(weight, bias)


class Fp4Handler(Int8Handler):
    def check(self, name, width):
        fp4.check_width(self.cfg.scheme, name, width)

    def convert(self, name, weight, bias, cpu_matmul):
        return Fp4Linear(weight, bias, self.cfg.scheme)


class W8A8Handler(Int8Handler):
    def convert(self, name, weight, bias, cpu_matmul):
        return DynamicInt8Linear(weight, bias)

    def convert_table(self, name, weight):
        return WeightOnlyInt8Linear(weight, None)  # lookups have no activations to round


class GgufHandler(Int8Handler):
    """The GGUF file's own blocks (speculators/quant/gguf.py), one module per GGUF tensor: a tied
    embedding table and lm_head share theirs. None for a tensor that stays as loaded."""

    def __init__(self, cfg, path: Path):
        super().__init__(cfg)
        self.weights = gguf.GgufWeights(path)
        self.built = {}

    def check(self, name, width):
        self.weights.check(name)

    def convert(self, name, weight, bias, cpu_matmul):
        tensor = self.weights.tensor_name(name)
        if tensor not in self.built:
            self.built[tensor] = self.build(name, weight, bias, cpu_matmul)
        return self.built[tensor]

    def convert_table(self, name, weight):
        return self.convert(name, weight, None, self.cfg.cpu_matmul)  # the table a tied lm_head multiplies by

    def build(self, name, weight, bias, cpu_matmul) -> QuantizedLinear | None:
        found = self.weights.levels(name)
        if found is None:
            return None
        kind, levels = found
        if kind == "Q4_1":
            return WeightOnlyInt4Linear(weight, bias, gguf.BLOCK, cpu_matmul, levels, self.cfg.int8_activations)
        return WeightOnlyInt8Linear(weight, bias, cpu_matmul, levels, self.cfg.int8_activations)


HANDLERS = {"int8": Int8Handler, "int4": Int4Handler, "gptq_int4": GptqInt4Handler, "fp8": Fp8Handler,
            "w8a8": W8A8Handler, "mxfp4": Fp4Handler, "nvfp4": Fp4Handler}


def check_gguf_source(cfg: QuantConfig, gguf_file: Path | None) -> None:
    """quant=gguf serves the blocks of the GGUF file the target was converted from: it needs that file."""
    if cfg.scheme == "gguf" and gguf_file is None:
        raise UserError("quant.scheme=gguf serves a GGUF file's own quantized weights: set target.gguf_file "
                        "(this target is not loaded from one), or choose another quant.scheme")


def quantize(model: nn.Module, cfg: QuantConfig, tokenizer=None, gguf_file: Path | None = None) -> nn.Module:
    """Replace `model`'s linear layers (and embeddings / lm_head if configured) in place; returns it.
    `tokenizer` reads gptq_int4's calibration text; `gguf_file` is the file gguf's blocks come from."""
    if cfg.scheme == "none":
        return model
    check_gguf_source(cfg, gguf_file)
    existing = getattr(model.config, "quantization_config", None)
    if existing is not None:
        method = existing.get("quant_method") if isinstance(existing, dict) else getattr(existing, "quant_method", "?")
        raise UserError(f"quant.scheme={cfg.scheme}: the target is already quantized ({method}); "
                        f"load it with quant.scheme=none")
    handler = GgufHandler(cfg, gguf_file) if cfg.scheme == "gguf" else HANDLERS[cfg.scheme](cfg)
    chosen = layers_to_quantize(model, cfg)
    for name, module in chosen:  # every check before any change
        handler.check(name, module.weight.shape[1])
    handler.prepare(model, chosen, tokenizer)
    for name, module in chosen:
        if isinstance(module, nn.Embedding):
            table = handler.convert_table(name, module.weight)
            new = None if table is None else QuantizedEmbedding(table, module.weight.dtype)
        else:
            new = handler.convert(name, module.weight, module.bias, cfg.cpu_matmul)
        if new is not None:  # None: gguf keeps a tensor the file stores unquantized as loaded
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    if cfg.scheme in EXPERT_SCHEMES:
        quantize_experts(model)
    warn_if_mostly_unquantized(model, cfg.scheme)
    return model


# Exact types: subclasses of nn.Linear compute something else with their weight (Llama-4's router returns top-k scores).
PLAIN_LINEARS = (nn.Linear, DecodingLinear)


def layers_to_quantize(model: nn.Module, cfg: QuantConfig) -> list[tuple[str, nn.Module]]:
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    from_file = cfg.scheme == "gguf"  # the file says which tensors are quantized, embeddings and lm_head too
    return [(name, m) for name, m in model.named_modules()
            if (type(m) in PLAIN_LINEARS and (m is not lm_head or cfg.quantize_lm_head or from_file))
            or (m is embed and (cfg.quantize_embeddings or from_file))]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, and of fbgemm's weight copies: what the weights occupy in memory."""
    tensors = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return tensors + sum(m.fbgemm_bytes() for m in model.modules() if isinstance(m, DynamicInt8Linear))
