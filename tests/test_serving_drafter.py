"""The drafter as the engine serves it (speculators.export.serving): the target's tensors its export left out,
and its linear layers quantized for serving (speculators.quant.quantized_linears; int8 on a CPU unless
drafter_quant says otherwise), with the target's outputs unchanged."""

import pytest
from torch import nn

from common.config import UserError
from inference import report
from inference.engine import generate
from speculators import export
from speculators.quant import QuantizedLinear, WeightOnlyInt8Linear, linear_precision, quantized_linears


def test_a_quantized_copy_leaves_the_drafter_as_trained(llama_target, make_drafter):
    drafter = make_drafter(llama_target).eval()
    served = quantized_linears(drafter, "int8")
    linears = [name for name, m in drafter.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(served.get_submodule(name)) is WeightOnlyInt8Linear for name in linears)
    assert not any(isinstance(m, QuantizedLinear) for m in drafter.modules())  # the original is untouched
    shared = dict(drafter.named_parameters())
    for name, p in served.named_parameters():  # what is not quantized is shared, not copied
        assert p is shared[name]
    assert linear_precision(served) == "int8" and linear_precision(drafter) == "float32"
    assert quantized_linears(drafter, "none") is drafter


@pytest.mark.parametrize("scheme, says", [("gguf", "gguf does not do"), ("gptq_int4", "gptq_int4 does not do"),
                                          ("int3", "drafter_quant='int3' is not valid")])
def test_schemes_that_need_more_than_the_weights_are_refused_in_one_line(llama_target, make_drafter, scheme, says):
    with pytest.raises(UserError, match=says) as refused:
        quantized_linears(make_drafter(llama_target), scheme)
    assert "\n" not in str(refused.value)


def test_a_served_drafter_keeps_the_targets_outputs_and_is_not_exported(llama_target, make_drafter, text_batch,
                                                                         tmp_path):
    path = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    served, target = report.load_pair(str(path))  # on a CPU: int8 unless told
    as_trained, _ = report.load_pair(str(path), drafter_quant="none")
    assert linear_precision(served) == "int8" and linear_precision(as_trained) == "float32"
    for row in range(2):
        prompt = text_batch[row, :16].tolist()
        plain = generate(target, None, prompt, 24).tokens
        assert generate(target, served, prompt, 24, k=3).tokens == plain
        assert generate(target, as_trained, prompt, 24, k=3).tokens == plain
    with pytest.raises(UserError, match="quantized for serving"):
        export.save(served, tmp_path / "again", export.Verifier.of(target))


def test_the_benchmark_serves_each_precision_against_one_baseline(llama_target, make_drafter, text_batch, tmp_path):
    from benchmarks import drafter_quant
    from inference import evalsets

    path = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    drafter, target = report.load_pair(str(path), drafter_quant="none")
    prompts = evalsets.prompts_of([["def add(a, b):\n"], ["class Stack:\n"]], None, target, 8)
    cfg = drafter_quant.DrafterQuantConfig(drafter=str(path), schemes=["none", "int8"], k=2, max_new_tokens=8)
    result = drafter_quant.measure(target, drafter, prompts, cfg)
    assert [(r["scheme"], r["drafter_linears"], r["k"]) for r in result["rows"]] == [("none", "float32", 2),
                                                                                     ("int8", "int8", 2)]
    assert all(r["outputs_match_baseline"] and len(r["speedup_repeats"]) == 2 for r in result["rows"])
    assert "| int8 | 2 |" in drafter_quant.markdown(result)
    with pytest.raises(UserError, match="schemes lists the arms"):
        drafter_quant.DrafterQuantConfig(drafter=str(path), drafter_quant="int8")
