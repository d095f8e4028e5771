"""Quantization of the frozen target, applied once at load (gpt-fast's pattern); its formats' arithmetic in
gptq.py (GPTQ levels), fp4.py (MXFP4/NVFP4) and gguf.py (a GGUF file's own blocks) beside this file.

Each scheme is a handler that checks a layer and builds its replacement module; `quantize`
swaps the target's nn.Linear modules (and, if asked, its embeddings and lm_head) in place.
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

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import kernels
from common.config import UserError, one_of, require
from kernels.quant_matmul import ACT_BLOCK, dequantize, pack_int4, round_activation_blocks, round_to_nearest_int4
from speculators.layers import DecodingLinear
from speculators.quant import fp4, gguf, gptq
from speculators.quant.experts import EXPERT_SCHEMES, quantize_experts
from speculators.quant.precision import describe as describe  # re-exported: what reports print
from speculators.quant.precision import precision_breakdown as precision_breakdown
from speculators.quant.precision import warn_if_mostly_unquantized

QUANT_SCHEMES = ("none", "int8", "int4", "gptq_int4", "fp8", "w8a8", "gguf", "mxfp4", "nvfp4")
CPU_MATMULS = ("kernel", "dequantize", "packed")
ACTIVATIONS = ("exact", "int8")
INT8_OP = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
INT4_PACK_OP = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
INT4_OP = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
INT4_OP_GROUPS = (32, 64, 128, 256)  # group sizes the int4 CPU operator takes; it also needs N % 16 == 0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FBGEMM = hasattr(torch.ops.quantized, "linear_dynamic") and torch.backends.quantized.engine in ("x86", "fbgemm")
ACT_LEVELS = 127  # w8a8 activations: a step of 2/127 of the row's max |x|, levels -64..64


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


# --- quantized modules -------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored quantized; subclasses define `matmul` and `rows`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features, device=next(self.buffers()).device))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class WeightOnlyInt8Linear(QuantizedLinear):
    precision = "int8"

    def __init__(self, weight, bias, cpu_matmul: str = "kernel", levels=None, int8_activations: bool = False):
        """levels: (q int8 [N, K], scales [N, K/g]) read elsewhere (a GGUF file's Q8_0 blocks); None: one
        scale per row, round to nearest. int8_activations: x rounded per block (module doc)."""
        super().__init__(weight, bias)
        if levels is None:
            w = weight.detach().float()
            scales = w.abs().amax(1).clamp(min=1e-12) / 127
            q, self.group_size = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), None
        else:
            q, scales = levels
            self.group_size = self.in_features // scales.shape[1]
        # PyTorch's int8 operator takes one scale per row; the same int8 layout serves every other path
        self.cpu_packed = cpu_matmul == "packed" and INT8_OP is not None and self.group_size is None
        self.cpu_kernel = cpu_matmul == "kernel"
        self.int8_activations = int8_activations
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)

    def matmul(self, x):
        if self.cpu_packed and not kernels.use_triton(x):
            return INT8_OP(rounded(x, self.int8_activations), self.qweight, self.scales.to(x.dtype))
        return kernels.quant_matmul(x, self.qweight, self.scales, None, self.group_size, self.cpu_kernel,
                                    self.int8_activations)

    def rows(self, ids):
        return dequantize(self.qweight[ids], self.scales[ids], None, self.group_size)

    def cpu_op(self) -> str:
        return "aten._weight_int8pack_mm" if self.cpu_packed else cpu_path(self.cpu_kernel, self.int8_activations)


class WeightOnlyInt4Linear(QuantizedLinear):
    precision = "int4"

    def __init__(self, weight, bias, group_size: int, cpu_matmul: str = "kernel", levels=None,
                 int8_activations: bool = False):
        """levels: (q, scales, zeros) chosen elsewhere (GPTQ); None: round to nearest. int8_activations: x
        rounded per block (module doc)."""
        super().__init__(weight, bias)
        N, K = weight.shape
        q, scales, zeros = levels if levels is not None else round_to_nearest_int4(weight, group_size)
        self.group_size = group_size
        self.cpu_kernel = cpu_matmul == "kernel"
        self.int8_activations = int8_activations
        self.cpu_packed = (cpu_matmul == "packed" and INT4_OP is not None and INT4_PACK_OP is not None and not kernels.INTERPRET
                           and weight.device.type == "cpu" and group_size in INT4_OP_GROUPS and N % 16 == 0)
        if self.cpu_packed:  # PyTorch's CPU operator: its own packing of q, and (s, z) as one [K/g, N, 2] tensor
            self.register_buffer("qweight", INT4_PACK_OP(q.to(torch.int32), 1))
            self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], -1).transpose(0, 1).contiguous())
        else:  # kernels.quant_matmul's format
            self.register_buffer("qweight", pack_int4(q))
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)

    def matmul(self, x):
        if self.cpu_packed:
            return INT4_OP(rounded(x, self.int8_activations), self.qweight, self.group_size, self.scales_and_zeros.to(x.dtype))
        return kernels.quant_matmul(x, self.qweight, self.scales, self.zeros, self.group_size, self.cpu_kernel,
                                    self.int8_activations)

    def unpack(self) -> None:
        """Back to kernels.quant_matmul's format, exactly: q = (W - z) / s + 8 with W read through the operator."""
        scales, zeros = self.scales_and_zeros.transpose(0, 1).unbind(-1)
        N, K = self.out_features, self.in_features
        w = self.weight.view(N, K // self.group_size, self.group_size)
        q = torch.round((w - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15).view(N, K)
        del self.scales_and_zeros
        self.cpu_packed = False
        self.qweight = pack_int4(q)
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())

    def _apply(self, fn, recurse=True):
        # The CPU operator's layout is CPU-only: leaving the CPU (model.to("cuda")), unpack first.
        if self.cpu_packed and fn(torch.zeros(0)).device.type != "cpu":
            self.unpack()
        return super()._apply(fn, recurse)

    def rows(self, ids):
        if self.cpu_packed:  # the operator's layout is opaque: W^T = I_K W^T, through the operator
            eye = torch.eye(self.in_features, device=ids.device)
            return INT4_OP(eye, self.qweight, self.group_size, self.scales_and_zeros).T[ids]
        return dequantize(self.qweight[ids], self.scales[ids], self.zeros[ids], self.group_size)

    def cpu_op(self) -> str:
        return "aten._weight_int4pack_mm_for_cpu" if self.cpu_packed else cpu_path(self.cpu_kernel, self.int8_activations)


class WeightOnlyFp8Linear(QuantizedLinear):
    precision = "fp8"

    def __init__(self, weight, bias):
        super().__init__(weight, bias)
        w = weight.detach().float()
        scales = w.abs().amax(1).clamp(min=1e-12) / FP8_MAX
        self.register_buffer("qweight", (w / scales[:, None]).to(torch.float8_e4m3fn))
        self.register_buffer("scales", scales)

    def matmul(self, x):
        # x (q s)^T = (x q^T) s: scale the N outputs, not the N x K weight
        return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)

    def rows(self, ids):
        return dequantize(self.qweight[ids], self.scales[ids])

    def cpu_op(self) -> str:
        return "dequantize + matmul"


class Fp4Linear(QuantizedLinear):
    """mxfp4 / nvfp4 weights (speculators/quant/fp4.py), dequantized for every matmul (emulated)."""

    @property
    def precision(self) -> str:
        return self.fmt

    def __init__(self, weight, bias, fmt: str):
        super().__init__(weight, bias)
        self.fmt = fmt
        codes, block_scales, tensor_scale = fp4.quantize(weight, fmt)
        self.register_buffer("codes", codes)
        self.register_buffer("block_scales", block_scales)
        self.register_buffer("tensor_scale", tensor_scale)

    def matmul(self, x):
        return F.linear(x, self.weight.to(x.dtype))

    def rows(self, ids):
        return fp4.dequantize(self.codes[ids], self.block_scales[ids], self.tensor_scale, self.fmt)

    def cpu_op(self) -> str:
        return "dequantize + matmul (emulated)"


class DynamicInt8Linear(WeightOnlyInt8Linear):
    """w8a8: WeightOnlyInt8Linear's weights times each row of x rounded to 129 levels (module doc).
    On a CPU with fbgemm its packed copy is the only int8 matrix kept (qweight None until it leaves the CPU)."""

    precision = "w8a8"

    def __init__(self, weight, bias):
        super().__init__(weight, bias)
        self.fbgemm = None
        if FBGEMM and weight.device.type == "cpu":
            self.fbgemm = prepack_fbgemm(self.qweight, self.scales)
            self.qweight = None

    def matmul(self, x):
        if self.fbgemm is not None and not kernels.use_triton(x) and x.dtype == torch.float32:
            rows = row_max(x)
            pin = x.new_zeros(1, self.in_features)
            pin[0, 0], pin[0, 1] = 1.0, -1.0
            return torch.ops.quantized.linear_dynamic(torch.cat([x / rows, pin]), self.fbgemm, True)[:-1] * rows
        return kernels.quant_matmul(round_activations(x), self.int8_weight(), self.scales)

    def int8_weight(self) -> torch.Tensor:
        if self.fbgemm is None:
            return self.qweight
        with warnings.catch_warnings():  # PyTorch marks quantized tensors as deprecated; torch is pinned in pyproject
            warnings.simplefilter("ignore", UserWarning)
            return torch.ops.quantized.linear_unpack(self.fbgemm)[0].int_repr()

    def rows(self, ids):
        return dequantize(self.int8_weight()[ids], self.scales[ids])

    def fbgemm_bytes(self) -> int:
        """fbgemm's int8 matrix and its int32 offset per channel (buffers do not hold them)."""
        return 0 if self.fbgemm is None else self.out_features * (self.in_features + 4)

    def _apply(self, fn, recurse=True):
        if self.fbgemm is not None and fn(torch.zeros(0)).device.type != "cpu":
            self.qweight = self.int8_weight()  # fbgemm's packed weights are CPU-only: the int8 matrix comes back
            self.fbgemm = None
        return super()._apply(fn, recurse)

    def cpu_op(self) -> str:
        return "quantized.linear_dynamic (fbgemm)" if self.fbgemm is not None else "rounded activations + dequantize + matmul"


# Layers whose every stored tensor holds one row per output channel (nn.Linear; our int8 and int4 formats).
STACKABLE = (nn.Linear, DecodingLinear, WeightOnlyInt8Linear, WeightOnlyInt4Linear)


def stack_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One layer computing torch.cat([linear(x) for linear in linears], -1) in one matmul (Q, K and V;
    gate and up): decoding calls it once instead of each. Its rows are theirs, so each output channel is
    computed from the same weights (to the last bit in the CPU kernels, which compute every channel alone).
    The linears' tensors become views of the stacked ones: no memory is added and their parameters stay
    the same objects. None where the layers differ in kind or settings, or a layout mixes rows (PyTorch's
    packed operators, fbgemm)."""
    first = linears[0]
    settings = [{k: v for k, v in vars(linear).items() if not k.startswith("_") and k != "out_features"}
                for linear in linears]
    names = [*first._parameters, *first._buffers]
    if (type(first) not in STACKABLE or getattr(first, "cpu_packed", False) or first._modules
            or any(type(linear) is not type(first) or s != settings[0] for linear, s in zip(linears, settings))
            or any({_kind(getattr(linear, name), linear) for linear in linears} not in ({"rows"}, {"absent"})
                   for name in names)):
        return None
    stacked = type(first).__new__(type(first))
    nn.Module.__init__(stacked)
    stacked.__dict__.update(settings[0], out_features=sum(linear.out_features for linear in linears))
    for name in names:
        parts = [getattr(linear, name) for linear in linears]
        whole = None if parts[0] is None else torch.cat([part.detach() for part in parts])
        if name in first._parameters:
            stacked.register_parameter(name, None if whole is None else nn.Parameter(whole, requires_grad=False))
        else:
            stacked.register_buffer(name, whole)
        if whole is None:
            continue
        start = 0
        for linear, part in zip(linears, parts):
            view = whole[start : start + len(part)]
            if name in linear._parameters:
                linear._parameters[name].data = view
            else:
                linear._buffers[name] = view
            start += len(part)
    return stacked


def _kind(tensor: torch.Tensor | None, linear: nn.Module) -> str:
    """rows: one row per output channel; absent (a bias may be None); other: not stackable."""
    if tensor is None:
        return "absent"
    return "rows" if tensor.dim() >= 1 and len(tensor) == linear.out_features else "other"


def cpu_path(kernel: bool, int8_activations: bool = False) -> str:
    """What a weight-only layer runs on the CPU without PyTorch's packed operators."""
    if int8_activations:
        return "int8-activation kernel (few rows) or int8 x + dequantize + matmul" if kernel else "int8 x + dequantize + matmul"
    return "int8/int4 kernel (few rows) or dequantize + matmul" if kernel else "dequantize + matmul"


def rounded(x: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    """x for PyTorch's packed operators: rounded per block if the layer rounds its activations."""
    return round_activation_blocks(x) if int8_activations else x


def prepack_fbgemm(qweight: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed form of int8 weights with per-channel scales (no bias: added after the rescale)."""
    zeros = torch.zeros(len(scales), dtype=torch.long)
    with warnings.catch_warnings():  # PyTorch marks quantized tensors as deprecated; torch is pinned in pyproject
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """max_k |x[m, k]| per row [..., 1], kept off zero (an all-zero row divides by it)."""
    return x.abs().amax(-1, keepdim=True).clamp(min=1e-12)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to w8a8's grid (module doc): the torch reference of the fbgemm path."""
    rows = row_max(x)
    step = 2 / ACT_LEVELS
    return torch.round(x / rows / step) * step * rows


class QuantizedEmbedding(nn.Module):
    """An embedding table stored like a quantized Linear's weight; looked-up rows are dequantized."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight


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
