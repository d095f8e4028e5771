"""DSpark as GGUF for llama.cpp's `--spec-type draft-dspark`: our writer (speculators/formats/gguf.py) against
llama.cpp's own converter run on our speculators export, and against its loader's tensor list. The llama.cpp
source is the one engines/llamacpp.py builds: llama-cpp-python 0.3.36's sdist (vendor/llama.cpp), read from
engines.llamacpp's unpacked source or the sdist in ~/.cache/speculators-forge/llamacpp-src; skipped when
neither is here (offline). Get it with
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d ~/.cache/speculators-forge/llamacpp-src

The converter runs with the vendored gguf-py and its target-vocabulary step stubbed out: for a Llama target it
needs sentencepiece, and our tiny BPE's pre-tokenizer hash is not in its table. So the target's tokenizer.*
keys are not compared (ours are the EAGLE-3 export's, tests/test_export_gguf.py); tokenizer.ggml.mask_token_id,
which the DSpark converter writes itself, is. general.name is the source folder's name there and the output
file's here. Everything else must be equal: every key, its type and value, every tensor's name, type, shape
and bytes."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import load_target
from gguf import GGUFReader
from test_dspark import make_dspark

from common.config import UserError
from engines import llamacpp
from speculators import export
from speculators.export import Verifier

SDIST_DIR = Path.home() / ".cache" / "speculators-forge" / "llamacpp-src"
NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "src/models/dflash.cpp", "src/llama-arch.cpp")
NOT_COMPARED = {"general.name"}  # see the module doc; tokenizer.* other than mask_token_id likewise
# The converter with the target's own vocabulary step (LlamaModel.set_vocab) stubbed out.
DRIVER = """import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.llama
import conversion.qwen
conversion.llama.LlamaModel.set_vocab = conversion.qwen.Qwen3Model.set_vocab = lambda self: None
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def llama_cpp_source(tmp_path_factory) -> Path:
    unpacked = llamacpp.cache_dir() / "src"
    if (unpacked / "convert_hf_to_gguf.py").is_file():
        return unpacked
    sdist = SDIST_DIR / f"llama_cpp_python-{llamacpp.VERSION}.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"llama.cpp's source is not here offline: no {unpacked} nor {sdist} (pip download "
                    f"llama-cpp-python=={llamacpp.VERSION} --no-deps --no-binary :all: -d {SDIST_DIR})")
    out = tmp_path_factory.mktemp("llama_cpp")
    prefix = f"llama_cpp_python-{llamacpp.VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and any(m.name[len(prefix):].startswith(n) for n in NEEDED)]
        tar.extractall(out, members=members, filter="data")
    return out / prefix


# qwen3: head_dim 16, not hidden / heads; and two block layers (the references train five)
@pytest.fixture(scope="module", params=[("llama", 1), ("qwen3", 2)], ids=["llama", "qwen3-2-layers"])
def dspark_export(request, target_dirs, text_batch, tmp_path_factory) -> tuple[Path, Path]:
    """(our speculators export of a DSpark drafter, its target's folder)."""
    family, layers = request.param
    drafter = make_dspark(load_target(target_dirs, family), text_batch, num_layers=layers).eval()
    target_dir = target_dirs[family]
    return export.save(drafter, tmp_path_factory.mktemp("dspark") / "export",
                       Verifier(str(target_dir), [])), target_dir


def convert_theirs(source: Path, export_dir: Path, target_dir: Path, out: Path) -> Path:
    (out.parent / "drive.py").write_text(DRIVER)
    done = subprocess.run([sys.executable, str(out.parent / "drive.py"), str(source), str(export_dir),
                           "--target-model-dir", str(target_dir), "--outfile", str(out),
                           "--outtype", "f16"], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": str(source / "gguf-py")})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def both(llama_cpp_source, dspark_export, tmp_path_factory) -> tuple[Path, Path]:
    """(llama.cpp's converter's GGUF, ours) of the same speculators export."""
    export_dir, target_dir = dspark_export
    out = tmp_path_factory.mktemp("gguf")
    theirs = convert_theirs(llama_cpp_source, export_dir, target_dir, out / "theirs.gguf")
    return theirs, Path(export.convert(export_dir, out / "ours.gguf", "gguf"))  # what the export command runs


def compared_fields(reader: GGUFReader) -> dict:
    return {key: (tuple(f.types), f.contents()) for key, f in reader.fields.items()
            if key not in NOT_COMPARED and (not key.startswith("tokenizer.") or key == "tokenizer.ggml.mask_token_id")
            and key != "GGUF.kv_count"}  # the count includes the tokenizer keys


def assert_same_gguf(theirs: Path, ours: Path) -> None:
    a, b = GGUFReader(theirs), GGUFReader(ours)
    fa, fb = compared_fields(a), compared_fields(b)
    assert set(fa) == set(fb), f"keys only theirs: {set(fa) - set(fb)}, only ours: {set(fb) - set(fa)}"
    for key in fa:
        assert fa[key] == fb[key], f"{key}: theirs {fa[key]}, ours {fb[key]}"
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb), f"tensors only theirs: {set(ta) - set(tb)}, only ours: {set(tb) - set(ta)}"
    for name, t in ta.items():
        u = tb[name]
        assert (t.tensor_type, list(t.shape)) == (u.tensor_type, list(u.shape)), \
            f"{name}: theirs {t.tensor_type.name} {list(t.shape)}, ours {u.tensor_type.name} {list(u.shape)}"
        assert np.array_equal(np.asarray(t.data), np.asarray(u.data)), f"{name}: values differ"


def test_our_gguf_is_what_llama_cpps_converter_writes(both):
    theirs, ours = both
    assert_same_gguf(theirs, ours)
    fields = GGUFReader(ours).fields
    assert fields["general.architecture"].contents() == "dflash" and fields["dflash.block_size"].contents() == 4
    assert "output.weight" in fields or any(t.name == "output.weight" for t in GGUFReader(ours).tensors)
    assert "tokenizer.ggml.tokens" in fields  # the target's vocabulary: llama.cpp checks it against the target's


@pytest.mark.parametrize("tamper", ["value", "key"])
def test_the_comparison_fails_on_a_differing_value_or_key(both, tmp_path, tamper):
    theirs, ours = both
    changed = shutil.copy(ours, tmp_path / "changed.gguf")
    reader = GGUFReader(changed, "r+")
    if tamper == "value":
        next(t for t in reader.tensors if t.name == "markov_w2.weight").data[0, 0] += 1
    else:
        field = reader.fields["dflash.block_size"]
        field.parts[field.data[0]][0] = 5
    reader.data.flush()
    del reader
    with pytest.raises(AssertionError, match="markov_w2.weight: values differ|dflash.block_size"):
        assert_same_gguf(theirs, changed)


def loader_tensors(source: Path, n_layers: int) -> tuple[set[str], set[str]]:
    """(required, all) tensor names llama.cpp's DFlash loader (src/models/dflash.cpp load_arch_tensors) creates
    for a plain DSpark draft: without DeepSeek-V4's stages or DFlash2's selector, names from llama-arch.cpp."""
    names = dict(re.findall(r'\{\s*(LLM_TENSOR_\w+),\s*"([^"]+)"\s*\}', (source / "src/llama-arch.cpp").read_text()))
    text = (source / "src/models/dflash.cpp").read_text()
    body = text[text.index("void llama_model_dflash::load_arch_tensors"):]
    body = body[:body.index("\n}\n")]
    dsv4 = body.index("if (hparams.dsv4_hc_mult > 0) {")
    body = body[:dsv4] + body[body.index("return;\n    }", dsv4):]
    required, every = set(), set()
    for enum, suffix, flags in re.findall(r'create_tensor\(tn\((LLM_TENSOR_\w+)(?:,\s*"(\w+)")?(?:,\s*i)?\),'
                                          r'\s*\{[^}]*\},\s*([^)]+)\)', body):
        if enum.startswith("LLM_TENSOR_DFLASH_"):  # DFlash2's conv and selector
            continue
        for i in range(n_layers) if "%d" in names[enum] else [None]:
            name = (names[enum] % i if i is not None else names[enum]) + (f".{suffix}" if suffix else "")
            every.add(name)
            if flags.strip() == "0":
                required.add(name)
    return required, every


def test_the_gguf_holds_what_llama_cpps_loader_creates(both, llama_cpp_source):
    _, ours = both
    reader = GGUFReader(ours)
    required, every = loader_tensors(llama_cpp_source, reader.fields["dflash.block_count"].contents())
    held = {t.name for t in reader.tensors}
    assert {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "fc.weight", "blk.0.attn_q_norm.weight"} <= every
    assert required <= held, f"the loader requires {required - held}"
    assert held <= every, f"the loader does not create {held - every} (llama.cpp refuses extra tensors)"


@pytest.mark.parametrize("fields, message", [({"markov_head_type": "gated"}, "vanilla Markov head only"),
                                             ({"confidence_with_markov": False}, "hidden state only")])
def test_heads_llama_cpp_lacks_are_refused_in_one_line(llama_target, llama_dir, text_batch, tmp_path, fields, message):
    drafter = make_dspark(llama_target, text_batch, **fields)
    with pytest.raises(UserError, match=message):
        export.save(drafter, tmp_path / "draft.gguf", Verifier(str(llama_dir), []), fmt="gguf")
    assert not (tmp_path / "draft.gguf").exists()


def test_a_full_vocabulary_lm_head_is_kept_where_the_converter_would_drop_it(llama_cpp_source, llama_target,
                                                                              llama_dir, text_batch, tmp_path):
    """The one deliberate difference: with the target's whole vocabulary and an untied target the converter
    drops lm_head and llama.cpp would project with token_embd; ours keeps output.weight (the lm_head's rows)."""
    drafter = make_dspark(llama_target, text_batch, draft_vocab_size=llama_target.vocab_size).eval()
    export_dir = export.save(drafter, tmp_path / "export", Verifier(str(llama_dir), []))
    theirs = GGUFReader(convert_theirs(llama_cpp_source, export_dir, llama_dir, tmp_path / "theirs.gguf"))
    ours = GGUFReader(export.convert(export_dir, tmp_path / "ours.gguf", "gguf"))
    assert "output.weight" not in {t.name for t in theirs.tensors}
    output = next(t for t in ours.tensors if t.name == "output.weight")
    np.testing.assert_array_equal(np.asarray(output.data), drafter.lm_head.weight.detach().half().numpy())
    assert {t.name for t in ours.tensors} - {t.name for t in theirs.tensors} == {"output.weight"}
