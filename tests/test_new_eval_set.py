"""A new eval set is one file: a module on the Python path that registers its conversations under its name;
`eval.name=<name>` imports it and every command serves its prompts. Unknown names are refused in one line."""

import sys
import textwrap

import pytest

from common.config import UserError
from inference import evalsets
from inference.evalsets import EVAL_SETS, EvalConfig

SET = textwrap.dedent('''
    from inference.evalsets import EvalSet, register_eval_set

    def conversations(cfg):
        return [["def add(a, b):"], ["import os", "and then?"], ["class Point:"]]

    register_eval_set(EvalSet("toyset", conversations))
''')


@pytest.fixture
def toy_set(tmp_path, monkeypatch):
    (tmp_path / "toyset.py").write_text(SET)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    EVAL_SETS.pop("toyset", None)
    sys.modules.pop("toyset", None)


def test_a_new_eval_set_is_imported_by_its_name_and_served(toy_set, llama_target):
    cfg = EvalConfig("toyset", num_prompts=2, turns=2)
    assert evalsets.conversations(cfg) == [["def add(a, b):"], ["import os", "and then?"]]
    prompts = evalsets.prompts(cfg, llama_target, 4)
    assert [p.turn for p in prompts] == [1, 1, 2]
    assert prompts[0].ids == llama_target.tokenizer("def add(a, b):")["input_ids"]  # raw: no chat template


def test_an_unknown_eval_set_is_refused_in_one_line():
    with pytest.raises(UserError, match="eval.name='nosuchset' is not valid; choose one of: stdlib, mtbench"):
        EvalConfig("nosuchset")
