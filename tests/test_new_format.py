"""A new export format is one file: tests/toy_format/toyfmt.py. `python -m speculators.export source=SRC out=OUT
format=toyfmt` imports it by its name from the Python path and writes it; read back, the drafter holds the same weights
and serves exactly what the target decodes alone. No file of the library names the format."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import UserError
from inference.engine import generate
from speculators import export
from speculators.export import Verifier
from speculators.formats import FORMATS, export_format

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "tests" / "toy_format"


@pytest.fixture
def toy_on_path(monkeypatch):
    """The format's module importable, as a user's own package would be; its registration undone after."""
    monkeypatch.syspath_prepend(str(TOY))
    yield
    FORMATS.pop("toyfmt", None)
    sys.modules.pop("toyfmt", None)


def test_the_library_does_not_name_the_toy_format():
    library = [p for d in ("speculators", "inference", "train", "kernels", "engines", "common", "conf") for p in
               (REPO / d).rglob("*") if p.is_file() and p.suffix in (".py", ".yaml")]
    assert not [p for p in library if "toyfmt" in p.read_text()]


def test_an_unknown_format_is_refused_in_one_line():
    with pytest.raises(UserError, match="format=.nosuchfmt. is not valid; choose one of: speculators, "):
        export_format("nosuchfmt")


def test_a_new_format_is_written_by_the_command_and_read_back(llama_target, make_drafter, tmp_path, toy_on_path):
    drafter = make_drafter(llama_target)
    source = export.save(drafter, tmp_path / "spec", Verifier.of(llama_target))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TOY), str(REPO)])}
    out = tmp_path / "toy"
    result = subprocess.run([sys.executable, "-m", "speculators.export", f"source={source}", f"out={out}", "format=toyfmt"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["toyfmt"] == 1
    assert (out / "toy.safetensors").is_file() and not (out / "model.safetensors").exists()

    export_format("toyfmt")  # a format of your own is read back once its module is imported
    loaded, verifier = export.load(out)
    assert verifier == llama_target.name_or_path
    assert export.format_of(json.loads((out / "config.json").read_text())) == "toyfmt"
    original = drafter.state_dict()
    assert all(torch.equal(t, original[name]) for name, t in loaded.state_dict().items())
    prompt = llama_target.tokenizer("def main(args):\n    ", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        alone = generate(llama_target, None, prompt, max_new_tokens=16, k=0)
        drafted = generate(llama_target, loaded, prompt, max_new_tokens=16, k=2)
    assert drafted.tokens == alone.tokens and drafted.stats.num_drafts > 0
