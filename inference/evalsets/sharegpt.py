"""sharegpt: the user turns of ShareGPT's test split (train/data.py splits by conversation id)."""

from common import corpus
from inference.evalsets import EvalConfig, EvalSet, register_eval_set


def conversations(cfg: EvalConfig) -> list[list[str]]:
    return [[turn["value"] for turn in row.get("conversations", [])
             if corpus.SHAREGPT_ROLES.get(turn.get("from")) == "user" and str(turn.get("value", "")).strip()]
            for row in corpus.sharegpt_split("test")]


register_eval_set(EvalSet("sharegpt", conversations, "chat"))
