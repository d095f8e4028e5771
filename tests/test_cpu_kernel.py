"""The CPU kernel (kernels/quant_matmul_cpu.cpp, kernels/dequantize_cpu.cpp).

1. The matmul against the reference for every row count it serves (1..32: each row-tile remainder), int8 and
   int4 with group sizes 16..128; a row's result does not depend on the other rows nor on the thread count,
   bit for bit; the AVX-512 loops give the AVX2 loops' bits; fp32 weights run it for few rows.
2. The reference path's weights (many rows of x: a prefill, a training batch) come from one pass of
   dequantize_cpu.cpp: bit for bit PyTorch's expression (dequantize_torch), for packed int4, int8 with a scale
   per group of columns and int8 with one per row, on one thread or two; other stored types (fp8) keep
   PyTorch's; inconsistent operands are refused.
3. It builds at load, and where it cannot build the reference serves, with one warning.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import require_cpu_kernel
from test_quant import TOL, linear

from forge_kernels import quant_matmul_reference
from forge_kernels.quant_matmul import (
    cpu_ops,
    dense_kernel_max_rows,
    dense_matmul,
    dequantize,
    dequantize_torch,
    pack_int4,
    quant_matmul_cpu,
)
from speculators.layers import DecodingLinear, decoding_linears
from speculators.quant import round_to_nearest_int4

needs_cpu_kernel = pytest.mark.usefixtures("cpu_kernel")  # skips without a compiler; a failed build fails


def test_cpu_kernel_builds_wherever_a_compiler_is(cpu_kernel):
    """Code paths that fall back to the reference when cpu_ops() is None pass either way; this one does not:
    with a C++ compiler and AVX2 here, a kernel that fails to build is a failure (conftest.require_cpu_kernel)."""
    assert cpu_kernel.fp32_x_isa("") in ("avx2", "avx512")


def int4_weights(N: int, K: int, group: int):
    q, scales, zeros = round_to_nearest_int4(torch.randn(N, K, generator=torch.Generator().manual_seed(2)), group)
    return pack_int4(q), scales, zeros, group


def int8_weights(N: int, K: int):
    g = torch.Generator().manual_seed(3)
    return torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g), torch.rand(N, generator=g) / 64, None, None


@needs_cpu_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 32])
@pytest.mark.parametrize("weights", ["int8", "int4/16", "int4/32", "int4/128"])
def test_cpu_kernel_matches_reference(weights, rows):
    N, K = 40, 256
    stored_w = int8_weights(N, K) if weights == "int8" else int4_weights(N, K, int(weights.split("/")[1]))
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(quant_matmul_cpu(x, *stored_w), quant_matmul_reference(x, *stored_w), **TOL)


@needs_cpu_kernel
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_cpu_kernel_rows_are_independent_of_batch_and_threads(weights):
    stored_w = int8_weights(64, 512) if weights == "int8" else int4_weights(64, 512, 32)
    x = torch.randn(11, 512)
    batch = quant_matmul_cpu(x, *stored_w)
    for i in range(len(x)):
        assert torch.equal(quant_matmul_cpu(x[i:i + 1], *stored_w), batch[i:i + 1]), i
        assert torch.equal(quant_matmul_cpu(x[i:i + 5], *stored_w), batch[i:i + 5]), i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_matmul_cpu(x, *stored_w), batch)
    finally:
        torch.set_num_threads(threads)


def test_kernel_bench_against_an_unknown_revision_is_one_line():
    from common.config import UserError
    from forge_kernels.bench_quant_matmul import revision_ops

    with pytest.raises(UserError, match="against=no-such-revision: no kernels/quant_matmul_cpu.cpp at that revision"):
        revision_ops("no-such-revision")


@needs_cpu_kernel
def test_fp32_weights_run_the_kernel_for_few_rows_one_row_at_a_time():
    """forge_kernels.dense_matmul: F.linear's values; up to dense_kernel_max_rows() rows each row alone (a
    verification pass gives one-token decoding's bits); more rows, or autograd, are F.linear itself."""
    layer = linear(48, 96)
    x = torch.randn(dense_kernel_max_rows() + 1, 96)
    with torch.no_grad():
        few = dense_matmul(x[:6], layer.weight, layer.bias)
        torch.testing.assert_close(few, F.linear(x[:6], layer.weight, layer.bias), **TOL)
        for i in range(6):
            assert torch.equal(dense_matmul(x[i:i + 1], layer.weight, layer.bias), few[i:i + 1]), i
        assert torch.equal(dense_matmul(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias))
    assert dense_matmul(x[:1], layer.weight.detach().requires_grad_()).requires_grad  # wants a gradient: F.linear


@needs_cpu_kernel
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32])
@pytest.mark.parametrize("weights", ["fp32", "int4/32", "int4/128", "int8/32", "int8/64"])
def test_fp32_x_kernels_give_the_same_bits_in_either_instruction_set(weights, rows):
    """The AVX-512 loops (tiles of rows x channels) sum each (row, channel) as the AVX2 loops do: the same
    bits, whatever the tile, including the channels left after the last whole tile (N = 47)."""
    if cpu_ops().fp32_x_isa("") != "avx512":
        pytest.skip("this CPU has no AVX-512: only the AVX2 loops run here")
    N, K = 47, 256
    if weights == "fp32":
        weight = torch.randn(N, K)
        matmul, reference = (lambda x: cpu_ops().fp32_matmul(x, weight)), (lambda x: F.linear(x, weight))
    else:
        kind, group = weights.split("/")
        q, scales, zeros, _ = int8_weights(N, K) if kind == "int8" else int4_weights(N, K, int(group))
        stored_w = (q, torch.rand(N, K // int(group)) / 64, None, int(group)) if kind == "int8" else (q, scales, zeros, int(group))
        matmul, reference = (lambda x: quant_matmul_cpu(x, *stored_w)), (lambda x: quant_matmul_reference(x, *stored_w))
    x = torch.randn(rows, K)
    wide = matmul(x)
    try:
        assert cpu_ops().fp32_x_isa("avx2") == "avx2"
        assert torch.equal(matmul(x), wide)
    finally:
        cpu_ops().fp32_x_isa("best")
    assert torch.equal(matmul(x[-1:]), wide[-1:])
    torch.testing.assert_close(wide, reference(x), **TOL)


def test_decoding_linears_keep_parameters_and_ties(llama_target):
    model = copy.deepcopy(llama_target.model)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    before = model.state_dict()
    decoding_linears(model)
    assert type(model.lm_head) is DecodingLinear and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_decoding_linears_build_the_cpu_kernel_at_load_not_in_the_first_decode():
    """A fresh machine compiles the kernel (tens of seconds): inside a report's first baseline decode
    it made that baseline look 2x slower."""
    cpu_ops.cache_clear()
    decoding_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert cpu_ops.cache_info().currsize == 1


def test_cpu_kernel_that_cannot_build_warns_and_leaves_the_reference(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'speculators_forge_cpu'\nc++: not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.warns(UserWarning, match=r"did not build \(Error building extension 'speculators_forge_cpu'\); "
                                         r"using dequantize \+ matmul"):
        assert cpu_ops.__wrapped__() is None


# --- one-pass dequantization ------------------------------------------------------------------

DEQUANTIZED_SHAPES = [(64, 64, 16), (192, 576, 32), (37, 96, 32)]  # (N, K, group_size); 37 rows: no even split between threads


def stored_forms(N: int, K: int, group: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.randn(N, K // group, generator=generator)
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    return {"int4": (pack_int4(torch.randint(0, 16, (N, K), generator=generator)), scales,
                     torch.randn(N, K // group, generator=generator), group),
            "int8/group": (q8, scales, None, group),
            "int8/row": (q8, torch.randn(N, generator=generator), None, None)}


@pytest.mark.parametrize("N, K, group", DEQUANTIZED_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_pass_dequantization_is_pytorchs_bit_for_bit(N, K, group, threads):
    require_cpu_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind, operands in stored_forms(N, K, group).items():
            assert torch.equal(dequantize(*operands), dequantize_torch(*operands)), kind
    finally:
        torch.set_num_threads(before)


def test_other_stored_types_keep_pytorchs_expression():
    qweight = torch.randn(8, 32).to(torch.float8_e4m3fn)
    scales = torch.rand(8)
    assert torch.equal(dequantize(qweight, scales), qweight.float() * scales[:, None])
    q, scales, zeros, group = stored_forms(64, 64, 16)["int4"]
    assert torch.equal(dequantize(q, scales.double(), zeros, group), dequantize_torch(q, scales.double(), zeros, group))


@pytest.mark.parametrize("change, message", [
    (lambda q, s, z, g: (q[:, :-1], s, z, g), "group_size"),  # K no longer a multiple of the group
    (lambda q, s, z, g: (q, s[:, :-1], z, g), "scales and zeros"),
])
def test_inconsistent_int4_operands_are_refused(change, message):
    require_cpu_kernel()
    with pytest.raises(RuntimeError, match=message):
        dequantize(*change(*stored_forms(64, 64, 16)["int4"]))
