"""mxfp4, nvfp4: 4-bit floating-point target weights, emulated on the CPU: MXFP4 (OCP Microscaling) and NVFP4
(NVIDIA).

Both store a weight as FP4 E2M1 (a sign, 2 exponent bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6})
times a scale shared by a block of consecutive input columns:
- mxfp4: blocks of 32; the scale is a power of two (E8M0), 2^(floor(log2 amax) - 2) for the block's
  largest magnitude amax (the OCP MX rule: amax lands in [4, 8), and what exceeds 6 saturates to 6);
- nvfp4: blocks of 16; the scale is an FP8 E4M3 number times one fp32 scale per tensor:
  s_tensor = amax(W) / (6 * 448), s_block = e4m3(amax(block) / 6 / s_tensor), so amax(block) maps near 6.
Values round to the nearest E2M1 value, ties to the even mantissa. Codes are packed two to a byte beside
one byte of scale per block (the formats' memory); the matmul dequantizes and runs one dense fp32 matmul,
as nothing here multiplies FP4: these schemes answer accuracy questions (drift, acceptance), not speed.
"""

import torch
import torch.nn.functional as F

from common.config import UserError
from speculators.quant.modules import QuantizedLinear
from speculators.quant.scheme import Scheme

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; code | 8 is the negative
BLOCK = {"mxfp4": 32, "nvfp4": 16}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes (sign << 3 | magnitude index) of the E2M1 values nearest x, ties to an even index."""
    values = torch.tensor(E2M1, device=x.device)
    mag = x.abs().clamp(max=E2M1[-1])
    lo = (torch.bucketize(mag, values, right=True) - 1).clamp(0, len(E2M1) - 1)
    hi = (lo + 1).clamp(max=len(E2M1) - 1)
    down, up = mag - values[lo], values[hi] - mag
    index = torch.where((up < down) | ((up == down) & (hi % 2 == 0)), hi, lo)
    return (index | ((x < 0) & (index > 0)).to(index.dtype) << 3).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(E2M1, device=codes.device)
    magnitude = values[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def block_scales(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-block scale as stored, per-tensor scale or None) for w [N, K/B, B]."""
    amax = w.abs().amax(-1)
    if fmt == "mxfp4":
        exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2
        return torch.where(amax > 0, exponent, 0.0).to(torch.int8), None
    tensor_scale = (w.abs().max() / (E2M1[-1] * FP8_MAX)).clamp(min=1e-30)
    return (amax / E2M1[-1] / tensor_scale).to(torch.float8_e4m3fn), tensor_scale


def scales_fp32(stored: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    if tensor_scale is None:
        return torch.exp2(stored.float())
    s = stored.float() * tensor_scale
    return torch.where(s > 0, s, 1.0)  # an all-zero block: any scale


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes packed two per byte [N, K/2], block scales as stored [N, K/B], tensor scale or None)."""
    N, K = weight.shape
    w = weight.detach().float().view(N, K // BLOCK[fmt], BLOCK[fmt])
    stored, tensor_scale = block_scales(w, fmt)
    codes = round_e2m1(w / scales_fp32(stored, tensor_scale)[..., None]).view(N, K)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), stored, tensor_scale


def dequantize(packed: torch.Tensor, stored: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    N = packed.shape[0]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(N, -1)
    w = decode_e2m1(codes).view(N, -1, BLOCK[fmt]) * scales_fp32(stored, tensor_scale)[..., None]
    return w.view(N, -1)


def check_width(fmt: str, name: str, width: int) -> None:
    if width % BLOCK[fmt]:
        raise UserError(f"quant.scheme={fmt} scales blocks of {BLOCK[fmt]} input columns: the input width {width} of "
                        f"{name} is not a multiple")


class Fp4Linear(QuantizedLinear):
    """mxfp4 / nvfp4 weights, dequantized for every matmul (emulated)."""

    @property
    def precision(self) -> str:
        return self.fmt

    def __init__(self, weight, bias, fmt: str):
        super().__init__(weight, bias)
        self.fmt = fmt
        codes, block_scales, tensor_scale = quantize(weight, fmt)
        self.register_buffer("codes", codes)
        self.register_buffer("block_scales", block_scales)
        self.register_buffer("tensor_scale", tensor_scale)

    def matmul(self, x):
        return F.linear(x, self.weight.to(x.dtype))

    def rows(self, ids):
        return dequantize(self.codes[ids], self.block_scales[ids], self.tensor_scale, self.fmt)

    def cpu_op(self) -> str:
        return "dequantize + matmul (emulated)"


class MxFp4Scheme(Scheme):
    name = "mxfp4"

    def check(self, name, width):
        check_width(self.name, name, width)

    def convert(self, name, weight, bias, cpu_matmul):
        return Fp4Linear(weight, bias, self.name)


class NvFp4Scheme(MxFp4Scheme):
    name = "nvfp4"
