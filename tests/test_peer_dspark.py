"""speculators 0.9.0's DSpark as a peer (benchmarks/peers/speculators_dspark.py, dspark_bench.py): its flags and
our mask token, a checkpoint of its layout (no embed_tokens) read as our drafter, the bench's commands and conf.
Opt-in (`engines`, slow): a 2-step training in its venv, when that venv exists, converted, matched logit for logit
against speculators' own model and served by our engine."""

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from test_dspark import make_dspark

from benchmarks import peers
from benchmarks.peers import dspark_bench, speculators_dspark, speculators_peer
from speculators import export
from speculators.formats.speculators import speculators_config

REPO = Path(__file__).resolve().parent.parent
# the weights of speculators 0.9.0's DSpark checkpoint (a 1-layer drafter, read from one it wrote): no embed_tokens
THEIR_KEYS = {"confidence_head.proj.bias", "confidence_head.proj.weight", "d2t", "t2d", "fc.weight", "hidden_norm.weight",
              "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "norm.weight",
              *(f"layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "mlp.down_proj", "mlp.gate_proj",
                                                 "mlp.up_proj", "self_attn.k_norm", "self_attn.k_proj", "self_attn.o_proj",
                                                 "self_attn.q_norm", "self_attn.q_proj", "self_attn.v_proj"))}


def test_flags_are_our_dspark_recipe(tmp_path):
    (tmp_path / "split.json").write_text(json.dumps({"train_data_ratio": 0.93}))
    args = speculators_dspark.train_args(Path("/t"), tmp_path, tmp_path / "w", 40, {"SEED": "3", "EXTRA": "--lr 2e-3"}, 49151)

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("--speculator-type") == "dspark" and value("--max-steps") == "40" and value("--seed") == "3"
    assert value("--block-size") == "8" and value("--max-anchors") == "128" and value("--mask-token-id") == "49151"
    assert value("--markov-rank") == "256" and value("--markov-head-type") == "vanilla" and value("--confidence-head-alpha") == "1.0"
    assert value("--dflash-decay-gamma") == "4" and value("--per-position-loss-weight") == "fixed-exp-decay"
    assert value("--num-layers") == "1" and value("--draft-arch") == "qwen3" and value("--draft-vocab-size") == "8192"
    assert value("--lr") == "1e-3" and value("--weight-decay") == "0" and value("--scheduler-warmup-steps") == "10"
    assert args[args.index("--target-layer-ids") + 1:][:3] == ["2", "15", "27"]
    assert {"--sample-from-anchor", "--enable-confidence-head", "--confidence-head-with-markov"} <= set(args)
    assert args[-2:] == ["--lr", "2e-3"]  # EXTRA last: it wins


def test_mask_token_is_ours(tmp_path):
    """The least frequent trained token of the train rows, the highest among ties (speculators/mask_token.py)."""
    rows = {"train": [[[1, 2, 2, 3, 9], [0, 1, 1, 1, 1]], [[3, 9], [1, 1]]], "validation": [[[7], [1]]]}
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert speculators_dspark.mask_token(tmp_path / "rows.json", 10) == 8  # 7 is in validation only, 0..8 unseen
    every = [t for t in range(10) for _ in range(2 - (t == 4))]  # every token trained, 4 the least
    (tmp_path / "rows.json").write_text(json.dumps({"train": [[every, [1] * len(every)]], "validation": []}))
    assert speculators_dspark.mask_token(tmp_path / "rows.json", 10) == 4


def their_checkpoint(drafter, folder: Path) -> Path:
    """`drafter` saved as speculators 0.9.0 saves a DSpark: its weight names less embed_tokens, its config keys."""
    weights = {k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items() if k in THEIR_KEYS}
    assert set(weights) == THEIR_KEYS
    config = speculators_config(drafter, export.Verifier("/tmp/hf-target", ["LlamaForCausalLM"]))
    config["transformer_layer_config"] |= {"model_type": "qwen3", "architectures": None}
    config |= {"architectures": ["DSparkDraftModel"], "target_hidden_size": None, "auto_map": {"AutoConfig": "config.X"},
               "dtype": "float32"}
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "optimizer_state_dict.pt").write_text("")
    return folder


def test_their_checkpoint_reads_as_our_drafter_with_the_targets_embeddings(llama_target, text_batch, tmp_path):
    drafter = make_dspark(llama_target, text_batch, block_size=8)
    out = speculators_peer.export(their_checkpoint(drafter, tmp_path / "final"), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["target_hidden_size"] == drafter.target_hidden_size and "auto_map" not in config
    assert config["speculators_config"]["verifier"] == {"name_or_path": peers.TARGET, "architectures": []}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded, verifier = export.load(out)
    assert verifier == peers.TARGET and set(loaded.left_to_target) == {"embed_tokens.weight", "mask_embedding"}
    export.share_target_embedding(loaded, llama_target)
    mask = drafter.cfg.mask_token_id
    assert torch.equal(loaded.mask_embedding, llama_target.embedding_weight()[mask].float())  # speculators' mask row
    theirs = {k: v for k, v in loaded.state_dict().items() if k in THEIR_KEYS}
    assert all(torch.equal(theirs[k], drafter.state_dict()[k]) for k in THEIR_KEYS)


def test_bench_commands_and_conf(tmp_path):
    cfg = dspark_bench.DSparkPeerConfig(runs=str(tmp_path / "runs"))
    folder = dspark_bench.run_dir(cfg, "ours")
    assert folder == tmp_path / "runs" / "ours" / "n384_s120_seed0"
    args = dspark_bench.ours_command(cfg, folder)
    assert args[1:3] == ["train.py", "conf=dspark_smollm2"] and "init_from=null" in args and "data.max_examples=384" in args
    assert {"drafter.block_size=8", "drafter.anchors=32", "drafter.markov_rank=256", "drafter.draft_vocab_size=8192",
            "trainer.max_steps=120", "optim.warmup_steps=10", "target.layer_ids=[2,15,27]"} <= set(args)
    args, env = dspark_bench.peer_command(cfg, tmp_path / "p")
    assert args[1:5] == ["-m", "benchmarks.peers.speculators_dspark", "384", "120"] and env["ANCHORS"] == "128"
    conf = yaml.safe_load((REPO / "conf" / "benchmarks" / "peer_dspark.yaml").read_text())
    assert set(conf) - {"hydra"} == {f.name for f in fields(dspark_bench.DSparkPeerConfig)}
    assert dspark_bench.peer_config(cfg).k == cfg.block_size  # served at K = the block


@pytest.mark.engines
@pytest.mark.slow
def test_two_peer_dspark_steps_load_and_serve_in_our_engine(tmp_path):
    from inference import report
    from inference.drafting import DraftingConfig
    from inference.engine import generate
    from speculators.dspark import DSparkDrafter
    from speculators.quant import QuantConfig

    if not speculators_dspark.VENV.ready():
        pytest.skip(f"no {speculators_dspark.VENV.name} venv at {speculators_dspark.VENV.path} "
                    "(python -m benchmarks.peers.speculators_peer makes it)")
    done = subprocess.run([sys.executable, "-m", speculators_dspark.__name__, "24", "2", str(tmp_path / "export"),
                           str(tmp_path / "work")], cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "[train_cpu] 2 steps" in done.stdout
    match = json.loads(done.stdout.split("== logits against speculators' own model: ")[1].splitlines()[0])
    assert match["same_argmax"] and match["logits_max_abs_diff"] < 1e-5 * match["logits_max_abs"] + 1e-4
    assert match["confidence_max_abs_diff"] < 1e-4
    drafter, target = report.load_pair(str(tmp_path / "export"), None, QuantConfig("gguf"))
    assert isinstance(drafter, DSparkDrafter) and drafter.layer_ids == [2, 15, 27] and drafter.cfg.draft_vocab_size == 8192
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 314]
    alone, drafted = generate(target, None, ids, 16, 0), generate(target, drafter, ids, 16, 8, drafting=DraftingConfig())
    assert drafted.tokens == alone.tokens


def test_table_pairs_the_prompts():
    def drafter(taus):
        by_set = {"mtbench_turn1": {"pooled": 1.5}, "mtbench_turn2": {"pooled": 1.6}, "sharegpt": {"pooled": 1.4}}
        return {"tau": sum(taus) / len(taus), "tau_per_prompt": taus, "over_prompts": {"mean": 1.5, "se": 0.1},
                "by_set": by_set, "acceptance_rate_per_position": [0.5, 0.2], "outputs_match_target_only": True}

    served = {"drafters": {"ours": drafter([1.6, 1.5, 1.7]), "speculators": drafter([1.5, 1.5, 1.4])}}
    difference = dspark_bench.paired_difference(served)
    assert difference["mean"] == pytest.approx(0.4 / 3) and (difference["ours_higher"], difference["ours_lower"]) == (2, 0)
    rows = [{"name": "ours", "steps": 120, "cpu_s_per_step": 6.7}, {"name": "speculators", "steps": 120}]
    table = dspark_bench.markdown(rows, served, difference)
    assert "| ours | 120 | 1.600 | 1.500 ± 0.100 | 1.500 / 1.600 | 1.400 | 0.500 0.200 | True | 6.70 | - |" in table
    assert "ours - speculators" in table and "+0.133 ± " in table and "3 prompts; 2 higher, 0 lower" in table
