"""P-EAGLE drafter (speculators/peagle.py) on the tiny Llama and Qwen3 targets: shapes and config,
the one-pass attention rule against a dense-mask reference, conditional drop-token sampling, the
loss, train/serve parity, the speculators export, the engine, and `python train.py conf=peagle`."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import DRAFT_VOCAB, LAYER_IDS, VOCAB_SIZE
from safetensors import safe_open
from test_cli import run_train

from common.config import UserError
from inference.engine import generate
from speculators import draft_vocab, export
from speculators.export import Verifier
from speculators.families import family
from speculators.layers import layer_config, rope_theta, rotary, shift_left
from speculators.peagle import PEagleConfig, PEagleDrafter
from speculators.target import TargetOutput

K = 4


def make_peagle(target, text_batch, seed: int = 0, **fields) -> PEagleDrafter:
    """A P-EAGLE drafter whose draft vocab is the batch's top tokens, with random mask_hidden and
    mask embedding (both start as constants, which would hide mistakes in how they are used)."""
    torch.manual_seed(seed)
    fields = {"depth": K, "draft_vocab_size": DRAFT_VOCAB, **fields}
    counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
    drafter = PEagleDrafter.from_target(PEagleConfig(**fields), target, counts)
    with torch.no_grad():
        drafter.mask_hidden.normal_()
        drafter.mask_embedding.normal_()
    return drafter


def dense_reference(drafter: PEagleDrafter, target_out: TargetOutput, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [K, B, T, N] of every (depth, anchor) row, by plain masked attention over all K*T
    rows of a sequence with the mask written from the rule: query (t, d) sees key (t', d') iff
    d' = 0 and t' <= t (the context), or t' = t and d' <= d (its own chain). Depth 0 reads token
    t+1 and fc(target features of t); depth d >= 1 the mask token and fc(mask_hidden); all at
    rotary position t+d."""
    B, T = input_ids.shape
    depths = drafter.depth
    depth, anchor = torch.arange(depths).repeat_interleave(T), torch.arange(T).repeat(depths)
    allowed = ((depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])) | (
        (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None]))
    is_real = depth == 0
    tokens = torch.where(is_real, shift_left(input_ids, 1)[:, anchor], drafter.cfg.mask_token_id)
    fused = drafter.fc(torch.cat(target_out.aux_hidden, dim=-1))[:, anchor]
    hidden = torch.where(is_real[:, None], fused, drafter.fc(drafter.mask_hidden))
    embeds = drafter.embed(tokens)
    cos, sin = rotary(anchor + depth, drafter.layer_cfg.head_dim, rope_theta(drafter.layer_cfg))
    for layer in drafter.layers:
        residual, x = layer.attention_input(embeds, hidden)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        hidden = layer.finish(residual, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
    return drafter.logits(hidden).view(B, depths, T, -1).transpose(0, 1)


def renormalised_entropy(target_logits: torch.Tensor, drafter: PEagleDrafter) -> torch.Tensor:
    p = torch.softmax(target_logits[..., drafter.draft_to_target], dim=-1)
    return -(p * p.log()).sum(-1)


# --- shapes and config ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [2, 3])
def test_parameter_shapes(target, text_batch, num_layers):
    c = target.config
    H, V, N = c.hidden_size, target.vocab_size, DRAFT_VOCAB
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    drafter = make_peagle(target, text_batch, num_layers=num_layers)
    assert len(drafter.layers) == num_layers
    assert drafter.fc.weight.shape == (H, 3 * H) and drafter.fc.bias is None
    assert drafter.mask_hidden.shape == (1, 1, 3 * H) and drafter.mask_hidden.requires_grad
    assert drafter.mask_embedding.shape == (H,) and drafter.mask_embedding.requires_grad
    assert drafter.embed_tokens.weight.shape == (V, H) and not drafter.embed_tokens.weight.requires_grad
    first = drafter.layers[0]  # EAGLE-3's: attention over [embed; hidden], 2H wide
    assert first.self_attn.q_proj.weight.shape == (heads * head_dim, 2 * H)
    assert first.self_attn.k_proj.weight.shape == (kv_heads * head_dim, 2 * H)
    assert first.hidden_norm.weight.shape == (H,)
    for layer in drafter.layers[1:]:  # plain Llama layers over the hidden stream
        assert layer.self_attn.q_proj.weight.shape == (heads * head_dim, H)
        assert layer.self_attn.v_proj.weight.shape == (kv_heads * head_dim, H)
        assert layer.input_layernorm.weight.shape == (H,) and not hasattr(layer, "hidden_norm")
        assert layer.mlp.gate_proj.weight.shape == (c.intermediate_size, H)
    assert drafter.norm.weight.shape == (H,) and drafter.lm_head.weight.shape == (N, H)
    draft_vocab.check(drafter.d2t, drafter.t2d, V, N)
    assert drafter.layer_cfg.num_hidden_layers == num_layers
    assert family("peagle") is PEagleDrafter and PEagleDrafter.config_class is PEagleConfig


@pytest.mark.parametrize("field, value", [("keep_ratio", 0.0), ("keep_ratio", 1.5), ("min_keep", -0.1),
                                          ("min_keep", 2.0), ("num_layers", 0), ("depth", 0),
                                          ("draft_vocab_size", 0), ("mask_token_id", -1)])
def test_bad_config_values_are_one_line_errors(field, value):
    with pytest.raises(UserError, match=f"drafter.{field}={value}"):
        PEagleConfig(**{field: value})


def test_mask_token_outside_the_vocabulary_is_a_user_error(llama_target):
    with pytest.raises(UserError, match=f"drafter.mask_token_id={VOCAB_SIZE}"):
        PEagleDrafter(PEagleConfig(draft_vocab_size=8, mask_token_id=VOCAB_SIZE), layer_config(llama_target),
                      LAYER_IDS, llama_target.hidden_size)


def test_default_mask_token_is_the_highest_unused_id(llama_target, text_batch):
    unused = sorted(set(range(VOCAB_SIZE)) - set(text_batch.flatten().tolist()))
    drafter = make_peagle(llama_target, text_batch)
    assert unused and drafter.cfg.mask_token_id == unused[-1]
    assert make_peagle(llama_target, text_batch, mask_token_id=5).cfg.mask_token_id == 5
    # Its embedding starts as the target's row and is then learned.
    torch.manual_seed(0)
    counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), VOCAB_SIZE)
    fresh = PEagleDrafter.from_target(PEagleConfig(draft_vocab_size=DRAFT_VOCAB), llama_target, counts)
    assert torch.equal(fresh.mask_embedding, llama_target.embed_tokens.weight[unused[-1]])


def test_mask_embedding_learns_and_travels_as_the_row_of_embed_tokens(llama_target, text_batch):
    drafter = make_peagle(llama_target, text_batch)
    loss, _ = drafter.training_loss(llama_target(text_batch), text_batch, torch.ones_like(text_batch))
    loss.backward()
    assert drafter.mask_embedding.grad.abs().sum() > 0 and drafter.mask_hidden.grad.abs().sum() > 0
    assert drafter.embed_tokens.weight.grad is None

    mask_id, table = drafter.cfg.mask_token_id, llama_target.embed_tokens.weight
    state = drafter.state_dict()
    assert "mask_embedding" not in state and "mask_hidden" in state
    assert torch.equal(state["embed_tokens.weight"][mask_id], drafter.mask_embedding)
    others = torch.arange(VOCAB_SIZE) != mask_id
    assert torch.equal(state["embed_tokens.weight"][others], table[others])
    assert torch.equal(drafter.embed_tokens.weight, table)  # folding copied the table, it did not write into it

    other = make_peagle(llama_target, text_batch, seed=1)
    other.load_state_dict(state)
    assert torch.equal(other.mask_embedding, drafter.mask_embedding)
    assert torch.equal(other.embed(torch.tensor([mask_id, 3])), drafter.embed(torch.tensor([mask_id, 3])))


# --- the one-pass attention rule ----------------------------------------------------------------


def test_one_pass_forward_equals_the_dense_mask_reference(target, text_batch):
    drafter = make_peagle(target, text_batch, num_layers=3).eval()
    ids = text_batch[:, :20]
    out = target(ids)
    with torch.no_grad():
        reference = dense_reference(drafter, out, ids)
        everything = torch.ones(K, *ids.shape, dtype=torch.bool)
        got = drafter.parallel_forward(out, ids, everything)
        assert got.shape == (K * ids.numel(), DRAFT_VOCAB)
        torch.testing.assert_close(got.view(reference.shape), reference, rtol=1e-5, atol=1e-5)
        # With dropped rows, every kept row still computes exactly what it computes in the full pass.
        drafter.train()
        torch.manual_seed(3)
        keep = drafter.kept_rows(*ids.shape)
        assert (~keep).any() and keep[0].all()
        torch.testing.assert_close(drafter.parallel_forward(out, ids, keep), reference[keep], rtol=1e-5, atol=1e-5)


def test_a_row_reads_its_context_and_its_chain_and_nothing_else(llama_target, text_batch):
    """Row (t, d) depends on tokens up to t+1 and features up to t; later inputs change nothing."""
    drafter = make_peagle(llama_target, text_batch).eval()
    ids = text_batch[:1, :24]
    out = llama_target(ids)
    everything = torch.ones(K, *ids.shape, dtype=torch.bool)
    with torch.no_grad():
        base = drafter.parallel_forward(out, ids, everything).view(K, 24, -1)
        t = 9
        later_ids = ids.clone()
        later_ids[:, t + 2:] = (later_ids[:, t + 2:] + 1) % VOCAB_SIZE
        later_aux = [h.clone() for h in out.aux_hidden]
        for h in later_aux:
            h[:, t + 1:] += torch.randn_like(h[:, t + 1:])
        changed = drafter.parallel_forward(TargetOutput(later_aux, out.last_hidden, out.logits), later_ids,
                                           everything).view(K, 24, -1)
        torch.testing.assert_close(changed[:, : t + 1], base[:, : t + 1])
        assert not torch.allclose(changed[:, t + 1], base[:, t + 1])
        # Token t+1 is read by depth 0 at t and, through attention, by every deeper row of the chain.
        token_ids = ids.clone()
        token_ids[:, t + 1] = (token_ids[:, t + 1] + 1) % VOCAB_SIZE
        moved = drafter.parallel_forward(out, token_ids, everything).view(K, 24, -1)
        assert all(not torch.allclose(moved[d, t], base[d, t]) for d in range(K))


# --- conditional drop-token sampling --------------------------------------------------------------


def test_drop_token_keeps_the_expected_fractions_and_is_conditional(llama_target, text_batch):
    depths, r, r_min = 6, 0.7, 0.2
    drafter = make_peagle(llama_target, text_batch, depth=depths, keep_ratio=r, min_keep=r_min)
    torch.manual_seed(0)
    keep = drafter.kept_rows(64, 256)
    assert keep.shape == (depths, 64, 256) and keep[0].all()
    expected = [1.0] + [max(r**d, r_min) for d in range(1, depths)]  # 1, .7, .49, .343, .24, .2
    for d in range(depths):
        assert float(keep[d].float().mean()) == pytest.approx(expected[d], abs=0.015), d
    for d in range(1, depths):
        assert not (keep[d] & ~keep[d - 1]).any(), f"depth {d} kept where depth {d - 1} was dropped"
        conditional = float(keep[d][keep[d - 1]].float().mean())
        assert conditional == pytest.approx(expected[d] / expected[d - 1], abs=0.03), d
    # The global RNG decides, so a seeded (or resumed) run draws the same rows.
    torch.manual_seed(0)
    assert torch.equal(drafter.kept_rows(64, 256), keep)
    assert drafter.eval().kept_rows(4, 8).all()


def test_dropped_rows_are_not_computed(llama_target, text_batch):
    drafter = make_peagle(llama_target, text_batch, num_layers=2)
    rows = []
    hooks = [drafter.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2])),
             drafter.layers[1].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))]
    out = llama_target(text_batch)
    torch.manual_seed(5)
    kept = int(drafter.kept_rows(*text_batch.shape).sum())
    torch.manual_seed(5)
    drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
    assert rows == [kept, kept] and kept < K * text_batch.numel()
    rows.clear()
    drafter.eval().training_loss(out, text_batch, torch.ones_like(text_batch))
    assert rows == [K * text_batch.numel()] * 2
    for h in hooks:
        h.remove()


# --- the loss -------------------------------------------------------------------------------------


def test_depth_losses_and_accuracies_are_those_of_the_spec(target, text_batch):
    """Depth d at anchor t: soft cross-entropy to the target's distribution at t+1+d restricted to
    the draft vocab and renormalised, over anchors whose token t+2+d is loss-masked and whose target
    argmax there is in the draft vocab; the loss is the plain (undecayed) sum over depths."""
    drafter = make_peagle(target, text_batch).eval()
    ids = text_batch
    out = target(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 30:] = 0
    with torch.no_grad():
        loss, metrics = drafter.training_loss(out, ids, loss_mask)
        reference = dense_reference(drafter, out, ids)
    T = ids.shape[1]
    argmax = out.logits.argmax(-1)
    total = 0.0
    for d in range(K):
        draft = reference[d, :, : T - 2 - d]  # anchors with a token t+2+d
        target_logits = out.logits[:, 1 + d : T - 1, drafter.draft_to_target]
        counted = loss_mask[:, 2 + d :].bool()
        trained = counted & drafter.t2d[argmax[:, 1 + d : T - 1]]
        ce = -(torch.softmax(target_logits, -1) * torch.log_softmax(draft, -1)).sum(-1)
        torch.testing.assert_close(metrics[f"loss_step{d}"], ce[trained].mean())
        hits = drafter.draft_to_target[draft.argmax(-1)] == argmax[:, 1 + d : T - 1]
        assert float(metrics[f"acc_step{d}"]) == pytest.approx(float(hits[counted].float().mean()))
        total += metrics[f"loss_step{d}"]
    torch.testing.assert_close(loss, total)


def test_loss_falls_on_a_fixed_batch(target, text_batch):
    """30 AdamW steps with drop-token on; the full (eval) loss's excess over its floor, the entropy
    of the renormalised target distributions, shrinks."""
    drafter = make_peagle(target, text_batch)
    out = target(text_batch)
    mask = torch.ones_like(text_batch)
    T = text_batch.shape[1]
    entropy = renormalised_entropy(out.logits, drafter)
    in_vocab = drafter.t2d[out.logits.argmax(-1)]
    floor = sum(float(entropy[:, 1 + d : T - 1][in_vocab[:, 1 + d : T - 1]].mean()) for d in range(K))

    def full_loss() -> float:
        drafter.eval()
        with torch.no_grad():
            value = float(drafter.training_loss(out, text_batch, mask)[0])
        drafter.train()
        return value

    before = full_loss()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(30):
        loss, _ = drafter.training_loss(out, text_batch, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    after = full_loss()
    assert before - floor > 0.5 and after - floor > -1e-4, (floor, before, after)
    assert after - floor < 0.3 * (before - floor), (floor, before, after)


# --- serving --------------------------------------------------------------------------------------


def test_served_drafts_equal_the_training_logits_at_the_anchor(target, text_batch):
    """draft() after a prefix returns, for its last position t, the logits of depths 0..K-1 at
    anchor t of the one-pass training forward (no dropping), whatever chunks the prefix came in."""
    drafter = make_peagle(target, text_batch, num_layers=2).eval()
    ids = text_batch[:1, :30]
    out = target(ids)
    tokens, features = shift_left(ids, 1), drafter.features(out)
    with torch.no_grad():
        trained = drafter.parallel_forward(out, ids, torch.ones(K, *ids.shape, dtype=torch.bool)).view(K, 30, -1)
    cache = drafter.new_cache(1, 64)
    assert len(cache) == len(drafter.layers)
    first = drafter.draft(cache, tokens[:, :10], features[:, :10], K)
    assert cache.length == 10 and all(c.length == 10 for c in cache)  # the mask positions are cropped
    torch.testing.assert_close(first, trained[:, 9], rtol=1e-5, atol=1e-5)
    t = 21
    served = drafter.draft(cache, tokens[:, 10 : t + 1], features[:, 10 : t + 1], K)
    assert served.shape == (K, DRAFT_VOCAB) and cache.length == t + 1
    torch.testing.assert_close(served, trained[:, t], rtol=1e-5, atol=1e-5)
    # Fewer drafts than depths: the first k rows; one more verified position moves the anchor.
    fewer = drafter.draft(cache, tokens[:, t + 1 : t + 2], features[:, t + 1 : t + 2], 2)
    torch.testing.assert_close(fewer, trained[:2, t + 1], rtol=1e-5, atol=1e-5)


def teach_target_continuation(target, drafter, prompt: list[int], steps: int = 60) -> None:
    """Train the drafter on the target's own greedy continuation of `prompt`, so it accepts some drafts."""
    sequence = torch.tensor([generate(target, None, prompt, 60, 0).tokens])
    sequence = torch.cat([torch.tensor([prompt]), sequence], dim=1)
    out = target(sequence)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss, _ = drafter.training_loss(out, sequence, torch.ones_like(sequence))
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()


# --- export ---------------------------------------------------------------------------------------


def test_export_round_trip(target, text_batch, tmp_path):
    drafter = make_peagle(target, text_batch, num_layers=2, keep_ratio=0.8, min_keep=0.25)
    out = target(text_batch)
    opt = torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):  # move every weight off its initial value
        loss, _ = drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    out_dir = export.save(drafter, tmp_path / "export", Verifier("org/verifier", ["SomeForCausalLM"]))

    config = json.loads((out_dir / "config.json").read_text())
    H = target.hidden_size
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    assert config["mask_token_id"] == drafter.cfg.mask_token_id  # vLLM requires it
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS and config["norm_before_residual"] is False
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        mask_hidden, table = f.get_tensor("mask_hidden"), f.get_tensor("embed_tokens.weight")
    assert mask_hidden.shape == (1, 1, 3 * H) and torch.equal(mask_hidden, drafter.mask_hidden.detach())
    assert torch.equal(table[drafter.cfg.mask_token_id], drafter.mask_embedding.detach())
    assert "mask_embedding" not in names and "layers.1.hidden_norm.weight" not in names
    assert {"d2t", "t2d", "fc.weight", "layers.0.hidden_norm.weight", "layers.1.input_layernorm.weight",
            "layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "lm_head.weight"} <= names

    loaded, verifier = export.load(out_dir)
    assert verifier == "org/verifier" and isinstance(loaded, PEagleDrafter)
    assert loaded.cfg == drafter.cfg and loaded.layer_ids == LAYER_IDS
    assert torch.equal(loaded.mask_embedding, drafter.mask_embedding)
    original, again = drafter.state_dict(), loaded.state_dict()
    assert set(original) == set(again) and all(torch.equal(again[n], t) for n, t in original.items())
    drafter.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(drafter.training_loss(out, text_batch, torch.ones_like(text_batch))[0],
                           loaded.training_loss(out, text_batch, torch.ones_like(text_batch))[0])


# --- the recipe -----------------------------------------------------------------------------------


def test_train_peagle_end_to_end(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    layer_ids = "[" + ",".join(map(str, LAYER_IDS)) + "]"
    result = run_train([
        "conf=peagle", "trainer.max_steps=3", "logger=none", f"hydra.run.dir={run_dir}",
        f"target.name_or_path={llama_dir}", f"target.layer_ids={layer_ids}", "drafter.draft_vocab_size=128",
        "drafter.depth=3", "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2",
        "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3", "trainer.num_threads=1",
        "trainer.progress_bar=false",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["draft_vocab_size"] == 128
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert 0 <= config["mask_token_id"] < VOCAB_SIZE
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        assert "mask_hidden" in set(f.keys())
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert len(report["acceptance_rate_per_position"]) == report["config"]["k"]
    assert len(report["offline_accuracy_per_step"]) == 3
    assert report["outputs_match_baseline"] is True
