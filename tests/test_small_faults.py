"""Smaller faults, each answered in one line: a local target folder that is not there (not called a bad hub
id), a hand-edited export config.json with a key missing, serve_eval.ks above the trained depth."""

import json

import pytest

from common.config import UserError
from speculators import export
from speculators.target import FrozenTarget, TargetConfig, TargetShape


@pytest.mark.parametrize("name", ["/no/such/target", "./missing-model"])
def test_a_missing_local_target_folder_is_named_as_a_folder(name):
    with pytest.raises(UserError, match="no such folder") as error:
        TargetShape.read(TargetConfig(name_or_path=name))
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="no such folder"):
        FrozenTarget.load(TargetConfig(name_or_path=name))


def test_an_export_config_with_a_key_missing_is_one_line(llama_target, make_drafter, tmp_path):
    path = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    config = json.loads((path / "config.json").read_text())
    del config["draft_vocab_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="config.json has no 'draft_vocab_size'") as error:
        export.load(path)
    assert "\n" not in str(error.value)
