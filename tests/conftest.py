"""Tiny random targets (a Llama and a Qwen3) built from configs, with a real BPE tokenizer; no hub access."""

import json
import os
import re
import shutil
import string
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)

# Property-based tests draw the same cases on every run, so CI is reproducible; to search new
# ones, run with HYPOTHESIS_PROFILE=explore (a case it finds is a bug to fix, then keep it green).
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

VOCAB_SIZE = 320  # byte-level BPE needs 257 (256 bytes + EOS); the rest are merges
NUM_LAYERS = 4
LAYER_IDS = [0, 1, 2]  # explicit: the default [2, L//2, L-3] is invalid for 4 layers
DRAFT_VOCAB = 96
FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="session")
def tokenizer():
    from train.pretrain import train_tokenizer

    texts = [Path(m.__file__).read_text() for m in (json.decoder, json.encoder, textwrap, string)]
    tok = train_tokenizer(texts, VOCAB_SIZE)
    assert len(tok) == VOCAB_SIZE, "the tokenizer corpus is too small for the requested vocabulary"
    return tok


def make_model(family: str, tokenizer, num_layers: int = NUM_LAYERS, seed: int = 0):
    """A tiny random causal LM of `family` whose vocabulary matches `tokenizer`."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if family == "qwen3":
        # head_dim 16 with 4 heads: q/k/v widths (64) differ from hidden_size (32), as in real Qwen3s.
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()
    raise ValueError(family)


@pytest.fixture(scope="session")
def target_dirs(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """family -> a save_pretrained folder holding the model and its tokenizer, and a training.json naming the
    standard library as its corpus (its tokenizer's is), as train.pretrain's do: recipes with data=stdlib take it."""
    from common.corpus import STDLIB_SOURCE

    dirs = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"tiny_{family}")
        make_model(family, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
        (path / "training.json").write_text(json.dumps({"corpus": {"source": STDLIB_SOURCE}}))
        dirs[family] = path
    return dirs


@pytest.fixture(scope="session")
def llama_dir(target_dirs) -> Path:
    return target_dirs["llama"]


@pytest.fixture(scope="session")
def qwen3_dir(target_dirs) -> Path:
    return target_dirs["qwen3"]


_loaded: dict[str, object] = {}


def load_target(target_dirs, family: str):
    from speculators.target import FrozenTarget, TargetConfig

    if family not in _loaded:
        _loaded[family] = FrozenTarget.load(TargetConfig(name_or_path=str(target_dirs[family]), layer_ids=LAYER_IDS))
    return _loaded[family]


@pytest.fixture(scope="session", params=FAMILIES)
def target(request, target_dirs):
    """A loaded FrozenTarget, once for each of llama and qwen3."""
    return load_target(target_dirs, request.param)


@pytest.fixture(scope="session")
def llama_target(target_dirs):
    return load_target(target_dirs, "llama")


@pytest.fixture(scope="session")
def text_batch(tokenizer) -> torch.Tensor:
    """[2, 48] token ids of real Python source (so token frequencies are skewed, as in training)."""
    text = Path(textwrap.__file__).read_text()
    ids = torch.tensor(tokenizer(text)["input_ids"][: 2 * 48])
    assert len(ids) == 2 * 48
    return ids.view(2, 48)


@pytest.fixture(scope="session")
def make_drafter(text_batch):
    """make_drafter(target, **Eagle3Config fields): an EAGLE-3 drafter whose draft vocab is the batch's top tokens."""
    from speculators import draft_vocab
    from speculators.eagle3 import Eagle3Config, Eagle3Drafter

    def make(target, seed: int = 0, **fields):
        torch.manual_seed(seed)
        fields = {"depth": 3, "draft_vocab_size": DRAFT_VOCAB, **fields}
        counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
        return Eagle3Drafter.from_target(Eagle3Config(**fields), target, counts)

    return make


def run_interpreted_tests(test_file: str) -> None:
    """Run `test_file`'s tests marked `interpreted` in a child process with TRITON_INTERPRET=1 (Triton
    reads it when first imported, so this process cannot switch), and require that none was skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                            test_file, "-k", "interpreted"], env=env, cwd=Path(__file__).parent.parent,
                           capture_output=True, text=True)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert re.search(r"^\d+ passed, \d+ deselected", summary), summary  # nothing skipped: Triton was interpreted


def cpu_kernel_cannot_build() -> str | None:
    """Why the compiled CPU kernel (kernels/quant_matmul_cpu.cpp) cannot exist in this process, or None: then it
    must build, and a test that needs it fails when it did not (kernels.quant_matmul.cpu_ops only warns)."""
    import forge_kernels as kernels

    if kernels.INTERPRET:
        return "TRITON_INTERPRET=1: this process interprets Triton"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU has no AVX2"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH"
    return None


def require_cpu_kernel():
    """The CPU kernel's ops. Skips only where it cannot build (no compiler, no AVX2, the Triton interpreter);
    where it could, a failed build fails the test with the compiler's complaint."""
    from forge_kernels.quant_matmul import cpu_ops

    reason = cpu_kernel_cannot_build()
    if reason:
        pytest.skip(f"the CPU kernel cannot build here: {reason}")
    ops = cpu_ops()
    if ops is None:
        with warnings.catch_warnings(record=True) as caught:  # build again to show why
            warnings.simplefilter("always")
            cpu_ops.__wrapped__()
        pytest.fail("the CPU kernel did not build although a C++ compiler and AVX2 are here: "
                    + ("; ".join(str(w.message) for w in caught) or "no warning"), pytrace=False)
    return ops


@pytest.fixture
def cpu_kernel():
    """Tests that need the compiled CPU kernel take this fixture (or call require_cpu_kernel)."""
    return require_cpu_kernel()


# --- tiers (docs/testing.md) -------------------------------------------------------------------------
# `slow`: a test that trains or serves in a subprocess, or took 20 s or more in `pytest --durations=0` on
# 2 cores at 1 thread with other jobs beside (2026-11-29). Named here, by file and test function (every parametrization), so the tiers
# are read in one place; a new test is quick until it is listed. `python -m pytest -m "not slow"` is the quick
# tier; plain `python -m pytest` (CI) runs every tier but skips gpu without CUDA and engines until built.
SLOW = {
    "test_architectures.py": {"test_train_py_trains_exports_and_serves_a_gpt_oss_target"},
    "test_batch.py": {"test_batch_sampling_emits_the_target_distribution"},
    "test_batch_sweep.py": {"test_command_line_end_to_end"},
    "test_cache_integrity.py": {"test_train_cli_refuses_a_flipped_shard_in_one_line"},
    "test_chat_data.py": {"test_train_eagle3_on_sharegpt_end_to_end"},
    "test_cli.py": {"test_train_eagle3_end_to_end"},
    "test_cli_grammar.py": {"test_misspelt_key_names_the_nearest_keys", "test_missing_value_names_the_key"},
    "test_compare.py": {"test_cli_end_to_end"},
    "test_ddp.py": {"test_two_processes_train_as_one_with_the_same_global_batch",
                    "test_train_py_with_trainer_ddp_runs_two_processes_and_exports_once",
                    "test_one_process_resumed_by_two_trains_as_one_uninterrupted"},
    "test_dflash.py": {"test_train_dflash_end_to_end", "test_original_dflash_export_bad_input_is_one_line"},
    "test_dspark.py": {"test_train_dspark_end_to_end", "test_sampled_markov_drafts_stay_lossless_with_and_without_a_plan"},
    "test_eagle.py": {"test_train_eagle_through_the_cli"},

    "test_export.py": {"test_convert_command_between_formats"},
    "test_gguf_quant.py": {"test_triton_kernel_in_the_interpreter"},
    "test_gpu.py": {"test_train_py_with_trainer_gpu_trains_exports_and_reports"},
    "test_hidden_cache.py": {"test_build_then_train_from_the_cache_on_the_command_line"},
    "test_inference_cli.py": {"test_report_files_and_an_offline_wandb_run"},
    "test_kernels.py": {"test_triton_kernels_in_the_interpreter"},
    "test_lookup.py": {"test_sampling_with_lookup_stays_lossless"},
    "test_medusa.py": {"test_train_medusa_through_the_cli"},
    "test_new_family.py": {"test_a_new_family_trains_exports_and_serves_losslessly"},
    "test_package.py": {"test_wheel_holds_every_package_and_the_shipped_data_and_nothing_else_at_the_top",
                        "test_installed_commands_run_from_any_folder_on_the_packed_conf",
                        "test_installed_forge_infer_serves_a_tiny_drafter",
                        "test_installed_beside_hf_kernels_every_command_runs_and_beside_vllm_speculators_refuses_in_one_line"},
    "test_parity.py": {"test_cli"},
    "test_peagle.py": {"test_train_peagle_end_to_end"},
    "test_quant.py": {"test_train_eagle3_against_an_int4_target", "test_triton_kernel_in_the_interpreter"},
    "test_quant_report.py": {"test_command_line_end_to_end"},
    "test_regenerate.py": {"test_sigterm_then_restart_loses_and_repeats_nothing"},
    "test_reliability.py": {"test_bad_values_through_real_processes", "test_offline_training_makes_no_network_attempt",
                            "test_every_bad_training_value_ends_in_one_line",
                            "test_every_bad_inference_value_ends_in_one_line"},
    "test_run_identity.py": {"test_sigterm_to_train_py_in_its_closing_report"},
    "test_sampling.py": {"test_generate_samples_the_target_distribution_end_to_end",
                         "test_sampled_chains_that_stop_early_stay_lossless"},
    "test_self_draft.py": {"test_sampling_with_another_model_as_copy_keeps_the_target_law"},
    "test_shipped_drafter.py": {"test_shipped_drafter_keeps_its_card_acceptance"},
    "test_shipped_target.py": {"test_default_recipe_trains_and_exports_for_the_shipped_target",
                               "test_shipped_target_loops_no_more_than_its_card_says"},
    "test_target_card.py": {"test_card_and_heldout_written_with_finite_numbers", "test_changed_corpus_is_warned_about"},
}
# `engines`: served by an engine built on demand outside pytest (llama.cpp: engines/llamacpp.py build();
# vLLM's CPU venv: engines/vllm_venv.py SETUP); they skip until it is there, and are slow too.
ENGINES = {
    "test_engines_bench.py": {"test_llamacpp_serves_the_drafter_beside_ours", "test_vllm_serves_our_export_in_its_cpu_build",
                              "test_vllm_cpu_build_refuses_dspark_for_the_reason_we_give"},
    "test_export_gguf.py": {"test_llamacpp_serves_the_export", "test_llamacpp_target_only_completion",
                            "test_llamacpp_bench_runs_both_engines_on_the_same_prompts"},
    "test_llamacpp_dspark.py": {"test_llamacpp_serves_dspark_beside_ours"},
}


def tier_markers(file: str, function: str) -> list[str]:
    """The tier markers conftest gives test `function` of tests/`file`."""
    engines = function in ENGINES.get(file, ())
    return ["engines", "slow"] * engines or ["slow"] * (function in SLOW.get(file, ()))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tier markers from SLOW and ENGINES; tests marked `gpu` need CUDA: without it they are collected and
    skipped, all with one reason."""
    for item in items:
        for name in tier_markers(item.path.name, getattr(item, "originalname", item.name)):
            item.add_marker(name)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)
