"""llama.cpp serving a DSpark export beside our engine (benchmarks/llamacpp_bench.py): the command line of
`--spec-type draft-dspark` with its confidence threshold off or on, the drafts counted from its log, the arms
named by the drafter's family and tau from the counters. Checked against llama.cpp's own source where
engines/llamacpp.py has unpacked it; served end to end once llama.cpp is built."""

from pathlib import Path

import pytest
from test_dspark import make_dspark
from test_export_gguf import built, gguf_target  # noqa: F401 - gguf_target is a fixture used below

from benchmarks import llamacpp_bench
from common.config import UserError
from engines import llamacpp
from inference import evalsets
from speculators import export
from speculators.export import Verifier

# llama-speculative-simple's closing log as this llama.cpp prints it (-lv 4: the statistics line included).
LOG = """0.31.102.395 I encoded   16 tokens in    0.622 seconds, speed:   25.731 t/s
0.31.102.395 I decoded   66 tokens in    0.400 seconds, speed:  165.000 t/s
0.31.102.396 I
0.31.102.396 I n_draft   = 8
0.31.102.396 I n_predict = 66
0.31.102.397 I n_drafted = 96
0.31.102.397 I n_accept  = 54
0.31.102.397 I accept    = 56.250%
0.31.102.398 I
0.31.102.398 I draft:

0.31.102.448 I spec common_specu: statistics     draft-dspark: #calls(b,g,a) =    1     12     12, #gen drafts =     12, \
#acc drafts =    11, #gen tokens =     96, #acc tokens =    54, #mean acc len = 5.50, #acc rate/pos = (0.917, 0.833), \
dur(b,g,a) = 0.002, 4684.231, 0.026 ms
0.31.102.448 I
0.31.102.448 I target:
"""


def command(p_min: float | None) -> list[str]:
    return llamacpp.speculative_command(Path("/bin/llama-speculative-simple"), Path("t.gguf"), Path("d.gguf"), "hi",
                                        64, 8, "draft-dspark", 1, 256, p_min)


def flag(line: list[str], name: str) -> str | None:
    return line[line.index(name) + 1] if name in line else None


def test_draft_dspark_command_sets_k_and_its_confidence_threshold():
    off, on = command(0.0), command(0.5)
    assert flag(off, "--spec-type") == "draft-dspark" and flag(off, "--spec-draft-n-max") == "8"
    assert flag(off, "--spec-draft-p-min") == "0.0" and flag(on, "--spec-draft-p-min") == "0.5"
    assert flag(off, "-md") == "d.gguf" and flag(off, "--temp") == "0" and flag(off, "-lv") == "4"
    assert "--spec-draft-p-min" not in command(None)  # EAGLE-3's runs keep llama.cpp's default


def test_the_flags_are_the_vendored_llama_cpps():
    source = llamacpp.cache_dir() / "src"
    if not (source / "common" / "arg.cpp").is_file():
        pytest.skip(f"llama.cpp's source is not unpacked in {source} (engines/llamacpp.py build)")
    args = (source / "common" / "arg.cpp").read_text()
    for name in ("--spec-type", "--spec-draft-n-max", "--spec-draft-p-min", "-lv"):
        assert f'"{name}"' in args, name
    spec = (source / "common" / "speculative.cpp").read_text()
    assert '"draft-dspark"' in spec and "#gen drafts = " in spec
    assert "conf[(size_t) idx * n_embd_dec] < params.p_min" in spec  # draft-dspark reads p_min as its confidence cut


def test_counters_and_drafts_are_read_from_the_log():
    run = llamacpp.parse_speculative("the text", LOG)
    assert (run.n_predict, run.n_drafted, run.n_accept, run.n_drafts) == (66, 96, 54, 12)
    no_statistics = LOG[:LOG.index("draft:")]
    assert llamacpp.parse_speculative("", no_statistics).n_drafts is None
    with pytest.raises(UserError, match="n_accept"):
        llamacpp.parse_speculative("", LOG.replace("n_accept  =", "accepted ="))


def test_arms_are_named_by_family_and_dspark_runs_its_cut_off_and_on():
    assert llamacpp_bench.drafter_arms("eagle3", 0.5) == {"llamacpp_eagle3_chain": None}
    assert llamacpp_bench.drafter_arms("dspark", 0.5) == {"llamacpp_dspark_chain": 0.0,
                                                          "llamacpp_dspark_confidence": 0.5}
    assert llamacpp_bench.drafter_arms("dspark", None) == {"llamacpp_dspark_chain": 0.0}


def test_tau_is_one_plus_accepted_per_draft():
    run = lambda drafted, accepted, drafts: llamacpp_bench.Run(1, 1.0, "", drafted, accepted, drafts)
    counts = llamacpp_bench.draft_counts([run(16, 9, 4), run(8, 3, 2)])
    assert counts["acceptance_rate"] == 12 / 24 and counts["tau"] == 1 + 12 / 6 and counts["num_drafts"] == 6
    assert llamacpp_bench.draft_counts([run(16, 9, 4), run(8, 3, None)])["tau"] is None


@pytest.mark.parametrize("value", [0.0, 1.0, 2.0])
def test_confidence_threshold_outside_0_1_is_a_one_line_error(value):
    with pytest.raises(UserError, match="confidence_min"):
        llamacpp_bench.LlamacppBenchConfig(drafter="x", confidence_min=value)


@built
def test_llamacpp_serves_dspark_beside_ours(gguf_target, text_batch, tmp_path):  # noqa: F811
    """A DSpark export served by llama.cpp's draft-dspark at the block's K, its confidence cut off and on,
    beside our engine: both count drafts, accepted tokens and tau on the same prompts."""
    path, target = gguf_target
    drafter = make_dspark(target, text_batch).eval()
    cfg = llamacpp_bench.LlamacppBenchConfig(drafter="unused", max_new_tokens=16, repeats=1, k=drafter.depth)
    prompts = evalsets.prompts_of([["def f(x):"], ["import os"]], None, target, cfg.max_new_tokens)
    draft = export.save(drafter, tmp_path / "d.gguf", Verifier.of(target), fmt="gguf")
    result = llamacpp_bench.run(target, drafter, prompts, cfg, draft)
    rows = result["methods"]
    assert {"llamacpp_dspark_chain", "llamacpp_dspark_confidence", "ours_dspark_chain"} <= set(rows)
    for name in ("llamacpp_dspark_chain", "ours_dspark_chain"):
        assert rows[name]["num_drafts"] > 0 and 1 <= rows[name]["tau"] <= 1 + drafter.depth
    assert result["family"] == "dspark" and result["acceptance_parity"]["tau_ours"] == rows["ours_dspark_chain"]["tau"]
    assert rows["ours_dspark_chain"]["outputs_match_own_target_only"]  # greedy verification: the target's output
