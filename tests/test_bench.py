"""The speed benchmark runs every method on the same prompts and checks each reproduces target-only greedy."""

from pathlib import Path

from benchmarks.bench import BenchConfig, run, table


def test_bench_runs_every_method_and_compares_outputs(llama_target, make_drafter, tokenizer):
    drafter = make_drafter(llama_target).eval()
    prompts = [tokenizer("import os\nimport sys\n")["input_ids"], tokenizer("def main():\n    return")["input_ids"]]
    cfg = BenchConfig(drafter="unused", max_new_tokens=12, k=3, repeats=2,
                      lookup_chain_lengths=[1], prompt_lookup_min=1)
    rows = run(llama_target, drafter, llama_target.model, prompts, cfg)
    assert set(rows) == {"target_only", "speculative_chain", "speculative_tree", "speculative_chain_k1_lookup",
                         "hf_greedy", "hf_prompt_lookup", "hf_assisted"}
    assert rows["speculative_chain_k1_lookup"]["k"] == 1
    assert rows["target_only"]["speedup"] == 1.0
    for name, row in rows.items():
        assert len(row["seconds"]) == cfg.repeats and row["tokens_per_second"] > 0
        assert row["outputs_match_target_only"], name  # all greedy: all must equal target-only output
    assert "speculative_tree" in table(rows)


def test_an_assistant_with_another_vocabulary_is_refused_in_one_line(llama_target, tmp_path):
    import pytest
    from transformers import AutoTokenizer

    from benchmarks.bench import load_assistant
    from common.config import UserError

    assert load_assistant(None, llama_target) is None
    with pytest.raises(UserError, match="assistant=.*saved causal LM"):
        load_assistant(str(tmp_path / "missing"), llama_target)
    other = tmp_path / "other"
    llama_target.model.save_pretrained(other)
    AutoTokenizer.from_pretrained(str(Path(__file__).parent.parent / "models" / "pycode")).save_pretrained(other)
    with pytest.raises(UserError, match="target's tokenizer"):
        load_assistant(str(other), llama_target)
    same = tmp_path / "same"
    llama_target.model.save_pretrained(same)
    llama_target.tokenizer.save_pretrained(same)
    assert load_assistant(str(same), llama_target).config.vocab_size == llama_target.model.config.vocab_size
