"""file (eval.path): JSON Lines, each line one conversation in one of the layouts users have: a prompt string; a
list of user turns; {"prompt": "..."}; MT-bench's {"turns": [...]} (its question.jsonl as it is); OpenAI's
{"messages": [{"role", "content"}]}; ShareGPT's {"conversations": [{"from", "value"}]}. Of a chat (messages,
conversations) only the user turns are served: system messages are dropped (the target's chat template brings
its own, if any) and so are the assistant's, since each later turn follows the target's own answers. A .json
file holds a list of such records. Rendered with the chat template when the tokenizer has one, as raw text
otherwise."""

import json
from pathlib import Path

from common import corpus
from common.config import UserError
from inference.evalsets import EvalConfig, EvalSet, register_eval_set, utf8_text

# The records eval=file reads (a line of JSON Lines, an item of a .json list), as its errors name them.
LAYOUTS = ('a JSON string, a list of strings, {"prompt": ...}, {"turns": [...]}, {"messages": [{"role", "content"}]} '
           'or {"conversations": [{"from", "value"}]}')
SHAREGPT_USERS = tuple(name for name, role in corpus.SHAREGPT_ROLES.items() if role == "user")


def conversations(cfg: EvalConfig) -> list[list[str]]:
    """Every conversation of the file, in the order written; one line on the first record in no layout."""
    path = Path(cfg.path)
    if not path.is_file():
        raise UserError(f"eval.path={cfg.path}: no such file")
    records = json_list(path, cfg) if path.suffix == ".json" else json_lines(path, cfg)
    prompts = []
    for where, record in records:
        turns = user_turns(record)
        if turns is None:
            raise UserError(f"eval.path={cfg.path}: {where} is in none of the layouts read here ({LAYOUTS}), "
                            f"got {json.dumps(record)[:60]!r}")
        prompts.append(turns)
    return prompts


def json_lines(path: Path, cfg: EvalConfig) -> list[tuple[str, object]]:
    """("line n", record) of every non-blank line."""
    records = []
    for n, line in enumerate(utf8_text(path.read_bytes(), f"eval.path={cfg.path}").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(f"eval.path={cfg.path}: line {n} is not JSON ({e.msg} at column {e.colno})") from None
    return records


def json_list(path: Path, cfg: EvalConfig) -> list[tuple[str, object]]:
    """("record n", record) of a .json file holding a list (ShareGPT's dumps are such files)."""
    try:
        records = json.loads(utf8_text(path.read_bytes(), f"eval.path={cfg.path}"))
    except json.JSONDecodeError as e:
        raise UserError(f"eval.path={cfg.path}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                        f"JSON Lines files end with .jsonl") from None
    if not isinstance(records, list):
        raise UserError(f"eval.path={cfg.path}: a .json file must hold a list of records, got a JSON "
                        f"{type(records).__name__}")
    return [(f"record {n}", record) for n, record in enumerate(records, 1)]


def user_turns(record) -> list[str] | None:
    """A record's user turns, in any layout of LAYOUTS; None when it is in none of them."""
    if isinstance(record, str):
        record = [record]
    elif isinstance(record, dict) and "prompt" in record:
        record = [record["prompt"]]
    elif isinstance(record, dict) and "turns" in record:
        record = record["turns"]
    elif isinstance(record, dict) and "messages" in record:
        record = spoken_by_user(record["messages"], "role", "content", ("user",))
    elif isinstance(record, dict) and "conversations" in record:
        record = spoken_by_user(record["conversations"], "from", "value", SHAREGPT_USERS)
    is_turns = isinstance(record, list) and len(record) > 0 and all(isinstance(turn, str) for turn in record)
    return record if is_turns else None


def spoken_by_user(messages, speaker: str, text: str, users: tuple[str, ...]) -> list | None:
    """The texts of a chat's messages whose `speaker` is one of `users`; None unless the chat is a list of objects."""
    if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        return None
    return [m.get(text) for m in messages if m.get(speaker) in users]


register_eval_set(EvalSet("file", conversations, "auto", reads_path=True))
