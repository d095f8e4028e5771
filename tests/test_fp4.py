"""speculators/quant/fp4.py: MXFP4 and NVFP4 weights as the formats define them (E2M1 values, block scales)."""

import pytest
import torch

from common.config import UserError
from speculators.quant import Fp4Linear, QuantConfig, fp4, weight_bytes

E2M1 = torch.tensor(fp4.E2M1)


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    exact = torch.cat([E2M1, -E2M1[1:]])
    assert torch.equal(fp4.decode_e2m1(fp4.round_e2m1(exact)), exact)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fp4.decode_e2m1(fp4.round_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp4.decode_e2m1(fp4.round_e2m1(torch.tensor([0.26, 2.6, 7.0, 100.0, -5.1, -0.1]))).tolist() == [
        0.5, 3.0, 6.0, 6.0, -6.0, 0.0]
    assert int(fp4.round_e2m1(torch.tensor([-0.1]))) == 0  # no negative zero code


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_blocks_dequantize_within_a_step_of_their_scale(fmt):
    torch.manual_seed(0)
    w = torch.randn(24, 128) * torch.logspace(-3, 1, 128)  # blocks of very different magnitudes
    w[3, :64] = 0  # whole zero blocks
    codes, stored, tensor_scale = fp4.quantize(w, fmt)
    B = fp4.BLOCK[fmt]
    assert codes.shape == (24, 64) and codes.dtype == torch.uint8 and stored.shape == (24, 128 // B)
    deq = fp4.dequantize(codes, stored, tensor_scale, fmt)
    scale = fp4.scales_fp32(stored, tensor_scale).repeat_interleave(B, dim=1)
    assert torch.equal(deq[3, :64], torch.zeros(64))
    # the widest step between E2M1 values is 2 (4 -> 6): no value lands farther than 1 scale away, but
    # what the block scale puts above 6 saturates: with MXFP4's power-of-two scale a block's amax lands
    # in [4, 8), with NVFP4's e4m3 scale within e4m3's rounding (1/16) of 6, so its error stays under 1 scale
    inside = w.abs() <= 6 * scale
    assert bool(((deq - w).abs() <= scale * (1 + 1e-6))[inside if fmt == "mxfp4" else slice(None)].all())
    assert torch.equal(deq[~inside], 6 * scale[~inside] * w[~inside].sign())
    assert bool((~inside).any())
    amax = w.abs().view(24, -1, B).amax(-1)
    if fmt == "mxfp4":
        assert stored.dtype == torch.int8  # E8M0: the scale is a power of two
        top = amax / scale[:, ::B]
        assert bool(((top >= 4) & (top < 8) | (amax == 0)).all())  # the block's amax lands in [4, 8)
    else:
        assert stored.dtype == torch.float8_e4m3fn and tensor_scale is not None
        assert float(stored.float().max()) <= fp4.FP8_MAX
        normal = stored.float() >= 2**-6  # e4m3's normal range: 3 mantissa bits, a relative rounding of 1/16
        assert bool(((amax / scale[:, ::B] - 6).abs() <= 6 * 2**-4 + 1e-6)[normal].all())  # amax maps to 6


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_linear_holds_half_a_byte_a_weight_and_multiplies_its_values(fmt):
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 64), torch.randn(32)
    layer = Fp4Linear(weight, bias, fmt)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + bias)
    relative = float((layer.weight - weight).norm() / weight.norm())
    assert 0.02 < relative < 0.15, relative  # 4-bit: visibly lossy, boundedly
    blocks = 64 // fp4.BLOCK[fmt]
    assert weight_bytes(layer) == 32 * 32 + 32 * blocks + 32 * 4 + (4 if fmt == "nvfp4" else 0)


def test_bad_fp4_settings_are_one_line():
    with pytest.raises(UserError, match="blocks of 16 input columns: the input width 40 of layer.q is not"):
        fp4.check_width("nvfp4", "layer.q", 40)
    with pytest.raises(UserError, match="quant.activations"):
        QuantConfig(scheme="mxfp4", activations="int8")
