"""Quantization of the target (speculators/quant/__init__.py, kernels/quant_matmul.py).

1. Each scheme's Linear replacement computes x W_q^T + b for its quantized W_q: PyTorch's packed
   CPU operators and the dequantize-matmul path against kernels.quant_matmul_reference, on
   ragged shapes (widths that are not multiples of 16: the int4 operator is then skipped).
2. Quantize-dequantize error ||W - W_q||_F / ||W||_F of N(0, 1) weights [256, 512], per scheme,
   printed and under a bound (int8 per channel ~0.007, int4 per 32 columns ~0.08, fp8 ~0.026).
3. A tiny random Llama quantized with each scheme decodes greedily through inference.engine,
   and greedy speculation reproduces that same quantized target's greedy output token for token
   (weight-only schemes: w8a8 rounds activations, which can amplify the last-bit differences
   between a 1-token and a (k+1)-token forward; speculation over it is lossless in distribution).
4. Bad input: unknown scheme, bad group sizes, a model quantized by another library.
5. The Triton kernel against the reference, in Triton's interpreter (a child process started
   with TRITON_INTERPRET=1, as tests/test_kernels.py does).
7. gptq_int4: with uncorrelated inputs (H = I) GPTQ is round-to-nearest exactly; with correlated
   ones its layer outputs on the calibration inputs are closer to full precision than round-to-
   nearest's, in the same int4 format.
6. w8a8: fbgemm's operator against the torch reference (activations rounded per row, then
   kernels.quant_matmul_reference), within a relative error of 1e-5 per row (summation order
   only); a row's result does not depend on the other rows of its batch, bit for bit.
8. The CPU kernel: tests/test_cpu_kernel.py.

Tolerances (fp32 everywhere; the implementations differ only in summation order and in where the
scale is applied): atol 1e-4, rtol 1e-4 on outputs of magnitude ~10 (K <= 256, N(0, 1) inputs).
"""

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS, require_cpu_kernel, run_interpreted_tests
from torch import nn

import forge_kernels as kernels
from common.config import UserError
from forge_kernels import quant_matmul, quant_matmul_reference, quant_matmul_triton
from forge_kernels.quant_matmul import (
    CPU_KERNEL_MAX_ROWS,
    cpu_kernel_applies,
    cpu_ops,
    dense_kernel_max_rows,
    dequantize,
    quant_matmul_cpu,
    unpack_int4,
)
from inference.engine import generate
from speculators.layers import decoding_linears
from speculators.quant import (
    ACT_LEVELS,
    CPU_MATMULS,
    FBGEMM,
    DynamicInt8Linear,
    QuantConfig,
    QuantizedEmbedding,
    QuantizedLinear,
    WeightOnlyFp8Linear,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    quantize,
    round_activations,
    round_to_nearest_int4,
    stack_linears,
    weight_bytes,
)
from speculators.quant.gptq import gptq_int4
from speculators.target import FrozenTarget, TargetConfig

TOL = dict(atol=1e-4, rtol=1e-4)
SCHEMES = ("int8", "int4", "fp8", "w8a8")
WEIGHT_ONLY = SCHEMES[:3]
ERROR_BOUND = {"int8": 0.01, "int4": 0.1, "fp8": 0.035, "w8a8": 0.01}
SHAPES = [(48, 64, 32), (32, 256, 64), (20, 96, 32), (33, 128, 16), (16, 32, 32)]  # (N, K, int4 group size)

interpreted = pytest.mark.skipif(not kernels.INTERPRET, reason="needs TRITON_INTERPRET=1 at start-up; "
                                 "test_triton_kernel_in_the_interpreter runs it in a child process")


def linear(N: int, K: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(K, N, bias=bias)
    nn.init.normal_(layer.weight)
    return layer.requires_grad_(False)


def stored(module: QuantizedLinear):
    """(qweight, scales, zeros, group_size) in kernels.quant_matmul's format; fp8 as its dequantized fp32."""
    if isinstance(module, DynamicInt8Linear):
        return module.int8_weight(), module.scales, None, None
    if isinstance(module, WeightOnlyInt8Linear):
        return module.qweight, module.scales, None, None
    if isinstance(module, WeightOnlyFp8Linear):
        return module.qweight.float(), module.scales, None, None
    return module.qweight, module.scales, module.zeros, module.group_size


def reference(module: QuantizedLinear, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x W_q^T + b through kernels.quant_matmul_reference, from the generic (unpacked) format."""
    if isinstance(module, WeightOnlyInt4Linear):
        module = WeightOnlyInt4Linear(layer.weight, layer.bias, module.group_size, cpu_matmul="dequantize")
    qweight, scales, zeros, group = stored(module)
    if isinstance(module, WeightOnlyFp8Linear):
        return x @ (qweight * scales[:, None]).T + layer.bias
    return quant_matmul_reference(x, qweight, scales, zeros, group) + layer.bias


def make(scheme: str, layer: nn.Linear, group: int, cpu_matmul: str = "kernel") -> QuantizedLinear:
    if scheme == "int8":
        return WeightOnlyInt8Linear(layer.weight, layer.bias, cpu_matmul)
    if scheme == "int4":
        return WeightOnlyInt4Linear(layer.weight, layer.bias, group, cpu_matmul)
    if scheme == "w8a8":
        return DynamicInt8Linear(layer.weight, layer.bias)
    return WeightOnlyFp8Linear(layer.weight, layer.bias)


# --- 1. the Linear replacements ----------------------------------------------------------------


@pytest.mark.parametrize("cpu_matmul", CPU_MATMULS)
@pytest.mark.parametrize("N, K, group", SHAPES)
@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_quantized_linear_matches_reference(scheme, N, K, group, cpu_matmul):
    layer = linear(N, K)
    module = make(scheme, layer, group, cpu_matmul)
    x = torch.randn(2, 5, K, generator=torch.Generator().manual_seed(1))
    y = module(x)
    assert y.shape == (2, 5, N)
    torch.testing.assert_close(y, reference(module, x, layer), **TOL)
    torch.testing.assert_close(module(x[:1, :1]), y[:1, :1], **TOL)  # one decode row, as in generation
    packed = cpu_matmul == "packed"
    if scheme == "int4":
        assert module.cpu_packed == (packed and not kernels.INTERPRET and N % 16 == 0 and group in (32, 64, 128, 256))
    if scheme == "int8":
        assert module.cpu_packed == packed


def test_int4_leaves_the_cpu_operators_layout_exactly():
    """model.to(<GPU>) unpacks the CPU operator's layout into kernels.quant_matmul's, bit for bit
    (here: unpack() on the CPU, and a move to the meta device)."""
    layer = linear(48, 64)
    packed = WeightOnlyInt4Linear(layer.weight, layer.bias, 32, cpu_matmul="packed")
    generic = WeightOnlyInt4Linear(layer.weight, layer.bias, 32)
    assert packed.cpu_packed
    x = torch.randn(3, 64)
    y = packed(x)
    packed.unpack()
    assert not packed.cpu_packed and "scales_and_zeros" not in dict(packed.named_buffers())
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(packed, name), getattr(generic, name)), name
    torch.testing.assert_close(packed(x), y, **TOL)
    moved = WeightOnlyInt4Linear(layer.weight, layer.bias, 32, cpu_matmul="packed").to("meta")
    assert not moved.cpu_packed and moved.qweight.shape == (48, 32) and moved.qweight.device.type == "meta"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weight_and_embedding_rows_are_the_dequantized_weight(scheme):
    layer = linear(32, 64, bias=False)
    module = make(scheme, layer, 32, cpu_matmul="packed")
    generic = WeightOnlyInt4Linear(layer.weight, None, 32) if scheme == "int4" else module
    qweight, scales, zeros, group = stored(generic)
    w = dequantize(qweight, scales, zeros, group)
    torch.testing.assert_close(module.weight, w, **TOL)
    embedding = QuantizedEmbedding(generic, torch.float32)
    ids = torch.tensor([[3, 0, 31], [5, 5, 7]])
    torch.testing.assert_close(embedding(ids), w[ids])


def test_quant_matmul_follows_the_dispatch_rule():
    """On the CPU: Triton (interpreted) under TRITON_INTERPRET=1; else the CPU kernel for up to
    CPU_KERNEL_MAX_ROWS rows where it applies and is allowed, the torch reference otherwise."""
    assert kernels.use_triton(torch.zeros(1)) == kernels.INTERPRET
    layer = linear(32, 64)
    module = WeightOnlyInt4Linear(layer.weight, None, 32)
    stored_int4 = (module.qweight, module.scales, module.zeros, 32)
    for rows in (3, CPU_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        expected = quant_matmul_reference(x, *stored_int4)
        torch.testing.assert_close(quant_matmul(x, *stored_int4), expected, **TOL)
        if kernels.INTERPRET or cpu_ops() is None:
            continue
        kernel_serves = rows <= CPU_KERNEL_MAX_ROWS
        assert torch.equal(quant_matmul(x, *stored_int4), quant_matmul_cpu(x, *stored_int4) if kernel_serves else expected)
        assert torch.equal(quant_matmul(x, *stored_int4, cpu_kernel=False), expected)
    assert not cpu_kernel_applies(torch.randn(1, 72), None)  # K not a multiple of 16
    assert not cpu_kernel_applies(torch.randn(1, 64), 8)  # nor the group size


@pytest.mark.parametrize("scheme", ["none", "fp32_kernel", "int8", "int4"])
def test_stacked_linears_compute_each_output_bit_for_bit_and_share_the_weights(scheme):
    """Q, K and V (gate and up) stacked into one matmul: the same bits per output channel, in the kernel's
    rows (decoding, verification) and beyond them (prefill), with no copy of the weights left behind."""
    layers = [linear(N, 64, seed=n) for n, N in enumerate((64, 32, 32))]
    if scheme in ("none", "fp32_kernel"):
        linears = layers if scheme == "none" else [decoding_linears(layer) for layer in layers]
    else:
        linears = [make(scheme, layer, 32) for layer in layers]
    kernel_rows = dense_kernel_max_rows() if scheme == "fp32_kernel" else CPU_KERNEL_MAX_ROWS
    alone = [linear.__class__.__name__ for linear in linears]
    stacked = stack_linears(linears)
    for rows in (1, 6, 40):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        expected = torch.cat([linear(x) for linear in linears], -1)
        if scheme != "none" and rows <= kernel_rows:  # our kernels; BLAS may block another N otherwise
            assert torch.equal(stacked(x), expected)
        torch.testing.assert_close(stacked(x), expected)
    assert [linear.__class__.__name__ for linear in linears] == alone
    for name, whole in [*stacked.named_parameters(), *stacked.named_buffers()]:
        assert all(getattr(linear, name).untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                   for linear in linears), name


def test_linears_that_cannot_stack_are_left_alone():
    a, b = linear(32, 64), linear(32, 64, bias=False)
    assert stack_linears([a, b]) is None  # one with a bias, one without
    assert stack_linears([a, make("int8", linear(32, 64), 32)]) is None  # two kinds
    assert stack_linears([make("int4", a, 32), make("int4", linear(32, 64), 16)]) is None  # two group sizes
    assert stack_linears([make("w8a8", a, 32), make("w8a8", linear(32, 64), 32)]) is None  # fbgemm's packing
    packed = [make("int4", layer, 32, cpu_matmul="packed") for layer in (a, linear(32, 64))]
    assert stack_linears(packed) is None or not packed[0].cpu_packed  # PyTorch's int4 layout mixes rows


# --- 2. quantize-dequantize error --------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_dequantize_error_is_bounded(scheme):
    layer = linear(256, 512, bias=False)
    error = float((make(scheme, layer, 32).weight - layer.weight).norm() / layer.weight.norm())
    print(f"{scheme}: quantize-dequantize relative error {error:.4f}")
    assert error < ERROR_BOUND[scheme]


def test_smaller_int4_groups_quantize_more_finely():
    layer = linear(64, 512, bias=False)
    errors = [float((make("int4", layer, g).weight - layer.weight).norm()) for g in (16, 64, 256)]
    assert errors[0] < errors[1] < errors[2], errors


# --- 3. a quantized target decodes, and speculation stays lossless ------------------------------


def load(llama_dir, **quant) -> FrozenTarget:
    return FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS), QuantConfig(**quant))


QUANTS = [dict(scheme="int8"), dict(scheme="int4"), dict(scheme="fp8"), dict(scheme="w8a8"), dict(scheme="mxfp4"),
          dict(scheme="nvfp4"),
          dict(scheme="int8", cpu_matmul="packed"),
          dict(scheme="int4", cpu_matmul="packed"), dict(scheme="gptq_int4", calibration_sequences=4),
          dict(scheme="gptq_int4", calibration_sequences=4, quantize_embeddings=True, quantize_lm_head=True),
          dict(scheme="w8a8", quantize_embeddings=True, quantize_lm_head=True),
          dict(scheme="int4", group_size=16, quantize_embeddings=True, quantize_lm_head=True)]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: "-".join(str(v) for v in q.values()))
def test_quantized_target_decodes_and_speculation_is_lossless(llama_dir, llama_target, make_drafter, text_batch, quant):
    target = load(llama_dir, **quant)
    linears = [m for m in target.model.modules() if isinstance(m, nn.Linear)]
    assert linears == ([] if quant.get("quantize_lm_head") else [target.model.lm_head])
    assert isinstance(target.embed_tokens, QuantizedEmbedding) == quant.get("quantize_embeddings", False)
    # The quantized target's logits differ from the full-precision ones, boundedly (a random target,
    # initialised with std 0.2, amplifies weight error more than a trained one).
    ids = text_batch[:1, :16]
    full, quantized = llama_target(ids), target(ids)
    drift = float((full.logits - quantized.logits).norm() / full.logits.norm())
    assert 0 < drift < 0.5, drift
    drafter = make_drafter(target)
    for prompt in (text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist()):
        alone = generate(target, None, prompt, 24, k=0).tokens
        assert len(alone) == 24 or alone[-1] == target.tokenizer.eos_token_id
        if quant["scheme"] == "w8a8":
            continue  # not token-identical in general (module doc, 3.)
        for k in (1, 3):
            assert generate(target, drafter, prompt, 24, k=k).tokens == alone


def test_decoding_never_dequantizes_a_whole_table(llama_dir, make_drafter, text_batch, monkeypatch):
    """`.weight` of a quantized module dequantizes all of it (0.15-0.6 s for SmolLM2's embeddings, several decoding
    steps' time): target.device and every decoding step read the packed tensors instead."""
    target = load(llama_dir, scheme="int4", group_size=16, quantize_embeddings=True, quantize_lm_head=True)
    drafter = make_drafter(target)
    prompt = text_batch[0, :12].tolist()
    alone = generate(target, None, prompt, 12, k=0).tokens

    def whole_table(module):
        raise AssertionError(f"decoding dequantized a whole {type(module).__name__}")

    for cls in (QuantizedLinear, QuantizedEmbedding):
        monkeypatch.setattr(cls, "weight", property(whole_table))
    assert target.device == torch.device("cpu")
    assert generate(target, None, prompt, 12, k=0).tokens == alone
    assert generate(target, drafter, prompt, 12, k=3).tokens == alone


def test_train_config_quant_int4_reaches_the_target():
    from test_config import composed, typed

    recipe, _ = typed(composed(["conf=eagle3_pycode", "quant=int4", "quant.group_size=64"]))
    assert recipe.quant == QuantConfig(scheme="int4", group_size=64)


def test_train_eagle3_against_an_int4_target(llama_dir, tmp_path):
    """`python train.py conf=eagle3_pycode quant=int4` trains, exports, and serves losslessly on the int4 target."""
    from test_cli import run_train

    layer_ids = "[" + ",".join(map(str, LAYER_IDS)) + "]"
    result = run_train([
        "conf=eagle3_pycode", "quant=int4", "trainer.max_steps=2", "logger=none", f"hydra.run.dir={tmp_path / 'run'}",
        f"target.name_or_path={llama_dir}", f"target.layer_ids={layer_ids}", "drafter.draft_vocab_size=96",
        "drafter.depth=2", "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2",
        "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2", "trainer.num_threads=1",
        "trainer.progress_bar=false", "serve_eval.every_n_steps=0",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "outputs match target-only greedy: True" in result.stdout
    report = json.loads((tmp_path / "run" / "acceptance" / "report.json").read_text())
    assert report["config"]["quant"]["scheme"] == "int4"  # the report says which target it served


@pytest.mark.parametrize("scheme", ["none", *SCHEMES, "gptq_int4"])
def test_quant_yaml_mirrors_the_config(scheme):
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).parent.parent / "conf" / "quant" / f"{scheme}.yaml")
    assert OmegaConf.to_container(conf) == {**vars(QuantConfig()), "scheme": scheme}


# --- 4. bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    (dict(scheme="int3"), r"quant.scheme='int3' is not valid; choose one of: none, int8, int4, gptq_int4, fp8, w8a8"),
    (dict(scheme="int4", group_size=0), r"quant.group_size=0 is not valid: must be an even number >= 2"),
    (dict(scheme="int4", group_size=33), r"quant.group_size=33 is not valid"),
    (dict(quantize_lm_head="yes"), r"quant.quantize_lm_head='yes' is not valid: must be true or false"),
    (dict(cpu_matmul="fast"), r"quant.cpu_matmul='fast' is not valid; choose one of: kernel, dequantize, packed"),
    (dict(calibration_sequences=0), r"quant.calibration_sequences=0 is not valid: must be an integer >= 1"),
])
def test_bad_config_is_a_one_line_error_naming_the_key(fields, message):
    with pytest.raises(UserError, match=message):
        QuantConfig(**fields)


def test_group_size_that_does_not_divide_a_width_is_refused_before_any_change(llama_target):
    from conftest import make_model

    model = make_model("llama", llama_target.tokenizer)
    before = {n: type(m) for n, m in model.named_modules()}
    # hidden 32, intermediate 64: 64 divides the up projections' input, not the others'
    with pytest.raises(UserError, match=r"quant.group_size=64 does not divide the input width 32 of model.layers.0"):
        quantize(model, QuantConfig(scheme="int4", group_size=64))
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_a_target_quantized_by_another_library_is_refused(llama_target):
    from conftest import make_model

    model = make_model("llama", llama_target.tokenizer)
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(UserError, match=r"already quantized \(bitsandbytes\); load it with quant.scheme=none"):
        quantize(model, QuantConfig(scheme="int8"))
    assert quantize(model, QuantConfig()) is model  # scheme none leaves it as it is


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_kernel_rejects_inconsistent_inputs(impl):
    if impl == "cpu":
        require_cpu_kernel()
    matmul = quant_matmul_reference if impl == "reference" else quant_matmul_cpu
    q = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size dividing K"):
        matmul(torch.zeros(1, 16), q, torch.ones(4, 1), torch.zeros(4, 1), 5)
    with pytest.raises(ValueError, match=r"must be \[N, K/group_size\] = \[4, 2\]"):
        matmul(torch.zeros(1, 16), q, torch.ones(4, 1), torch.zeros(4, 1), 8)
    with pytest.raises(ValueError, match="x has 15 features but the weight has K=16"):
        matmul(torch.zeros(1, 15), q, torch.ones(4, 2), torch.zeros(4, 2), 8)


# --- 5. the Triton kernel in the interpreter ---------------------------------------------------


def test_triton_kernel_in_the_interpreter():
    if kernels.INTERPRET:
        pytest.skip("this process interprets Triton itself")
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("M", [1, 7, 20])
@pytest.mark.parametrize("N, K, group", SHAPES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_interpreted_triton_kernel_matches_reference(scheme, N, K, group, M):
    module = make(scheme, linear(N, K, bias=False), group)  # int4 in the kernels' format: no CPU packing here
    qweight, scales, zeros, group_size = stored(module)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    expected = quant_matmul_reference(x, qweight, scales, zeros, group_size)
    torch.testing.assert_close(quant_matmul_triton(x, qweight, scales, zeros, group_size), expected, **TOL)
    torch.testing.assert_close(quant_matmul(x, qweight, scales, zeros, group_size), expected, **TOL)  # the rule picks Triton


@interpreted
def test_interpreted_w8a8_rounds_activations_then_runs_the_kernel():
    layer = linear(48, 64)
    module = DynamicInt8Linear(layer.weight, layer.bias)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    expected = quant_matmul_reference(round_activations(x), module.int8_weight(), module.scales) + layer.bias
    torch.testing.assert_close(module(x), expected, **TOL)


# --- 6. w8a8 -----------------------------------------------------------------------------------


def outlier_rows(M: int, K: int) -> torch.Tensor:
    """N(0, 1) rows, one of them 50x larger: a batch whose rows need very different scales."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    x[M // 2] *= 50
    return x


@pytest.mark.skipif(not FBGEMM, reason="this CPU build has no fbgemm")
@pytest.mark.parametrize("N, K, group", SHAPES)
def test_w8a8_fbgemm_matches_the_torch_reference(N, K, group):
    layer = linear(N, K)
    module = DynamicInt8Linear(layer.weight, layer.bias)
    assert module.cpu_op().startswith("quantized.linear_dynamic") != kernels.INTERPRET
    x = outlier_rows(7, K)
    expected = quant_matmul_reference(round_activations(x), module.int8_weight(), module.scales) + layer.bias
    y = module(x)
    assert ((y - expected).norm(dim=1) / expected.norm(dim=1)).max() < 1e-5
    drift = float((y - layer(x)).norm() / layer(x).norm())
    assert 0 < drift < 0.03, drift  # 8-bit weights and 7-bit activations against fp32


@pytest.mark.skipif(not FBGEMM, reason="this CPU build has no fbgemm")
def test_w8a8_keeps_one_int8_matrix_and_brings_it_back_off_the_cpu():
    layer = linear(48, 64)
    module, weight_only = DynamicInt8Linear(layer.weight, layer.bias), WeightOnlyInt8Linear(layer.weight, layer.bias)
    assert module.qweight is None and torch.equal(module.int8_weight(), weight_only.qweight)
    assert weight_bytes(module) == weight_bytes(weight_only) + 4 * 48  # + fbgemm's int32 offset per channel
    moved = module.to("meta")  # leaving the CPU drops fbgemm's copy for the plain int8 matrix
    assert moved.fbgemm is None and moved.qweight.shape == (48, 64) and moved.qweight.dtype == torch.int8


@pytest.mark.parametrize("M", [2, 6, 33])
def test_w8a8_rows_do_not_depend_on_the_batch(M):
    """What keeps speculation lossless: verifying k+1 tokens computes each row as decoding it alone would."""
    layer = linear(40, 96)
    module = DynamicInt8Linear(layer.weight, layer.bias)
    x = outlier_rows(M, 96)
    alone = torch.cat([module(row[None]) for row in x])
    assert torch.equal(module(x), alone)


def test_round_activations_is_a_grid_of_129_levels_per_row():
    x = outlier_rows(4, 256)
    rounded = round_activations(x)
    rows = x.abs().amax(-1, keepdim=True)
    levels = rounded / rows * ACT_LEVELS / 2
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)
    assert levels.abs().max() == 64 and len(levels.round().unique()) <= 129
    assert ((rounded - x).abs() <= rows / ACT_LEVELS + 1e-6).all()  # within half a step (2/127) of the row's max
    assert torch.equal(round_activations(x[:1]), rounded[:1])


# --- 7. gptq_int4 ------------------------------------------------------------------------------


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    layer = linear(48, 128, bias=False)
    levels = gptq_int4(layer.weight, torch.eye(128), group_size=32)
    for got, expected in zip(levels, round_to_nearest_int4(layer.weight, 32)):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_gptq_keeps_layer_outputs_closer_than_round_to_nearest():
    layer = linear(64, 128, bias=False)
    mixing = torch.randn(128, 128, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2048, 128, generator=torch.Generator().manual_seed(3)) @ mixing  # correlated features
    hessian = x.T @ x / len(x)
    gptq = WeightOnlyInt4Linear(layer.weight, None, 32, levels=gptq_int4(layer.weight, hessian, 32))
    nearest = WeightOnlyInt4Linear(layer.weight, None, 32)
    errors = {name: float((m(x) - layer(x)).norm() / layer(x).norm()) for name, m in
              (("gptq", gptq), ("nearest", nearest))}
    print(errors)
    assert errors["gptq"] < 0.8 * errors["nearest"], errors
    q = unpack_int4(gptq.qweight)
    assert q.min() >= 0 and q.max() <= 15 and gptq.scales.shape == (64, 4)


def test_gptq_without_a_tokenizer_is_a_one_line_error(llama_target):
    with pytest.raises(UserError, match="gptq_int4 needs the target's tokenizer"):
        quantize(copy.deepcopy(llama_target.model), QuantConfig(scheme="gptq_int4"))
