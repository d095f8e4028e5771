"""DSpark drafter (speculators/dspark.py) on the tiny Llama and Qwen3 targets: config errors, the Markov and
confidence heads in training and serving, losslessness in our engine with and without a plan, the
speculators export against speculators 0.9.0's DSparkSpeculatorConfig keys, and refusals in one line."""

import json
import re

import pytest
import torch
from conftest import DRAFT_VOCAB, LAYER_IDS
from test_cli import run_train
from test_sampling import check_two_token_law, tiny_target

from common.config import UserError
from inference.drafting import DraftingConfig
from inference.engine import generate
from inference.planning import StepCosts, machine, target_key
from speculators import draft_vocab, export
from speculators.dspark import DSparkConfig, DSparkDrafter
from speculators.export import Verifier
from speculators.families import family

B = 4  # block size: 4 drafts per pass (the anchor's slot drafts too)

# speculators 0.9.0's DSparkSpeculatorConfig fields beyond the shared speculators keys (its config.py and
# dflash/config.py): what vLLM and llama.cpp's converter read from a DSpark export.
SPECULATORS_DSPARK_KEYS = {"block_size", "aux_hidden_state_layer_ids", "mask_token_id", "target_hidden_size",
                           "transformer_layer_config", "draft_vocab_size", "sample_from_anchor", "markov_rank",
                           "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}


def make_dspark(target, text_batch, seed: int = 0, **fields) -> DSparkDrafter:
    torch.manual_seed(seed)
    fields = {"block_size": B, "num_layers": 1, "draft_vocab_size": DRAFT_VOCAB, "anchors": 8, "markov_rank": 16, **fields}
    counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
    drafter = DSparkDrafter.from_target(DSparkConfig(**fields), target, counts)
    with torch.no_grad():  # heads and mask off their initial values, so the tests see them
        drafter.mask_embedding.normal_()
        drafter.markov_head.markov_w1.weight.normal_()
        drafter.confidence_head.proj.weight.normal_()
    return drafter


@pytest.mark.parametrize("field, value", [("markov_rank", 0), ("markov_head_type", "lstm"),
                                          ("confidence_alpha", -1.0), ("confidence_target", "exact")])
def test_bad_head_settings_are_one_line_errors(field, value):
    with pytest.raises(UserError, match=f"drafter.{field}='?{value}'?"):
        DSparkConfig(**{field: value})


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_training_bias_is_the_serving_bias_of_the_true_previous_tokens(llama_target, text_batch, kind):
    """Every slot's Markov-biased logits and confidence in training equal those of serving the block left to
    right with the true tokens as the drafts before each slot."""
    drafter = make_dspark(llama_target, text_batch, markov_head_type=kind).eval()
    ids = text_batch[:1, :24]
    out = llama_target(ids)
    features = drafter.features(out)
    anchor = 12
    with torch.no_grad():
        hidden = drafter.norm(drafter.block_forward(features, ids, torch.tensor([[anchor]])))[0, 0]
        prev_emb = drafter.markov_head.markov_w1(ids[0, anchor : anchor + B])
        trained = drafter.lm_head(hidden) + drafter.markov_head.block_bias(prev_emb, hidden)
        trained_conf = drafter.confidence(hidden, prev_emb)
        cache = drafter.new_cache(1, 64)
        normed = drafter.draft_block(cache, ids[:, 1 : anchor + 1], features[:, :anchor])
        state = None
        for j in range(B):
            logits, state = drafter.slot(normed[j], int(ids[0, anchor + j]), state)
            torch.testing.assert_close(logits, trained[j], rtol=1e-5, atol=1e-5)
            confidence = drafter.slot_confidence(normed[j], int(ids[0, anchor + j]))
            assert confidence == pytest.approx(float(trained_conf[j]), abs=1e-5)
    assert family("dspark") is DSparkDrafter and drafter.depth == B


def test_the_loss_adds_the_confidence_bce_against_the_acceptance_rate(llama_target, text_batch):
    drafter = make_dspark(llama_target, text_batch, confidence_alpha=0.0).eval()
    out = llama_target(text_batch)
    mask = torch.ones_like(text_batch)
    with torch.no_grad():
        plain, metrics = drafter.training_loss(out, text_batch, mask)
        drafter.cfg.confidence_alpha = 2.0
        with_conf, _ = drafter.training_loss(out, text_batch, mask)
    torch.testing.assert_close(with_conf - plain, 2.0 * metrics["conf_loss"])
    for j in range(B):
        assert 0 < float(metrics[f"accept_step{j}"]) <= 1 and 0 < float(metrics[f"conf_step{j}"]) < 1


@pytest.mark.parametrize("target_kind", ["soft", "hard"])
def test_training_lowers_both_losses_and_the_confidence_follows_acceptance(llama_target, text_batch, target_kind):
    drafter = make_dspark(llama_target, text_batch, loss="kl", confidence_target=target_kind)
    out = llama_target(text_batch)
    mask = torch.ones_like(text_batch)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    drafter.eval()
    with torch.no_grad():
        _, before = drafter.training_loss(out, text_batch, mask)
    drafter.train()
    for _ in range(40):
        loss, _ = drafter.training_loss(out, text_batch, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    with torch.no_grad():
        _, after = drafter.training_loss(out, text_batch, mask)
    assert float(after["conf_loss"]) < float(before["conf_loss"])
    assert float(after["loss_step0"]) < float(before["loss_step0"])
    gap = [abs(float(after[f"conf_step{j}"] - after[f"accept_step{j}"])) for j in range(B)]
    assert max(gap) < 0.2, gap


@pytest.mark.parametrize("plan", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_served_outputs_are_the_targets_own(target, text_batch, plan, temperature, tmp_path):
    """Greedy: identical to target-only decoding; sampled: the same draws' seed gives the target's own
    distribution (checked as identical to the target-only output when the drafter proposes exactly the
    target's tokens is left to test_engine; here, the engine's sampled path runs and stays in the vocabulary)."""
    drafter = make_dspark(target, text_batch).eval()
    prompt = text_batch[0, :12].tolist()
    drafting = DraftingConfig(plan=plan, cost_table=str(tmp_path / "costs.json"))
    plain = generate(target, None, prompt, 24, temperature=temperature, seed=3)
    spec = generate(target, drafter, prompt, 24, k=B, temperature=temperature, seed=3, drafting=drafting)
    if temperature == 0:
        assert spec.tokens == plain.tokens
    assert spec.stats.num_drafts > 0 and all(0 <= t < target.vocab_size for t in spec.tokens)
    if plan:
        assert spec.stats.estimates and all(1 <= pos <= B for pos, _, _ in spec.stats.estimates)
        assert json.loads((tmp_path / "costs.json").read_text())["verify_ms"]


@pytest.mark.parametrize("steep", [False, True])
def test_sampled_markov_drafts_stay_lossless_with_and_without_a_plan(steep, tmp_path):
    """The two-token law of test_engine: Markov drafts sampled slot by slot, and with a plan whose costs make
    it stop at varying lengths (steep: each verified token costs 40% of a step), pass the chi-square test."""
    target = tiny_target(8)
    torch.manual_seed(2)
    cfg = DSparkConfig(block_size=3, draft_vocab_size=6, markov_rank=4, markov_head_type="rnn")
    drafter = DSparkDrafter.from_target(cfg, target, torch.arange(8, 0, -1)).eval()
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_()
        # estimates of about 0.7 that move with the token before each slot: the plan's length depends on the drafts
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.weight[0, drafter.layer_cfg.hidden_size] = 1.0
        drafter.confidence_head.proj.bias.fill_(0.85)
    drafting = None
    if steep:
        table = tmp_path / "costs.json"
        StepCosts([10.0, 14.0, 18.0, 22.0], 4, target_key(target), machine()).save(table)
        drafting = DraftingConfig(plan=True, cost_table=str(table))
    stats = check_two_token_law(target, drafter, k=3, drafting=drafting)
    if steep:
        assert stats.num_drafts < stats.num_draft_tokens < 3 * stats.num_drafts  # plans of 1 to 3 drafts


def test_speculators_export_carries_the_dspark_keys_and_round_trips(target, text_batch, tmp_path):
    drafter = make_dspark(target, text_batch, markov_head_type="gated")
    out_dir = export.save(drafter, tmp_path / "export", Verifier("org/verifier", ["SomeForCausalLM"]))
    config = json.loads((out_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert SPECULATORS_DSPARK_KEYS <= set(config), SPECULATORS_DSPARK_KEYS - set(config)
    assert config["sample_from_anchor"] is True and config["block_size"] == B
    assert config["aux_hidden_state_layer_ids"] == LAYER_IDS and config["markov_head_type"] == "gated"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B
    loaded, _ = export.load(out_dir)
    assert isinstance(loaded, DSparkDrafter)
    state, original = loaded.state_dict(), drafter.state_dict()
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.gate_proj.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias"} <= set(state)
    for name, tensor in original.items():
        torch.testing.assert_close(state[name], tensor, msg=name)


def test_an_export_without_its_heads_is_refused_in_one_line(target, text_batch, tmp_path):
    drafter = make_dspark(target, text_batch)
    out_dir = export.save(drafter, tmp_path / "export", Verifier("org/verifier", []))
    config = json.loads((out_dir / "config.json").read_text())
    config["enable_confidence_head"] = False
    (out_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="no enable_confidence_head: it was trained without the heads"):
        export.load(out_dir)


def test_train_dspark_end_to_end(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    layer_ids = "[" + ",".join(map(str, LAYER_IDS)) + "]"
    result = run_train([
        "conf=dspark_pycode", "trainer.max_steps=3", "logger=none", f"hydra.run.dir={run_dir}",
        f"target.name_or_path={llama_dir}", f"target.layer_ids={layer_ids}", "drafter.draft_vocab_size=128",
        "drafter.block_size=4", "drafter.markov_rank=8", "data.seq_len=64", "data.batch_size=2",
        "data.max_val_sequences=2", "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3",
        "trainer.num_threads=1", "trainer.log_every_n_steps=2",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^step 2/3  .*train/acc_step0", result.stdout, re.M), result.stdout[-2000:]
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["block_size"] == 4
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert list(report["k_sweep"]) == ["1", "3"]  # the recipe's ks=[1, 3, 8] up to the block's 4 drafts
    assert "serve_eval.ks [8]: beyond the 4 drafts this drafter was trained for" in result.stdout
    assert report["outputs_match_baseline"] is True
    plan = report["plan"]  # a confidence head: the report serves the plan too, calibrated on held-out data
    assert plan["outputs_match_baseline"] is True and 1 <= plan["drafts_per_verify"] <= 3
    assert plan["reliability"]["after"]["all"]["drafts"] > 0 and "ece" in plan["reliability"]["before"]["all"]
    assert json.loads((run_dir / "export" / "sts.json").read_text())["sts_temperatures"]
    assert json.loads((run_dir / "export" / "sps.json").read_text())["step_time_ms"]
    assert "planned (drafting.plan, up to K=3)" in result.stdout
    assert report["lookup"]["command"].endswith("drafting.plan=true")  # lookup planned from its own counts too
    assert report["lookup"]["outputs_match_baseline"] is True
