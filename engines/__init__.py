"""Clients of other serving engines, used to regenerate data and to compare: llama.cpp's server and vLLM (run in
its own venv by vllm_runner.py, which imports nothing of ours). One client file each, registered by
`register_engine(Engine(...))` when imported; `serving_engine(name)` imports engines/<name>.py, or a module `<name>` of
your own on the Python path, the first time a name is asked for (docs/new_engine.md). benchmarks/engines.py
reads its choices and labels here."""

from typing import NamedTuple

from common.registry import import_built_in, look_up

BUILT_IN = ("llamacpp", "vllm_venv")  # modules: vllm_venv is the engine vllm
ENGINES: dict[str, "Engine"] = {}


class Engine(NamedTuple):
    name: str
    label: str  # how tables name it
    trained_quant: bool = False  # ours beside it serves the target as the drafter was trained (the same GGUF blocks)


def register_engine(found: Engine) -> Engine:
    ENGINES[found.name] = found
    return found


def serving_engine(name: str) -> Engine:
    """Engine `name`, importing its module when it is not registered yet (an unknown name: one line)."""
    return look_up(ENGINES, name, "engines", "engines")


import_built_in("engines", BUILT_IN)
