"""The frozen target: feature layer ids, the features and logits it returns, and that it never trains."""

import pytest
import torch
from conftest import LAYER_IDS, make_model

from common.config import UserError
from speculators.target import FrozenTarget, TargetConfig


@pytest.fixture(scope="module")
def eight_layer_llama(tokenizer):
    return make_model("llama", tokenizer, num_layers=8, seed=1)


def test_default_layer_ids_for_eight_layers(eight_layer_llama, tokenizer):
    target = FrozenTarget(eight_layer_llama, tokenizer, "tiny-llama-8")
    assert target.num_layers == 8
    assert target.layer_ids == [2, 4, 5]  # hidden_states[2], [L//2], [L-3]


def test_explicit_layer_ids_are_kept(eight_layer_llama, tokenizer):
    assert FrozenTarget(eight_layer_llama, tokenizer, "x", [7, 0, 3]).layer_ids == [7, 0, 3]


@pytest.mark.parametrize("ids,bad", [([0, 1, 8], 8), ([-1, 2, 3], -1), ([2, 4, 100], 100)])
def test_out_of_range_layer_ids_are_a_user_error(eight_layer_llama, tokenizer, ids, bad):
    with pytest.raises(UserError) as e:
        FrozenTarget(eight_layer_llama, tokenizer, "x", ids)
    msg = str(e.value)
    assert "out of range" in msg and f"[{bad}]" in msg and "8 layers" in msg and "layer_ids" in msg


def test_default_layer_ids_of_small_targets_are_refused(tokenizer):
    four = make_model("llama", tokenizer, num_layers=4)
    with pytest.raises(UserError, match="duplicate"):
        FrozenTarget(four, tokenizer, "x")  # default [2, 2, 1]
    two = make_model("llama", tokenizer, num_layers=2)
    with pytest.raises(UserError) as e:
        FrozenTarget(two, tokenizer, "x")  # default [2, 1, -1]
    assert "out of range" in str(e.value) and "explicit" in str(e.value)


def test_duplicate_layer_ids_are_a_user_error(eight_layer_llama, tokenizer):
    with pytest.raises(UserError) as e:
        FrozenTarget(eight_layer_llama, tokenizer, "x", [3, 5, 3])
    assert "duplicate" in str(e.value) and "[3, 5, 3]" in str(e.value)


def test_load_checks_layer_ids_and_paths(llama_dir, tmp_path):
    with pytest.raises(UserError, match="out of range"):
        FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=[0, 1, 4]))
    with pytest.raises(UserError, match="cannot load target"):
        FrozenTarget.load(TargetConfig(name_or_path=str(tmp_path / "missing")))
    with pytest.raises(UserError, match="target.dtype"):
        FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS, dtype="fp8"))


def residual_streams(model, input_ids):
    """Reference features by forward hooks: [embeddings, after layer 1, ..., after layer L, final norm]."""
    inner = model.model
    captured = {}
    hooks = [inner.embed_tokens.register_forward_hook(lambda m, i, o: captured.__setitem__(0, o))]
    for k, layer in enumerate(inner.layers, start=1):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o, k=k: captured.__setitem__(k, o[0] if isinstance(o, tuple) else o)))
    hooks.append(inner.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("norm", o)))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    for h in hooks:
        h.remove()
    return captured, logits


def test_features_and_logits_match_the_model(target, text_batch):
    ids = text_batch[:, :32]
    out = target(ids)
    with torch.no_grad():
        hf = target.model(input_ids=ids, output_hidden_states=True)
    streams, logits = residual_streams(target.model, ids)
    assert len(out.aux_hidden) == len(LAYER_IDS)
    for k, feature in zip(LAYER_IDS, out.aux_hidden):
        assert feature.shape == (2, 32, target.hidden_size) and feature.dtype == torch.float32
        torch.testing.assert_close(feature, hf.hidden_states[k].float())
        torch.testing.assert_close(feature, streams[k].float())  # the residual stream after k layers
    # Distinct layers give distinct features (not the same tensor three times).
    assert not torch.allclose(out.aux_hidden[0], out.aux_hidden[1])
    torch.testing.assert_close(out.last_hidden, streams["norm"].float())
    torch.testing.assert_close(out.logits, logits.float())
    torch.testing.assert_close(out.logits, hf.logits.float())
    assert out.logits.shape == (2, 32, target.vocab_size)
    assert not out.logits.requires_grad and not any(h.requires_grad for h in out.aux_hidden)


def test_features_without_logits_are_the_same_features(target, text_batch):
    """What the hidden-state cache asks for: no lm_head over the row, the features unchanged."""
    ids = text_batch[:, :32]
    full, features = target(ids), target(ids, logits="none")
    assert target.can_skip_logits and features.logits is None
    for with_head, without in zip([*full.aux_hidden, full.last_hidden], [*features.aux_hidden, features.last_hidden]):
        assert torch.equal(with_head, without)


def test_target_is_frozen(target):
    assert not target.model.training
    params = list(target.model.parameters())
    assert params and not any(p.requires_grad for p in params)
    assert not isinstance(target, torch.nn.Module)  # so no holder registers it as a submodule


def test_drafter_module_holds_no_target_weights(llama_target, make_drafter):
    from train.module import DrafterModule
    from train.optim import OptimConfig

    drafter = make_drafter(llama_target)
    module = DrafterModule(drafter, llama_target, OptimConfig(), max_steps=10)
    target_ptrs = {p.data_ptr() for p in llama_target.model.parameters()}
    target_ids = {id(p) for p in llama_target.model.parameters()}

    state = module.state_dict()
    assert set(state) == {f"drafter.{k}" for k in drafter.state_dict()}
    assert not any(t.data_ptr() in target_ptrs for t in state.values())
    assert not any(id(p) in target_ids for p in module.parameters())

    optimizer = module.configure_optimizers()["optimizer"]
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    assert not any(id(p) in target_ids or p.data_ptr() in target_ptrs for p in in_optimizer)
    trainable = {id(p) for p in drafter.parameters() if p.requires_grad}
    assert {id(p) for p in in_optimizer} == trainable
    assert id(drafter.embed_tokens.weight) not in trainable  # the frozen copy of the target's embeddings


# --- targets larger than one device: accelerate's placement (target.device_map) ----------------------


def test_a_target_placed_by_accelerate_with_disk_offload_serves_and_trains_as_the_loaded_one(
        llama_dir, llama_target, make_drafter, text_batch, tmp_path):
    """max_memory of half the weights on the only device (the CPU) sends the rest to disk: the
    features, the logits, the drafter's starting weights, the cache fingerprint and greedy decoding
    (through transformers and accelerate's hooks, not the static session) are those of the target
    loaded whole."""
    from inference.engine import generate
    from inference.sessions import HFSession, open_session

    weights = sum(p.numel() * p.element_size() for p in llama_target.model.parameters())
    placed = FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS, device_map="auto",
                                            max_memory={"cpu": weights // 2}, offload_folder=str(tmp_path / "off")))
    assert placed.placed and "disk" in placed.model.hf_device_map.values()
    assert placed.model.get_output_embeddings().weight.device.type == "meta"  # offloaded: only accelerate has it
    ids = text_batch[:2, :24]
    whole, split = llama_target(ids), placed(ids)
    for a, b in zip([*whole.aux_hidden, whole.last_hidden, whole.logits], [*split.aux_hidden, split.last_hidden,
                                                                            split.logits]):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(placed.lm_head_weight(), llama_target.lm_head_weight())
    torch.testing.assert_close(placed.embedding_weight(), llama_target.embedding_weight())
    assert placed.fingerprint() == llama_target.fingerprint() and placed.device.type == "cpu"
    assert isinstance(open_session(placed, 64), HFSession)
    torch.manual_seed(0)
    drafter = make_drafter(placed)
    prompt = text_batch[0, :12].tolist()
    assert generate(placed, drafter, prompt, 16, k=3).tokens == generate(llama_target, None, prompt, 16, k=0).tokens


def test_placement_keys_are_checked(llama_dir):
    from speculators.quant import QuantConfig

    with pytest.raises(UserError, match=r"target.device_map='everywhere' is not valid; choose one of: None, auto"):
        TargetConfig(name_or_path="x", device_map="everywhere")
    with pytest.raises(UserError, match=r"target.offload_folder='/tmp/x' is not valid: must be null unless "
                                        r"target.device_map is set"):
        TargetConfig(name_or_path="x", offload_folder="/tmp/x")
    with pytest.raises(UserError, match=r"quant.scheme=int8 with target.device_map=auto: .* use one or the other"):
        FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), device_map="auto"), QuantConfig(scheme="int8"))


def test_the_example_offload_config_composes():
    from test_config import composed, typed

    recipe, _ = typed(composed(["conf=eagle3", "target=llama3_70b_offload"]))
    assert recipe.target.big_model_options() == {"device_map": "auto", "max_memory": {0: "70GiB", "cpu": "120GiB"},
                                                 "offload_folder": "/tmp/offload-llama3-70b"}


def test_the_teacher_is_not_autocast_under_bf16_mixed(llama_target, make_drafter, text_batch):
    """trainer.precision=bf16-mixed autocasts the drafter; the target's features and logits stay the served fp32."""
    from train.module import DrafterModule
    from train.optim import OptimConfig

    module = DrafterModule(make_drafter(llama_target), llama_target, OptimConfig(), max_steps=10)
    expected = llama_target(text_batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        online = module.target_outputs({"input_ids": text_batch})
        cached = module.target_outputs({"input_ids": text_batch, "last_hidden": expected.last_hidden,
                                        "aux_hidden": torch.stack(expected.aux_hidden, 1)})
    for out in (online, cached):
        assert torch.equal(out.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(online.aux_hidden, expected.aux_hidden))
