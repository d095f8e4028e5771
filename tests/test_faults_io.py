"""Writes the disk refuses (full, read-only), overwrites onto files, and what conversions add.

Each fault ends in one line naming the path, what was there before stays intact, and nothing
half-written is left beside it. A full disk is simulated (the write raises ENOSPC after its first
4,096 bytes, as a filling disk does) and, where a user namespace can mount one, made real: a tiny
tmpfs. A read-only folder is chmod 555 (not as root, where chmod does not bind), a path under a file,
or, in the namespace, a tmpfs mounted read-only.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.config import UserError
from speculators import export
from speculators.export import Verifier
from speculators.formats import gguf as export_gguf

ROOT = Path(__file__).parent.parent


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def disk_fills_after(monkeypatch, first_bytes: int = 4096) -> None:
    """os.write takes `first_bytes` more, then fails as a full disk does."""
    left = [first_bytes]
    real_write = os.write

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        taken = real_write(fd, bytes(data[:left[0]]))
        left[0] -= taken
        return taken

    monkeypatch.setattr(os, "write", write)


def unwritable_places(tmp_path: Path) -> list[Path]:
    """Folders that cannot be written here: a path under a file always; a chmod-555 folder unless root."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    places = [a_file / "out"]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        places.append(locked / "out")
    return places


# --- the inference report (report.json, acceptance.png) ---------------------------------------------


def a_report(tau: float = 1.5, size: int = 10_000) -> dict:
    """The keys report.write and its table read, padded to about `size` bytes."""
    return {"acceptance_rate_per_position": [0.5, 0.25], "acceptance_length": tau, "num_drafts": 10,
            "lookup_drafts": 0, "num_draft_tokens": 20, "per_turn": None, "tokens_per_second": 11.0,
            "baseline_tokens_per_second": 10.0, "speedup": 1.1, "time_split_s": {"drafter": 1.0},
            "outputs_match_baseline": True, "drift": None, "filler": "x" * size,
            "config": {"drafting": {"chain_min_prob": 0}, "quant": {"scheme": "none"}, "acceptance_tolerance": 0}}


def test_a_full_disk_keeps_the_previous_report_whole(tmp_path, monkeypatch):
    from inference import report

    report.write(a_report(1.5), tmp_path)
    before = folder_bytes(tmp_path)
    disk_fills_after(monkeypatch)
    with pytest.raises(UserError, match=f"^cannot write {tmp_path / 'report.json'}: No space left on device$"):
        report.write(a_report(2.5), tmp_path)
    monkeypatch.undo()
    assert folder_bytes(tmp_path) == before  # not a truncated 4,096-byte report; no partial file beside it
    assert json.loads((tmp_path / "report.json").read_text())["acceptance_length"] == 1.5


def test_a_full_disk_while_drawing_keeps_the_previous_figure(tmp_path, monkeypatch):
    from common import plots
    from inference import report

    report.write(a_report(1.5), tmp_path)
    before = (tmp_path / "acceptance.png").read_bytes()

    def full(path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", lambda self, path, **kw: full(path, **kw))
    with pytest.raises(UserError, match="acceptance.png: No space left on device"):
        report.write(a_report(2.5), tmp_path)
    assert (tmp_path / "acceptance.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.png", "report.json"]
    assert plots  # the figure is drawn through common.plots


def test_an_unwritable_out_is_refused_before_any_work(tmp_path):
    from inference.report import InferenceConfig

    for place in unwritable_places(tmp_path):
        with pytest.raises(UserError, match=f"^out={place}: cannot write there") as refused:
            InferenceConfig(drafter="unused", out=str(place))  # the config is read before the target loads
        assert "\n" not in str(refused.value)
    assert InferenceConfig(drafter="unused", out=str(tmp_path / "new" / "folder")).out  # created, writable


def test_the_inference_command_refuses_an_unwritable_out_in_one_line(tmp_path):
    place = unwritable_places(tmp_path)[0]
    child = subprocess.run([sys.executable, "-m", "inference", "drafter=models/smollm2-eagle3", f"out={place}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode != 0
    assert child.stderr.strip().splitlines() == [f"error: out={place}: cannot write there (Not a directory)"]


# --- exports --------------------------------------------------------------------------------------


@pytest.fixture
def drafter(llama_target, make_drafter):
    return make_drafter(llama_target)


def test_a_full_disk_during_an_export_keeps_the_previous_one_and_leaves_no_partial(drafter, llama_target,
                                                                                  make_drafter, tmp_path, monkeypatch):
    out = export.save(drafter, tmp_path / "export", Verifier.of(llama_target))
    before = folder_bytes(out)
    real_save_file = export.save_file

    def fills_up(tensors, path, *args, **kwargs):  # safetensors writes part of the file, then the disk is full
        real_save_file(tensors, path, *args, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(export, "save_file", fills_up)
    with pytest.raises(UserError, match=f"^cannot write {out}: No space left on device$"):
        export.save(make_drafter(llama_target, seed=1), out, Verifier.of(llama_target), overwrite=True)
    assert folder_bytes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_export_into_an_unwritable_folder_is_one_line(drafter, llama_target, tmp_path):
    for place in unwritable_places(tmp_path):
        with pytest.raises(UserError, match=f"^{place.parent}: cannot write there"):
            export.save(drafter, place, Verifier.of(llama_target))
        with pytest.raises(UserError, match=f"^{place.parent}: cannot write there"):
            export.save(drafter, place.with_suffix(".gguf"), Verifier.of(llama_target), fmt="gguf")


def test_overwrite_onto_a_file_replaces_it_and_leaves_nothing_beside(drafter, llama_target, tmp_path):
    out = tmp_path / "export"
    out.write_text("a file where the export goes")
    for _ in range(2):  # the second overwrite=True there too
        export.save(drafter, out, Verifier.of(llama_target), overwrite=True)
        assert out.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    (tmp_path / "export.previous").write_text("left by an earlier version")
    export.save(drafter, out, Verifier.of(llama_target), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_the_export_command_names_its_own_overwrite_key(drafter, llama_target, tmp_path):
    source = export.save(drafter, tmp_path / "spec", Verifier.of(llama_target))
    (tmp_path / "taken").mkdir()
    with pytest.raises(SystemExit, match=f"^error: {tmp_path / 'taken'} already exists; pass overwrite=true to "
                                         f"replace it$"):
        export.main([f"source={source}", f"out={tmp_path / 'taken'}", "format=eagle3"])
    place = unwritable_places(tmp_path)[0]
    with pytest.raises(SystemExit, match=f"^error: {place.parent}: cannot write there"):
        export.main([f"source={source}", f"out={place}", "format=eagle3"])


def test_a_full_disk_during_a_gguf_export_keeps_the_previous_file(llama_target, make_drafter, tmp_path, monkeypatch):
    out = export.save(make_drafter(llama_target), tmp_path / "d.gguf", Verifier.of(llama_target), fmt="gguf")
    before = out.read_bytes()
    real_write = export_gguf.write

    def fills_up(path, *args):
        real_write(path, *args)
        with open(path, "r+b") as f:
            f.truncate(4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_gguf, "write", fills_up)
    with pytest.raises(UserError, match=f"^cannot write {out}: No space left on device$"):
        export.save(make_drafter(llama_target, seed=1), out, Verifier.of(llama_target), fmt="gguf", overwrite=True)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf"]


# --- a real full disk and a real read-only filesystem (a tmpfs in a user namespace) ------------------

NAMESPACE_SCRIPT = textwrap.dedent("""\
    import json, os, subprocess, sys
    from pathlib import Path
    from common.config import UserError
    from speculators import export
    source, mount, size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    out = mount / "export"
    print("first:", export.convert(source, out, "speculators"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    try:
        export.convert(source, out, "speculators", overwrite=True)  # needs room for two
    except UserError as e:
        print("full:", e)
    print("intact:", {p.name: p.read_bytes() for p in out.iterdir()} == before, sorted(os.listdir(mount)))
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    for attempt in (lambda: export.convert(source, mount / "other", "speculators"),
                    lambda: export.convert(source, out, "speculators", overwrite=True)):
        try:
            attempt()
        except UserError as e:
            print("read-only:", e)

    from inference import report  # a report into a disk that is full
    reports = mount.with_name("reports")
    reports.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(reports)], check=True)
    first, second = json.loads(sys.argv[4]), json.loads(sys.argv[5])
    report.write(first, reports)
    before = {p.name: p.read_bytes() for p in reports.iterdir()}
    try:
        with open(reports / "filler", "wb") as filler:  # fill what is left
            while True:
                filler.write(b"x" * 4096)
                filler.flush()
    except OSError:
        pass
    try:
        report.write(second, reports)
    except UserError as e:
        print("full report:", e)
    (reports / "filler").unlink()
    print("report intact:", {p.name: p.read_bytes() for p in reports.iterdir()} == before, sorted(os.listdir(reports)))
    """)


def namespace_available() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not namespace_available(), reason="needs unshare -rm (a user namespace to mount a tmpfs in)")
def test_a_real_full_disk_and_read_only_filesystem_for_exports_and_reports(drafter, llama_target, tmp_path):
    source = export.save(drafter, tmp_path / "spec", Verifier.of(llama_target))
    size = sum(p.stat().st_size for p in source.iterdir())
    assert size > 2**16  # room for one export and a half (and the pages each file rounds up to), not for two
    mount = tmp_path / "mnt"
    mount.mkdir()
    child = subprocess.run(["unshare", "-rm", sys.executable, "-c", NAMESPACE_SCRIPT, str(source), str(mount),
                            str(int(size * 1.5) + 16384), json.dumps(a_report(1.5)),
                            json.dumps(a_report(2.5, size=30_000))],  # larger: no room even in the pages it frees
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert child.returncode == 0, child.stderr
    said = ("first", "full", "intact", "read-only", "full report", "report intact")
    lines = [line for line in child.stdout.splitlines() if line.split(":")[0] in said]  # not report.write's table
    assert lines[0] == f"first: {mount / 'export'}"
    assert lines[1] == f"full: cannot write {mount / 'export'}: No space left on device" or (
        lines[1].startswith(f"full: cannot write {mount / 'export'}: ") and "space" in lines[1]), lines
    assert lines[2] == "intact: True ['export']", lines  # the previous export whole, no .partial
    assert lines[3] == f"read-only: {mount}: cannot write there (Read-only file system)", lines
    assert lines[4] == f"read-only: {mount}: cannot write there (Read-only file system)", lines
    reports = tmp_path / "reports"
    assert lines[5] == f"full report: cannot write {reports / 'report.json'}: No space left on device", lines
    assert lines[6] == "report intact: True ['acceptance.png', 'report.json']", lines


# --- what a conversion keeps and adds ------------------------------------------------------------


def stored(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def test_a_conversion_keeps_the_dtype_and_adds_no_embeddings(drafter, llama_target, llama_dir, tmp_path):
    """The shipped form (bf16, embed_tokens left to the target) converted to SGLang's layout stays that
    (not fp32 with nn.Embedding's random initial values written as its embeddings), and back."""
    lean = export.save(drafter, tmp_path / "lean", Verifier.of(llama_target), dtype="bfloat16", shared_embedding=True)
    sglang = export.convert(lean, tmp_path / "sglang", "eagle3")
    dtypes = stored(sglang)
    assert "embed_tokens.weight" not in dtypes and dtypes["fc.weight"] == "BF16" and dtypes["d2t"] == "I64"
    config = json.loads((sglang / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    size = lambda folder: (folder / "model.safetensors").stat().st_size  # noqa: E731
    assert abs(size(sglang) - size(lean)) < 1024

    loaded, _ = export.load(sglang)
    assert loaded.embedding_from_target  # and served with the target's, as SGLang and vLLM do
    export.share_target_embedding(loaded, llama_target)
    reference, _ = export.load(lean)
    export.share_target_embedding(reference, llama_target)
    assert all(torch.equal(loaded.state_dict()[name], t) for name, t in reference.state_dict().items())

    back = export.convert(sglang, tmp_path / "back", "speculators", target=str(llama_dir))
    assert stored(back) == stored(lean)
    assert json.loads((back / "config.json").read_text())["transformer_layer_config"]["dtype"] == "bfloat16"
    assert stored(export.convert(lean, tmp_path / "fp32", "eagle3", dtype="float32"))["fc.weight"] == "F32"


def test_a_full_export_converts_with_its_embeddings_in_its_dtype(drafter, llama_target, tmp_path):
    full = export.save(drafter, tmp_path / "full", Verifier.of(llama_target))
    assert json.loads((full / "config.json").read_text())["torch_dtype"] == "float32"
    sglang = export.convert(full, tmp_path / "sglang", "eagle3")
    assert stored(sglang)["embed_tokens.weight"] == "F32"  # its own: written, as the source had it
    loaded, _ = export.load(sglang)
    assert not loaded.embedding_from_target
    assert torch.equal(loaded.embed_tokens.weight, drafter.embed_tokens.weight)
