"""kernels/build.py: a build killed mid-compile does not hang the next run; builds are keyed by their sources.

A tiny extension (one C function, no torch headers) stands in for the CPU kernel, compiled through a
wrapper compiler that sleeps first, so a build can be SIGKILLed while its compiler runs; the real
kernel is checked with a lock planted as a killed build leaves it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from forge_kernels import build

ROOT = Path(__file__).parent.parent
TINY_SOURCE = 'extern "C" int forge_tiny() { return 7; }\n'


def tiny_extension(tmp_path: Path) -> tuple[dict, Path]:
    """(environment, source) for a tiny build under tmp_path whose compiler sleeps 2 s, then marks it started."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    slow = tmp_path / "slow-c++"
    slow.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -c "*) touch {tmp_path}/compiling; sleep 2;; esac
        exec c++ "$@"
        """))
    slow.chmod(0o755)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": str(slow), "OMP_NUM_THREADS": "1"}
    return env, source


def load_tiny(env: dict, source: Path, **run) -> subprocess.Popen | subprocess.CompletedProcess:
    code = (f"from forge_kernels.build import load_library; "
            f"load_library('forge_tiny', [{str(source)!r}], ['-O0'], [], purpose='a test')")
    command = [sys.executable, "-c", code]
    if run.pop("background", False):
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, **run)


def compiler_available() -> bool:
    return subprocess.run(["sh", "-c", "command -v c++ && command -v ninja || python -c 'import ninja'"],
                          capture_output=True).returncode == 0


needs_compiler = pytest.mark.skipif(not compiler_available(), reason="needs c++ and ninja")


@needs_compiler
def test_a_build_killed_mid_compile_is_cleared_and_rebuilt_by_the_next_run(tmp_path):
    env, source = tiny_extension(tmp_path)
    first = load_tiny(env, source, background=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "compiling").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)  # as `kill -9` does: ninja and the compiler live on, orphaned
    first.wait()
    folder = next((tmp_path / "ext").iterdir())
    assert (folder / "lock").exists()  # what hung every later run

    second = load_tiny(env, source, timeout=120)
    assert second.returncode == 0, second.stderr
    cleared = [line for line in second.stderr.splitlines() if line.startswith("cleared")]
    assert len(cleared) == 1 and f"pid {first.pid}" in cleared[0] and "rebuilding" in cleared[0], second.stderr
    assert (folder / "forge_tiny.so").exists() and not (folder / "lock").exists()

    third = load_tiny(env, source, timeout=120)  # built: neither cleared nor compiled again
    assert third.returncode == 0 and "cleared" not in third.stderr and "compiling" not in third.stderr, third.stderr


@needs_compiler
def test_a_live_build_is_waited_for_not_cleared(tmp_path):
    env, source = tiny_extension(tmp_path)
    first, second = (load_tiny(env, source, background=True) for _ in range(2))
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outputs
    assert not any("cleared" in err for _, err in outputs), outputs
    assert sum("compiling" in err for _, err in outputs) == 1, outputs  # the second found it built


def test_the_build_folder_is_keyed_by_sources_flags_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    one, other = tmp_path / "a.cpp", tmp_path / "b.cpp"
    one.write_text(TINY_SOURCE)
    other.write_text(TINY_SOURCE.replace("7", "8"))  # another checkout's kernel
    folder = build.build_directory("k", [one], ["-O3"], [])
    assert folder.parent == tmp_path and folder.name.startswith("k-")
    assert build.build_directory("k", [one], ["-O3"], []) == folder
    assert build.build_directory("k", [other], ["-O3"], []) != folder
    assert build.build_directory("k", [one], ["-O2"], []) != folder
    monkeypatch.setattr(build.torch, "__version__", "0.0.0")
    assert build.build_directory("k", [one], ["-O3"], []) != folder


def test_the_cpu_kernel_loads_past_a_lock_a_killed_build_left(cpu_kernel):
    from forge_kernels.quant_matmul import CPU_KERNEL_BUILD

    folder = build.build_directory(*CPU_KERNEL_BUILD)
    (folder / "lock").touch()  # as a build SIGKILLed mid-compile leaves it
    child = subprocess.run([sys.executable, "-c", "from forge_kernels.quant_matmul import cpu_ops; assert cpu_ops()"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr
    assert "cleared" in child.stderr and not (folder / "lock").exists()


def test_without_flock_a_lock_whose_recorded_owner_is_dead_is_cleared(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "take_flock", lambda file: False)  # a filesystem without locks (some NFS)
    host = build.socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid: a process of this host that no longer runs
    assert build.owner_is_dead(f"pid {dead.pid} on {host}")
    assert not build.owner_is_dead(f"pid {os.getpid()} on {host}")  # alive
    assert not build.owner_is_dead(f"pid {dead.pid} on another-host")  # cannot tell: left alone
    (tmp_path / "owner").write_text(f"pid {dead.pid} on {host}\n")
    (tmp_path / "lock").touch()
    with build.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert (tmp_path / "owner").read_text() == f"pid {os.getpid()} on {host}\n"
    assert f"left by a build that was killed (pid {dead.pid} on {host}, no longer running)" in capsys.readouterr().err
