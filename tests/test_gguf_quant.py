"""quant=gguf: a GGUF file's own Q4_1 / Q8_0 blocks served as they are (speculators/quant/gguf.py,
speculators/quant/__init__.py), and the int8 format with one scale per group of columns they need
(kernels/quant_matmul.py, kernels/quant_matmul_cpu.cpp).

The GGUFs are written here with gguf-py's GGUFWriter and gguf.quants.quantize from a tiny random
Llama and the conftest BPE tokenizer (byte-level, so the file says tokenizer.ggml.model=gpt2), with
Q and K rows permuted as llama.cpp's converter writes them. Checks:
1. every packed layer dequantizes bit for bit to gguf-py's dequantization of its tensor and to the
   fp32 weight transformers loads from the same file; the tied embedding and lm_head share one module;
2. with exact activations the packed target's logits stay within 1e-4 of the dequantized target's (our
   kernels sum in another order) and greedy decoding gives the same tokens; with its default int8
   activations (llama.cpp's arithmetic) it stays within 1e-2 of the same rounding done in torch, and
   near the dequantized target (top-1 agreement > 90% on a random tiny model);
3. the grouped int8 format: the CPU kernel and the Triton kernel (interpreted, in a child process as
   tests/test_quant.py does) against the reference, and bad shapes refused;
4. int8 activations, in the kernel's AVX-512 VNNI variant where the CPU has it and forced to AVX2:
   the kernel against a float64 reference of its own math (exact integer dot products, then the
   scales) within 1e-6 of the sum of |products| (fp32 rounding), and against the fp32 reference
   within the bound x's rounding gives, sum_k |W[n, k]| d_x / 2; rows independent of the batch and
   of the threads, bit for bit; non-finite x gives NaN rows; the config's `activations`;
5. bad input: a type quant=gguf does not serve, a target without a GGUF file; a Q4_1 block whose zero
   m + 8 d is not exact in fp32 keeps its layer as loaded.
"""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import LAYER_IDS, make_model, require_cpu_kernel, run_interpreted_tests
from gguf import GGMLQuantizationType as Q
from torch import nn

import forge_kernels as kernels
from common.config import UserError
from forge_kernels.quant_matmul import (
    CPU_KERNEL_MAX_ROWS,
    cpu_kernel_applies,
    cpu_ops,
    dequantize,
    pack_int4,
    quant_matmul,
    quant_matmul_cpu,
    quant_matmul_reference,
    round_activation_blocks,
    unpack_int4,
)
from inference.engine import generate
from speculators.layers import DecodingLinear
from speculators.quant import (
    Int4Scheme,
    QuantConfig,
    QuantizedEmbedding,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    quantize,
    weight_bytes,
)
from speculators.target import FrozenTarget, TargetConfig

# llama.cpp's names, written out here apart from speculators/quant/gguf.py's table
LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
NUM_LAYERS = 2
TOL = dict(atol=1e-4, rtol=1e-4)

interpreted = pytest.mark.skipif(not kernels.INTERPRET, reason="needs TRITON_INTERPRET=1 at start-up; "
                                 "test_triton_kernel_in_the_interpreter runs it in a child process")
needs_cpu_kernel = pytest.mark.usefixtures("cpu_kernel")  # skips without a compiler; a failed build fails


# --- tiny GGUF files ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def conversion_cache(tmp_path_factory):
    """Converted folders (speculators/gguf_file.py) in a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULATORS_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: the Q/K row order it writes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, tokenizer, types: dict[str, Q] | None = None, edit=None) -> Path:
    """`model` as llama.cpp writes a Llama: Q4_1 linear layers, Q8_0 tied embedding, F32 norms.
    `types`: other types for some tensors; `edit(name, raw)` may change a tensor's stored bytes."""
    c = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    add_tokenizer(writer, tokenizer)
    for name, weight in gguf_tensors(model):
        kind = (types or {}).get(name, Q.F32 if weight.ndim == 1 else Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1)
        raw = gguf.quants.quantize(weight, kind)
        if edit is not None:
            edit(name, raw)
        writer.add_tensor(name, raw, raw_dtype=kind)  # quantized: the shape follows from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(model):
    """(GGUF name, fp32 array) of the model's weights, Q and K rows permuted as llama.cpp does."""
    c, state = model.config, model.state_dict()
    yield "token_embd.weight", state["model.embed_tokens.weight"].numpy()
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        yield f"blk.{i}.attn_norm.weight", state[prefix + "input_layernorm.weight"].numpy()
        yield f"blk.{i}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"].numpy()
        for hf, short in LINEARS.items():
            w = state[prefix + hf + ".weight"].numpy()
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(short)
            yield f"blk.{i}.{short}.weight", w if heads is None else permute(w, heads)
    yield "output_norm.weight", state["model.norm.weight"].numpy()


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer) -> None:
    """The byte-level BPE as llama.cpp stores one: tokens by id, merges, special ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in tokenizer.all_special_tokens else 1 for token, _ in vocab])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def tiny_gguf(tokenizer, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", make_model("llama", tokenizer, NUM_LAYERS),
                      tokenizer)


def load(path: Path, scheme: str = "none", **quant) -> FrozenTarget:
    return FrozenTarget.load(TargetConfig(gguf_file=str(path), layer_ids=LAYER_IDS[:NUM_LAYERS]),
                             QuantConfig(scheme=scheme, **quant))


@pytest.fixture(scope="module")
def targets(tiny_gguf) -> tuple[FrozenTarget, FrozenTarget]:
    """(dequantized fp32 target, packed target with its default int8 activations) of the same file."""
    return load(tiny_gguf), load(tiny_gguf, "gguf")


# --- 1. the file's blocks, bit for bit ---------------------------------------------------------


def test_packed_weights_are_the_files_blocks_bit_for_bit(tiny_gguf, targets):
    full, packed = targets
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(tiny_gguf).tensors}
    heads = {"attn_q": full.config.num_attention_heads, "attn_k": full.config.num_key_value_heads}
    for i in range(NUM_LAYERS):
        for hf, short in LINEARS.items():
            module = packed.model.get_submodule(f"model.layers.{i}.{hf}")
            assert isinstance(module, WeightOnlyInt4Linear) and module.group_size == 32
            weight = module.weight
            assert torch.equal(weight, full.model.get_submodule(f"model.layers.{i}.{hf}").weight), hf
            in_file_order = permute(weight.numpy(), heads[short]) if short in heads else weight.numpy()
            assert np.array_equal(in_file_order, stored[f"blk.{i}.{short}.weight"]), hf
    head = packed.model.lm_head
    assert isinstance(head, WeightOnlyInt8Linear) and head.group_size == 32 and head.qweight.dtype == torch.int8
    assert isinstance(packed.embed_tokens, QuantizedEmbedding) and packed.embed_tokens.table is head  # one copy
    assert torch.equal(head.weight, full.model.lm_head.weight)
    assert np.array_equal(head.weight.numpy(), stored["token_embd.weight"])
    ids = torch.tensor([[0, 5, 7], [319, 2, 5]])
    assert torch.equal(packed.embed_tokens(ids), full.embed_tokens(ids))
    for name, param in packed.model.named_parameters():  # only the norms stay parameters, as loaded
        assert name.endswith("norm.weight") and torch.equal(param, full.model.get_parameter(name)), name
    # per weight: int4 + an fp32 scale and zero per 32, or int8 + an fp32 scale per 32, for 4 bytes of fp32;
    # the tied table counted once, as in the fp32 target
    linears = sum(m.weight.numel() for m in full.model.modules() if isinstance(m, nn.Linear)) - head.weight.numel()
    saved = linears * (4 - 1 / 2 - 8 / 32) + head.weight.numel() * (4 - 1 - 4 / 32)
    assert weight_bytes(packed.model) == weight_bytes(full.model) - saved


# --- 2. the packed target ----------------------------------------------------------------------


def test_packed_target_with_exact_activations_matches_the_dequantized_target(tiny_gguf, targets, text_batch):
    full, _ = targets
    packed = load(tiny_gguf, "gguf", activations="exact")
    ids = text_batch[:1, :24]  # 24 rows: the CPU kernel's path, not dequantize + matmul
    expected, got = full(ids).logits, packed(ids).logits
    assert float((got - expected).abs().max()) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    for prompt in (text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist()):
        assert generate(packed, None, prompt, 16, k=0).tokens == generate(full, None, prompt, 16, k=0).tokens


def test_packed_target_with_int8_activations_stays_near_the_dequantized_target(tiny_gguf, targets, text_batch):
    """The kernel's integer arithmetic against the same rounding in torch (x rounded, then dequantize +
    matmul: fp32 sums in another order, which can move a later layer's input across a rounding boundary
    by one level, hence 1e-2 rather than 1e-4); against the fp32 target, the rounding itself."""
    full, _ = targets
    packed = load(tiny_gguf, "gguf", activations="int8")
    same_math = load(tiny_gguf, "gguf", cpu_matmul="dequantize", activations="int8")
    for rows in (text_batch[:1, :24], text_batch[1:, 3:30]):
        expected, got = full(rows).logits, packed(rows).logits
        assert float((got - same_math(rows).logits).abs().max()) < 1e-2
        assert float((got - expected).abs().max()) < 0.1 * float(expected.abs().max())
        assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) > 0.9


# --- 3. int8 with one scale per group of columns -----------------------------------------------


def grouped_int8(N: int, K: int, group: int):
    g = torch.Generator().manual_seed(group)
    return torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g), torch.rand(N, K // group, generator=g) / 64


def test_grouped_int8_dequantizes_to_q_times_its_groups_scale():
    q, scales = grouped_int8(3, 64, 16)
    expected = q.float() * scales.repeat_interleave(16, dim=1)
    assert torch.equal(dequantize(q, scales, None, 16), expected)


@needs_cpu_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 32])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_cpu_kernel_grouped_int8_matches_reference(group, rows):
    q, scales = grouped_int8(40, 256, group)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(quant_matmul_cpu(x, q, scales, None, group),
                               quant_matmul_reference(x, q, scales, None, group), **TOL)


@needs_cpu_kernel
def test_cpu_kernel_grouped_int8_rows_are_independent_of_batch_and_threads():
    q, scales = grouped_int8(64, 512, 32)
    x = torch.randn(11, 512)
    batch = quant_matmul_cpu(x, q, scales, None, 32)
    for i in range(len(x)):
        assert torch.equal(quant_matmul_cpu(x[i:i + 1], q, scales, None, 32), batch[i:i + 1]), i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(quant_matmul_cpu(x, q, scales, None, 32), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_grouped_int8_rejects_inconsistent_inputs(impl):
    if impl == "cpu":
        require_cpu_kernel()
    matmul = quant_matmul_reference if impl == "reference" else quant_matmul_cpu
    q, scales = grouped_int8(4, 64, 32)
    with pytest.raises(ValueError, match="a group_size dividing K=64, got 48"):
        matmul(torch.zeros(1, 64), q, scales, None, 48)
    with pytest.raises(ValueError, match=r"scales \[4, 4\], got torch.int8 \(4, 64\) and \(4, 2\)"):
        matmul(torch.zeros(1, 64), q, scales, None, 16)


def test_triton_kernel_in_the_interpreter():
    if kernels.INTERPRET:
        pytest.skip("this process interprets Triton itself")
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("M", [1, 20])
@pytest.mark.parametrize("N, K, group", [(48, 64, 32), (20, 96, 32), (33, 128, 16)])
def test_interpreted_triton_grouped_int8_matches_reference(N, K, group, M):
    q, scales = grouped_int8(N, K, group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    expected = quant_matmul_reference(x, q, scales, None, group)
    torch.testing.assert_close(quant_matmul(x, q, scales, None, group), expected, **TOL)  # the rule picks Triton


# --- 4. int8 activations -----------------------------------------------------------------------


@pytest.fixture(params=["best", "avx2"])
def isa(request):
    """The int8-activation kernel in the best variant this CPU has, then forced to AVX2."""
    require_cpu_kernel()
    yield cpu_ops().int8_dot_isa(request.param)
    cpu_ops().int8_dot_isa("best")


def weights(kind: str, N: int, K: int, group: int):
    """(qweight, scales, zeros, group_size) of random levels: int4 (zeros near m + 8 d, as GGUF's Q4_1
    gives), int8 with a scale per group, or int8 with one scale per row (group_size None)."""
    g = torch.Generator().manual_seed(N + K + group)
    if kind == "int4":
        scales = torch.rand(N, K // group, generator=g) / 16
        zeros = torch.randn(N, K // group, generator=g) / 8 + 8 * scales
        return pack_int4(torch.randint(0, 16, (N, K), generator=g)), scales, zeros, group
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    if kind == "int8":
        return q, torch.rand(N, K // group, generator=g) / 64, None, group
    return q, torch.rand(N, generator=g) / 64, None, None


def integer_reference(x, qweight, scales, zeros, group_size):
    """The kernel's math in float64 (kernels/quant_matmul_cpu.cpp): x's int8 levels per block of 32, exact
    integer dot products with the weight's levels, then the scales, and int4's zero term; and the same sum
    over |products|, the size fp32 rounding errors are relative to."""
    blocks = x.unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    qx, dx = torch.round(blocks * torch.where(d > 0, 1 / d, 0)).double(), d.double()[..., 0]  # [M, B, 32], [M, B]
    N, K = qweight.shape[0], x.shape[-1]
    qw = (unpack_int4(qweight) if zeros is not None else qweight).double().view(N, -1, 32)
    per_group = (group_size or K) // 32
    scale = dx[:, None] * scales.double().view(N, -1).repeat_interleave(per_group, 1)[None]  # [M, N, B]
    y = (torch.einsum("mbk,nbk->mnb", qx, qw) * scale).sum(-1)
    size = (torch.einsum("mbk,nbk->mnb", qx.abs(), qw.abs()) * scale).sum(-1)
    if zeros is not None:  # + sum_g (z - 8 s) s_x,g with s_x,g = sum over the group's blocks of d_x sum(q_x)
        x_sums = (dx * qx.sum(-1)).view(len(x), -1, per_group).sum(-1)
        mins = zeros.double() - 8 * scales.double()
        y, size = y + x_sums @ mins.T, size + x_sums.abs() @ mins.abs().T
    return y, size


INT8_ACTIVATION_CASES = [("int4", 42, 576, 32), ("int4", 19, 96, 32), ("int4", 13, 256, 64), ("int4", 10, 192, 96),
                         ("int8", 42, 576, 32), ("int8", 19, 96, 32), ("int8", 13, 256, 64),
                         ("per-row int8", 42, 576, 0), ("per-row int8", 19, 96, 0)]  # (kind, N, K, group)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 32])
@pytest.mark.parametrize("kind, N, K, group", INT8_ACTIVATION_CASES)
def test_int8_activation_kernel_is_its_integer_math(isa, kind, N, K, group, rows):
    w = weights(kind, N, K, group)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    got = quant_matmul_cpu(x, *w, int8_activations=True)
    expected, size = integer_reference(x, *w)
    assert bool(((got.double() - expected).abs() <= 1e-6 * size).all()), isa
    # the torch path of the same math: x rounded (round_activation_blocks), dequantize + one matmul
    torch_path = quant_matmul(x, *w, cpu_kernel=False, int8_activations=True)
    assert bool(((got - torch_path).double().abs() <= 2e-6 * size).all()), isa


@pytest.mark.parametrize("kind, N, K, group", INT8_ACTIVATION_CASES[:1] + INT8_ACTIVATION_CASES[4:5])
def test_int8_activation_kernel_is_within_the_rounding_of_x_of_the_fp32_result(isa, kind, N, K, group):
    w = weights(kind, N, K, group)
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    exact = quant_matmul_reference(x, *w)
    step = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True).expand(-1, -1, 32).flatten(1) / 127
    bound = 0.5 * step @ dequantize(*w).abs().T  # |W (x - x_rounded)| <= sum_k |W[n, k]| d_x / 2
    error = (quant_matmul_cpu(x, *w, int8_activations=True) - exact).abs()
    assert bool((error <= bound * (1 + 1e-4) + 1e-5 * exact.abs().max()).all()), isa
    assert float(error.max()) > 0  # x was rounded


@pytest.mark.parametrize("kind", ["int4", "int8", "per-row int8"])
def test_int8_activation_kernel_rows_are_independent_of_batch_and_threads(isa, kind):
    w = weights(kind, 70, 320, 0 if kind == "per-row int8" else 32)
    x = torch.randn(13, 320)
    batch = quant_matmul_cpu(x, *w, int8_activations=True)
    for i in range(len(x)):
        assert torch.equal(quant_matmul_cpu(x[i:i + 1], *w, int8_activations=True), batch[i:i + 1]), (isa, i)
        assert torch.equal(quant_matmul_cpu(x[i:i + 5], *w, int8_activations=True), batch[i:i + 5]), (isa, i)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(quant_matmul_cpu(x, *w, int8_activations=True), batch), isa
    finally:
        torch.set_num_threads(threads)


def test_int8_activation_kernel_gives_nan_rows_for_non_finite_x(isa):
    w = weights("int4", 8, 64, 32)
    x = torch.randn(3, 64)
    x[0, 40], x[2, 3] = float("nan"), float("inf")
    y = quant_matmul_cpu(x, *w, int8_activations=True)
    assert bool(y[0].isnan().all()) and bool(y[2].isnan().all()) and bool(y[1].isfinite().all())


def test_int8_activations_follow_the_dispatch_rule():
    """The CPU kernel for up to CPU_KERNEL_MAX_ROWS rows where it applies, else x rounded in torch then the
    exact path: the same math either way."""
    w = weights("int4", 16, 64, 32)
    for rows in (3, CPU_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        rounded = quant_matmul_reference(round_activation_blocks(x), *w)
        got = quant_matmul(x, *w, int8_activations=True)
        if kernels.INTERPRET or cpu_ops() is None or rows > CPU_KERNEL_MAX_ROWS:
            assert torch.equal(got, quant_matmul(round_activation_blocks(x), *w))
        else:
            assert torch.equal(got, quant_matmul_cpu(x, *w, int8_activations=True))
        torch.testing.assert_close(got, rounded, **TOL)
    assert not cpu_kernel_applies(torch.randn(1, 48), 16, int8_activations=True)  # blocks of 32 only
    assert cpu_kernel_applies(torch.randn(1, 48), 16) == (not kernels.INTERPRET and cpu_ops() is not None)


def test_int8_activation_kernel_refuses_blocks_it_cannot_form(isa):
    q, scales, zeros, _ = weights("int4", 4, 64, 16)
    with pytest.raises(RuntimeError, match="int8 activations: K and group_size multiples of 32"):
        cpu_ops().int4_matmul_q8(torch.zeros(1, 64), q, scales, zeros, 16)


def test_activations_are_exact_unless_int8_is_asked_for(targets):
    """int8 activations are not token-identical in speculation (speculators/quant/__init__.py): opt-in only."""
    _, packed = targets
    assert not any(m.int8_activations for m in packed.model.modules()
                   if isinstance(m, (WeightOnlyInt4Linear, WeightOnlyInt8Linear)))
    assert QuantConfig(scheme="gguf", activations="int8").int8_activations and not QuantConfig(scheme="gguf").int8_activations
    assert not QuantConfig(scheme="int4").int8_activations and QuantConfig(scheme="int4", activations="int8").int8_activations
    with pytest.raises(UserError, match=r"^quant.activations='fast' is not valid; choose one of: exact, int8$"):
        QuantConfig(activations="fast")
    with pytest.raises(UserError, match=r"^quant.activations='int8' is not valid: must be exact with quant.scheme=w8a8"):
        QuantConfig(scheme="w8a8", activations="int8")
    with pytest.raises(UserError, match=r"^quant.activations=int8 rounds x in blocks of 32 columns: the input width 48 of l"):
        Int4Scheme(QuantConfig(scheme="int4", group_size=16, activations="int8")).check("l", 48)


# --- 5. bad input ------------------------------------------------------------------------------


def test_a_type_gguf_does_not_serve_is_a_one_line_error(tokenizer, tmp_path):
    path = write_gguf(tmp_path / "q4_0.gguf", make_model("llama", tokenizer, NUM_LAYERS), tokenizer,
                      types={"blk.1.ffn_up.weight": Q.Q4_0})
    with pytest.raises(UserError) as error:
        load(path, "gguf")
    assert str(error.value) == ("quant.scheme=gguf: blk.1.ffn_up.weight in q4_0.gguf is Q4_0; served: Q4_1, Q8_0 "
                                "packed, F32, F16 unquantized; load it with quant.scheme=none")


def test_gguf_needs_a_gguf_file(llama_dir, tokenizer):
    message = r"^quant.scheme=gguf serves a GGUF file's own quantized weights: set target.gguf_file"
    with pytest.raises(UserError, match=message):
        FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS), QuantConfig(scheme="gguf"))
    with pytest.raises(UserError, match=message):
        quantize(make_model("llama", tokenizer), QuantConfig(scheme="gguf"))


def test_a_q4_1_block_whose_zero_is_inexact_keeps_its_layer_as_loaded(tokenizer, tmp_path):
    d, m = np.float32(1.25 * 2.0 ** -19), np.float32(1000.0)  # m + 8 d needs more than fp32's 24 bits
    q = np.arange(16, dtype=np.float32)
    assert not np.array_equal((q - 8) * d + np.float32(m + 8 * d), d * q + m)  # so z = m + 8 d would be off

    def edit(name, raw):
        if name == "blk.0.attn_v.weight":
            raw[0, 0:4] = np.array([d, m], dtype=np.float16).view(np.uint8)

    path = write_gguf(tmp_path / "inexact.gguf", make_model("llama", tokenizer, NUM_LAYERS), tokenizer, edit=edit)
    with pytest.warns(UserWarning, match=r"blk.0.attn_v.weight has 1 Q4_1 blocks whose zero m \+ 8 d is not exact"):
        packed = load(path, "gguf")
    kept = packed.model.model.layers[0].self_attn.v_proj
    assert type(kept) is DecodingLinear and float(kept.weight[0, :32].min()) >= 1000  # unquantized, fp32
    assert isinstance(packed.model.model.layers[1].self_attn.v_proj, WeightOnlyInt4Linear)


def test_gguf_yaml_mirrors_the_config():
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).parent.parent / "conf" / "quant" / "gguf.yaml")
    assert OmegaConf.to_container(conf) == {**vars(QuantConfig()), "scheme": "gguf"}
