"""EAGLE-3 drafter: shapes, training-time-test attention, the loss and its masks (Llama and Qwen3 targets)."""

import pytest
import torch
from conftest import DRAFT_VOCAB, LAYER_IDS

from common.config import UserError
from speculators import draft_vocab
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from speculators.layers import layer_config, ttt_attention
from speculators.target import TargetOutput


def capture_logits(drafter):
    """Record the drafter's logits of every TTT step (lm_head outputs), keeping their gradients."""
    steps = []

    def hook(_module, _inputs, out):
        if out.requires_grad:
            out.retain_grad()
        steps.append(out)

    handle = drafter.lm_head.register_forward_hook(hook)
    return steps, handle


def dense(rows: torch.Tensor, loss_mask: torch.Tensor, j: int) -> torch.Tensor:
    """Step j's lm_head rows (or their gradients) as [B, T, D], zero where the step computes none:
    training sends only counted positions (token t+2+j loss-masked) through the lm_head."""
    counted = torch.zeros_like(loss_mask, dtype=torch.bool)
    counted[:, : loss_mask.shape[1] - 2 - j] = loss_mask[:, 2 + j :].bool()
    out = rows.new_zeros(*counted.shape, rows.shape[-1])
    out[counted] = rows
    return out


def expected_trained(target_logits, loss_mask, kept, steps):
    """[steps, B, T] bool: position t of step j is trained on the target's distribution at t+1+j
    (predicting token t+2+j) iff token t+2+j is loss-masked and the target's argmax at t+1+j is in
    the draft vocab. Written from the spec, independent of the drafter's code."""
    B, T = loss_mask.shape
    argmax = target_logits.argmax(-1)
    kept = set(kept.tolist())
    out = torch.zeros(steps, B, T, dtype=torch.bool)
    for j in range(steps):
        for b in range(B):
            for t in range(T):
                if t + 2 + j < T:
                    out[j, b, t] = bool(loss_mask[b, t + 2 + j]) and int(argmax[b, t + 1 + j]) in kept
    return out


# --- shapes -------------------------------------------------------------------------------------


def test_parameter_shapes(target, make_drafter):
    c = target.config
    H, V, N = c.hidden_size, target.vocab_size, DRAFT_VOCAB
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    drafter = make_drafter(target)
    layer = drafter.layers[0]
    assert len(drafter.layers) == 1
    assert drafter.fc.weight.shape == (H, 3 * H) and drafter.fc.bias is None
    attn = layer.self_attn
    assert attn.q_proj.weight.shape == (heads * head_dim, 2 * H)
    assert attn.k_proj.weight.shape == (kv_heads * head_dim, 2 * H)
    assert attn.v_proj.weight.shape == (kv_heads * head_dim, 2 * H)
    assert attn.o_proj.weight.shape == (H, heads * head_dim)
    assert layer.input_layernorm.weight.shape == (H,) and layer.hidden_norm.weight.shape == (H,)
    assert layer.post_attention_layernorm.weight.shape == (H,)
    assert layer.mlp.gate_proj.weight.shape == (c.intermediate_size, H)
    assert layer.mlp.down_proj.weight.shape == (H, c.intermediate_size)
    assert drafter.norm.weight.shape == (H,)
    assert drafter.lm_head.weight.shape == (N, H)
    assert drafter.embed_tokens.weight.shape == (V, H)
    assert drafter.d2t.shape == (N,) and drafter.d2t.dtype == torch.int64
    assert drafter.t2d.shape == (V,) and drafter.t2d.dtype == torch.bool
    draft_vocab.check(drafter.d2t, drafter.t2d, V, N)


def test_from_target_copies_embeddings_and_lm_head_rows(target, make_drafter):
    drafter = make_drafter(target)
    assert not drafter.embed_tokens.weight.requires_grad
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens.weight.float())
    kept = torch.nonzero(drafter.t2d).flatten()
    assert torch.equal(drafter.lm_head.weight, target.model.get_output_embeddings().weight[kept].float())
    # A copy, not a view: training the drafter must not touch the target.
    assert drafter.lm_head.weight.data_ptr() != target.model.get_output_embeddings().weight.data_ptr()


def test_layer_config_follows_the_target(target):
    lc = layer_config(target)
    c = target.config
    assert lc.hidden_size == c.hidden_size and lc.num_attention_heads == c.num_attention_heads
    assert lc.num_key_value_heads == c.num_key_value_heads
    assert lc.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert lc.vocab_size == target.vocab_size and lc.num_hidden_layers == 1


def test_mlp_width_is_the_targets_unless_set(target, make_drafter):
    assert make_drafter(target).cfg.intermediate_size == target.config.intermediate_size
    wide = make_drafter(target, intermediate_size=3 * target.config.intermediate_size)
    assert wide.layers[0].mlp.gate_proj.weight.shape[0] == 3 * target.config.intermediate_size
    assert wide.layers[0].mlp.down_proj.weight.shape[1] == 3 * target.config.intermediate_size
    with pytest.raises(UserError, match="drafter.intermediate_size"):
        Eagle3Config(intermediate_size=0)


def test_eagle31_normalises_fc_input_one_way_only():
    with pytest.raises(UserError, match="drafter.fc_norm and drafter.norm_before_fc .* set one") as error:
        Eagle3Config(fc_norm=True, norm_before_fc=True)
    assert "\n" not in str(error.value)


def test_draft_vocab_larger_than_target_is_a_user_error(target, make_drafter):
    V = target.vocab_size
    with pytest.raises(UserError, match="draft_vocab_size"):
        make_drafter(target, draft_vocab_size=V + 1)
    with pytest.raises(UserError, match=str(V)):
        Eagle3Drafter(Eagle3Config(draft_vocab_size=V + 1), layer_config(target), LAYER_IDS, target.hidden_size)


# --- training-time-test attention ---------------------------------------------------------------


def reference_ttt_attention(q, keys, values):
    """Plain masked softmax attention over the keys of all steps concatenated: step-0 keys are
    seen causally (key position <= query position), step-i keys (i >= 1) only at the same position."""
    T = q.shape[2]
    K, Vv = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    pos = torch.arange(T)
    blocks = [pos[None, :] <= pos[:, None]] + [pos[None, :] == pos[:, None]] * (len(keys) - 1)
    allowed = torch.cat(blocks, dim=1)  # [T, steps * T]
    scores = (q @ K.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ Vv


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_matches_masked_reference(steps):
    g = torch.Generator().manual_seed(steps)
    B, heads, T, d = 2, 3, 7, 8
    q = torch.randn(B, heads, T, d, generator=g, dtype=torch.float64)
    keys = [torch.randn(B, heads, T, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(B, heads, T, d, generator=g, dtype=torch.float64) for _ in range(steps)]
    got = ttt_attention(q, keys, values)
    assert got.shape == (B, heads, T, d)
    torch.testing.assert_close(got, reference_ttt_attention(q, keys, values), rtol=1e-10, atol=1e-10)


def test_ttt_attention_ignores_future_and_other_positions_of_later_steps():
    g = torch.Generator().manual_seed(0)
    B, heads, T, d = 1, 2, 6, 4
    q = torch.randn(B, heads, T, d, generator=g)
    keys = [torch.randn(B, heads, T, d, generator=g) for _ in range(3)]
    values = [torch.randn(B, heads, T, d, generator=g) for _ in range(3)]
    base = ttt_attention(q, keys, values)
    t = 2
    # Change step-0 keys/values after t and later steps' keys/values at every position but t.
    k2, v2 = [k.clone() for k in keys], [v.clone() for v in values]
    k2[0][:, :, t + 1:] += 5
    v2[0][:, :, t + 1:] -= 3
    for i in (1, 2):
        others = [p for p in range(T) if p != t]
        k2[i][:, :, others] += 5
        v2[i][:, :, others] += 7
    assert torch.allclose(ttt_attention(q, k2, v2)[:, :, t], base[:, :, t], atol=1e-6)
    # Changing the chain's value at t itself does change position t.
    v2[2][:, :, t] += 10
    assert not torch.allclose(ttt_attention(q, k2, v2)[:, :, t], base[:, :, t], atol=1e-3)


def test_drafter_logits_do_not_see_the_future(target, make_drafter, text_batch):
    """Step j at position t may read tokens up to t+1+j and target features up to t, nothing later."""
    drafter = make_drafter(target, depth=3)
    ids = text_batch[:1, :24]
    out = target(ids)
    steps, handle = capture_logits(drafter)
    with torch.no_grad():
        drafter.training_loss(out, ids, torch.ones_like(ids))
        base = [s.clone() for s in steps]
        t = 8
        for j in range(3):
            steps.clear()
            ids2 = ids.clone()
            ids2[:, t + 2 + j:] = (ids2[:, t + 2 + j:] + 1) % target.vocab_size
            aux2 = [h.clone() for h in out.aux_hidden]
            for h in aux2:
                h[:, t + 1:] += torch.randn_like(h[:, t + 1:])
            drafter.training_loss(TargetOutput(aux2, out.last_hidden, out.logits), ids2, torch.ones_like(ids))
            torch.testing.assert_close(steps[j][: t + 1], base[j][: t + 1])  # batch 1: row t is position t
            # ... while the token it does read (t+1+j) matters.
            steps.clear()
            ids3 = ids.clone()
            ids3[:, t + 1 + j] = (ids3[:, t + 1 + j] + 1) % target.vocab_size
            drafter.training_loss(out, ids3, torch.ones_like(ids))
            assert not torch.allclose(steps[j][t], base[j][t])
    handle.remove()


def test_later_steps_read_the_previous_step_output(target, make_drafter, text_batch):
    """Step 0's hidden input is fc(target features); step j > 0's is the drafter's own step j-1 output."""
    drafter = make_drafter(target, depth=3)
    layer = drafter.layers[0]
    hidden_in, hidden_out = [], []
    hooks = [layer.hidden_norm.register_forward_pre_hook(lambda m, args: hidden_in.append(args[0])),
             drafter.norm.register_forward_pre_hook(lambda m, args: hidden_out.append(args[0]))]
    out = target(text_batch)
    with torch.no_grad():
        drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
    for h in hooks:
        h.remove()
    assert len(hidden_in) == len(hidden_out) == 3
    fused = torch.cat(out.aux_hidden, dim=-1) @ drafter.fc.weight.T
    torch.testing.assert_close(hidden_in[0], fused)
    T = text_batch.shape[1]
    for j in (1, 2):  # the final norm sees only step j-1's counted positions: t < T - 2 - (j-1)
        assert torch.equal(hidden_in[j][:, : T - 1 - j].flatten(0, 1), hidden_out[j - 1])
        assert not torch.allclose(hidden_in[j], fused)


def test_step_j_uses_rotary_positions_shifted_by_j(target, make_drafter, text_batch, monkeypatch):
    import speculators.layers as layers

    seen = []
    real = layers.rotary

    def recording(positions, *args, **kwargs):
        seen.append(positions.clone())
        return real(positions, *args, **kwargs)

    monkeypatch.setattr(layers, "rotary", recording)
    drafter = make_drafter(target, depth=4)
    with torch.no_grad():
        drafter.training_loss(target(text_batch), text_batch, torch.ones_like(text_batch))
    T = text_batch.shape[1]
    assert len(seen) == 4
    for j, positions in enumerate(seen):
        assert torch.equal(positions.flatten(), torch.arange(T) + j)


# --- the loss -----------------------------------------------------------------------------------


def test_training_loss_falls_on_a_fixed_batch(target, make_drafter, text_batch):
    steps_n, decay = 3, 0.8
    drafter = make_drafter(target, depth=steps_n, step_decay=decay)
    out = target(text_batch)
    mask = torch.ones_like(text_batch)
    # The loss is a soft cross-entropy: its floor is the entropy of the renormalised target
    # distributions it is trained on; what training can remove is the KL above that floor.
    kept = torch.nonzero(drafter.t2d).flatten()
    trained = expected_trained(out.logits, mask, kept, steps_n)
    p = torch.softmax(out.logits[..., kept], dim=-1)
    entropy = -(p * p.log()).sum(-1)  # [B, T] at the target position
    floor = sum(decay**j * entropy[:, 1 + j:][trained[j][:, : entropy.shape[1] - 1 - j]].mean() for j in range(steps_n))
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(30):
        loss, _ = drafter.training_loss(out, text_batch, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    gap = [l - float(floor) for l in losses]
    assert gap[0] > 0.1 and min(gap) > -1e-4, (floor, losses)
    assert gap[-1] < 0.3 * gap[0], (float(floor), losses)
    assert losses[-1] < losses[0]


def test_loss_is_the_decayed_sum_of_step_losses(target, make_drafter, text_batch):
    drafter = make_drafter(target, depth=4, step_decay=0.5)
    loss, metrics = drafter.training_loss(target(text_batch), text_batch, torch.ones_like(text_batch))
    weighted = sum(0.5**j * metrics[f"loss_step{j}"] for j in range(4))
    torch.testing.assert_close(loss.detach(), weighted)
    assert all(metrics[f"loss_step{j}"] > 0 for j in range(4))


def test_step0_loss_is_soft_cross_entropy_to_the_renormalised_target(target, make_drafter, text_batch):
    drafter = make_drafter(target, depth=1)
    out = target(text_batch)
    steps, handle = capture_logits(drafter)
    with torch.no_grad():
        _, metrics = drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
    handle.remove()
    kept = torch.nonzero(drafter.t2d).flatten()
    trained = expected_trained(out.logits, torch.ones_like(text_batch), kept, 1)[0]
    # Position t matches the target at t+1, restricted to the draft vocab and renormalised.
    p = torch.softmax(out.logits[:, 1:, kept], dim=-1)
    logq = torch.log_softmax(dense(steps[0], torch.ones_like(text_batch), 0)[:, :-1], dim=-1)
    ce = -(p * logq).sum(-1)
    expected = ce[trained[:, :-1]].mean()
    torch.testing.assert_close(metrics["loss_step0"], expected)


def test_positions_outside_draft_vocab_and_unmasked_get_no_gradient(target, make_drafter, text_batch):
    steps_n = 3
    drafter = make_drafter(target, depth=steps_n)
    out = target(text_batch)
    kept = torch.nonzero(drafter.t2d).flatten()
    outside = int(torch.nonzero(~drafter.t2d)[0])
    # Force the target's argmax out of the draft vocab at some positions, and mask some tokens.
    logits = out.logits.clone()
    forced = torch.zeros_like(text_batch, dtype=torch.bool)
    forced[0, 5:12] = True
    forced[1, ::3] = True
    logits[forced, outside] = logits.max() + 5
    loss_mask = torch.ones_like(text_batch)
    loss_mask[0, 20:30] = 0
    loss_mask[1, 2] = 0
    trained = expected_trained(logits, loss_mask, kept, steps_n)
    assert trained.any() and (~trained).any()

    steps, handle = capture_logits(drafter)
    loss, _ = drafter.training_loss(TargetOutput(out.aux_hidden, out.last_hidden, logits), text_batch, loss_mask)
    loss.backward()
    handle.remove()
    for j in range(steps_n):
        grad_norm = dense(steps[j].grad, loss_mask, j).abs().sum(-1)  # [B, T]
        assert (grad_norm[~trained[j]] == 0).all(), f"step {j}: untrained positions have gradient"
        assert (grad_norm[trained[j]] > 0).all(), f"step {j}: trained positions have no gradient"


def test_loss_ignores_target_distribution_where_argmax_is_outside(target, make_drafter, text_batch):
    drafter = make_drafter(target, depth=3)
    out = target(text_batch)
    outside = torch.nonzero(~drafter.t2d).flatten()
    logits = out.logits.clone()
    logits[0, 10, outside[0]] = logits.max() + 5  # argmax at (0, 10) is outside the draft vocab
    mask = torch.ones_like(text_batch)
    with torch.no_grad():
        base, _ = drafter.training_loss(TargetOutput(out.aux_hidden, out.last_hidden, logits), text_batch, mask)
        perturbed = logits.clone()
        perturbed[0, 10] += torch.randn(perturbed.shape[-1]) * 3
        perturbed[0, 10, outside[0]] = perturbed[0, 10].max() + 5  # still outside
        again, _ = drafter.training_loss(TargetOutput(out.aux_hidden, out.last_hidden, perturbed), text_batch, mask)
        # Control: the same perturbation at a position whose argmax is inside changes the loss.
        inside = logits.clone()
        inside[0, 11] += torch.randn(inside.shape[-1]) * 3
        inside[0, 11, drafter.draft_to_target[0]] = inside[0, 11].max() + 5
        changed, _ = drafter.training_loss(TargetOutput(out.aux_hidden, out.last_hidden, inside), text_batch, mask)
    assert float(again) == pytest.approx(float(base), rel=1e-6, abs=1e-7)
    assert abs(float(changed) - float(base)) > 1e-4


def test_all_argmaxes_outside_draft_vocab_give_zero_loss(target, make_drafter, text_batch):
    drafter = make_drafter(target, depth=3)
    out = target(text_batch)
    logits = out.logits.clone()
    logits[..., int(torch.nonzero(~drafter.t2d)[0])] = logits.max() + 5
    loss, metrics = drafter.training_loss(TargetOutput(out.aux_hidden, out.last_hidden, logits),
                                          text_batch, torch.ones_like(text_batch))
    assert float(loss.detach()) == 0.0
    assert all(float(metrics[f"loss_step{j}"]) == 0.0 for j in range(3))
    # Nothing can be accepted either: the draft can never produce that token.
    assert all(float(metrics[f"acc_step{j}"]) == 0.0 for j in range(3))


def test_zero_loss_mask_gives_zero_loss_and_no_gradient(target, make_drafter, text_batch):
    drafter = make_drafter(target, depth=2)
    loss, metrics = drafter.training_loss(target(text_batch), text_batch, torch.zeros_like(text_batch))
    assert float(loss.detach()) == 0.0
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    assert all(g is None or float(g.abs().sum()) == 0.0 for g in grads)


def test_per_step_accuracies(target, make_drafter, text_batch):
    steps_n = 4
    drafter = make_drafter(target, depth=steps_n)
    out = target(text_batch)
    mask = torch.ones_like(text_batch)
    mask[1, :10] = 0
    steps, handle = capture_logits(drafter)
    with torch.no_grad():
        _, metrics = drafter.training_loss(out, text_batch, mask)
    handle.remove()
    accs = {k: float(v) for k, v in metrics.items() if k.startswith("acc_step")}
    assert sorted(accs) == [f"acc_step{j}" for j in range(steps_n)]
    assert all(0.0 <= a <= 1.0 for a in accs.values())
    # Accuracy = draft argmax (mapped to target ids) == target argmax, over loss-masked positions.
    T = text_batch.shape[1]
    argmax = out.logits.argmax(-1)
    for j in range(steps_n):
        draft = drafter.draft_to_target[dense(steps[j], mask, j).argmax(-1)]
        hits = total = 0
        for b in range(2):
            for t in range(T - 2 - j):
                if mask[b, t + 2 + j]:
                    total += 1
                    hits += int(draft[b, t] == argmax[b, t + 1 + j])
        assert accs[f"acc_step{j}"] == pytest.approx(hits / total)


def test_accuracy_is_one_when_the_drafter_copies_the_target(target, make_drafter, text_batch):
    """A target whose argmax is the same draft-vocab token everywhere, and a drafter biased to it."""
    drafter = make_drafter(target, depth=3)
    out = target(text_batch)
    token = int(drafter.draft_to_target[7])
    logits = out.logits.clone()
    logits[..., token] = logits.max() + 5
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
        drafter.norm.weight.fill_(1.0)
        drafter.lm_head.weight[7] = 1.0
        drafter.layers[0].self_attn.o_proj.weight.zero_()
        drafter.layers[0].mlp.down_proj.weight.zero_()
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 0] = 1.0  # every hidden unit = low-layer feature 0, made positive below
    aux = [h.clone() for h in out.aux_hidden]
    aux[0][..., 0] = aux[0][..., 0].abs() + 1.0
    _, metrics = drafter.training_loss(TargetOutput(aux, out.last_hidden, logits), text_batch,
                                       torch.ones_like(text_batch))
    assert [float(metrics[f"acc_step{j}"]) for j in range(3)] == [1.0, 1.0, 1.0]


def test_norm_before_residual_changes_the_residual(target, make_drafter, text_batch):
    plain = make_drafter(target, seed=3)
    normed = make_drafter(target, seed=3, norm_before_residual=True)
    layer_a, layer_b = plain.layers[0], normed.layers[0]
    embeds = torch.randn(1, 4, target.hidden_size)
    hidden = torch.randn(1, 4, target.hidden_size) * 10
    res_a, x_a = layer_a.attention_input(embeds, hidden)
    res_b, x_b = layer_b.attention_input(embeds, hidden)
    assert torch.equal(res_a, hidden)
    torch.testing.assert_close(res_b, layer_b.hidden_norm(hidden))
    torch.testing.assert_close(x_a, x_b)
    assert x_a.shape[-1] == 2 * target.hidden_size
