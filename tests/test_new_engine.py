"""Serving engines by name (engines/__init__.py): the built-in clients register themselves, benchmarks.engines
takes its `engines=[...]` choices from the registry, and a client of your own is imported by its name."""

import sys
import textwrap

import pytest

from benchmarks.engines import EnginesConfig
from common.config import UserError
from engines import ENGINES, serving_engine

CLIENT = textwrap.dedent('''
    from engines import Engine, register_engine

    register_engine(Engine("toyengine", "Toy Engine"))
''')


def test_the_built_in_engines_are_registered_with_their_labels():
    assert {name: e.label for name, e in ENGINES.items()} == {"llamacpp": "llama.cpp", "vllm": "vLLM (CPU)"}
    assert ENGINES["llamacpp"].trained_quant and not ENGINES["vllm"].trained_quant
    assert EnginesConfig(drafter="x").engines == ["llamacpp", "vllm"]


def test_an_unknown_engine_is_refused_in_one_line():
    with pytest.raises(UserError, match="engines='nosuchengine' is not valid; choose one of: llamacpp, vllm"):
        EnginesConfig(drafter="x", engines=["nosuchengine"])


def test_an_engine_of_your_own_is_imported_by_its_name(tmp_path, monkeypatch):
    (tmp_path / "toyengine.py").write_text(CLIENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert serving_engine("toyengine").label == "Toy Engine"
    finally:
        ENGINES.pop("toyengine", None)
        sys.modules.pop("toyengine", None)
