"""A new drafter family is one file and one YAML: tests/toy_family/toyfam.py (a ChainDrafter built from
speculators.layers) and tests/toy_family/conf/conf/toyfam.yaml. `python train.py` trains it from that
recipe, exports it in the speculators format and reports on it; the export loads back and decodes
exactly what the target decodes alone. No file of the library names the family."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS

from inference.engine import generate
from speculators import export
from speculators.drafter import ChainDrafter
from speculators.target import FrozenTarget, TargetConfig

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "tests" / "toy_family"


@pytest.fixture
def toy_on_path(monkeypatch):
    """The family's module importable, as a user's own package would be; its registration undone after."""
    from speculators.drafter import FAMILIES

    monkeypatch.syspath_prepend(str(TOY))
    yield
    FAMILIES.pop("toyfam", None)
    sys.modules.pop("toyfam", None)


def test_the_library_does_not_name_the_toy_family():
    library = [p for d in ("speculators", "inference", "train", "kernels", "conf") for p in (REPO / d).rglob("*")
               if p.is_file() and p.suffix in (".py", ".yaml")]
    assert not [p for p in library if "toyfam" in p.read_text()]


def test_a_family_missing_a_method_of_its_kind_cannot_be_built():
    class NoStep(ChainDrafter):  # no `family`: not registered
        from_target = training_loss = features = new_cache = None
        target_hidden_size = 1

    with pytest.raises(TypeError, match="step"):
        NoStep()


def test_a_new_family_trains_exports_and_serves_losslessly(llama_dir, tmp_path, toy_on_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(TOY), str(REPO)])}
    args = [sys.executable, str(REPO / "train.py"), f"hydra.searchpath=[file://{TOY / 'conf'}]", "conf=toyfam",
            f"target.name_or_path={llama_dir}", f"target.layer_ids=[{','.join(map(str, LAYER_IDS))}]",
            "trainer.max_steps=3", "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2",
            "trainer.val_every_n_steps=3", "trainer.num_threads=1", "serve_eval.every_n_steps=0",
            "eval.num_prompts=2", "serve_eval.ks=[2]", f"hydra.run.dir={run_dir}"]
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "toyfam" and config["trained_depth"] == 3
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["outputs_match_baseline"] is True

    drafter, _ = export.load(run_dir / "export")  # the family's module imported by its name
    assert type(drafter).__name__ == "ToyDrafter" and drafter.depth == 3
    target = FrozenTarget.load(TargetConfig(str(llama_dir), layer_ids=LAYER_IDS))
    export.share_target_embedding(drafter, target)
    prompt = target.tokenizer("def main(args):\n    ", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        alone = generate(target, None, prompt, max_new_tokens=24, k=0)
        drafted = generate(target, drafter, prompt, max_new_tokens=24, k=2)
    assert drafted.tokens == alone.tokens
    assert drafted.stats.num_drafts > 0
