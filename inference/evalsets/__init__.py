"""Eval sets by name: the conversations every inference command serves (`eval=<name>`). One file each in this
folder (inference/evalsets/<name>.py), registered by `register_eval_set(EvalSet(...))` when imported; a set's
name is also its module: an unknown `eval.name` imports inference/evalsets/<name>.py, or a module `<name>` of
your own on the Python path, the first time it is asked for (docs/new_eval_set.md). Built in: stdlib (raw code
completion), mtbench, sharegpt, file (eval.path: JSON Lines or a .json list in the layouts users have), and
data (training only: the run's own held-out split, train/distill.py).

A conversation is its list of user turns. Chat sets are rendered with the target tokenizer's chat
template (turn i after the target's answers to the turns before it); raw sets as text. A set rendered
"auto" (file) uses the chat template when the tokenizer has one, and raw text otherwise (turn i after
the earlier turns and answers, concatenated); chat sets need a chat template.
"""

from dataclasses import dataclass
from typing import Callable, NamedTuple

from common.config import UserError, at_least, require
from common.progress import bar
from common.registry import import_built_in, look_up
from inference.engine import generate

BUILT_IN = ("stdlib", "mtbench", "sharegpt", "file")
DATA = "data"  # a training run's own held-out split (train/distill.py): a name, not a registered set
MISSING_TEMPLATE = "<no chat template>"  # EvalConfig.template's answer for a chat set on a tokenizer without one
DRAFT_ROOM = 64  # positions kept free after a prompt and its answer: the widest draft tree verified at once
LISTED_LINES = 5  # utf8_text: the lines an error names


@dataclass
class EvalConfig:
    """conf/eval/*.yaml."""

    name: str = "stdlib"  # stdlib | mtbench | sharegpt | file (eval.path) | data (training) | a set of your own
    path: str | None = None  # name=file: JSON Lines (or a .json list), a conversation a line: a prompt, user turns,
    # {prompt}, {turns} (MT-bench), {messages} (OpenAI) or {conversations} (ShareGPT)
    num_prompts: int = 8  # conversations served
    turns: int = 1  # user turns served per conversation (mtbench has 2)
    prompt_lines: int = 6  # stdlib: lines of each file's opening

    def __post_init__(self):
        found = None if self.name == DATA else eval_set(self.name)
        require((self.path is None) != bool(found and found.reads_path), "eval.path", self.path,
                f"set for eval.name={'|'.join(n for n, s in EVAL_SETS.items() if s.reads_path)}, and unset for the "
                f"named sets")
        at_least(1, eval__num_prompts=self.num_prompts, eval__turns=self.turns, eval__prompt_lines=self.prompt_lines)
        require(not (found and found.one_turn) or self.turns == 1, "eval.turns", self.turns,
                f"1 for eval.name={self.name}")

    def template(self, tokenizer) -> str | None:
        """The chat template the set is rendered with: the tokenizer's for a chat set (render refuses a tokenizer
        without one) and for an "auto" set when it has one; None (raw text) otherwise."""
        rendering = "raw" if self.name == DATA else EVAL_SETS[self.name].rendering
        if rendering == "chat":
            return tokenizer.chat_template or MISSING_TEMPLATE
        return tokenizer.chat_template if rendering == "auto" else None


class EvalSet(NamedTuple):
    name: str
    conversations: Callable[[EvalConfig], list[list[str]]]  # every conversation in order, each its user turns
    rendering: str = "raw"  # chat: the tokenizer's chat template; raw: text; auto: the template when there is one
    reads_path: bool = False  # eval.path names what it reads
    one_turn: bool = False  # its conversations are single prompts (eval.turns must be 1)


EVAL_SETS: dict[str, EvalSet] = {}


def register_eval_set(found: EvalSet) -> EvalSet:
    EVAL_SETS[found.name] = found
    return found


def eval_set(name: str) -> EvalSet:
    """Eval set `name`, importing its module when it is not registered yet (an unknown name: one line)."""
    return look_up(EVAL_SETS, name, "inference.evalsets", "eval.name", after=(DATA,))


def conversations(cfg: EvalConfig) -> list[list[str]]:
    """The first num_prompts conversations, each its first `turns` user turns."""
    return first(EVAL_SETS[cfg.name].conversations(cfg), cfg)


def first(chats: list[list[str]], cfg: EvalConfig) -> list[list[str]]:
    """The first num_prompts conversations with a user turn, each cut to `turns` turns."""
    chosen = [turns[: cfg.turns] for turns in chats if turns][: cfg.num_prompts]
    if not chosen:
        raise UserError(f"eval.name={cfg.name}: no prompts")
    return chosen


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
    if cfg.name == DATA:
        raise UserError(f"eval.name={DATA} is a training run's own held-out split; name an eval set here: "
                        f"{', '.join(EVAL_SETS)}")
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
    earlier_turns = sum(len(turns) - 1 for turns in chats)
    with bar(total=earlier_turns, unit="answer", desc="the target's answers to earlier turns",
             disable=earlier_turns == 0) as shown:
        for turn in range(max(map(len, chats))):
            for c, turns in enumerate(chats):
                if turn >= len(turns):
                    continue
                ids = render(target.tokenizer, turns[: turn + 1], answers[c], template)[-room:]
                out.append(Prompt(ids, turn + 1, turns[turn]))
                if turn + 1 < len(turns):
                    tokens = generate(target, None, ids, max_new_tokens, k=0).tokens
                    answers[c].append(target.tokenizer.decode(tokens, skip_special_tokens=True))
                    shown.update()
    return out


import_built_in("inference.evalsets", BUILT_IN)
