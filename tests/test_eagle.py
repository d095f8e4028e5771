"""EAGLE-1 drafter (speculators/eagle.py) on Llama and Qwen3 targets: shapes, the layer without
input norm, the loss and its shifts, frozen embeddings and lm_head, the EAGLE export round trip,
lossless greedy serving with the engine, and `python train.py conf=eagle`.

Indexing (as in the module docstring): drafter position t reads token t+1 and the target's
last hidden state f_t; it predicts f_{t+1} and, through the target's lm_head, token t+2.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import LAYER_IDS
from safetensors import safe_open
from test_cli import run_train

from common.config import UserError
from inference.drafting import DraftingConfig
from inference.engine import generate
from speculators import export
from speculators.eagle import EagleConfig, EagleDrafter
from speculators.export import Verifier
from speculators.families import FAMILIES
from speculators.layers import decoding_linears
from train.module import DrafterModule
from train.optim import OptimConfig

K = 3
# What EAGLE's draft model (cnets1.Model) names its weights, plus the target's lm_head (see export.py).
EAGLE_WEIGHTS = {
    "embed_tokens.weight", "fc.weight", "fc.bias",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "lm_head.weight",
}


def make_eagle(target, seed: int = 0, **fields) -> EagleDrafter:
    torch.manual_seed(seed)
    return EagleDrafter.from_target(EagleConfig(**{"depth": K, **fields}), target,
                                    torch.ones(target.vocab_size))


def trained(target, ids, steps: int = 30, lr: float = 3e-3, seed: int = 0, **fields) -> EagleDrafter:
    """A drafter fitted a little to `ids`, so it agrees with the target often but not always."""
    drafter = make_eagle(target, seed, **fields).train()
    out = target(ids)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss, _ = drafter.training_loss(out, ids, torch.ones_like(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def serve_prefix(drafter, features: torch.Tensor, ids: torch.Tensor, pieces: list[int]):
    """step() over positions 0..T-2 of one sequence, fed in `pieces` of these sizes: (logits, f_hat) [1, T-1, *]."""
    cache = drafter.new_cache(1, ids.shape[1])
    logits, hidden, start = [], [], 0
    for m in pieces:
        lo, hi = drafter.step(cache, ids[:, start + 1 : start + 1 + m], features[:, start : start + m])
        logits.append(lo)
        hidden.append(hi)
        start += m
    return torch.cat(logits, 1), torch.cat(hidden, 1)


# --- shapes and structure -----------------------------------------------------------------------


def test_parameter_shapes_and_full_vocabulary(target):
    c = target.config
    H, V = c.hidden_size, target.vocab_size
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    drafter = make_eagle(target)
    layer = drafter.layers[0]
    assert len(drafter.layers) == 1
    assert drafter.fc.weight.shape == (H, 2 * H) and drafter.fc.bias.shape == (H,)
    attn = layer.self_attn
    assert attn.q_proj.weight.shape == (heads * head_dim, H)
    assert attn.k_proj.weight.shape == (kv_heads * head_dim, H)
    assert attn.v_proj.weight.shape == (kv_heads * head_dim, H)
    assert attn.o_proj.weight.shape == (H, heads * head_dim)
    assert layer.post_attention_layernorm.weight.shape == (H,)
    assert layer.mlp.gate_proj.weight.shape == (c.intermediate_size, H)
    assert layer.mlp.down_proj.weight.shape == (H, c.intermediate_size)
    assert set(drafter.state_dict()) == EAGLE_WEIGHTS  # no norms besides the post-attention one, no maps
    assert drafter.d2t.dtype == torch.int64 and torch.equal(drafter.d2t, torch.zeros(V, dtype=torch.long))
    assert drafter.t2d.dtype == torch.bool and drafter.t2d.shape == (V,) and bool(drafter.t2d.all())
    assert torch.equal(drafter.draft_to_target, torch.arange(V))
    assert drafter.layer_ids == [] and drafter.target_hidden_size == H
    assert FAMILIES["eagle"] is EagleDrafter and drafter.depth == K


def test_embeddings_and_lm_head_are_frozen_copies_of_the_target(target):
    drafter = make_eagle(target)
    target_head = target.model.get_output_embeddings().weight
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens.weight.float())
    assert torch.equal(drafter.lm_head.weight, target_head.float())
    assert drafter.lm_head.weight.data_ptr() != target_head.data_ptr()  # a copy: training never touches the target
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad


def test_the_layer_attends_over_fc_output_without_input_norm(target, text_batch):
    """Attention reads fc's output as it is (EAGLE-1's layer 0 has no input_layernorm), and the
    same tensor is the residual: scaling fc's output scales what q_proj sees."""
    drafter = make_eagle(target)
    layer = drafter.layers[0]
    assert not hasattr(layer, "input_layernorm") and not hasattr(layer, "hidden_norm")
    seen = {}
    hooks = [drafter.fc.register_forward_hook(lambda m, i, o: seen.__setitem__("fc", o)),
             layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q_in", i[0]))]
    with torch.no_grad():
        drafter.eval().training_loss(target(text_batch), text_batch, torch.ones_like(text_batch))
    for h in hooks:
        h.remove()
    assert torch.equal(seen["q_in"], seen["fc"])


def test_output_shapes(target, text_batch):
    drafter = make_eagle(target).eval()
    B, T = text_batch.shape
    H, V = target.hidden_size, target.vocab_size
    out = target(text_batch)
    cache = drafter.new_cache(B, T)
    logits, hidden = drafter.step(cache, text_batch[:, 1:], drafter.features(out)[:, :-1])
    assert logits.shape == (B, T - 1, V) and hidden.shape == (B, T - 1, H)
    assert cache.length == T - 1
    assert torch.equal(drafter.features(out), out.last_hidden)
    loss, metrics = drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
    assert loss.shape == () and torch.isfinite(loss)
    assert set(metrics) == {"loss_regression", "loss_distillation"} | {f"acc_step{j}" for j in range(K)}
    # Training computes only the step it trains; validation (eval mode) unrolls the whole chain.
    _, train_metrics = drafter.train().training_loss(out, text_batch, torch.ones_like(text_batch))
    assert set(train_metrics) == {"loss_regression", "loss_distillation", "acc_step0"}


def test_config_rejects_bad_values():
    for fields, key in (({"depth": 0}, "drafter.depth"),
                        ({"regression_weight": -1.0}, "drafter.regression_weight"),
                        ({"input_noise": -0.1}, "drafter.input_noise"),
                        ({"regression_weight": 0.0, "distillation_weight": 0.0}, "drafter.distillation_weight")):
        with pytest.raises(UserError, match=key):
            EagleConfig(**fields)


# --- the loss -----------------------------------------------------------------------------------


def test_loss_is_regression_plus_distillation_at_the_right_shifts(target, text_batch):
    """The loss, recomputed from the definition with f_hat from the serving path: position t
    (counted when token t+2 is loss-masked) regresses f_{t+1} and matches softmax(target logits at t+1)."""
    drafter = make_eagle(target, regression_weight=0.7, distillation_weight=0.3).eval()
    B, T = text_batch.shape
    out = target(text_batch)
    loss_mask = torch.zeros_like(text_batch)
    loss_mask[0, 10:30], loss_mask[1, 5:] = 1, 1
    loss, metrics = drafter.training_loss(out, text_batch, loss_mask)

    reg, ce, hits, n = 0.0, 0.0, 0, 0
    for b in range(B):
        logits, f_hat = serve_prefix(drafter, out.last_hidden[b : b + 1], text_batch[b : b + 1], [T - 1])
        for t in range(T - 2):
            if not loss_mask[b, t + 2]:
                continue
            n += 1
            reg += F.smooth_l1_loss(f_hat[0, t], out.last_hidden[b, t + 1])
            p = torch.softmax(out.logits[b, t + 1], -1)
            ce += -(p * torch.log_softmax(logits[0, t], -1)).sum()
            hits += int(logits[0, t].argmax() == out.logits[b, t + 1].argmax())
    reg, ce = reg / n, ce / n
    torch.testing.assert_close(metrics["loss_regression"], reg, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics["loss_distillation"], ce, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, 0.7 * reg + 0.3 * ce, rtol=1e-4, atol=1e-5)
    assert metrics["acc_step0"].item() == pytest.approx(hits / n)


def test_uniform_noise_on_input_features_in_training_only(target, text_batch):
    """fc's hidden half is f_t + U(-a/2, a/2) in training, exactly f_t in eval mode."""
    a = 0.3
    drafter = make_eagle(target, input_noise=a)
    out = target(text_batch)
    seen = []
    hook = drafter.fc.register_forward_hook(lambda m, i, o: seen.append(i[0][..., target.hidden_size :]))
    for mode in (drafter.train, drafter.eval):
        mode()
        with torch.no_grad():
            drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
    hook.remove()
    noise = seen[0] - out.last_hidden
    assert 0.4 * a < noise.abs().max() <= a / 2 + 1e-6
    assert abs(noise.mean()) < 0.05 * a  # centred
    assert torch.equal(seen[1], out.last_hidden)


def test_loss_falls_on_a_fixed_batch(target, text_batch):
    drafter = make_eagle(target)
    out = target(text_batch)
    mask = torch.ones_like(text_batch)
    with torch.no_grad():
        before, before_metrics = drafter.eval().training_loss(out, text_batch, mask)
    drafter = trained(target, text_batch, steps=30)
    with torch.no_grad():
        after, after_metrics = drafter.training_loss(out, text_batch, mask)
    # The random target's next-token distributions are near uniform, so the soft cross-entropy
    # cannot fall far below their entropy; the feature regression can (0.49 -> 0.17 on llama).
    assert after < 0.8 * before, (before, after)
    assert after_metrics["loss_regression"] < 0.5 * before_metrics["loss_regression"]
    assert after_metrics["loss_distillation"] < before_metrics["loss_distillation"]
    assert after_metrics["acc_step0"] > before_metrics["acc_step0"] + 0.1


def test_frozen_weights_get_no_gradient_and_stay_out_of_the_optimizer(llama_target, text_batch):
    drafter = make_eagle(llama_target).train()
    module = DrafterModule(drafter, llama_target, OptimConfig(), max_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frozen = [drafter.embed_tokens.weight, drafter.lm_head.weight]
    assert not any(id(p) in in_optimizer for p in frozen)
    assert in_optimizer == {id(p) for p in drafter.parameters() if p.requires_grad}
    assert len(in_optimizer) == len(EAGLE_WEIGHTS) - 2

    frozen_before = [p.clone() for p in frozen]
    loss, _ = drafter.training_loss(llama_target(text_batch), text_batch, torch.ones_like(text_batch))
    loss.backward()
    assert all(p.grad is None for p in frozen)
    assert drafter.fc.weight.grad is not None and drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    optimizer.step()
    assert all(torch.equal(p, before) for p, before in zip(frozen, frozen_before))


# --- serving computes what validation measures -------------------------------------------------


def test_step_over_a_prefix_in_pieces_equals_the_training_forward(target, text_batch):
    drafter = trained(target, text_batch, steps=5)
    ids, T = text_batch[:1], text_batch.shape[1]
    features = target(ids).last_hidden
    whole_logits, whole_hidden = serve_prefix(drafter, features, ids, [T - 1])
    piece_logits, piece_hidden = serve_prefix(drafter, features, ids, [10, 1, 7, T - 19])
    torch.testing.assert_close(piece_hidden, whole_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(piece_logits, whole_logits, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        trained_hidden = drafter.unrolled_step(0, ids[:, 1:], features[:, :-1], [], [])
    torch.testing.assert_close(whole_hidden, trained_hidden, rtol=1e-5, atol=1e-5)


def test_served_chain_equals_the_validation_unroll(target, text_batch):
    """A chain drafted by step() from verified position t, with teacher-forced tokens and its
    own f_hat fed back, computes what the unrolled step j of validation computes at t."""
    drafter = trained(target, text_batch, steps=5)
    ids, T = text_batch[:1], text_batch.shape[1]
    features = target(ids).last_hidden
    with torch.no_grad():
        keys, values, unrolled = [], [], []
        hidden = features
        for j in range(K):
            hidden = drafter.unrolled_step(j, torch.cat([ids[:, 1 + j :], ids[:, : 1 + j] * 0], 1), hidden, keys,
                                           values)
            unrolled.append(hidden)
    for t in (3, 17, T - K - 2):
        cache = drafter.new_cache(1, T + K)
        _, hidden = drafter.step(cache, ids[:, 1 : t + 2], features[:, : t + 1])
        hidden = hidden[:, -1:]
        torch.testing.assert_close(hidden[0, 0], unrolled[0][0, t], rtol=1e-5, atol=1e-5)
        for j in range(1, K):
            _, hidden = drafter.step(cache, ids[:, t + 1 + j : t + 2 + j], hidden)
            torch.testing.assert_close(hidden[0, 0], unrolled[j][0, t], rtol=1e-5, atol=1e-5)


# --- export -------------------------------------------------------------------------------------


def test_eagle_export_round_trip(target, text_batch, tmp_path):
    drafter = trained(target, text_batch, steps=3, depth=4)
    out_dir = export.save(drafter, tmp_path / "export", Verifier("org/base-model", ["LlamaForCausalLM"]))
    config = json.loads((out_dir / "config.json").read_text())
    assert export.format_of(config) == "eagle"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["bias"] is True and config["tie_word_embeddings"] is False
    assert config["base_model_name_or_path"] == "org/base-model" and config["num_speculative_tokens"] == 4
    c = target.config
    assert config["vocab_size"] == target.vocab_size and config["hidden_size"] == c.hidden_size
    assert config["intermediate_size"] == c.intermediate_size and config["num_key_value_heads"] == c.num_key_value_heads
    assert config["head_dim"] == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert config["rope_theta"] == drafter.layer_cfg.rope_parameters["rope_theta"]
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == EAGLE_WEIGHTS

    loaded, verifier = export.load(out_dir)
    assert verifier == "org/base-model"
    assert isinstance(loaded, EagleDrafter) and loaded.cfg.depth == 4
    original, again = drafter.state_dict(), loaded.state_dict()
    assert set(original) == set(again)
    assert all(torch.equal(again[name], tensor) for name, tensor in original.items())
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)

    # The loaded drafter serves exactly as the saved one, both as export.load serves them: a prefix,
    # then a chain of its own outputs.
    ids = text_batch[:1, :20]
    features = target(ids).last_hidden
    results = []
    for model in (decoding_linears(drafter), loaded.eval()):
        cache = model.new_cache(1, 32)
        logits, hidden = model.step(cache, ids[:, 1:], features[:, :-1])
        chain = [logits, hidden]
        for _ in range(3):
            logits, hidden = model.step(cache, logits[:, -1:].argmax(-1), hidden[:, -1:])
            chain += [logits, hidden]
        results.append(chain)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_eagle_format_is_told_apart_from_the_others():
    eagle = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "base_model_name_or_path": "x"}
    assert export.format_of(eagle) == "eagle"
    assert export.format_of({**eagle, "speculators_model_type": "eagle3"}) == "speculators"
    eagle3_original = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 32,
                       "eagle_config": {"use_aux_hidden_state": True}}
    assert export.format_of(eagle3_original) != "eagle"
    assert export.format_of({**eagle, "num_hidden_layers": 32}) is None  # a whole model, not a draft
    assert export.format_of({k: v for k, v in eagle.items() if k != "base_model_name_or_path"}) is None


# --- serving with the engine --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_equals_target_greedy(target, text_batch, mode):
    """Token for token the target's own greedy output. The drafter is fitted to the target's greedy
    continuations of the prompts, so drafts are accepted in part (tau about 2 on these targets) and
    both caches are rolled back past rejected drafts."""
    prompts = (text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist())
    baselines = [generate(target, None, prompt, 30, k=0).tokens for prompt in prompts]
    length = min(len(p) + len(b) for p, b in zip(prompts, baselines))
    drafter = trained(target, torch.tensor([(p + b)[:length] for p, b in zip(prompts, baselines)]), steps=60)
    drafting = DraftingConfig(mode=mode, tree_top_k=2, tree_total_tokens=6)
    accepted = proposed = 0
    for prompt, baseline in zip(prompts, baselines):
        spec = generate(target, drafter, prompt, 30, k=K, drafting=drafting)
        assert spec.tokens == baseline
        accepted += spec.stats.num_accepted_tokens
        proposed += spec.stats.num_draft_tokens
    assert 0 < accepted < proposed


# --- the recipe through the CLI -----------------------------------------------------------------


def test_train_eagle_through_the_cli(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    layer_ids = "[" + ",".join(map(str, LAYER_IDS)) + "]"  # the default layer ids do not fit a 4-layer target
    result = run_train([
        "conf=eagle", "trainer.max_steps=3", "logger=none", f"hydra.run.dir={run_dir}",
        f"target.name_or_path={llama_dir}", f"target.layer_ids={layer_ids}", f"drafter.depth={K}",
        "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2", "trainer.val_every_n_steps=3",
        "trainer.checkpoint_every_n_steps=3", "trainer.num_threads=1", "trainer.progress_bar=false",
        "serve_eval.every_n_steps=0",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    export_dir = run_dir / "export"
    config = json.loads((export_dir / "config.json").read_text())
    assert export.format_of(config) == "eagle" and config["base_model_name_or_path"] == str(llama_dir)
    drafter, verifier = export.load(export_dir)
    assert isinstance(drafter, EagleDrafter) and verifier == str(llama_dir)
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["outputs_match_baseline"] is True
    for curve, length in ((report["acceptance_rate_per_position"], report["config"]["k"]),
                          (report["offline_accuracy_per_step"], K)):
        assert len(curve) == length and all(0.0 <= a <= 1.0 for a in curve)
