"""DFlash drafter (speculators/dflash.py) on the tiny Llama and Qwen3 targets: config errors, what a
block sees, the loss, train/serve parity, the engine (greedy and sampled), the speculators export,
and `python train.py conf=dflash_pycode`."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import DRAFT_VOCAB, LAYER_IDS, VOCAB_SIZE
from safetensors import safe_open
from test_cli import run_train

from common.config import UserError
from inference.engine import generate
from speculators import draft_vocab, export
from speculators.dflash import DFlashConfig, DFlashDrafter
from speculators.export import Verifier
from speculators.families import family
from speculators.layers import layer_config
from speculators.target import TargetOutput

B = 5  # block size: 4 drafts per pass


def make_dflash(target, text_batch, seed: int = 0, **fields) -> DFlashDrafter:
    """A DFlash drafter whose draft vocab is the batch's top tokens, with a random mask embedding."""
    torch.manual_seed(seed)
    fields = {"block_size": B, "num_layers": 1, "draft_vocab_size": DRAFT_VOCAB, "anchors": 8, **fields}
    counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
    drafter = DFlashDrafter.from_target(DFlashConfig(**fields), target, counts)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    return drafter


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("block_size", 1), ("num_layers", 0), ("anchors", 0), ("gamma", 0.0),
                                          ("draft_vocab_size", 0), ("mask_token_id", -1), ("loss", "'mse'")])
def test_bad_config_values_are_one_line_errors(field, value):
    with pytest.raises(UserError, match=f"drafter.{field}={value}"):
        DFlashConfig(**{field: value.strip("'") if isinstance(value, str) else value})


def test_a_mask_token_outside_the_vocabulary_or_a_block_beyond_the_context_is_one_line(llama_target):
    layer_cfg = layer_config(llama_target)
    with pytest.raises(UserError, match=f"drafter.mask_token_id={VOCAB_SIZE}"):
        DFlashDrafter(DFlashConfig(draft_vocab_size=8, mask_token_id=VOCAB_SIZE), layer_cfg, LAYER_IDS,
                      llama_target.hidden_size)
    too_long = layer_cfg.max_position_embeddings
    with pytest.raises(UserError, match=f"drafter.block_size={too_long}.*below the target's context"):
        DFlashDrafter(DFlashConfig(block_size=too_long, draft_vocab_size=8, mask_token_id=1), layer_cfg, LAYER_IDS,
                      llama_target.hidden_size)


def test_shapes_and_what_is_frozen(target, text_batch):
    c = target.config
    H, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    drafter = make_dflash(target, text_batch, num_layers=2)
    assert family("dflash") is DFlashDrafter and drafter.depth == B - 1
    assert drafter.fc.weight.shape == (H, 3 * H) and drafter.fc.bias is None and drafter.hidden_norm.weight.shape == (H,)
    for layer in drafter.layers:
        assert layer.self_attn.q_proj.weight.shape == (heads * head_dim, H)
        assert layer.self_attn.q_norm.weight.shape == layer.self_attn.k_norm.weight.shape == (head_dim,)
    frozen = {name for name, p in drafter.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight"}
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head_weight()[drafter.draft_to_target].float())
    assert DFlashConfig(block_size=16).slot_weight(8) == pytest.approx(math.exp(-1))
    assert DFlashConfig(block_size=8).slot_weight(5) == pytest.approx(math.exp(-1))


# --- what a block sees ----------------------------------------------------------------------------


def reference_block(drafter: DFlashDrafter, out: TargetOutput, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """Hidden states [block_size, H] of one block of row 0, written from the rule: queries are the block
    [ids[anchor], MASK, ...] at positions anchor.., keys the context features of positions < anchor
    (k_proj/v_proj, k_norm, RoPE at their own positions) and the whole block, no mask."""
    context = drafter.features(out)[:1, :anchor]
    tokens = torch.tensor([[int(ids[0, anchor])] + [drafter.cfg.mask_token_id] * (B - 1)])
    x = drafter.embed(tokens)
    cos, sin = drafter.rotary_table.at(torch.arange(anchor, anchor + B))
    context_cos, context_sin = drafter.rotary_table.at(torch.arange(anchor))
    for layer in drafter.layers:
        h = layer.input_layernorm(x)
        q = layer.self_attn.queries(h, cos, sin)
        k, v = layer.self_attn.keys_values(h, cos, sin)
        ck, cv = layer.self_attn.keys_values(context, context_cos, context_sin)
        attn = F.scaled_dot_product_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2))
        x = x + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(1, B, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x[0]


def test_each_block_of_a_pass_equals_the_block_alone(target, text_batch):
    drafter = make_dflash(target, text_batch, num_layers=2).eval()
    ids = text_batch[:, :32]
    out = target(ids)
    anchors = torch.tensor([[3, 17, 9, 28], [1, 2, 3, 4]])
    with torch.no_grad():
        blocks = drafter.block_forward(drafter.features(out), ids, anchors)
        for i, anchor in enumerate(anchors[0].tolist()):
            torch.testing.assert_close(blocks[0, i], reference_block(drafter, out, ids, anchor), rtol=1e-5, atol=1e-5)


def test_a_block_reads_the_context_before_its_anchor_and_nothing_later(llama_target, text_batch):
    drafter = make_dflash(llama_target, text_batch).eval()
    ids = text_batch[:1, :32]
    out = llama_target(ids)
    anchors = torch.tensor([[10, 20]])
    with torch.no_grad():
        base = drafter.block_forward(drafter.features(out), ids, anchors)
        later_ids = ids.clone()
        later_ids[:, 11:] = (later_ids[:, 11:] + 1) % VOCAB_SIZE
        later_aux = [h.clone() for h in out.aux_hidden]
        for h in later_aux:
            h[:, 10:] += torch.randn_like(h[:, 10:])
        later = TargetOutput(later_aux, out.last_hidden, out.logits)
        changed = drafter.block_forward(drafter.features(later), later_ids, anchors)
        torch.testing.assert_close(changed[0, 0], base[0, 0])  # anchor 10 reads features < 10 and token 10
        assert not torch.allclose(changed[0, 1], base[0, 1])
        anchor_token = ids.clone()
        anchor_token[0, 10] = (anchor_token[0, 10] + 1) % VOCAB_SIZE
        assert not torch.allclose(drafter.block_forward(drafter.features(out), anchor_token, anchors)[0, 0], base[0, 0])


# --- the loss -------------------------------------------------------------------------------------


def test_slot_losses_and_accuracies_are_those_of_the_spec(target, text_batch):
    """Slot k of the block at anchor a: soft cross-entropy to the target's renormalised draft-vocab
    distribution at a+k-1, over blocks whose token a+k is loss-masked (and in the draft vocab for the
    loss); the loss weighs slot k by exp(-(k-1)/gamma)."""
    drafter = make_dflash(target, text_batch, gamma=2.0).eval()
    ids = text_batch
    T = ids.shape[1]
    out = target(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 30:] = 0
    with torch.no_grad():
        loss, metrics = drafter.training_loss(out, ids, loss_mask)
        anchors, valid = drafter.sample_anchors(loss_mask)
        assert valid.all() and (anchors >= 1).all() and bool(loss_mask.gather(1, anchors + 1).all())
        logits = drafter.logits(drafter.block_forward(drafter.features(out), ids, anchors))
    argmax = out.logits.argmax(-1)
    total = 0.0
    for j in range(B - 1):
        k = j + 1
        hits, trained_ce = [], []
        for row in range(2):
            for i, a in enumerate(anchors[row].tolist()):
                if a + k >= T or not loss_mask[row, a + k]:
                    continue
                p = torch.softmax(out.logits[row, a + k - 1, drafter.draft_to_target], -1)
                value = -(p * torch.log_softmax(logits[row, i, k], -1)).sum()
                if drafter.t2d[argmax[row, a + k - 1]]:
                    trained_ce.append(value)
                hits.append(bool(drafter.draft_to_target[logits[row, i, k].argmax()] == argmax[row, a + k - 1]))
        torch.testing.assert_close(metrics[f"loss_step{j}"], torch.stack(trained_ce).mean())
        assert float(metrics[f"acc_step{j}"]) == pytest.approx(sum(hits) / len(hits))
        total += math.exp(-(k - 1) / 2.0) * metrics[f"loss_step{j}"]
    torch.testing.assert_close(loss, total)


def test_loss_falls_on_a_fixed_batch(llama_target, text_batch):
    drafter = make_dflash(llama_target, text_batch, loss="kl")  # KL: 0 at the target, so the fall is visible
    out = llama_target(text_batch)
    mask = torch.ones_like(text_batch)
    drafter.eval()
    with torch.no_grad():
        before = float(drafter.training_loss(out, text_batch, mask)[0])
    drafter.train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(30):
        loss, _ = drafter.training_loss(out, text_batch, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    drafter.eval()
    with torch.no_grad():
        after = float(drafter.training_loss(out, text_batch, mask)[0])
    assert after < 0.5 * before, (before, after)


# --- serving --------------------------------------------------------------------------------------


def test_served_drafts_equal_the_training_block_at_the_anchor(target, text_batch):
    """draft() after a prefix of m verified positions (features of 0..m-1, the anchor token at m) returns
    slots 1..k of the training block at anchor m, whatever chunks the prefix came in; the block is not cached."""
    drafter = make_dflash(target, text_batch, num_layers=2).eval()
    ids = text_batch[:1, :30]
    out = target(ids)
    features = drafter.features(out)
    with torch.no_grad():
        trained = drafter.logits(drafter.block_forward(features, ids, torch.tensor([[10, 22]])))[0]
    cache = drafter.new_cache(1, 64)
    first = drafter.draft(cache, ids[:, 1:11], features[:, :10], B - 1)
    assert cache.length == 10
    torch.testing.assert_close(first, trained[0, 1:], rtol=1e-5, atol=1e-5)
    served = drafter.draft(cache, ids[:, 11:23], features[:, 10:22], 2)
    assert served.shape == (2, DRAFT_VOCAB) and cache.length == 22
    torch.testing.assert_close(served, trained[1, 1:3], rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match=f"drafts at most {B - 1}"):
        drafter.draft(cache, ids[:, 23:24], features[:, 22:23], B)


# --- export ---------------------------------------------------------------------------------------


def test_speculators_export_has_the_documented_keys_and_tensors_and_round_trips(target, text_batch, tmp_path):
    drafter = make_dflash(target, text_batch, num_layers=2)
    out = target(text_batch)
    opt = torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):  # move every trained weight off its initial value
        loss, _ = drafter.training_loss(out, text_batch, torch.ones_like(text_batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    out_dir = export.save(drafter, tmp_path / "export", Verifier("org/verifier", ["SomeForCausalLM"]))

    config = json.loads((out_dir / "config.json").read_text())
    c, H = target.config, target.hidden_size
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert config["block_size"] == B and config["aux_hidden_state_layer_ids"] == LAYER_IDS
    assert config["mask_token_id"] == drafter.cfg.mask_token_id and config["draft_vocab_size"] == DRAFT_VOCAB
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["hidden_size"] == H
    assert "eagle_aux_hidden_state_layer_ids" not in config and "norm_before_residual" not in config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    expected = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
                "lm_head.weight": (DRAFT_VOCAB, H), "embed_tokens.weight": (VOCAB_SIZE, H), "d2t": (DRAFT_VOCAB,),
                "t2d": (VOCAB_SIZE,)}
    for n in range(2):
        p = f"layers.{n}."
        expected |= {p + "self_attn.q_proj.weight": (heads * head_dim, H), p + "self_attn.k_proj.weight":
                     (kv_heads * head_dim, H), p + "self_attn.v_proj.weight": (kv_heads * head_dim, H),
                     p + "self_attn.o_proj.weight": (H, heads * head_dim), p + "self_attn.q_norm.weight": (head_dim,),
                     p + "self_attn.k_norm.weight": (head_dim,), p + "mlp.gate_proj.weight": (c.intermediate_size, H),
                     p + "mlp.up_proj.weight": (c.intermediate_size, H), p + "mlp.down_proj.weight":
                     (H, c.intermediate_size), p + "input_layernorm.weight": (H,),
                     p + "post_attention_layernorm.weight": (H,)}
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == expected
        assert torch.equal(f.get_tensor("embed_tokens.weight")[drafter.cfg.mask_token_id],
                           drafter.mask_embedding.detach())

    loaded, verifier = export.load(out_dir)
    assert verifier == "org/verifier" and isinstance(loaded, DFlashDrafter)
    served = ("block_size", "num_layers", "draft_vocab_size", "mask_token_id")  # anchors and gamma only train
    assert [getattr(loaded.cfg, f) for f in served] == [getattr(drafter.cfg, f) for f in served]
    original, again = drafter.state_dict(), loaded.state_dict()
    assert all(torch.equal(again[n], t) for n, t in original.items())
    prompt = text_batch[0, :12].tolist()
    assert generate(target, loaded.eval(), prompt, 20, 3).tokens == generate(target, drafter.eval(), prompt, 20, 3).tokens
    with pytest.raises(UserError, match="the gguf format holds eagle3, dspark drafters, not dflash"):
        export.save(drafter, tmp_path / "draft.gguf", Verifier("org/verifier", []), fmt="gguf")


def test_original_dflash_export_has_the_authors_keys_and_tensors_and_round_trips(target, text_batch, tmp_path):
    """The layout z-lab/dflash, SGLang and llama.cpp's converter read: Qwen3 keys, dflash_config with layer ids
    one below ours, no embeddings, head or vocabulary maps (the target's), the mask embedding in its own file."""
    drafter = make_dflash(target, text_batch, num_layers=2, draft_vocab_size=VOCAB_SIZE)  # a full vocabulary
    with torch.no_grad():
        drafter.fc.weight.normal_(std=0.1)
    out_dir = export.save(drafter, tmp_path / "original", Verifier.of(target), fmt="dflash")

    config = json.loads((out_dir / "config.json").read_text())
    c, H = target.config, target.hidden_size
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == B and config["num_target_layers"] == c.num_hidden_layers
    assert config["dflash_config"] == {"mask_token_id": drafter.cfg.mask_token_id,
                                       "target_layer_ids": [k - 1 for k in LAYER_IDS]}
    head_dim = getattr(c, "head_dim", None) or H // c.num_attention_heads
    assert {k: config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                   "intermediate_size", "num_hidden_layers", "rms_norm_eps", "vocab_size",
                                   "max_position_embeddings")} == {
        "hidden_size": H, "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": head_dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": 2,
        "rms_norm_eps": pytest.approx(c.rms_norm_eps), "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": c.max_position_embeddings}
    assert config["rope_theta"] == drafter.layer_cfg.rope_parameters["rope_theta"]
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()
                if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")}
    assert shapes == expected and "fc.weight" in shapes and "hidden_norm.weight" in shapes
    mask = torch.load(out_dir / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == drafter.cfg.mask_token_id and torch.equal(mask["embedding"],
                                                                               drafter.mask_embedding.detach())

    loaded, verifier = export.load(out_dir)
    assert verifier is None and loaded.left_to_target == ("embed_tokens.weight", "lm_head.weight")
    export.share_target_embedding(loaded, target)
    assert loaded.layer_ids == LAYER_IDS and loaded.cfg.block_size == B and not loaded.left_to_target
    assert torch.equal(loaded.mask_embedding, drafter.mask_embedding)
    original, again = drafter.state_dict(), loaded.state_dict()
    assert all(torch.equal(again[n], t) for n, t in original.items())
    prompt = text_batch[0, :12].tolist()
    assert generate(target, loaded.eval(), prompt, 20, 3).tokens == generate(target, drafter.eval(), prompt, 20, 3).tokens
    assert (generate(target, loaded, prompt, 20, 3).stats.num_accepted_tokens
            == generate(target, drafter, prompt, 20, 3).stats.num_accepted_tokens)

    (out_dir / "mask_embedding.pt").unlink()  # the authors' own exports: the mask token's row is the target's
    plain, _ = export.load(out_dir)
    export.share_target_embedding(plain, target)
    assert torch.equal(plain.mask_embedding, target.embedding_weight()[drafter.cfg.mask_token_id].float())


def test_original_dflash_export_bad_input_is_one_line(llama_target, text_batch, make_drafter, tmp_path):
    drafter = make_dflash(llama_target, text_batch)
    with pytest.raises(UserError, match="records the target's layer count.*org/verifier"):
        export.save(drafter, tmp_path / "x", Verifier("org/verifier", []), fmt="dflash")
    out_dir = export.save(drafter, tmp_path / "original", Verifier.of(llama_target), fmt="dflash")
    torch.save({"mask_token_id": 7, "embedding": drafter.mask_embedding.detach()}, out_dir / "mask_embedding.pt")
    with pytest.raises(UserError, match=f"mask_embedding.pt is for mask_token_id 7, config.json says "
                                        f"{drafter.cfg.mask_token_id}"):
        export.load(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (out_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="needs dflash_config.mask_token_id and dflash_config.target_layer_ids"):
        export.load(out_dir)
    with pytest.raises(UserError, match="the dflash format holds dflash drafters, not eagle3"):
        export.save(make_drafter(llama_target), tmp_path / "y", Verifier.of(llama_target),
                    fmt="dflash")


# --- the recipe -----------------------------------------------------------------------------------


def test_train_dflash_end_to_end(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    layer_ids = "[" + ",".join(map(str, LAYER_IDS)) + "]"
    result = run_train([
        "conf=dflash_pycode", "trainer.max_steps=3", "logger=none", f"hydra.run.dir={run_dir}",
        f"target.name_or_path={llama_dir}", f"target.layer_ids={layer_ids}", "drafter.draft_vocab_size=128",
        "drafter.block_size=4", "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2",
        "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3", "trainer.num_threads=1",
        "trainer.log_every_n_steps=2",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^step 2/3  .*train/acc_step0", result.stdout, re.M), result.stdout[-2000:]
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert list(report["k_sweep"]) == ["1", "3"]  # the recipe's ks=[1, 3, 7] up to the block's 3 drafts
    assert report["outputs_match_baseline"] is True and len(report["acceptance_rate_per_position"]) == report["config"]["k"]
    assert len(report["offline_accuracy_per_step"]) == 3
