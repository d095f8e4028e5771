"""The CLIs under bad input, offline use and interruption.

- A property test (hypothesis) gives random bad values to every key of `python train.py` (each
  recipe in conf/conf/) and `python -m inference`: each case ends in one line on stderr naming
  the key, a non-zero exit, no traceback and no result or checkpoint left behind.
- With HF_HUB_OFFLINE=1 and WANDB_MODE=offline a training run makes no network attempt.
- An interrupted export leaves the previous one intact, and a finished run's export is replaced
  only with overwrite=true, refused before training starts.
"""

import contextlib
import dataclasses
import functools
import inspect
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import types
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import torch
from conftest import LAYER_IDS, NUM_LAYERS
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import corpus
from common.config import run_cli
from inference.report import InferenceConfig
from speculators import export
from speculators.export import Verifier
from speculators.families import family
from train.recipes import RECIPES

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
CLI_FILES = {"train": "train.py", "inference": "inference/__main__.py"}


# --- a tiny, fast run of each CLI -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_stdlib(tmp_path_factory) -> Path:
    return copy_small_stdlib(tmp_path_factory.mktemp("stdlib"))


def copy_small_stdlib(folder: Path) -> Path:
    """A few small standard-library files, at least one per split: a corpus that packs in a moment."""
    wanted = {"train": 6, "validation": 1, "test": 1}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        split = corpus.split_of(path.name)
        if 2_000 < path.stat().st_size < 8_000 and wanted[split]:
            shutil.copy(path, folder)
            wanted[split] -= 1
    assert not any(wanted.values())
    return folder


def tiny_training(llama_dir: Path, stdlib: Path, run_dir: Path, recipe: str = "eagle3") -> list[str]:
    """`python train.py` overrides for a 2-step run on the tiny target."""
    if not any(key.startswith("target.") for key, _ in TRAIN_KEYS[recipe]):  # pretraining: no frozen target
        return [f"conf={recipe}", f"hydra.run.dir={run_dir}", f"data.stdlib_path={stdlib}", "data.seq_len=32",
                "data.batch_size=2", "data.max_val_sequences=2", "trainer.max_steps=2", "logger=none",
                "trainer.progress_bar=false", "model.vocab_size=300", "model.hidden_size=32",
                "model.intermediate_size=64", "model.num_hidden_layers=2"]
    # The groups of the quick recipes, whatever the recipe's own (eagle3_smollm2 serves a GGUF, packed)
    # and none of its data selection or starting weights (conf=eagle3 with no target: a slice of ShareGPT, the shipped drafter)
    return [f"conf={recipe}", "target=pycode", "data=stdlib", "quant=none", "eval=data", "init_from=null",
            "++data.path=null", "++data.max_examples=null", "++data.skip_examples=0", f"hydra.run.dir={run_dir}",
            f"target.name_or_path={llama_dir}",
            f"target.layer_ids=[{','.join(map(str, LAYER_IDS))}]", f"data.stdlib_path={stdlib}", "data.seq_len=32",
            "data.batch_size=2", "data.max_val_sequences=2", "trainer.max_steps=2", "trainer.val_every_n_steps=2",
            "trainer.checkpoint_every_n_steps=2", "trainer.progress_bar=false", "serve_eval.every_n_steps=0",
            "logger=none"] + [f"drafter.{name}={value}" for name, value in SMALL_DRAFTER.items()
                              if any(key == f"drafter.{name}" for key, _ in TRAIN_KEYS[recipe])]


SMALL_DRAFTER = {"draft_vocab_size": 64, "depth": 2}  # where the family has them


@pytest.fixture(scope="module")
def tiny_export(llama_target, make_drafter, tmp_path_factory) -> Path:
    return export.save(make_drafter(llama_target), tmp_path_factory.mktemp("drafter") / "export",
                       Verifier.of(llama_target))


def tiny_inference(drafter: Path, out: Path) -> list[str]:
    """`python -m inference` overrides for one short prompt."""
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text(json.dumps("def add(a, b):\n") + "\n")
    return [f"drafter={drafter}", f"hydra.run.dir={out.parent / 'hydra'}", f"out={out}", "eval=file",
            f"eval.path={prompts}", "max_new_tokens=4", "k=2"]


def cli_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECULATORS_TRACEBACK", "WANDB_MODE")}
    return env | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "0", **extra}


def run_subprocess(args: list[str], cwd: Path, timeout: int = 600, **env: str) -> tuple[int, str]:
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=cli_env(**env), capture_output=True, text=True,
                            timeout=timeout)
    return result.returncode, result.stderr


@functools.cache
def cli_main(cli: str):
    """The @hydra.main function of train.py or inference/__main__.py."""
    main = runpy.run_path(str(REPO / CLI_FILES[cli]), run_name=f"{cli}_cli")["main"]
    inspect.unwrap(main).__module__ = "__main__"  # as when run as a script: Hydra looks for conf/ beside the file
    return main


def run_in_process(cli: str, args: list[str], monkeypatch) -> tuple[Any, str]:
    """`python train.py <args>` (or `python -m inference`) in this process: (exit code, stderr).
    An exception other than SystemExit escapes, as a traceback would."""
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.delenv("SPECULATORS_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "argv", [cli, *args])
    stderr = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(stderr):
        try:
            run_cli(cli_main(cli))
        except SystemExit as e:
            code = e.code
    if isinstance(code, str):  # sys.exit("error: ...") prints its message and exits with 1
        stderr.write(code + "\n")
        code = 1
    return code, stderr.getvalue()


def one_line_error(code, stderr: str) -> str:
    """The run failed and said why in one line, its last, with no traceback."""
    assert code not in (0, None), stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stderr.rstrip().splitlines()[-1] == errors[0], stderr
    return errors[0]


RESULT_NAMES = {"export", "export.partial", "export.previous", "model", "checkpoints", "acceptance", "wandb"}


def results_left(run_dir: Path) -> list[str]:
    """Anything a run writes besides Hydra's own record (.hydra/, the log)."""
    return sorted(p.name for p in run_dir.rglob("*") if p.name in RESULT_NAMES or p.name.endswith(".partial"))


# --- the property test ----------------------------------------------------------------------

FREE_TEXT = {"logger.project", "logger.name", "out"}  # any text is valid (`out` is created)
PATHS = {"resume", "target", "target.name_or_path", "data.stdlib_path", "drafter", "eval.path"}
ZERO_ALLOWED = {"seed", "optim.warmup_steps", "optim.weight_decay", "optim.min_lr_ratio", "optim.beta1",
                "optim.beta2", "trainer.gradient_clip_val", "serve_eval.every_n_steps", "temperature",
                "k", "drafter.regression_weight", "drafter.distillation_weight",
                "drafter.input_noise", "acceptance_tolerance", "drafting.prompt_lookup_max", "drafting.chain_min_prob",
                "data.skip_examples", "serve_eval.lookup_tokens", "drafter.mask_token_id"}
GROUPS = {"train": ["conf", "target", "data", "quant", "eval", "trainer", "logger"], "inference": ["quant", "eval"]}
WEIRD = ["[", "]", "{", "}", "'", "=", "a,b", "${nope}", "${oc.env:SPECULATORS_NO_SUCH_VARIABLE}", "%", "\\\\"]


def leaves(cls, prefix: str = "", drafter_cls=None):
    """(dotted key, type) of every leaf field; `drafter` (Any in the recipe) is the family's config."""
    for f in dataclasses.fields(cls):
        key, kind = prefix + f.name, f.type
        if f.name == "drafter" and drafter_cls is not None:
            kind = drafter_cls
        if dataclasses.is_dataclass(kind):
            yield from leaves(kind, key + ".")
        else:
            yield key, kind


def recipes() -> dict[str, list[tuple[str, Any]]]:
    """conf name -> its keys, for every recipe in conf/conf/."""
    found = {}
    for path in sorted((CONF / "conf").glob("*.yaml")):
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"conf={path.stem}"])
        drafter_cls = family(cfg.drafter.family).config_class if cfg.recipe == "drafter" else None
        found[path.stem] = list(leaves(RECIPES[cfg.recipe], drafter_cls=drafter_cls))
    return found


TRAIN_KEYS = recipes()
INFERENCE_KEYS = list(leaves(InferenceConfig))


def base_types(kind) -> set:
    return set(kind.__args__) if isinstance(kind, types.UnionType) else {kind}


def text(prefix: str = "no_such_"):
    return st.text("abcxyz_-.", min_size=1, max_size=8).map(lambda s: f"'{prefix}{s}'")


def bad_values(key: str, kind) -> st.SearchStrategy[str]:
    """Override values (Hydra syntax) that `key`, of type `kind`, must refuse."""
    kinds = base_types(kind) - {type(None)}
    wrong_shape = st.sampled_from(["[1,2]", "{a: 1}"])
    weird = st.sampled_from(WEIRD)
    if kinds <= {int, float}:
        lowest = 0 if key in ZERO_ALLOWED else 1
        too_small = st.integers(max_value=lowest - 1).map(str)
        options = [too_small, wrong_shape, weird, text("")]
        if float in kinds:
            below = st.floats(max_value=0, allow_nan=False).filter(lambda x: x < 0 or key not in ZERO_ALLOWED)
            options += [below.map(repr), st.sampled_from(["nan", "inf", "-inf"])]
        else:
            options.append(st.sampled_from(["0.5", "2.25", "true"]))
        if key == "seed":
            options.append(st.integers(min_value=2**32).map(str))
        return st.one_of(options)
    if kinds == {bool}:
        return st.one_of(st.integers(min_value=2).map(str), st.sampled_from(["0.5", "maybe", "[true]"]), weird)
    if kinds == {list[int]}:
        out_of_range = st.one_of(st.integers(min_value=NUM_LAYERS), st.integers(max_value=-1))
        return st.one_of(out_of_range.map(lambda k: f"[0,1,{k}]"), st.just("[0,0,1]"), st.just("['a',1,2]"),
                         st.just("abc"), weird)
    if key in PATHS:
        return st.one_of(text().map(lambda s: s.replace("'", "")), st.just("/no/such/folder"))
    return st.one_of(text(), wrong_shape, weird)  # a value outside a closed set, or not text at all


def group_choices(cli: str) -> st.SearchStrategy[tuple[str, str]]:
    return st.tuples(st.sampled_from(GROUPS[cli]), text("").map(lambda s: s.strip("'")))


def cases(cli: str, keys: list[tuple[str, Any]]) -> st.SearchStrategy[tuple[str, str, bool]]:
    """(key, override, whether the message may name the value instead of the key: paths)."""
    existing = [(key, kind) for key, kind in keys if key not in FREE_TEXT]
    value = st.sampled_from(existing).flatmap(
        lambda kk: bad_values(*kk).map(lambda v: (kk[0], f"{kk[0]}={v}", kk[0] in PATHS)))
    sections = sorted({""} | {key.rsplit(".", 1)[0] + "." for key, _ in keys if "." in key})
    unknown = st.tuples(st.sampled_from(sections),
                        st.sampled_from(["epochs", "lr_", "layers", "nope"]), st.booleans()).map(
        lambda t: (t[0] + t[1], f"{'+' if t[2] else ''}{t[0]}{t[1]}=1", False))
    options = [value, unknown]
    if GROUPS[cli]:
        options.append(group_choices(cli).map(lambda g: (g[0], f"{g[0]}={g[1]}", False)))
    return st.one_of(options)


@contextlib.contextmanager
def no_network(monkeypatch):
    """Offline, and no attempt to reach another host (a mistyped path must never go to the hub)."""
    import socket

    attempts = []

    def refuse(self, address, *_):
        attempts.append(address)
        raise OSError(f"network disabled by the test: {address}")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield
    assert attempts == []


def replace_key(args: list[str], override: str) -> list[str]:
    key = override.split("=", 1)[0].lstrip("+")
    return [a for a in args if a.split("=", 1)[0] != key] + [override]


def check_case(cli: str, base: list[str], case: tuple[str, str, bool], run_dir: Path, monkeypatch) -> None:
    key, override, may_name_value = case
    code, stderr = run_in_process(cli, replace_key(base, override), monkeypatch)
    line = one_line_error(code, stderr)
    value = override.split("=", 1)[1].strip("'")
    assert key in line or (may_name_value and value in line), (override, line)
    assert results_left(run_dir) == [], (override, results_left(run_dir))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_bad_training_value_ends_in_one_line(data, llama_dir, small_stdlib, monkeypatch):
    recipe = data.draw(st.sampled_from(sorted(TRAIN_KEYS)), "recipe")
    case = data.draw(cases("train", TRAIN_KEYS[recipe]), "case")
    with tempfile.TemporaryDirectory() as tmp, no_network(monkeypatch):
        run_dir = Path(tmp) / "run"
        check_case("train", tiny_training(llama_dir, small_stdlib, run_dir, recipe), case, run_dir, monkeypatch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases("inference", INFERENCE_KEYS))
def test_every_bad_inference_value_ends_in_one_line(case, tiny_export, monkeypatch):
    with tempfile.TemporaryDirectory() as tmp, no_network(monkeypatch):
        out = Path(tmp) / "out"
        check_case("inference", tiny_inference(tiny_export, out), case, out, monkeypatch)
        assert not out.exists()


@pytest.mark.parametrize("cli", ["train", "inference"])
def test_the_in_process_runner_sees_a_good_run_succeed(cli, llama_dir, small_stdlib, tiny_export, tmp_path,
                                                       monkeypatch):
    """The control for the property tests: the same base command lines succeed and write their results."""
    if cli == "train":
        args, result = tiny_training(llama_dir, small_stdlib, tmp_path / "run"), tmp_path / "run" / "export"
    else:
        args, result = tiny_inference(tiny_export, tmp_path / "out"), tmp_path / "out" / "report.json"
    code, stderr = run_in_process(cli, args, monkeypatch)
    assert code == 0, stderr
    assert result.exists()


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_values_through_real_processes(data, llama_dir, small_stdlib, tiny_export, tmp_path_factory):
    """A few cases of each CLI as users meet them: a separate process, its real stderr and exit code."""
    tmp = tmp_path_factory.mktemp("cli")
    cli = data.draw(st.sampled_from(["train", "inference"]), "cli")
    if cli == "train":
        run_dir, base = tmp / "run", tiny_training(llama_dir, small_stdlib, tmp / "run")
        case = data.draw(cases("train", TRAIN_KEYS["eagle3"]), "case")
        command = [str(REPO / "train.py")]
    else:
        run_dir, base = tmp / "out", tiny_inference(tiny_export, tmp / "out")
        case = data.draw(cases("inference", INFERENCE_KEYS), "case")
        command = ["-m", "inference"]
    key, override, may_name_value = case
    code, stderr = run_subprocess(command + replace_key(base, override), cwd=tmp)
    line = one_line_error(code, stderr)
    assert key in line or (may_name_value and override.split("=", 1)[1].strip("'") in line), (override, line)
    assert results_left(run_dir) == []


# --- offline ------------------------------------------------------------------------------------

# Run a CLI with every connection to another host refused and reported. Unix sockets and loopback
# stay open: W&B talks to its own service process through them.
GUARDED = """
import runpy, socket, sys

LOCAL = {"localhost", "127.0.0.1", "::1", None}

def report(what):
    print(f"NETWORK ATTEMPT: {what}", file=sys.stderr, flush=True)
    raise OSError(f"network disabled by the test: {what}")

def guard(method):
    def guarded(self, address, *args):
        if self.family != socket.AF_UNIX and address[0] not in LOCAL:
            report(f"{method.__name__} {address}")
        return method(self, address, *args)
    return guarded

real_getaddrinfo = socket.getaddrinfo
def getaddrinfo(host, *args, **kwargs):
    if host not in LOCAL and (not isinstance(host, bytes) or host.decode() not in LOCAL):
        report(f"resolve {host}")
    return real_getaddrinfo(host, *args, **kwargs)

socket.socket.connect = guard(socket.socket.connect)
socket.socket.connect_ex = guard(socket.socket.connect_ex)
socket.getaddrinfo = getaddrinfo
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("offline_by", ["WANDB_MODE", "logger.mode"])
def test_offline_training_makes_no_network_attempt(llama_dir, small_stdlib, tmp_path, offline_by):
    """W&B offline by its environment variable, or by the config key (as when no W&B login is found):
    W&B's own analytics once went online in the second case."""
    run_dir = tmp_path / "run"
    args = replace_key(tiny_training(llama_dir, small_stdlib, run_dir), "logger=wandb")
    args.append("logger.mode=null" if offline_by == "WANDB_MODE" else "logger.mode=offline")
    env = {"WANDB_MODE": "offline"} if offline_by == "WANDB_MODE" else {}
    code, stderr = run_subprocess(["-c", GUARDED, str(REPO / "train.py"), *args], cwd=tmp_path, timeout=900,
                                  WANDB_CONFIG_DIR=str(tmp_path), WANDB_CACHE_DIR=str(tmp_path), **env)
    assert "NETWORK ATTEMPT" not in stderr, stderr
    assert code == 0, stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B did not run (offline)"


# --- exports: interrupted, refused, replaced only when asked --------------------------------------


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def interrupt(*_, **__):
    raise KeyboardInterrupt


@pytest.mark.parametrize("moment", ["after the weights are written", "when the new export moves in"])
def test_an_interrupted_export_leaves_the_previous_one_intact(llama_target, make_drafter, tmp_path, monkeypatch,
                                                              moment):
    first = make_drafter(llama_target, seed=0)
    out = export.save(first, tmp_path / "export", Verifier.of(llama_target))
    before = folder_bytes(out)
    if moment == "after the weights are written":
        real_save_file = export.save_file
        monkeypatch.setattr(export, "save_file", lambda *args, **kw: (real_save_file(*args, **kw), interrupt()))
    else:
        real_rename = Path.rename
        monkeypatch.setattr(Path, "rename", lambda self, to: interrupt() if self.name == "export.partial"
                            else real_rename(self, to))
    with pytest.raises(KeyboardInterrupt):
        export.save(make_drafter(llama_target, seed=1), out, Verifier.of(llama_target), overwrite=True)
    monkeypatch.undo()

    assert folder_bytes(out) == before
    loaded, _ = export.load(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in first.state_dict().items())
    # The next export goes through and replaces it whole, leaving nothing beside it.
    export.save(make_drafter(llama_target, seed=1), out, Verifier.of(llama_target), overwrite=True)
    assert folder_bytes(out)["model.safetensors"] != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_existing_export_is_refused_without_overwrite(llama_target, make_drafter, tmp_path):
    out = export.save(make_drafter(llama_target, seed=0), tmp_path / "export", Verifier.of(llama_target))
    before = folder_bytes(out)
    with pytest.raises(export.UserError, match="overwrite=true"):
        export.save(make_drafter(llama_target, seed=1), out, Verifier.of(llama_target))
    assert folder_bytes(out) == before


def test_resume_into_the_same_run_dir_and_the_overwrite_key(llama_dir, small_stdlib, tmp_path, monkeypatch):
    """An interrupted run resumes into its own run directory and exports; resuming the finished run
    is refused before the target loads unless overwrite=true; with it the export is replaced."""
    from train.callbacks import CheckpointOnSignal
    from train.distill import FrozenTarget

    run_dir = tmp_path / "run"
    args = tiny_training(llama_dir, small_stdlib, run_dir)
    resume = args + [f"resume={run_dir}"]

    def sigterm_after_step_1(self, trainer, *_):
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointOnSignal, "on_train_batch_end", sigterm_after_step_1, raising=False)
        code, stderr = run_in_process("train", args, monkeypatch)
    assert code == 1 and "stopped by a signal at step 1" in stderr
    assert not (run_dir / "export").exists()

    code, stderr = run_in_process("train", resume, monkeypatch)
    assert code == 0, stderr
    trained = folder_bytes(run_dir / "export")
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2

    def fail(*_):
        raise AssertionError("the target was loaded before the refusal")

    with monkeypatch.context() as patch:
        patch.setattr(FrozenTarget, "load", fail)
        code, stderr = run_in_process("train", resume, monkeypatch)
    line = one_line_error(code, stderr)
    assert str(run_dir / "export") in line and "overwrite=true" in line
    assert folder_bytes(run_dir / "export") == trained

    code, stderr = run_in_process("train", resume + ["overwrite=true"], monkeypatch)
    assert code == 0, stderr
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("export")) == ["export"]
