"""stdlib: the first `prompt_lines` lines of held-out (test-split) standard-library files, as raw text: code
completion, what the shipped pycode target was trained on."""

from common import corpus
from inference.evalsets import EvalConfig, EvalSet, register_eval_set


def conversations(cfg: EvalConfig) -> list[list[str]]:
    test = corpus.stdlib_files()["test"]
    return [["".join(text.splitlines(keepends=True)[: cfg.prompt_lines])] for text in test["text"][: cfg.num_prompts]]


register_eval_set(EvalSet("stdlib", conversations, one_turn=True))
