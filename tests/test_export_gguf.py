"""The llama.cpp export (speculators/formats/gguf.py): a tiny EAGLE-3 drafter written as GGUF and read
back with gguf-py's GGUFReader, checked against what llama.cpp's eagle3 loader reads (its
src/models/eagle3.cpp and src/llama-model.cpp, written out here apart from the exporter): metadata keys,
values and types, tensor names, shapes in ggml order and types, d2t as absolute target ids, the values
(F16 within rounding of the weights; Q/K rows in llama.cpp's rope order), the target's tokenizer, and
refusals. With llama.cpp built (engines/llamacpp.py build), the export is served by
llama-speculative-simple beside a tiny GGUF target.
"""

import gguf
import numpy as np
import pytest
import torch
from conftest import DRAFT_VOCAB, LAYER_IDS, make_model
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T
from test_gguf_quant import write_gguf

from benchmarks import llamacpp_bench
from common.config import UserError
from engines import llamacpp
from inference import evalsets
from speculators import export
from speculators.export import Verifier
from speculators.formats import gguf as export_gguf
from speculators.layers import apply_rotary, rotary
from speculators.target import FrozenTarget, TargetConfig


def randomized(drafter):
    """Norms off their initial ones, so the round trip compares something."""
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return drafter


def fields(path) -> dict:
    """{key: (value, [types])} of a GGUF file."""
    return {k: (f.contents(), [t for t in f.types]) for k, f in gguf.GGUFReader(path).fields.items()
            if not k.startswith("GGUF.")}


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter, LlamaModel.permute: the Q/K row order it writes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def exported(llama_target, llama_dir, make_drafter, tmp_path_factory):
    drafter = randomized(make_drafter(llama_target, norm_before_residual=True))
    path = export.save(drafter, tmp_path_factory.mktemp("gguf") / "draft.gguf", Verifier(str(llama_dir), []),
                       fmt="gguf")
    return drafter, path


def test_metadata_is_what_llamacpp_reads(exported, llama_target):
    drafter, path = exported
    c, H = llama_target.config, llama_target.hidden_size
    u32, f32 = [T.UINT32], [T.FLOAT32]
    expected = {
        "general.architecture": ("eagle3", [T.STRING]),
        "general.file_type": (1, u32),  # mostly F16
        "eagle3.block_count": (1, u32),
        "eagle3.context_length": (c.max_position_embeddings, u32),
        "eagle3.embedding_length": (H, u32),
        "eagle3.feed_forward_length": (c.intermediate_size, u32),
        "eagle3.attention.head_count": (c.num_attention_heads, u32),
        "eagle3.attention.head_count_kv": (c.num_key_value_heads, u32),
        "eagle3.attention.key_length": (H // c.num_attention_heads, u32),
        "eagle3.attention.value_length": (H // c.num_attention_heads, u32),
        "eagle3.rope.dimension_count": (H // c.num_attention_heads, u32),
        "eagle3.vocab_size": (llama_target.vocab_size, u32),
        "eagle3.target_layers": (LAYER_IDS, [T.ARRAY, T.INT32]),  # llama.cpp reads an int32/uint32 array
        "eagle3.target_hidden_size": (H, u32),
        "eagle3.norm_before_residual": (True, [T.BOOL]),
        "eagle3.norm_before_fc": (False, [T.BOOL]),
    }
    found = fields(path)
    for key, value in expected.items():
        assert found[key] == value, key
    assert found["eagle3.rope.freq_base"][1] == f32
    assert found["eagle3.rope.freq_base"][0] == pytest.approx(c.rope_parameters["rope_theta"])
    assert found["eagle3.attention.layer_norm_rms_epsilon"][1] == f32
    assert found["eagle3.attention.layer_norm_rms_epsilon"][0] == pytest.approx(c.rms_norm_eps)


def test_tensors_names_shapes_types_and_values(exported, llama_target):
    drafter, path = exported
    c, H, N = llama_target.config, llama_target.hidden_size, DRAFT_VOCAB
    q, kv, ff = c.num_attention_heads * (H // c.num_attention_heads), c.num_key_value_heads * (
        H // c.num_attention_heads), c.intermediate_size
    # ggml order (ne: input width first), as llama.cpp's load_arch_tensors creates them
    shapes = {"fc.weight": [3 * H, H], "blk.0.attn_norm.weight": [H], "blk.0.attn_norm_2.weight": [H],
              "blk.0.attn_q.weight": [2 * H, q], "blk.0.attn_k.weight": [2 * H, kv], "blk.0.attn_v.weight": [2 * H, kv],
              "blk.0.attn_output.weight": [q, H], "blk.0.ffn_norm.weight": [H], "blk.0.ffn_gate.weight": [H, ff],
              "blk.0.ffn_up.weight": [H, ff], "blk.0.ffn_down.weight": [ff, H], "output_norm.weight": [H],
              "output.weight": [H, N], "d2t": [N]}
    found = tensors(path)
    assert set(found) == set(shapes)  # no token_embd: the drafter's is the target's; no t2d
    for name, tensor in found.items():
        assert tensor.shape.tolist() == shapes[name], name
        kind = Q.I64 if name == "d2t" else Q.F32 if len(shapes[name]) == 1 else Q.F16
        assert tensor.tensor_type == kind, name

    assert found["d2t"].data.tolist() == [i + int(d) for i, d in enumerate(drafter.d2t)]  # absolute target ids
    state = {k: v.numpy() for k, v in drafter.state_dict().items()}
    ours = {"fc.weight": "fc.weight", "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
            "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
            "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
            "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
            "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
            "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight", "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
            "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    expected = {theirs: state[name] for name, theirs in ours.items()}
    expected["blk.0.attn_q.weight"] = permute(state["layers.0.self_attn.q_proj.weight"], c.num_attention_heads)
    expected["blk.0.attn_k.weight"] = permute(state["layers.0.self_attn.k_proj.weight"], c.num_key_value_heads)
    for name, weight in expected.items():
        stored = gguf.quants.dequantize(found[name].data, found[name].tensor_type)
        np.testing.assert_allclose(stored, weight, rtol=1e-3, atol=1e-6, err_msg=name)


def test_rope_rows_make_llamacpp_rope_compute_ours():
    """llama.cpp's Llama rope rotates pairs (2i, 2i+1); ours (i, i + d/2). With Q/K rows reordered by
    rope_rows, its rotated q.k scores equal ours."""
    torch.manual_seed(0)
    heads, d, T_, width = 2, 8, 5, 12
    wq, wk, x = torch.randn(heads * d, width), torch.randn(heads * d, width), torch.randn(T_, width)
    cos, sin = rotary(torch.arange(T_), d, 10000.0)

    def ours(w):
        return apply_rotary((x @ w.T).view(T_, heads, d).transpose(0, 1), cos, sin)

    def llamacpp_rope(w):
        y = (x @ w.T).view(T_, heads, d // 2, 2)
        c, s = cos[:, None, : d // 2], sin[:, None, : d // 2]
        rotated = torch.stack([y[..., 0] * c - y[..., 1] * s, y[..., 0] * s + y[..., 1] * c], dim=-1)
        return rotated.reshape(T_, heads, d).transpose(0, 1)

    scores = ours(wq) @ ours(wk).transpose(-1, -2)
    theirs = llamacpp_rope(export_gguf.rope_rows(wq, heads)) @ llamacpp_rope(export_gguf.rope_rows(wk, heads)).transpose(-1, -2)
    torch.testing.assert_close(theirs, scores, rtol=1e-5, atol=1e-5)


def test_tokenizer_is_the_targets(exported, tokenizer):
    _, path = exported
    found = fields(path)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    assert found["tokenizer.ggml.model"][0] == "gpt2"
    assert found["tokenizer.ggml.tokens"] == ([token for token, _ in vocab], [T.ARRAY, T.STRING])
    assert found["tokenizer.ggml.token_type"][0][tokenizer.eos_token_id] == 3  # control
    assert found["tokenizer.ggml.eos_token_id"] == (tokenizer.eos_token_id, [T.UINT32])
    assert len(found["tokenizer.ggml.merges"][0]) > 0


def test_embedding_written_when_it_is_not_the_targets(llama_target, llama_dir, make_drafter, tmp_path):
    drafter = make_drafter(llama_target)
    with torch.no_grad():
        drafter.embed_tokens.weight[5] += 1  # a drafter that trained its embedding
    path = export_gguf.save(drafter, tmp_path / "d.gguf", str(llama_dir))
    embedding = tensors(path)["token_embd.weight"]
    assert embedding.shape.tolist() == [llama_target.hidden_size, llama_target.vocab_size]
    assert embedding.tensor_type == Q.F16
    np.testing.assert_allclose(embedding.data, drafter.embed_tokens.weight.numpy(), rtol=1e-3, atol=1e-6)


@pytest.fixture(scope="module")
def gguf_target(tokenizer, tmp_path_factory):
    """(path, FrozenTarget) of a tiny 4-layer Llama GGUF (Q4_1, Q8_0 embedding), converted in a temporary cache."""
    path = write_gguf(tmp_path_factory.mktemp("target") / "tiny.gguf", make_model("llama", tokenizer), tokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULATORS_CACHE", str(tmp_path_factory.mktemp("cache")))
        return path, FrozenTarget.load(TargetConfig(gguf_file=str(path), layer_ids=LAYER_IDS))


def test_gguf_target_tokenizer_copied_and_its_embedding_shared(gguf_target, make_drafter, tmp_path):
    path, target = gguf_target
    draft = export.save(make_drafter(target), tmp_path / "d.gguf", Verifier.of(target), fmt="gguf")
    assert "token_embd.weight" not in tensors(draft)  # the frozen copy equals the file's dequantized Q8_0
    theirs = {k: v for k, v in fields(path).items() if k.startswith("tokenizer.")}
    ours = {k: v for k, v in fields(draft).items() if k.startswith("tokenizer.")}
    assert ours == theirs and "tokenizer.ggml.tokens" in ours


def test_command_line_conversion(llama_target, make_drafter, tmp_path):
    source = export.save(make_drafter(llama_target), tmp_path / "spec", Verifier.of(llama_target))
    export.main([f"source={source}", f"out={tmp_path / 'out' / 'draft.gguf'}", "format=gguf"])
    assert gguf.GGUFReader(tmp_path / "out" / "draft.gguf").fields["general.architecture"].contents() == "eagle3"


def test_refuses_what_llamacpp_cannot_serve(llama_target, llama_dir, make_drafter, text_batch, tmp_path):
    from test_peagle import make_peagle

    from speculators.medusa import MedusaConfig, MedusaDrafter

    out = tmp_path / "d.gguf"
    medusa = MedusaDrafter(MedusaConfig(depth=2), llama_target.hidden_size, llama_target.vocab_size)
    for drafter in (medusa, make_peagle(llama_target, text_batch)):
        with pytest.raises(UserError, match="the gguf format holds eagle3, dspark drafters, not"):
            export.save(drafter, out, Verifier(str(llama_dir), []), fmt="gguf")
        with pytest.raises(UserError, match="llama.cpp serves EAGLE-3 drafters only"):
            export_gguf.save(drafter, out, str(llama_dir))
    with pytest.raises(UserError, match="name it \\*.gguf"):
        export_gguf.save(make_drafter(llama_target), tmp_path / "folder", str(llama_dir))
    assert list(tmp_path.iterdir()) == []


def test_refuses_bad_maps_layers_and_overwrite(llama_target, llama_dir, make_drafter, tmp_path):
    from speculators.eagle3 import Eagle3Drafter
    from speculators.layers import layer_config

    out = tmp_path / "d.gguf"
    drafter = make_drafter(llama_target)
    export_gguf.save(drafter, out, str(llama_dir))
    before = out.read_bytes()
    with pytest.raises(UserError, match="already exists"):
        export_gguf.save(drafter, out, str(llama_dir))
    broken = make_drafter(llama_target)
    broken.d2t = torch.zeros_like(broken.d2t)
    bare = Eagle3Drafter(drafter.cfg, layer_config(llama_target), LAYER_IDS, llama_target.hidden_size)  # no vocab
    for bad in (broken, bare):
        with pytest.raises(UserError, match="d2t"):
            export_gguf.save(bad, out, str(llama_dir), overwrite=True)
    two = Eagle3Drafter(drafter.cfg, layer_config(llama_target), LAYER_IDS[:2], llama_target.hidden_size)
    with pytest.raises(UserError, match="exactly 3 target layers"):
        export_gguf.save(two, out, str(llama_dir), overwrite=True)
    with pytest.raises(UserError, match="llama.cpp's EAGLE-3 has no norm_before_fc .EAGLE-3.1."):
        export_gguf.save(make_drafter(llama_target, norm_before_fc=True), out, str(llama_dir), overwrite=True)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf"]


def test_the_build_joins_the_log_thread_at_exit_or_refuses_a_changed_source(tmp_path):
    """The one patch of llama.cpp's source (engines/llamacpp.py LOG_JOIN), applied once after its anchor."""
    source = tmp_path / "log.cpp"
    source.write_text("static void f() {\n" + llamacpp.LOG_ANCHOR + "}\n")
    llamacpp.join_log_at_exit(source)
    assert source.read_text() == "static void f() {\n" + llamacpp.LOG_ANCHOR + llamacpp.LOG_JOIN + "}\n"
    source.write_text("static void f() {}\n")
    with pytest.raises(UserError, match="LOG_ANCHOR"):
        llamacpp.join_log_at_exit(source)


built = pytest.mark.skipif(not all((llamacpp.cache_dir() / "bin" / tool).is_file() for tool in llamacpp.TOOLS),
                           reason="llama.cpp is not built (engines/llamacpp.py build)")


@built
def test_llamacpp_serves_the_export(gguf_target, make_drafter, tmp_path):
    path, target = gguf_target
    draft = export.save(make_drafter(target), tmp_path / "d.gguf", Verifier.of(target), fmt="gguf")
    run = llamacpp.speculative_simple(path, draft, "def f(x):", n_predict=16, draft_max=3, context=256)
    assert run.n_predict >= 16 and run.n_drafted > 0 and 0 <= run.n_accept <= run.n_drafted


@built
def test_llamacpp_target_only_completion(gguf_target):
    """llama.cpp's baseline for the drafter card: greedy, counted tokens and a decode speed."""
    path, _ = gguf_target
    run = llamacpp.completion(path, "def f(x):", n_predict=16, context=256)
    assert run.n_predict >= 15 and run.decode_tokens_per_s > 0 and run.text.startswith("def f(x):")


def test_llamacpp_bench_continuations_agree_over_their_common_length():
    """speculative-simple may run past n_predict by part of a draft: agreement is over the common length."""
    assert llamacpp_bench.after_prompt("\n\n<s>user: hi\nbot: hello", "user: hi\nbot:") == " hello"
    run = lambda text: llamacpp_bench.Run(1, 1.0, text)
    assert llamacpp_bench.same_output([run(" a b c d")], [run(" a b c")])
    assert not llamacpp_bench.same_output([run(" a b x")], [run(" a b c")])
    with pytest.raises(UserError, match="did not print the prompt"):
        llamacpp_bench.after_prompt("something else", "user: hi")


def test_llamacpp_bench_refuses_a_target_llamacpp_cannot_load(llama_target):
    with pytest.raises(UserError, match="llama.cpp serves GGUF targets"):
        llamacpp_bench.check_gguf_target(llama_target)


@built
def test_llamacpp_bench_runs_both_engines_on_the_same_prompts(gguf_target, make_drafter, tmp_path):
    """Plain, n-gram and EAGLE-3 decoding in llama.cpp beside our engine: speeds, llama.cpp's own
    counters and ours for the same drafter, K and prompts."""
    path, target = gguf_target
    cfg = llamacpp_bench.LlamacppBenchConfig(drafter="unused", max_new_tokens=16, repeats=1,
                                             k=3)
    prompts = evalsets.prompts_of([["def f(x):"], ["import os"]], None, target, cfg.max_new_tokens)
    draft = export.save(make_drafter(target), tmp_path / "d.gguf", Verifier.of(target), fmt="gguf")
    result = llamacpp_bench.run(target, make_drafter(target), prompts, cfg, draft)
    rows = result["methods"]
    assert set(rows) == {"llamacpp_target_only", "llamacpp_target_only_ubatch1", "llamacpp_ngram",
                         "llamacpp_eagle3_chain", "ours_target_only", "ours_eagle3_chain"}
    assert all(row["tokens_per_second"] > 0 for row in rows.values())
    assert rows["llamacpp_target_only"]["outputs_match_llamacpp_target_only"] and result["k"] == 3
    for name in ("llamacpp_eagle3_chain", "ours_eagle3_chain"):
        assert rows[name]["num_draft_tokens"] > 0 and 0 <= rows[name]["acceptance_rate"] <= 1
    parity = result["acceptance_parity"]
    assert parity["ours"] == rows["ours_eagle3_chain"]["acceptance_rate"]
    assert parity["llamacpp"] == rows["llamacpp_eagle3_chain"]["acceptance_rate"]
