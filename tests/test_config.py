"""conf/ mirrors the config dataclasses, and every bad value fails with one line naming its key."""

from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks.batch_sweep import BatchSweepConfig
from benchmarks.bench import BenchConfig
from benchmarks.drafter_quant import DrafterQuantConfig
from benchmarks.llamacpp_bench import LlamacppBenchConfig
from common.config import (
    UserError,
    _user_message,
    check_no_missing,
    to_dataclass,
    with_named_target,
)
from inference.report import InferenceConfig
from speculators.families import family
from speculators.target import FrozenTarget, TargetConfig
from train.recipes import RECIPES

CONF = Path(__file__).resolve().parent.parent / "conf"


def composed(overrides: list[str], folder: Path = CONF, name: str = "config"):
    with initialize_config_dir(str(folder), version_base="1.3"):
        return compose(name, overrides=with_named_target(overrides))


def typed(cfg):
    """The recipe and, for drafter recipes, the family's config, as train.run builds them."""
    recipe = to_dataclass(RECIPES[cfg.recipe], cfg)
    if cfg.recipe == "drafter":
        return recipe, to_dataclass(family(cfg.drafter.family).config_class, cfg.drafter, "drafter")
    return recipe, None


@pytest.mark.parametrize("recipe", sorted(path.stem for path in (CONF / "conf").glob("*.yaml")))
def test_every_recipe_maps_onto_its_dataclasses(recipe):
    typed(composed([f"conf={recipe}"]))  # an unknown key anywhere in conf/ would raise here


@pytest.mark.parametrize("path", sorted((CONF / "family").glob("*.yaml")), ids=lambda path: path.stem)
def test_every_family_file_holds_its_dataclass_defaults(path):
    """A default written once: conf/family/<name>.yaml lists every field of its config class, with its default."""
    written = OmegaConf.to_container(OmegaConf.load(path))
    defaults = {f.name: f.default_factory() if f.default is MISSING else f.default
                for f in fields(family(written["family"]).config_class)}
    assert written == defaults


@pytest.mark.parametrize("folder, name, cls", [("inference", "config", InferenceConfig), ("benchmarks", "bench", BenchConfig),
                                               ("benchmarks", "llamacpp_bench", LlamacppBenchConfig),
                                               ("benchmarks", "batch_sweep", BatchSweepConfig),
                                               ("benchmarks", "drafter_quant", DrafterQuantConfig)])
def test_inference_configs_map_onto_their_dataclasses(folder, name, cls):
    to_dataclass(cls, composed(["drafter=some/export"], CONF / folder, name))


@pytest.mark.parametrize("override, key", [
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.max_steps=ten", "trainer.max_steps"),
    ("trainer.num_threads=0", "trainer.num_threads"),
    ("optim.lr=-1", "optim.lr"),
    ("optim.beta2=1.5", "optim.beta2"),
    ("data.seq_len=4", "data.seq_len"),
    ("data.batch_size=0", "data.batch_size"),
    ("data.source=web", "data.source"),
    ("logger.kind=tensorboard", "logger.kind"),
    ("logger.mode=sometimes", "logger.mode"),
    ("target.dtype=int3", "target.dtype"),
    ("drafter.depth=0", "drafter.depth"),
    ("drafter.step_decay=0", "drafter.step_decay"),
    ("drafter.family=lookahead", "drafter.family"),
    ("serve_eval.max_new_tokens=0", "serve_eval.max_new_tokens"),
    ("serve_eval.report_new_tokens=0", "serve_eval.report_new_tokens"),
    ("+trainer.epochs=3", "trainer.epochs"),
    ("+drafter.layers=2", "drafter.layers"),
    ("target.max_memory=[1,2]", "target.max_memory"),  # a list for a mapping: OmegaConf names no key
])
def test_bad_values_fail_with_one_line_naming_the_key(override, key):
    with pytest.raises(UserError) as error:
        typed(composed(["conf=eagle3_pycode", override]))
    message = str(error.value)
    assert key in message and "\n" not in message


def test_bad_model_shape_for_pretraining_names_the_rule():
    with pytest.raises(UserError, match="model.num_attention_heads=3 .*divisor of model.hidden_size"):
        typed(composed(["conf=target_pretrain", "model.num_attention_heads=3"]))


@pytest.mark.parametrize("override, key", [("temperature=-1", "temperature"), ("max_new_tokens=0", "max_new_tokens"),
                                           ("k=-2", "k")])
def test_bad_inference_values_fail_with_one_line(override, key):
    with pytest.raises(UserError, match=key):
        to_dataclass(InferenceConfig, composed(["drafter=x", override], CONF / "inference"))


def test_resume_continues_in_the_run_directory_it_names(tmp_path):
    """A resumed run writes its checkpoints, logs and export where the run began, not in a new timestamped
    folder; hydra.run.dir still wins when given."""
    run = tmp_path / "my-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    for resume in (run, run / "checkpoints" / "last.ckpt"):
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"resume={resume}"], return_hydra_config=True)
        assert cfg.hydra.run.dir == str(run)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        fresh = compose("config", return_hydra_config=True)
        chosen = compose("config", overrides=[f"resume={run}", f"hydra.run.dir={tmp_path / 'elsewhere'}"],
                         return_hydra_config=True)
    assert fresh.hydra.run.dir.startswith("runs/") and chosen.hydra.run.dir == str(tmp_path / "elsewhere")


@pytest.mark.parametrize("override, nearest", [("trainer.max_stepz=3", "'trainer.max_steps'"),
                                               ("data.batchsize=2", "'data.batch_size'"), ("quantt=int8", "'quant'")])
def test_misspelt_key_names_the_nearest_keys_not_hydras_append(override, nearest):
    with pytest.raises(Exception) as error:
        composed(["conf=eagle3_pycode", override])
    message = _user_message(error.value)
    assert f"did you mean {nearest}?" in message and "+" not in message and "\n" not in message, message
    assert "hydra" not in message  # Hydra's own node is no key a typo meant


def test_misspelt_key_past_hydra_names_the_nearest_dataclass_field():
    with pytest.raises(UserError, match=r"'trainer.max_stepz': did you mean 'trainer.max_steps'\? allowed under trainer:"):
        typed(composed(["conf=eagle3_pycode", "+trainer.max_stepz=3"]))


def test_missing_mandatory_value_names_the_key_and_what_to_pass():
    with pytest.raises(UserError, match=r"^drafter=<an export folder> is required$"):
        check_no_missing(composed([], CONF / "inference"))
    with pytest.raises(UserError, match=r"^drafter=<an export folder> is required$"):
        to_dataclass(InferenceConfig, OmegaConf.create({}))
    with pytest.raises(UserError, match=r"^eval.path=<a prompts file> is required$"):
        check_no_missing(composed(["conf=eagle3_pycode", "eval=file"]))


@pytest.mark.parametrize("gpu, dtype, reason", [(False, "float32", "auto: no GPU"), (True, "bfloat16", "auto: a CUDA GPU")])
def test_an_unset_target_dtype_follows_the_device(gpu, dtype, reason, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    target = to_dataclass(TargetConfig, composed(["conf=eagle3", "target.name_or_path=my/model"]).target, "target")
    assert (target.dtype, target._dtype_reason) == (dtype, reason)
    assert TargetConfig(name_or_path="my/model").dtype == dtype  # an export's target, named without a dtype
    explicit = composed(["conf=eagle3", "target.name_or_path=my/model", "target.dtype=bfloat16"]).target
    assert to_dataclass(TargetConfig, explicit, "target").dtype == "bfloat16"


def test_the_target_says_its_automatic_dtype_at_load(llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    target = FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS))
    assert target.model.dtype == torch.float32
    assert "target dtype: float32 (auto: no GPU)" in capsys.readouterr().out.splitlines()
    FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS, dtype="float32"))
    assert "target dtype" not in capsys.readouterr().out  # a dtype that was asked for goes unsaid


def test_a_list_where_a_registered_name_belongs_is_one_line():
    from common.registry import look_up

    for name in ([1, 2], {"a": 1}):
        with pytest.raises(UserError, match=r"drafter\.family=.* is not valid; choose one of: eagle3"):
            look_up({"eagle3": object()}, name, "speculators", "drafter.family")
