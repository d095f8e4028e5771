"""`pip install <checkout>` (not editable): a wheel that runs every command from any folder with the conf/, data/
and models/ packed inside it, and that refuses, in one line, an environment where vLLM's `speculators` shares our import name. Hugging Face's
`kernels` (which transformers requires) keeps its name: our kernels/ is imported as forge_kernels."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CODE = ["common", "forge_kernels", "speculators", "inference", "engines", "train", "benchmarks"]  # as setup.py's
NOT_COPIED = {".git", ".venv", "runs", "outputs", "wandb", "results", "build", "__pycache__", ".pytest_cache",
              ".hypothesis"}
RIVAL_WHEELS = Path.home() / ".cache" / "speculators-forge" / "wheels"
RIVALS = ["speculators==0.9.0", "kernels==0.17.2"]  # vLLM's, Hugging Face's


def run(args, cwd: Path, python_path: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    env.pop("SPECULATORS_TRACEBACK", None)
    env.pop("PYTHONPATH", None)
    if python_path:
        env["PYTHONPATH"] = python_path
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The checkout's wheel, built from a copy (a build writes build/ and *.egg-info beside its sources)."""
    root = tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns(*NOT_COPIED, "*.egg-info")
    shutil.copytree(REPO, root / "src", ignore=ignore, symlinks=True)
    result = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root,
                  root / "src"], cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return next(root.glob("speculators_forge-*.whl"))


def make_venv(folder: Path, wheels: list[Path]) -> tuple[Path, Path]:
    """A venv with `wheels` installed in order, that borrows this venv's dependencies through a .pth (a path line
    adds a folder only: the editable install's finder in it does not run, so the checkout stays out of sys.path).
    Returns its bin/ and site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True)
    bin_dir = folder / "bin"
    site = Path(run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=folder).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for whl in wheels:
        result = run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--no-deps",
                      "--no-index", "-q", whl], cwd=folder)
        assert result.returncode == 0, result.stderr[-3000:]
    return bin_dir, site


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path]:
    return make_venv(tmp_path_factory.mktemp("venv") / "forge", [wheel])


def test_wheel_holds_every_package_and_the_shipped_data_and_nothing_else_at_the_top(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = [p.relative_to(REPO) for name in CODE for p in (REPO / name).rglob("__init__.py")]
    assert packages and all(p.as_posix() in names for p in packages)  # a subpackage setup.py missed fails here
    assert {"forge_kernels/quant_matmul_cpu.cpp", "forge_kernels/quant_matmul.py"} <= names  # kernels/, as setup.py packs it
    for asset in ("conf", "data", "models"):
        shipped = [p.relative_to(REPO).as_posix() for p in (REPO / asset).rglob("*") if p.is_file()]
        assert shipped and all(f"common/{f}" in names for f in shipped), asset
    assert "common/conf/inference/eval/mtbench.yaml" in names  # conf/inference/eval is a link: copied as files
    assert {n.split("/")[0] for n in names} == set(CODE) | {next(n for n in names if ".dist-info/" in n).split("/")[0]}
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert all(f"forge-{cmd} = train.commands:{cmd}" in entry_points for cmd in ("train", "infer", "export"))


def test_installed_commands_run_from_any_folder_on_the_packed_conf(installed, tmp_path):
    bin_dir, site = installed
    python = bin_dir / "python"
    where = run([python, "-c", "import common.config, sys; print(common.config.PROJECT_ROOT); print(*sys.path)"],
                cwd=tmp_path)
    root, path = where.stdout.splitlines()
    assert root == str(site / "common") and str(REPO) not in path.split(), where.stderr  # the install's, not ours

    for args in ([python, "-m", "inference", "--help"], [bin_dir / "forge-infer", "--help"],
                 [bin_dir / "forge-train", "--help"], [bin_dir / "forge-export", "--help"],
                 [python, "-m", "speculators.export", "--help"], [python, "-m", "train", "--help"]):
        result = run(args, cwd=tmp_path)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stderr[-3000:])
    assert "eval: data, file, mtbench, sharegpt, stdlib" in run([bin_dir / "forge-infer", "--help"], tmp_path).stdout

    # ${project_root:} resolves inside the install: the default target and the shipped data are the packed ones.
    composed = run([bin_dir / "forge-train", "conf=eagle3_smollm2", "--cfg", "job", "--resolve"], cwd=tmp_path)
    assert f"path: {site / 'common' / 'data' / 'sharegpt-smollm2'}" in composed.stdout, composed.stderr[-3000:]
    composed = run([bin_dir / "forge-train", "conf=eagle3_pycode", "--cfg", "job", "--resolve"], cwd=tmp_path)
    assert f"name_or_path: {site / 'common' / 'models' / 'pycode'}" in composed.stdout, composed.stderr[-3000:]
    assert (site / "common" / "models" / "pycode" / "model.safetensors").is_file()

    probe = run([python, "-c", "import forge_kernels; print(forge_kernels.__file__)"], tmp_path)
    assert probe.stdout.strip() == str(site / "forge_kernels" / "__init__.py"), probe.stderr[-3000:]


def test_installed_forge_infer_serves_a_tiny_drafter(installed, llama_target, make_drafter, tmp_path):
    from speculators import export

    bin_dir, _ = installed
    drafter_dir = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    out = tmp_path / "report"
    result = run([bin_dir / "forge-infer", f"drafter={drafter_dir}", "eval.num_prompts=1", "eval.prompt_lines=2",
                  "max_new_tokens=8", "k=2", f"out={out}"], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"report: {out / 'report.json'}" in result.stdout


@pytest.fixture(scope="module")
def rival_wheels() -> list[Path]:
    """The real wheels of vLLM's speculators and Hugging Face's kernels, downloaded once into RIVAL_WHEELS."""
    def cached():
        return [next(RIVAL_WHEELS.glob(f"{r.replace('==', '-')}-*.whl"), None) for r in RIVALS]

    if None in cached():
        RIVAL_WHEELS.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", RIVAL_WHEELS, *RIVALS],
                           capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:
            pass
    if None in cached():
        pytest.skip(f"could not download {' and '.join(RIVALS)} (offline?) into {RIVAL_WHEELS}")
    return cached()


def test_installed_beside_hf_kernels_every_command_runs_and_beside_vllm_speculators_refuses_in_one_line(
        wheel, rival_wheels, tmp_path):
    speculators_whl, kernels_whl = rival_wheels
    def commands(bin_dir):
        return ([bin_dir / "python", "-m", "inference", "--help"], [bin_dir / "forge-infer", "--help"],
                [bin_dir / "forge-train", "--help"], [bin_dir / "forge-export", "--help"],
                [bin_dir / "python", "-m", "speculators.export", "--help"])

    bin_dir, site = make_venv(tmp_path / "beside-kernels", [kernels_whl, wheel])
    for args in commands(bin_dir):
        result = run(args, cwd=tmp_path)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stderr[-3000:])

    # vLLM's before ours (ours overwrites its speculators/__init__.py), Hugging Face's after: its kernels/ is its own.
    bin_dir, site = make_venv(tmp_path / "mixed", [speculators_whl, wheel, kernels_whl])
    for args in [*commands(bin_dir), [bin_dir / "speculators", "--help"]]:
        line = one_line_error(run(args, cwd=tmp_path))
        assert all(part in line for part in ("vLLM's speculators 0.9.0", "speculators-forge", str(site),
                                             "pip wrote one's files over the other's", "venv of its own")), line

    # What the line says happened: pip overwrote, in both orders; Hugging Face's kernels is untouched.
    def file_of(whl, name):
        return zipfile.ZipFile(whl).read(name)

    assert (site / "speculators" / "__init__.py").read_bytes() == (REPO / "speculators" / "__init__.py").read_bytes()
    assert (site / "speculators" / "__init__.py").read_bytes() != file_of(speculators_whl, "speculators/__init__.py")
    kernels_files = [n for n in zipfile.ZipFile(kernels_whl).namelist() if n.startswith("kernels/")]
    assert kernels_files and all((site / n).read_bytes() == file_of(kernels_whl, n) for n in kernels_files)
    assert sorted(p.name for p in (site / "kernels").glob("*.py")) == sorted(
        Path(n).name for n in kernels_files if n.count("/") == 1 and n.endswith(".py"))


def fake_package(folder: Path, name: str, version: str | None) -> Path:
    """`name`/__init__.py in `folder`, with the dist-info pip would write for distribution `name` if `version`."""
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("raise ImportError('not ours')\n")
    if version:
        (folder / f"{name}-{version}.dist-info").mkdir()
        (folder / f"{name}-{version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def test_another_projects_package_beside_ours_stops_our_commands_in_one_line(tmp_path):
    beside = fake_package(tmp_path / "beside", "speculators", "0.9.0")  # first on sys.path: -m speculators.* is its own
    for args in ([sys.executable, "-m", "inference", "--help"], [sys.executable, REPO / "train.py", "--help"]):
        line = one_line_error(run(args, cwd=tmp_path, python_path=str(beside)))
        assert f"vLLM's speculators 0.9.0 ({beside}) and speculators-forge ({REPO})" in line, line

    shadow = fake_package(tmp_path / "shadow", "speculators", None)  # first on sys.path, no metadata
    line = one_line_error(run([sys.executable, "-m", "inference", "--help"], cwd=tmp_path, python_path=str(shadow)))
    assert f"'speculators' is {shadow / 'speculators'}, not speculators-forge's {REPO / 'speculators'}" in line, line


def test_transformers_gets_hugging_faces_kernels_where_the_checkout_is_on_sys_path():
    """From the checkout's root (its folder first on sys.path), `import kernels` is Hugging Face's where it is
    installed (kernels/ is a folder, not a package, so an installed package wins), and never ours."""
    probe = ("import importlib.util, transformers.utils.import_utils as u; s = importlib.util.find_spec('kernels'); "
             "print(s.origin if s else None, u.is_kernels_available())")
    result = run([sys.executable, "-c", probe], cwd=REPO)
    origin, available = result.stdout.split()
    try:
        theirs = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        assert available == "False", result.stderr[-3000:]  # only our folder, which transformers does not take
        return
    assert available == "True" and origin == str(theirs), result.stderr[-3000:]
