"""Medusa-1 drafter (speculators/medusa.py) on the tiny Llama and Qwen3 targets: config and shapes,
fresh heads equal to the target's lm_head, the loss against a plain reference, training with the
target frozen, the Medusa export, the chain and tree proposers, the engine, and
`python train.py conf=medusa`."""

import json
import math

import pytest
import torch
from conftest import VOCAB_SIZE
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors import safe_open
from test_cli import REPO, run_train

from common.config import UserError, to_dataclass
from inference.drafting import DraftingConfig, MedusaChainProposer, MedusaTreeProposer
from inference.engine import generate, select_rows
from inference.planning import Planner, StepCosts, machine
from inference.sessions import open_session
from speculators import export
from speculators.export import Verifier
from speculators.families import family
from speculators.layers import decoding_linears
from speculators.medusa import DEFAULT_TREE, MedusaConfig, MedusaDrafter

K = 3


def make_medusa(target, seed: int = 0, perturb: bool = True, **fields) -> MedusaDrafter:
    """A Medusa drafter for `target`; `perturb` adds noise to every weight, so that no head is the
    identity or the lm_head (which would hide a wrong head, shift or weight)."""
    torch.manual_seed(seed)
    drafter = MedusaDrafter.from_target(MedusaConfig(**{"depth": K, **fields}), target,
                                        torch.ones(target.vocab_size))
    if perturb:
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return drafter


def fit(drafter: MedusaDrafter, target, sequences: torch.Tensor, steps: int, lr: float) -> list[float]:
    """AdamW steps on one fixed batch; the losses before each step."""
    target_out = target(sequences)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = drafter.training_loss(target_out, sequences, torch.ones_like(sequences))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


# --- config and shapes ----------------------------------------------------------------------------


def test_the_recipe_mirrors_the_config_and_the_family_is_registered():
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["conf=medusa"])
    assert to_dataclass(MedusaConfig, cfg.drafter, "drafter") == MedusaConfig()  # same keys, same defaults
    assert list(cfg.target.layer_ids) == []  # Medusa reads no intermediate layers
    assert family("medusa") is MedusaDrafter and MedusaDrafter.config_class is MedusaConfig


@pytest.mark.parametrize("field, value", [
    ("depth", 0), ("num_layers", 0), ("head_decay", 0.0), ("head_decay", 1.5), ("head_decay", math.inf),
    ("head_decay", math.nan), ("loss", "mse"), ("tree_choices", []), ("tree_choices", [[]]),
    ("tree_choices", [[0], [-1]]), ("tree_choices", [[0], [0]]), ("tree_choices", [[0, 0], [0]]),
    ("tree_choices", [1, 2]), ("tree_choices", [[0.5]]), ("tree_choices", [[True]]), ("tree_choices", [["a"]]),
])
def test_bad_config_values_are_one_line_errors_naming_the_key(field, value):
    with pytest.raises(UserError) as error:
        MedusaConfig(**{field: value})
    assert f"drafter.{field}" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match=f"drafter.{field}"):  # as the CLI builds it from the composed YAML
        to_dataclass(MedusaConfig, OmegaConf.create({field: value}), "drafter")


def test_default_tree_is_a_16_node_tree_over_3_heads():
    cfg = MedusaConfig()
    assert cfg.tree_choices == DEFAULT_TREE and len(DEFAULT_TREE) == 16
    assert MedusaConfig(depth=1).tree_choices == DEFAULT_TREE  # deeper paths are simply not drafted
    assert [sum(len(path) == d for path in DEFAULT_TREE) for d in (1, 2, 3)] == [6, 8, 2]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_parameter_shapes_and_full_vocabulary(target, num_layers):
    H, V = target.hidden_size, target.vocab_size
    drafter = make_medusa(target, num_layers=num_layers)
    expected = {}
    for k in range(K):
        for layer in range(num_layers):
            expected[f"heads.{k}.{layer}.linear.weight"] = (H, H)
            expected[f"heads.{k}.{layer}.linear.bias"] = (H,)
        expected[f"heads.{k}.{num_layers}.weight"] = (V, H)
    assert {name: tuple(t.shape) for name, t in drafter.state_dict().items()} == expected  # no maps saved
    assert drafter.depth == K and drafter.layer_ids == [] and drafter.target_hidden_size == H
    assert torch.equal(drafter.d2t, torch.zeros(V, dtype=torch.long)) and bool(drafter.t2d.all())
    assert torch.equal(drafter.draft_to_target, torch.arange(V))
    assert drafter.head_logits(torch.randn(2, H)).shape == (2, K, V)
    assert all(p.requires_grad for p in drafter.parameters())


@pytest.mark.parametrize("num_layers", [1, 2])
def test_fresh_heads_are_the_targets_lm_head(target, text_batch, num_layers):
    """Zero-initialised ResBlocks are the identity and the projections copy the lm_head, so every
    fresh head gives the target's own logits."""
    drafter = make_medusa(target, perturb=False, num_layers=num_layers)
    out = target(text_batch)
    for head in drafter.heads:
        torch.testing.assert_close(head(out.last_hidden), out.logits, atol=1e-5, rtol=1e-5)
    heads = drafter.head_logits(out.last_hidden[:, -1])
    for k in range(K):
        torch.testing.assert_close(heads[:, k], out.logits[:, -1], atol=1e-5, rtol=1e-5)


# --- the loss -------------------------------------------------------------------------------------


def reference_loss(drafter: MedusaDrafter, target_out, loss_mask: torch.Tensor, kind: str):
    """Plain torch, position by position: head k at t against softmax(target logits at t+k), for t
    whose drafted token t+k+1 exists and is loss-masked; weights decay^k."""
    T = loss_mask.shape[1]
    total, metrics = 0.0, {}
    for j, head in enumerate(drafter.heads):
        k = j + 1
        n = T - k - 1  # positions t < T-k-1: token t+k+1 is in the sequence
        log_q = torch.log_softmax(head(target_out.last_hidden[:, :n]), -1)
        log_p = torch.log_softmax(target_out.logits[:, k:k + n], -1)
        per_position = -(log_p.exp() * log_q).sum(-1)
        if kind == "kl":
            per_position = per_position + (log_p.exp() * log_p).sum(-1)
        counted = loss_mask[:, k + 1:].bool()
        metrics[f"loss_step{j}"] = per_position[counted].mean()
        metrics[f"acc_step{j}"] = (log_q.argmax(-1) == log_p.argmax(-1))[counted].float().mean()
        total = total + drafter.cfg.head_decay**k * metrics[f"loss_step{j}"]
    return total, metrics


@pytest.mark.parametrize("kind", ["soft_ce", "kl"])
def test_loss_and_metrics_are_those_of_the_spec(target, text_batch, kind):
    drafter = make_medusa(target, loss=kind, head_decay=0.7)
    torch.manual_seed(1)
    loss_mask = (torch.rand(text_batch.shape) < 0.7).long()
    out = target(text_batch)
    loss, metrics = drafter.training_loss(out, text_batch, loss_mask)
    expected_loss, expected = reference_loss(drafter, out, loss_mask, kind)
    torch.testing.assert_close(loss, expected_loss, atol=1e-4, rtol=1e-5)
    assert set(metrics) == set(expected)
    for name in expected:
        torch.testing.assert_close(metrics[name].float(), expected[name].float(), atol=1e-4, rtol=1e-5)
    assert 0 < float(metrics["acc_step0"]) < 1  # the metric is not trivially 0 or 1 here


def test_training_lowers_the_loss_and_the_target_stays_frozen(target, text_batch):
    """Medusa-1: only the heads learn. 30 AdamW steps at the recipe's lr on one batch; the KL shows
    the part of the loss the heads can remove."""
    drafter = make_medusa(target, perturb=False, loss="kl")
    loss, _ = drafter.training_loss(target(text_batch), text_batch, torch.ones_like(text_batch))
    loss.backward()
    for head in drafter.heads:  # zero-initialised blocks still learn: SiLU'(0) = 1/2
        assert head[0].linear.weight.grad.abs().sum() > 0 and head[-1].weight.grad.abs().sum() > 0
    assert all(not p.requires_grad and p.grad is None for p in target.model.parameters())
    losses = fit(drafter, target, text_batch, steps=30, lr=1e-3)
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(not p.requires_grad and p.grad is None for p in target.model.parameters())


# --- the Medusa export ----------------------------------------------------------------------------

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_export_round_trip_gives_back_a_drafter_that_serves_identically(target, text_batch, tmp_path):
    drafter = make_medusa(target, num_layers=2, tree_choices=TREE).eval()
    path = export.save(drafter, tmp_path / "medusa", Verifier.of(target))
    config = json.loads((path / "config.json").read_text())
    assert export.format_of(config) == "medusa"
    assert config["medusa_num_heads"] == K and config["medusa_num_layers"] == 2
    assert config["base_model_name_or_path"] == target.name_or_path and config["medusa_choices"] == TREE
    assert config["hidden_size"] == target.hidden_size and config["vocab_size"] == target.vocab_size
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "medusa_lm_head.safetensors"]  # Medusa's name
    with safe_open(str(path / "medusa_lm_head.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {f"{k}.{layer}.linear.{p}" for k in range(K) for layer in range(2) for p in ("weight", "bias")} | {
        f"{k}.2.weight" for k in range(K)}

    loaded, verifier = export.load(path)
    assert isinstance(loaded, MedusaDrafter) and verifier == target.name_or_path
    assert loaded.cfg.tree_choices == TREE and loaded.cfg.num_layers == 2 and loaded.depth == K
    original, restored = drafter.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys() and all(torch.equal(original[n], restored[n]) for n in original)
    x = target(text_batch).last_hidden[:, -1]
    decoding_linears(drafter)  # as export.load serves it
    assert torch.equal(drafter.head_logits(x), loaded.eval().head_logits(x))
    prompt = text_batch[0, :12].tolist()
    for mode in ("chain", "tree"):
        runs = [generate(target, d, prompt, 24, k=K, drafting=DraftingConfig(mode=mode)) for d in (drafter, loaded)]
        assert runs[0].tokens == runs[1].tokens and runs[0].stats.accepted_at == runs[1].stats.accepted_at


def test_reads_medusas_own_config_and_refuses_other_drafters(llama_target, make_drafter, tmp_path):
    """FasterDecoding's config.json records only the three medusa keys: the sizes come from the
    weights and the tree is the default."""
    path = export.save(make_medusa(llama_target), tmp_path / "medusa", Verifier.of(llama_target))
    config = json.loads((path / "config.json").read_text())
    medusas_own = {key: config[key] for key in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")}
    (path / "config.json").write_text(json.dumps(medusas_own))
    loaded, _ = export.load(path)
    assert loaded.cfg.tree_choices == DEFAULT_TREE and loaded.target_hidden_size == llama_target.hidden_size
    assert len(loaded.t2d) == VOCAB_SIZE
    with pytest.raises(UserError, match="the medusa format holds medusa drafters, not eagle3"):
        export.save(make_drafter(llama_target), tmp_path / "eagle3_as_medusa", Verifier.of(llama_target),
                    fmt="medusa")


# --- proposers ------------------------------------------------------------------------------------


def prefilled(proposer_class, drafter, target, prompt: list[int], k: int = K, **drafting):
    """A proposer after the prompt, and the heads' logits [K, V] at the prompt's last position."""
    out = open_session(target, 128)(torch.tensor([prompt]))
    proposer = proposer_class(drafter, k, target.vocab_size, 128, DraftingConfig(mode="tree", **drafting))
    proposer.prefill(prompt, int(out.logits[0, -1].argmax()), out)
    return proposer, drafter.head_logits(out.last_hidden[:, -1])[0]


def test_chain_drafts_are_each_heads_argmax_at_the_last_verified_position(target, text_batch):
    drafter, prompt = make_medusa(target).eval(), text_batch[0, :12].tolist()
    proposer, heads = prefilled(MedusaChainProposer, drafter, target, prompt)
    draft = proposer.propose(0.0, torch.Generator())
    assert draft.is_chain and draft.tokens == heads.argmax(-1).tolist() and draft.probs is None
    assert len(set(draft.tokens)) > 1  # perturbed heads disagree: the order of the drafts is checked

    # After a verify pass the heads read the row of the bonus token's position: the last one.
    out = select_rows(target(text_batch[:1, :20]), [17, 18, 19])
    proposer.accept(text_batch[0, 18:21].tolist(), out)
    assert proposer.propose(0.0, torch.Generator()).tokens == drafter.head_logits(out.last_hidden[:, -1])[0].argmax(
        -1).tolist()

    sampled = proposer.propose(0.8, torch.Generator().manual_seed(0))
    expected_q = torch.softmax(drafter.head_logits(out.last_hidden[:, -1])[0] / 0.8, -1)
    assert sampled.is_chain and len(sampled.tokens) == K
    torch.testing.assert_close(sampled.probs, expected_q)

    short, _ = prefilled(MedusaChainProposer, drafter, target, prompt, k=2)
    assert short.propose(0.0, torch.Generator()).tokens == draft.tokens[:2]
    with pytest.raises(UserError, match=f"k={K + 1}"):
        MedusaChainProposer(drafter, K + 1, target.vocab_size, 128, DraftingConfig())


def test_only_the_heads_drafted_with_are_computed(target, text_batch):
    """Each head projects onto the whole vocabulary: K=2 computes two heads, and a plan that stops after the
    first draft computes one (a drafter this slow is worth one draft at most)."""
    drafter, prompt = make_medusa(target).eval(), text_batch[0, :12].tolist()
    computed = []
    for i, head in enumerate(drafter.heads):
        head.register_forward_hook(lambda module, args, out, i=i: computed.append(i))
    short, _ = prefilled(MedusaChainProposer, drafter, target, prompt, k=2)
    computed.clear()
    assert len(short.propose(0.0, torch.Generator()).tokens) == 2 and computed == [0, 1]

    planned, _ = prefilled(MedusaChainProposer, drafter, target, prompt)
    planned.planner = Planner(StepCosts([10.0] * (K + 1), 16, "t", machine()), per_pass=False)
    planned.planner.record_draft(1.0, 1)  # 1 s a head against 10 ms a verification
    computed.clear()
    draft = planned.propose(0.0, torch.Generator())
    assert len(draft.tokens) == 1 and len(draft.estimates) == 1 and computed == [0]


def paths_of(draft, heads: torch.Tensor) -> list[tuple[int, ...]]:
    """Each node's path of per-head ranks, read back from its token and its ancestors'."""
    ranking = heads.argsort(-1, descending=True).tolist()
    depths = draft.depths()
    paths = []
    for node, token in enumerate(draft.tokens):
        rank = ranking[depths[node] - 1].index(token)
        parent = draft.parents[node]
        paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
    return paths


@pytest.mark.parametrize("k, total, expected", [
    (K, 100, DEFAULT_TREE),  # the whole default tree (3 deep)
    (2, 100, [path for path in DEFAULT_TREE if len(path) <= 2]),  # k bounds the depth
    (K, 5, DEFAULT_TREE[:5]),  # the engine's node budget keeps the first choices
])
def test_tree_is_built_from_the_choices_over_per_head_top_k(llama_target, text_batch, k, total, expected):
    drafter, prompt = make_medusa(llama_target).eval(), text_batch[0, :12].tolist()
    proposer, heads = prefilled(MedusaTreeProposer, drafter, llama_target, prompt, k=k, tree_total_tokens=total)
    draft = proposer.propose(0.0, torch.Generator())
    assert all(parent < node for node, parent in enumerate(draft.parents))  # parents before children
    paths = paths_of(draft, heads)
    assert sorted(paths) == sorted(map(tuple, expected))
    assert draft.depths() == [len(path) for path in paths] and draft.depths() == sorted(draft.depths())
    assert not draft.is_chain and draft.probs is None


# --- serving with the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fitted() -> dict:
    """target name -> its drafter for the engine tests, fitted once (fitted_drafter)."""
    return {}


def fitted_drafter(cache: dict, target, prompts: list[list[int]], baselines: list[list[int]]) -> MedusaDrafter:
    """A drafter fitted to the target's greedy continuations of the prompts, so that many drafts,
    tree branches beyond the first included, are accepted and many rejected."""
    if target.name_or_path not in cache:
        length = min(len(p) + len(b) for p, b in zip(prompts, baselines))
        drafter = make_medusa(target, perturb=False, loss="kl")
        fit(drafter, target, torch.tensor([(p + b)[:length] for p, b in zip(prompts, baselines)]), steps=60, lr=1e-2)
        cache[target.name_or_path] = drafter.eval()
    return cache[target.name_or_path]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_equals_target_greedy(target, text_batch, fitted, mode):
    prompts = [text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist()]
    baselines = [generate(target, None, prompt, 40, k=0).tokens for prompt in prompts]
    drafter = fitted_drafter(fitted, target, prompts, baselines)
    accepted = proposed = deep = 0
    for prompt, baseline in zip(prompts, baselines):
        spec = generate(target, drafter, prompt, 40, k=K, drafting=DraftingConfig(mode=mode))
        assert spec.tokens == baseline
        accepted += spec.stats.num_accepted_tokens
        proposed += spec.stats.num_draft_tokens
        deep += spec.stats.accepted_at[1]
    assert 0 < accepted < proposed and deep > 0  # whole drafts of 2+ tokens were accepted, others rejected


def test_sampling_with_the_chain_runs_and_trees_refuse_it(llama_target, text_batch):
    drafter, prompt = make_medusa(llama_target).eval(), text_batch[0, :12].tolist()
    out = generate(llama_target, drafter, prompt, 24, k=K, temperature=1.0, seed=3)
    assert len(out.tokens) == 24 and all(0 <= t < VOCAB_SIZE for t in out.tokens) and out.stats.num_drafts > 0
    with pytest.raises(UserError, match="greedily"):
        generate(llama_target, drafter, prompt, 8, k=K, temperature=1.0, drafting=DraftingConfig(mode="tree"))


# --- the recipe through the CLI -------------------------------------------------------------------


def test_train_medusa_through_the_cli(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train([
        "conf=medusa", "trainer.max_steps=3", "logger=none", f"hydra.run.dir={run_dir}",
        f"target.name_or_path={llama_dir}", f"drafter.depth={K}", "data.seq_len=64", "data.batch_size=2",
        "data.max_val_sequences=2", "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3",
        "trainer.num_threads=1", "trainer.progress_bar=false", "serve_eval.every_n_steps=0",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    export_dir = run_dir / "export"
    config = json.loads((export_dir / "config.json").read_text())
    assert export.format_of(config) == "medusa" and config["medusa_num_heads"] == K
    assert config["base_model_name_or_path"] == str(llama_dir)
    drafter, verifier = export.load(export_dir)
    assert isinstance(drafter, MedusaDrafter) and verifier == str(llama_dir)
    assert json.loads((export_dir / "training.json").read_text())["family"] == "medusa"
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["outputs_match_baseline"] is True
    assert list(report["k_sweep"]) == [str(k) for k in range(1, K + 1)]  # the closing report's K, 1 to the depth
    for curve, length in ((report["acceptance_rate_per_position"], report["config"]["k"]),
                          (report["offline_accuracy_per_step"], K)):
        assert len(curve) == length and all(0.0 <= a <= 1.0 for a in curve)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["state_dict"] and all(name.startswith("drafter.heads.") for name in checkpoint["state_dict"])
