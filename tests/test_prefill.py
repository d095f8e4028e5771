"""A prompt's prefill on the CPU: what it computes is unchanged, it just does less.

1. The reference path's weights (many rows of x: a prefill, a training batch) come from one pass of
   kernels/dequantize_cpu.cpp: bit for bit PyTorch's expression (dequantize_torch), for packed int4, int8 with a
   scale per group of columns and int8 with one per row, on one thread or two; other stored types (fp8) keep
   PyTorch's; inconsistent operands are refused.
2. Prefill computes the logits of the last prompt position only (logits="last"), in the static session, the
   HF session and FrozenTarget: the same next token, and the same features.
"""

import pytest
import torch
from conftest import require_cpu_kernel

from forge_kernels.quant_matmul import dequantize, dequantize_torch, pack_int4
from inference.sessions import HFSession, StaticSession

SHAPES = [(64, 64, 16), (192, 576, 32), (37, 96, 32)]  # (N, K, group_size); 37 rows: no even split between threads


def stored(N: int, K: int, group: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.randn(N, K // group, generator=generator)
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    return {"int4": (pack_int4(torch.randint(0, 16, (N, K), generator=generator)), scales,
                     torch.randn(N, K // group, generator=generator), group),
            "int8/group": (q8, scales, None, group),
            "int8/row": (q8, torch.randn(N, generator=generator), None, None)}


@pytest.mark.parametrize("N, K, group", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_pass_dequantization_is_pytorchs_bit_for_bit(N, K, group, threads):
    require_cpu_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind, operands in stored(N, K, group).items():
            assert torch.equal(dequantize(*operands), dequantize_torch(*operands)), kind
    finally:
        torch.set_num_threads(before)


def test_other_stored_types_keep_pytorchs_expression():
    qweight = torch.randn(8, 32).to(torch.float8_e4m3fn)
    scales = torch.rand(8)
    assert torch.equal(dequantize(qweight, scales), qweight.float() * scales[:, None])
    q, scales, zeros, group = stored(64, 64, 16)["int4"]
    assert torch.equal(dequantize(q, scales.double(), zeros, group), dequantize_torch(q, scales.double(), zeros, group))


@pytest.mark.parametrize("change, message", [
    (lambda q, s, z, g: (q[:, :-1], s, z, g), "group_size"),  # K no longer a multiple of the group
    (lambda q, s, z, g: (q, s[:, :-1], z, g), "scales and zeros"),
])
def test_inconsistent_int4_operands_are_refused(change, message):
    require_cpu_kernel()
    with pytest.raises(RuntimeError, match=message):
        dequantize(*change(*stored(64, 64, 16)["int4"]))


@pytest.mark.parametrize("session_class", [StaticSession, HFSession])
def test_prefill_computes_the_last_positions_logits_alone(session_class, llama_target, text_batch):
    prompt = text_batch[:1, :40]
    opened = (lambda: session_class(llama_target, 64)) if session_class is StaticSession else (
        lambda: session_class(llama_target))
    everything, last = opened()(prompt), opened()(prompt, logits="last")
    assert last.logits.shape == (1, 1, llama_target.vocab_size)
    torch.testing.assert_close(last.logits, everything.logits[:, -1:], rtol=1e-5, atol=1e-5)
    assert last.logits.argmax() == everything.logits[0, -1].argmax()
    for whole, alone in zip([*everything.aux_hidden, everything.last_hidden], [*last.aux_hidden, last.last_hidden]):
        assert torch.equal(whole, alone)


def test_frozen_target_names_the_logits_it_returns(llama_target, text_batch):
    ids = text_batch[:, :16]
    assert llama_target(ids, logits="last").logits.shape == (2, 1, llama_target.vocab_size)
    assert llama_target(ids, logits="none").logits is None
    with pytest.raises(ValueError, match="logits='first'"):
        llama_target(ids, logits="first")
