"""Quantization of the frozen target, applied once at load (gpt-fast's pattern): one file per scheme beside
this one, each a handler (speculators/quant/scheme.py, the registry) with its arithmetic in its docstring:
int8.py, int4.py, gptq.py (gptq_int4), fp8.py, w8a8.py, fp4.py (mxfp4, nvfp4), gguf.py (a GGUF file's own
blocks); the shared replacement layers in modules.py, fused MoE experts in experts.py, the precision breakdown
in precision.py. A scheme of your own is one module on the Python path (docs/new_quant_scheme.md).

`quantize` swaps the target's nn.Linear modules (exactly that type: subclasses such as Llama-4's router
compute something else) and, if asked, its embeddings and lm_head, in place. int8 also stores fused MoE expert
weights as int8 (experts.py); the other schemes leave them as loaded, and a load that leaves most of the
layers' weights unquantized warns in one line with the breakdown (precision.py). int8, int4, gptq_int4, fp8,
mxfp4 and nvfp4 are weight-only: activations stay in the target's dtype; w8a8 quantizes both.
About 7 bits, not 8, for w8a8's activations: the x86 operator (fbgemm) multiplies uint8 by int8 in int16
pairs, which 8-bit activations could overflow (PyTorch's `reduce_range`).

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

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.config import UserError, one_of, require
from forge_kernels.quant_matmul import round_to_nearest_int4
from speculators.layers import DecodingLinear
from speculators.quant import fp4, gguf, gptq
from speculators.quant.experts import quantize_experts
from speculators.quant.fp4 import Fp4Linear
from speculators.quant.int4 import Int4Scheme
from speculators.quant.modules import (
    ACT_LEVELS,
    FBGEMM,
    INT4_OP,
    INT4_OP_GROUPS,
    INT4_PACK_OP,
    INT8_OP,
    DynamicInt8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    WeightOnlyFp8Linear,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    round_activations,
    stack_linears,
)
from speculators.quant.precision import describe, precision_breakdown, warn_if_mostly_unquantized
from speculators.quant.scheme import SCHEMES, Scheme, scheme

__all__ = [  # the layers (speculators/quant/modules.py) and the precision breakdown, importable from here
    "ACT_LEVELS", "ACTIVATIONS", "CPU_MATMULS", "FBGEMM", "INT4_OP", "INT4_OP_GROUPS", "INT4_PACK_OP", "INT8_OP",
    "QUANT_SCHEMES", "SCHEMES", "DynamicInt8Linear", "Fp4Linear", "Int4Scheme", "QuantConfig", "Scheme", "QuantizedEmbedding", "QuantizedLinear",
    "WeightOnlyFp8Linear", "WeightOnlyInt4Linear", "WeightOnlyInt8Linear", "check_gguf_source", "describe", "fp4",
    "gguf", "gptq", "layers_to_quantize", "precision_breakdown", "quantize", "round_activations",
    "linear_precision", "quantized_linears", "round_to_nearest_int4", "serving_quant", "scheme", "stack_linears", "weight_bytes",
]

QUANT_SCHEMES = ("none", *SCHEMES)  # the built-in schemes; a scheme of your own is found by name
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
        served = scheme(self.scheme).activations if self.scheme != "none" else ACTIVATIONS
        one_of("quant.cpu_matmul", self.cpu_matmul, CPU_MATMULS)
        one_of("quant.activations", self.activations, ACTIVATIONS)
        require(self.activations in served, "quant.activations", self.activations,
                f"{' or '.join(served)} with quant.scheme={self.scheme}")
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


def check_gguf_source(cfg: QuantConfig, gguf_file: Path | None) -> None:
    """quant=gguf serves the blocks of the GGUF file the target was converted from: it needs that file."""
    if cfg.scheme != "none" and scheme(cfg.scheme).from_file and gguf_file is None:
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
    handler = scheme(cfg.scheme)(cfg, gguf_file)
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
    if handler.quantizes_experts:
        quantize_experts(model)
    warn_if_mostly_unquantized(model, cfg.scheme)
    return model


# Exact types: subclasses of nn.Linear compute something else with their weight (Llama-4's router returns top-k scores).
PLAIN_LINEARS = (nn.Linear, DecodingLinear)


def layers_to_quantize(model: nn.Module, cfg: QuantConfig) -> list[tuple[str, nn.Module]]:
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    from_file = scheme(cfg.scheme).from_file  # the file says which tensors are quantized, embeddings and lm_head too
    return [(name, m) for name, m in model.named_modules()
            if (type(m) in PLAIN_LINEARS and (m is not lm_head or cfg.quantize_lm_head or from_file))
            or (m is embed and (cfg.quantize_embeddings or from_file))]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, and of fbgemm's weight copies: what the weights occupy in memory."""
    tensors = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return tensors + sum(m.fbgemm_bytes() for m in model.modules() if isinstance(m, DynamicInt8Linear))


def quantized_linears(module: nn.Module, name: str) -> nn.Module:
    """A copy of `module` (a drafter, for serving) whose plain linear layers are quantized with scheme `name`;
    everything else, parameters included, is shared with `module`, which stays as it is. "none": `module`."""
    if name == "none":
        return module
    handler = scheme(name, "drafter_quant")
    if handler.from_file or handler.prepare is not Scheme.prepare:
        raise UserError(f"drafter_quant={name}: a drafter is quantized from its own weights alone, which "
                        f"{name} does not do (it reads a file or calibrates on text); use int8, int4 or fp8")
    return _with_quantized_linears(module, handler(QuantConfig(name)), "")


def _with_quantized_linears(module: nn.Module, handler: Scheme, prefix: str) -> nn.Module:
    twin = copy.copy(module)  # its own containers below, the same tensors
    twin._parameters, twin._buffers, twin._modules = dict(module._parameters), dict(module._buffers), {}
    for child_name, child in module._modules.items():
        name = prefix + child_name
        if type(child) in PLAIN_LINEARS:
            handler.check(name, child.weight.shape[1])
            child = handler.convert(name, child.weight, child.bias, "kernel") or child
        elif child is not None:
            child = _with_quantized_linears(child, handler, name + ".")
        twin._modules[child_name] = child
    return twin


def serving_quant(device) -> str:
    """The scheme a drafter's linear layers are served with when none is chosen: int8 on a CPU, where a drafter
    step reads its weights from memory at one or two rows (its time -26% on SmolLM2's EAGLE-3 at the same tau:
    docs/results.md), none on a GPU."""
    return "int8" if torch.device(device).type == "cpu" else "none"


def linear_precision(module: nn.Module) -> str:
    """The precisions of `module`'s linear layers, e.g. "int8" or "float32"."""
    kinds = {getattr(m, "precision", None) or str(m.weight.dtype).removeprefix("torch.") for m in module.modules()
             if isinstance(m, (nn.Linear, QuantizedLinear))}
    return ", ".join(sorted(kinds)) or "none"
