"""The vLLM speculators export: config.json + model.safetensors, round trip, and refusing broken maps."""

import json

import pytest
import torch
from conftest import DRAFT_VOCAB, LAYER_IDS
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.config import UserError
from speculators import draft_vocab, export
from speculators.export import Verifier


def trained_a_little(drafter, target, ids, steps=3):
    """Move the weights off their initial values so the round trip compares something non-trivial."""
    out = target(ids)
    opt = torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        loss, _ = drafter.training_loss(out, ids, torch.ones_like(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter


@pytest.mark.parametrize("fields", [{}, {"norm_before_residual": True}, {"fc_norm": True, "norm_output": True},
                                    {"norm_before_fc": True, "norm_output": True},  # these two: EAGLE-3.1
                                    {"intermediate_size": 80}])  # an MLP wider than the target's
def test_save_load_round_trip(target, make_drafter, text_batch, tmp_path, fields):
    drafter = trained_a_little(make_drafter(target, depth=4, **fields), target, text_batch)
    out_dir = export.save(drafter, tmp_path / "export", Verifier("org/verifier-model", ["SomeForCausalLM"]))
    assert out_dir == tmp_path / "export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no partial folder left behind
    config = json.loads((out_dir / "config.json").read_text())
    for flag in ("fc_norm", "norm_before_fc", "norm_output"):  # EAGLE-3.1's flags, written when set
        assert config.get(flag, False) == fields.get(flag, False), flag
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ({f"fc_norm.{i}.weight" for i in range(len(LAYER_IDS))} <= names) == fields.get("fc_norm", False)
    assert ("input_norm.weight" in names) == fields.get("norm_before_fc", False)

    loaded, verifier = export.load(out_dir)
    assert verifier == "org/verifier-model"
    original, again = drafter.state_dict(), loaded.state_dict()
    assert set(original) == set(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype, name
        assert torch.equal(again[name], tensor), name
    assert loaded.cfg == drafter.cfg
    assert loaded.layer_ids == LAYER_IDS
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        assert getattr(loaded.layer_cfg, field) == getattr(drafter.layer_cfg, field), field
    assert loaded.layer_cfg.rope_parameters["rope_theta"] == drafter.layer_cfg.rope_parameters["rope_theta"]

    # The loaded drafter computes exactly what the saved one did.
    out = target(text_batch)
    with torch.no_grad():
        loss_a, metrics_a = drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
        loss_b, metrics_b = loaded.training_loss(out, text_batch, torch.ones_like(text_batch))
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)


def test_bf16_export_without_embeddings_takes_the_targets(llama_target, make_drafter, text_batch, tmp_path):
    """The shipped form: bfloat16 weights, embed_tokens left out (the target's own); loaded back and given
    the target's embeddings it drafts what the bf16-rounded drafter drafts."""
    drafter = trained_a_little(make_drafter(llama_target, depth=2), llama_target, text_batch)
    out_dir = export.save(drafter, tmp_path / "lean", Verifier.of(llama_target), dtype="bfloat16",
                          shared_embedding=True)
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16 and f.get_tensor("d2t").dtype == torch.int64
    assert json.loads((out_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"

    loaded, _ = export.load(out_dir)
    assert loaded.embedding_from_target
    export.share_target_embedding(loaded, llama_target)
    assert torch.equal(loaded.embed_tokens.weight, llama_target.embedding_weight().float())
    rounded = {name: t.to(torch.bfloat16).float() if t.is_floating_point() and name != "embed_tokens.weight" else t
               for name, t in drafter.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, rounded[name]), name

    sglang = export.save(drafter, tmp_path / "eagle3", Verifier.of(llama_target), fmt="eagle3", shared_embedding=True)
    with safe_open(str(sglang / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()  # SGLang and vLLM share the target's
    from speculators.medusa import MedusaConfig, MedusaDrafter

    medusa = MedusaDrafter(MedusaConfig(depth=2), llama_target.hidden_size, llama_target.vocab_size)
    with pytest.raises(UserError, match="only EAGLE-3"):
        export.save(medusa, tmp_path / "medusa", Verifier.of(llama_target), shared_embedding=True)
    with pytest.raises(UserError, match="floating-point"):
        export.save(drafter, tmp_path / "int", Verifier.of(llama_target), dtype="int8")


def test_config_and_tensors_in_the_export(target, make_drafter, tmp_path):
    drafter = make_drafter(target, depth=3)
    out_dir = export.save(drafter, tmp_path / "export", Verifier("/models/my-target", Verifier.of(target).architectures))
    config = json.loads((out_dir / "config.json").read_text())
    V, N = target.vocab_size, DRAFT_VOCAB

    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3DraftModel"]
    assert config["draft_vocab_size"] == N
    assert config["target_hidden_size"] == target.hidden_size
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert "norm_before_residual" in config and config["norm_before_residual"] is False  # explicit: vLLM defaults to true
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["verifier"]["name_or_path"] == "/models/my-target"
    assert spec["verifier"]["architectures"] == [type(target.model).__name__]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    layer = config["transformer_layer_config"]
    assert layer["vocab_size"] == V and layer["hidden_size"] == target.hidden_size
    assert layer["num_hidden_layers"] == 1 and layer["model_type"] == "llama"

    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        fc, lm_head = f.get_tensor("fc.weight"), f.get_tensor("lm_head.weight")
    assert d2t.dtype == torch.int64 and d2t.shape == (N,)
    assert t2d.dtype == torch.bool and t2d.shape == (V,)
    assert torch.equal(d2t, drafter.d2t) and torch.equal(t2d, drafter.t2d)
    draft_vocab.check(d2t, t2d, V, N)
    assert fc.shape == (target.hidden_size, 3 * target.hidden_size)
    assert lm_head.shape == (N, target.hidden_size)
    assert {"embed_tokens.weight", "norm.weight", "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_proj.weight"} <= names


def test_norm_before_residual_true_is_written(llama_target, make_drafter, tmp_path):
    drafter = make_drafter(llama_target, norm_before_residual=True)
    config = json.loads((export.save(drafter, tmp_path / "e", Verifier("v", ["A"])) / "config.json").read_text())
    assert config["norm_before_residual"] is True


def file_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def broken_maps(drafter):
    """Ways a drafter's d2t/t2d can be wrong; each must be refused."""
    d2t, t2d = drafter.d2t.clone(), drafter.t2d.clone()
    yield "d2t zeros", torch.zeros_like(d2t), t2d
    yield "d2t int32", d2t.to(torch.int32), t2d
    shifted = d2t.clone()
    shifted[3] += 1 if int(draft_vocab.target_ids(d2t)[3]) + 1 < int(draft_vocab.target_ids(d2t)[4]) else -1
    yield "d2t off by one", shifted, t2d
    yield "d2t too short", d2t[:-1], t2d
    yield "t2d all true", d2t, torch.ones_like(t2d)


def test_save_refuses_broken_maps_and_keeps_the_previous_export(llama_target, make_drafter, tmp_path):
    drafter = make_drafter(llama_target)
    out_dir = export.save(drafter, tmp_path / "export", Verifier("v", ["A"]))
    before = file_bytes(out_dir)
    for label, d2t, t2d in list(broken_maps(drafter)):
        drafter.d2t, drafter.t2d = d2t, t2d
        with pytest.raises(UserError, match="d2t|t2d"):
            export.save(drafter, out_dir, Verifier("v", ["A"]), overwrite=True)
        assert file_bytes(out_dir) == before, label
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], label


def test_save_refuses_a_drafter_never_given_a_vocab(llama_target, make_drafter, tmp_path):
    from speculators.eagle3 import Eagle3Drafter
    from speculators.layers import layer_config

    built = make_drafter(llama_target)
    bare = Eagle3Drafter(built.cfg, layer_config(llama_target), LAYER_IDS, llama_target.hidden_size)
    with pytest.raises(UserError):
        export.save(bare, tmp_path / "export", Verifier("v", ["A"]))
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("damage", ["drop d2t", "drop t2d", "d2t int32", "d2t wrong"])
def test_load_refuses_exports_with_bad_maps(llama_target, make_drafter, tmp_path, damage):
    out_dir = export.save(make_drafter(llama_target), tmp_path / "export", Verifier("v", ["A"]))
    weights = load_file(out_dir / "model.safetensors")
    if damage.startswith("drop"):
        del weights[damage.split()[1]]
    elif damage == "d2t int32":
        weights["d2t"] = weights["d2t"].to(torch.int32)
    else:
        weights["d2t"] = torch.zeros_like(weights["d2t"])
    save_file(weights, out_dir / "model.safetensors")
    with pytest.raises(UserError, match="d2t|t2d"):
        export.load(out_dir)


def test_load_refuses_other_model_types_and_missing_files(llama_target, make_drafter, tmp_path):
    with pytest.raises(UserError, match="not a drafter export"):
        export.load(tmp_path)
    out_dir = export.save(make_drafter(llama_target), tmp_path / "export", Verifier("v", ["A"]))
    config = json.loads((out_dir / "config.json").read_text())
    config["speculators_model_type"] = "medusa"
    (out_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="medusa"):
        export.load(out_dir)


# --- the original EAGLE-3 format (SGLang) and conversion between formats ------------------------


def test_eagle3_original_format_round_trip_serves_identically(llama_target, make_drafter, text_batch, tmp_path):
    from inference.engine import generate

    drafter = trained_a_little(make_drafter(llama_target, depth=3), llama_target, text_batch).eval()
    out_dir = export.save(drafter, tmp_path / "sglang", Verifier.of(llama_target), fmt="eagle3")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": LAYER_IDS, "use_aux_hidden_state": True}
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == llama_target.vocab_size
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "midlayer.self_attn.q_proj.weight" in names and not any(n.startswith("layers.") for n in names)
    assert {"d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight"} <= names

    loaded, verifier = export.load(out_dir)
    assert verifier is None  # the format does not name its target
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in drafter.state_dict().items())
    prompt = text_batch[0, :12].tolist()
    here, there = (generate(llama_target, d, prompt, 24, k=3) for d in (drafter, loaded.eval()))
    assert here.tokens == there.tokens
    assert (here.stats.num_drafts, here.stats.num_accepted_tokens, here.stats.accepted_at) == (
        there.stats.num_drafts, there.stats.num_accepted_tokens, there.stats.accepted_at)


def test_eagle3_original_format_refuses_what_it_cannot_hold(llama_target, make_drafter, tmp_path):
    with pytest.raises(UserError, match="norm_before_residual"):
        export.save(make_drafter(llama_target, norm_before_residual=True), tmp_path / "e", Verifier("v", []),
                    fmt="eagle3")
    with pytest.raises(UserError, match="no fc_norm, norm_output .EAGLE-3.1.; export this drafter in the speculators"):
        export.save(make_drafter(llama_target, fc_norm=True, norm_output=True), tmp_path / "e", Verifier("v", []),
                    fmt="eagle3")
    from speculators.medusa import MedusaConfig, MedusaDrafter

    medusa = MedusaDrafter(MedusaConfig(depth=2), llama_target.hidden_size, llama_target.vocab_size)
    for fmt in ("speculators", "eagle3", "eagle"):
        with pytest.raises(UserError, match=f"the {fmt} format holds .* not medusa"):
            export.save(medusa, tmp_path / "e", Verifier("v", []), fmt=fmt)
    with pytest.raises(UserError, match="format=.* is not valid; choose one of"):
        export.save(make_drafter(llama_target), tmp_path / "e", Verifier("v", []), fmt="onnx")
    assert not (tmp_path / "e").exists()


def test_convert_command_between_formats(llama_dir, llama_target, make_drafter, tmp_path):
    import subprocess
    import sys

    source = export.save(make_drafter(llama_target), tmp_path / "spec", Verifier.of(llama_target),
                         training={"steps": 7})

    def convert(*args):
        return subprocess.run([sys.executable, "-m", "speculators.export", *args], capture_output=True,
                              text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})

    to_sglang = convert(f"source={source}", f"out={tmp_path / 'sglang'}", "format=eagle3")
    assert to_sglang.returncode == 0, to_sglang.stderr
    back = convert(f"source={tmp_path / 'sglang'}", f"out={tmp_path / 'back'}", "format=speculators")
    assert back.returncode != 0 and "target=" in back.stderr.splitlines()[-1]  # eagle3 does not name the target
    back = convert(f"source={tmp_path / 'sglang'}", f"out={tmp_path / 'back'}", f"target={llama_dir}")
    assert back.returncode == 0, back.stderr
    assert file_bytes(tmp_path / "back")["model.safetensors"] == file_bytes(source)["model.safetensors"]
    assert json.loads((tmp_path / "back" / "training.json").read_text()) == {"steps": 7}
    again = convert(f"source={source}", f"out={tmp_path / 'sglang'}", "format=eagle3")
    assert again.returncode != 0 and "overwrite" in again.stderr
