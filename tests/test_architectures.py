"""The architecture matrix: a tiny random target of every family users train drafters for (4 layers, hidden 64, the
tests' BPE tokenizer; sliding windows and Llama-4's attention chunk shorter than every prompt), built from the
installed transformers' own config class. For each: the feature layers are the outputs of the decoder layers they
name; an EAGLE-3 drafter trains a few steps (the trainer's optimizer and the family's loss, in process), exports
(speculators, eagle3 and trtllm formats, each reloaded to the same weights and rope; gguf written) and serves
greedily; target-only decoding equals an
independent reference (no cache: a full forward over the growing sequence, argmax), and so does speculation with
the trained drafter and with the target's own int8 copy (`drafter=self:int8`, which accepts: tau > 1, the verify
path exercised). One `python train.py` run for a representative family (gpt-oss: MoE, YaRN, sliding window).

Each family's outcome goes to a JSON (SUPPORT_MATRIX_JSON, else a temporary file), which
benchmarks/support_table.py turns into docs/support.md; the last test checks that table is this run's.
A family the installed transformers lacks is skipped with its reason and appears in the table as such.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_engine import MAX_NEW, prompts_of

from benchmarks import support_table
from common.corpus import STDLIB_SOURCE
from inference.engine import check_pair, generate
from speculators import export
from speculators.quant import QuantConfig
from speculators.self_draft import SelfDrafter
from speculators.target import FrozenTarget, TargetConfig
from train.optim import OptimConfig, configure

REPO = Path(__file__).resolve().parent.parent

LAYER_IDS = [1, 2, 3]  # outputs of layers 0, 1 and 2 of 4 (the default [2, L//2, L-3] repeats a layer at L=4)
WINDOW = 8  # sliding windows and Llama-4's attention chunk: shorter than every prompt plus its output
TRAIN_STEPS = 3
K = 3
EXPORTS = ("speculators", "eagle3", "trtllm")  # formats that load back; gguf (llama.cpp) is written only
RESULTS: dict[str, dict] = {}
S, F = "sliding_attention", "full_attention"

# family -> (kind, model class, config class, config fields beyond tiny()). The families users train drafters for, then
# those the installed transformers adds that build as cheaply.
FAMILIES = {
    "llama": ("dense", "LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2": ("dense", "Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("dense", "Qwen3ForCausalLM", "Qwen3Config", {}),
    "qwen3_moe": ("moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    "mistral": ("dense, sliding window", "MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("dense, sliding window, soft-capping", "Gemma2ForCausalLM", "Gemma2Config",
               dict(sliding_window=WINDOW)),
    "gemma3_text": ("dense, sliding window, rope per layer type", "Gemma3ForCausalLM", "Gemma3TextConfig",
                    dict(sliding_window=WINDOW, layer_types=[S, S, S, F], rope_parameters={
                        F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                        S: {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma3": ("multimodal (text served)", "Gemma3ForConditionalGeneration", "Gemma3Config", {}),
    "gpt_oss": ("moe, sliding window, YaRN", "GptOssForCausalLM", "GptOssConfig",
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=[S, F, S, F],
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 64,
                                      "rope_theta": 150000.0})),
    "phi3": ("dense, fused qkv", "Phi3ForCausalLM", "Phi3Config", {}),
    "llama4_text": ("moe, chunked attention", "Llama4ForCausalLM", "Llama4TextConfig",
                    dict(intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                         interleave_moe_layer_step=1, attention_chunk_size=WINDOW)),
    "deepseek_v3": ("moe, MLA, YaRN", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(head_dim=None, intermediate_size=192, num_key_value_heads=4, q_lora_rank=32,
                         kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=1, topk_group=1,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "rope_theta": 10000.0})),
    "glm4_moe": ("moe, partial rotary", "Glm4MoeForCausalLM", "Glm4MoeConfig",
                 dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1)),
    "olmo2": ("dense, qk-norm", "Olmo2ForCausalLM", "Olmo2Config", {}),
    "granite": ("dense, logits scaling", "GraniteForCausalLM", "GraniteConfig", dict(logits_scaling=4.0)),
    "cohere": ("dense, logit scale", "CohereForCausalLM", "CohereConfig", {}),
    "qwen3_next": ("hybrid: gated delta-net, moe", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(layer_types=["linear_attention", F] * 2, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "lfm2": ("hybrid: short convolutions", "Lfm2ForCausalLM", "Lfm2Config",
             dict(head_dim=None, layer_types=["conv", F] * 2)),
    "granitemoehybrid": ("hybrid: Mamba-2, moe", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                         dict(head_dim=None, layer_types=["mamba", "attention"] * 2, num_local_experts=4,
                              num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32,
                              mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)),
    # beyond the list: families of the installed transformers users serve
    "qwen3_5_text": ("hybrid: gated delta-net", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                     dict(layer_types=["linear_attention", F] * 2, linear_key_head_dim=16, linear_value_head_dim=16,
                          linear_num_key_heads=2, linear_num_value_heads=4)),
    "qwen3_5_moe_text": ("hybrid: gated delta-net, moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                         dict(layer_types=["linear_attention", F] * 2, linear_key_head_dim=16, linear_value_head_dim=16,
                              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "nemotron_h": ("hybrid: Mamba-2, moe", "NemotronHForCausalLM", "NemotronHConfig",
                   dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], ssm_state_size=16,
                        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=16, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                        use_mamba_kernels=False)),
    "mixtral": ("moe, sliding window", "MixtralForCausalLM", "MixtralConfig",
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen2_moe": ("moe, shared expert", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)),
    "deepseek_v2": ("moe, MLA", "DeepseekV2ForCausalLM", "DeepseekV2Config",
                    dict(head_dim=None, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)),
    "glm4_moe_lite": ("moe, MLA", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig",
                      dict(head_dim=None, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                           topk_group=1)),
    "smollm3": ("dense, NoPE layers", "SmolLM3ForCausalLM", "SmolLM3Config", {}),
    "ministral": ("dense, sliding window", "MinistralForCausalLM", "MinistralConfig", dict(sliding_window=WINDOW)),
    "cohere2": ("dense, sliding window", "Cohere2ForCausalLM", "Cohere2Config", dict(sliding_window=WINDOW)),
    "exaone4": ("dense, sliding window", "Exaone4ForCausalLM", "Exaone4Config", dict(sliding_window=WINDOW)),
    "olmo3": ("dense, sliding window", "Olmo3ForCausalLM", "Olmo3Config", dict(sliding_window=WINDOW)),
    "glm4": ("dense", "Glm4ForCausalLM", "Glm4Config", {}),
    "ernie4_5": ("dense", "Ernie4_5ForCausalLM", "Ernie4_5Config", {}),
    "seed_oss": ("dense", "SeedOssForCausalLM", "SeedOssConfig", {}),
    "starcoder2": ("dense, sliding window", "Starcoder2ForCausalLM", "Starcoder2Config", dict(sliding_window=WINDOW)),
}


def tiny(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def build(family: str, tokenizer) -> torch.nn.Module:
    """The tiny random model of `family`; pytest.skip (recorded) when the installed transformers lacks it."""
    import transformers

    kind, model_name, config_name, fields = FAMILIES[family]
    missing = [name for name in (model_name, config_name) if not hasattr(transformers, name)]
    if missing:
        RESULTS[family] = {"family": family, "kind": kind, "status": "skipped",
                           "reason": f"transformers {transformers.__version__} has no {', '.join(missing)}"}
        pytest.skip(RESULTS[family]["reason"])
    fields = {k: v for k, v in {**tiny(tokenizer), **fields}.items() if v is not None}
    torch.manual_seed(0)
    if family == "gemma3":  # as Gemma-3 4B-27B ship: the text model's settings under text_config
        image, start, end = len(tokenizer), len(tokenizer) + 1, len(tokenizer) + 2
        text = {**fields, "sliding_window": WINDOW, "layer_types": [S, S, S, F]}
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                           image_token_index=image, boi_token_index=start, eoi_token_index=end)
    else:
        config = getattr(transformers, config_name)(**fields)
    return getattr(transformers, model_name)(config).eval()


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.model
    return getattr(base, "language_model", base).layers


def check_features(target: FrozenTarget, ids: torch.Tensor) -> None:
    """Feature k is what decoder layer k-1 outputs, read by a hook on that layer (not from hidden_states)."""
    outputs = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: outputs.setdefault(i, out[0] if isinstance(out, tuple)
                                                                                    else out))
             for i, layer in enumerate(decoder_layers(target.model))]
    try:
        out = target(ids)
    finally:
        for hook in hooks:
            hook.remove()
    for k, feature in zip(target.layer_ids, out.aux_hidden):
        torch.testing.assert_close(feature, outputs[k - 1].float())
    torch.testing.assert_close(target.final_norm(outputs[len(outputs) - 1]), out.last_hidden)


def reference_decode(target: FrozenTarget, prompt: list[int], n: int) -> list[int]:
    """Greedy without any cache: the whole sequence so far through the model, argmax of the last logits."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = target.model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def train_steps(drafter, target: FrozenTarget, batch: torch.Tensor, steps: int) -> list[float]:
    """The trainer's optimizer and schedule (train/optim.py) over the family's loss, as DrafterModule steps it."""
    opt = configure(list(drafter.parameters()), OptimConfig(lr=1e-3, warmup_steps=1), steps)
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    losses = []
    for _ in range(steps):
        loss, _ = drafter.training_loss(target(batch), batch, torch.ones_like(batch))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses


def tau(generations) -> float:
    drafts = sum(g.stats.num_drafts for g in generations)
    return (drafts + sum(g.stats.num_accepted_tokens for g in generations)) / max(drafts, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_architecture(family, tokenizer, text_batch, make_drafter, tmp_path):
    started = time.perf_counter()
    kind = FAMILIES[family][0]
    model = build(family, tokenizer)
    folder = tmp_path / family
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = TargetConfig(name_or_path=str(folder), layer_ids=LAYER_IDS)
    target = FrozenTarget.load(cfg)
    check_features(target, text_batch[:, :24])

    drafter = make_drafter(target)
    losses = train_steps(drafter, target, text_batch[:, :32], TRAIN_STEPS)
    assert all(torch.isfinite(torch.tensor(losses))), losses

    verifier = export.Verifier.of(target)
    trained, loaded = drafter.state_dict(), {}
    for fmt in EXPORTS:  # each reloads to the trained weights and rope
        loaded[fmt], _ = export.load(export.save(drafter, tmp_path / fmt, verifier, fmt=fmt))
        export.share_target_embedding(loaded[fmt], target)
        assert all(torch.equal(trained[name], t) for name, t in loaded[fmt].state_dict().items()), fmt
        assert loaded[fmt].layer_cfg.rope_parameters == drafter.layer_cfg.rope_parameters, fmt
    assert export.save(drafter, tmp_path / "draft.gguf", verifier, fmt="gguf").stat().st_size > 0  # written only
    exported = [*loaded, "gguf"]
    reloaded = loaded["speculators"]  # the one served

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a share of weights left unquantized is said at load
        copy = SelfDrafter.of(FrozenTarget.load(cfg, QuantConfig("int8")), "int8", "none", K)
    check_pair(target, copy)
    with_drafter, with_copy = [], []
    for prompt in prompts_of(text_batch):
        alone = generate(target, None, prompt, MAX_NEW, k=0).tokens
        assert alone == reference_decode(target, prompt, len(alone)), "target-only decoding is not greedy"
        with_drafter.append(generate(target, reloaded, prompt, MAX_NEW, k=K))
        with_copy.append(generate(target, copy, prompt, MAX_NEW, k=K))
        assert with_drafter[-1].tokens == alone and with_copy[-1].tokens == alone
    assert tau(with_copy) > 1, "the int8 copy accepted nothing: the verify path went unexercised"
    layer = reloaded.layer_cfg
    RESULTS[family] = {
        "family": family, "kind": kind, "status": "supported", "model_type": target.config.model_type,
        "recurrent": target.recurrent, "features": LAYER_IDS, "trained_steps": TRAIN_STEPS,
        "loss": [round(x, 3) for x in losses], "exported": exported, "served": True, "lossless": True,
        "tau_trained": round(tau(with_drafter), 2), "tau_self_int8": round(tau(with_copy), 2),
        "drafter_layer": {"heads": layer.num_attention_heads, "kv_heads": layer.num_key_value_heads,
                          "head_dim": layer.head_dim, "mlp": layer.intermediate_size,
                          "rope": layer.rope_parameters.get("rope_type", "default")},
        "seconds": round(time.perf_counter() - started, 1),
    }


def test_a_family_transformers_lacks_is_skipped_with_its_reason_and_tabled(tokenizer, monkeypatch):
    import transformers

    monkeypatch.setitem(FAMILIES, "nonesuch", ("dense", "NonesuchForCausalLM", "NonesuchConfig", {}))
    reason = f"transformers {transformers.__version__} has no NonesuchForCausalLM, NonesuchConfig"
    with pytest.raises(pytest.skip.Exception, match=reason):
        build("nonesuch", tokenizer)
    record = RESULTS.pop("nonesuch")
    assert support_table.row(record)[:3] == ["nonesuch", "dense", f"skipped: {reason}"]
    assert f"| nonesuch | dense | {reason} |" in support_table.short_table([record])


@pytest.mark.skipif(os.environ.get("SUPPORT_MATRIX_SUBPROCESS") == "0", reason="SUPPORT_MATRIX_SUBPROCESS=0")
def test_train_py_trains_exports_and_serves_a_gpt_oss_target(tokenizer, tmp_path):
    """The whole command line for one representative family: `python train.py conf=eagle3` trains, exports (its
    default format) and reports the served outputs identical to target-only decoding."""
    folder = tmp_path / "gpt_oss"
    build("gpt_oss", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "training.json").write_text(json.dumps({"corpus": {"source": STDLIB_SOURCE}}))  # data=stdlib's own
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    args = [sys.executable, str(REPO / "train.py"), "conf=eagle3", f"target.name_or_path={folder}",
            f"target.layer_ids=[{','.join(map(str, LAYER_IDS))}]", "data=stdlib", "eval=data", "logger=none",
            "trainer.max_steps=3",
            "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2", "trainer.val_every_n_steps=3",
            "trainer.num_threads=1", "serve_eval.every_n_steps=0", "eval.num_prompts=2", "serve_eval.ks=[2]",
            "drafter.draft_vocab_size=96", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "drafter rope: yarn" in result.stdout  # the drafter's rope is the target's, said at start
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["outputs_match_baseline"] is True
    drafter, _ = export.load(run_dir / "export")
    assert drafter.layer_cfg.rope_parameters["rope_type"] == "yarn"


def test_the_support_table_is_this_runs():
    """With every family run, their results are written (SUPPORT_MATRIX_JSON) and docs/support.md's table is the
    one they make (columns that do not depend on floating-point order: tau may differ in its last digit)."""
    if set(RESULTS) != set(FAMILIES):
        pytest.skip(f"{len(RESULTS)} of {len(FAMILIES)} families ran (-k?): the table needs all")
    results = [RESULTS[name] for name in FAMILIES]
    path = Path(os.environ.get("SUPPORT_MATRIX_JSON") or Path(tempfile.gettempdir()) / "support_matrix.json")
    support_table.write_results(results, path)
    shipped = support_table.read_table(REPO / "docs" / "support.md")
    assert support_table.stable(shipped) == support_table.stable(support_table.rows(results)), (
        "docs/support.md differs from this run: regenerate it with python -m benchmarks.support_table")
