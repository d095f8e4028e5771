"""The quantized layers that replace a target's nn.Linear and embedding modules, and the helpers their forwards
share; each scheme's arithmetic and dispatch rule are in speculators/quant/__init__.py's doc."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import forge_kernels as kernels
from forge_kernels.quant_matmul import dequantize, pack_int4, round_activation_blocks, round_to_nearest_int4
from speculators.layers import DecodingLinear

INT8_OP = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
INT4_PACK_OP = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
INT4_OP = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
INT4_OP_GROUPS = (32, 64, 128, 256)  # group sizes the int4 CPU operator takes; it also needs N % 16 == 0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FBGEMM = hasattr(torch.ops.quantized, "linear_dynamic") and torch.backends.quantized.engine in ("x86", "fbgemm")
ACT_LEVELS = 127  # w8a8 activations: a step of 2/127 of the row's max |x|, levels -64..64

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
