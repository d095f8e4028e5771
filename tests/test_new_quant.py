"""A new quantization scheme is one file: tests/toy_quant/toyquant.py. `quant.scheme=toyquant` imports it by its
name from the Python path; the target it quantizes serves a drafter exactly as it decodes alone, in process and
through `python -m inference`. No file of the library names the scheme."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS
from torch import nn

from common.config import UserError
from inference.engine import generate
from speculators import export
from speculators.quant import SCHEMES, QuantConfig
from speculators.target import FrozenTarget, TargetConfig

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "tests" / "toy_quant"


@pytest.fixture
def toy_on_path(monkeypatch):
    """The scheme's module importable, as a user's own package would be; its registration undone after."""
    monkeypatch.syspath_prepend(str(TOY))
    yield
    SCHEMES.pop("toyquant", None)
    sys.modules.pop("toyquant", None)


def test_the_library_does_not_name_the_toy_scheme():
    library = [p for d in ("speculators", "inference", "train", "kernels", "engines", "common", "conf") for p in
               (REPO / d).rglob("*") if p.is_file() and p.suffix in (".py", ".yaml")]
    assert not [p for p in library if "toyquant" in p.read_text()]


def test_an_unknown_scheme_is_refused_in_one_line():
    with pytest.raises(UserError, match="quant.scheme='nosuchquant' is not valid; choose one of: none, int8"):
        QuantConfig(scheme="nosuchquant")


def test_a_new_scheme_quantizes_the_target_and_serves_losslessly(llama_dir, llama_target, make_drafter, text_batch,
                                                                  toy_on_path):
    target = FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS),
                               QuantConfig(scheme="toyquant"))
    replaced = [m for m in target.model.modules() if type(m).__name__ == "RowInt8Linear"]
    assert replaced and [m for m in target.model.modules() if isinstance(m, nn.Linear)] == [target.model.lm_head]
    ids = text_batch[:1, :16]
    drift = float((llama_target(ids).logits - target(ids).logits).norm() / llama_target(ids).logits.norm())
    assert 0 < drift < 0.5, drift
    drafter = make_drafter(target)
    prompt = text_batch[0, :12].tolist()
    with torch.no_grad():
        alone = generate(target, None, prompt, 24, k=0).tokens
        for k in (1, 3):
            assert generate(target, drafter, prompt, 24, k=k).tokens == alone


def test_the_inference_command_serves_a_new_scheme(llama_target, make_drafter, tmp_path):
    drafter_dir = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(TOY), str(REPO)])}
    result = subprocess.run([sys.executable, "-m", "inference", f"drafter={drafter_dir}", "quant.scheme=toyquant",
                             "eval.num_prompts=2", "eval.prompt_lines=2", "max_new_tokens=8", "k=2", f"out={out}",
                             "logger.kind=none"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["quant"]["scheme"] == "toyquant" and report["outputs_match_baseline"] is True
