"""Quantized self-speculation (speculators/self_draft.py, inference/drafting.py SelfProposer): the
target's own copy drafts; greedy output and sampled law stay the target's; the copy's cache follows
the verified sequence; a copy no cheaper than its target, or of another target, is refused."""

import pytest
from conftest import LAYER_IDS
from test_engine import MAX_NEW, check_stats, prompts_of
from test_sampling import check_two_token_law, tiny_target

from common.config import UserError
from inference import evalsets
from inference.engine import check_pair, generate, generate_batch
from speculators.quant import QuantConfig
from speculators.self_draft import SelfDrafter
from speculators.target import FrozenTarget, TargetConfig


@pytest.mark.parametrize("k", [1, 4])
def test_a_copy_equal_to_the_target_has_every_draft_accepted(target, text_batch, k):
    """If the copy's cache lost track of the verified sequence (a draft kept after its rejection, the
    bonus token not read), its drafts would stop matching the target's next tokens."""
    copy = SelfDrafter(target, "int8", k)  # the target itself as its copy: the same argmax everywhere
    for prompt in prompts_of(text_batch):
        spec = generate(target, copy, prompt, MAX_NEW, k=k)
        assert spec.tokens == generate(target, None, prompt, MAX_NEW, k=0).tokens
        check_stats(spec.stats, k, len(spec.tokens))
        assert spec.stats.num_accepted_tokens >= 0.9 * k * spec.stats.num_drafts
        sampled = generate(target, copy, prompt, MAX_NEW, k=k, temperature=1.0, seed=3)
        assert sampled.stats.num_accepted_tokens >= 0.9 * k * sampled.stats.num_drafts  # q = p: accepted


def test_an_int8_copy_is_lossless_and_accepted_often(llama_target, llama_dir, text_batch):
    int8 = FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS), QuantConfig("int8"))
    copy = SelfDrafter.of(int8, "int8", "none", 3)
    check_pair(llama_target, copy)
    for prompt in prompts_of(text_batch):
        spec = generate(llama_target, copy, prompt, MAX_NEW, k=3)
        assert spec.tokens == generate(llama_target, None, prompt, MAX_NEW, k=0).tokens
        assert spec.stats.acceptance_length > 2.5


def test_sampling_with_another_model_as_copy_keeps_the_target_law():
    """The target's law of two sampled tokens when the drafting copy is a different model (so drafts
    are rejected and resampled often)."""
    check_two_token_law(tiny_target(8), SelfDrafter(tiny_target(8, seed=5), "int8", 3))


@pytest.mark.parametrize("copy, target", [("int8", "int4"), ("gguf", "int4"), ("int8", "fp8"), ("none", "none")])
def test_a_copy_no_cheaper_than_its_target_is_one_line(llama_target, copy, target):
    with pytest.raises(UserError) as error:
        SelfDrafter.of(llama_target, copy, target, 3)
    message = str(error.value)
    assert f"self-drafting scheme={copy!r}" in message and "fewer bits per weight" in message and "\n" not in message


def test_a_copy_of_another_target_is_refused(llama_target):
    with pytest.raises(UserError, match="^drafter does not fit the target: the drafting copy is of target tiny"):
        check_pair(llama_target, SelfDrafter(tiny_target(llama_target.vocab_size), "int8", 3))


def test_batches_say_they_are_not_served_yet(llama_target, text_batch):
    with pytest.raises(UserError, match="not served for a SelfDrafter yet; use batch_size=1"):
        generate_batch(llama_target, SelfDrafter(llama_target, "int8", 3), prompts_of(text_batch), 8, k=3)


def test_every_inference_command_serves_drafter_self(llama_dir, text_batch):
    from inference import report

    copy, target = report.load_pair("self:int8", str(llama_dir))
    assert isinstance(copy, SelfDrafter) and copy.scheme == "int8" and copy.k == 5
    prompts = evalsets.prompts_of([[text] for text in ("import os\n", "def f(x):\n")], None, target, 12)
    measured = report.measure(target, copy, prompts, report.InferenceConfig(drafter="self:int8", max_new_tokens=12))
    assert measured["outputs_match_baseline"] and measured["acceptance_length"] > 2
    for drafter, target_path, quant, message in (
            ("self:int8", None, QuantConfig(), "^drafter=self:int8 drafts with a copy of the target: name it"),
            ("self:int8", str(llama_dir), QuantConfig("int4"), "self-drafting scheme='int8' is not valid")):
        with pytest.raises(UserError, match=message):
            report.load_pair(drafter, target_path, quant)
