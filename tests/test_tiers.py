"""The test tiers (docs/testing.md): the markers are registered, every test conftest names as slow or engines
exists, and `-m "not slow"` leaves them out (plain pytest, CI's run, deselects nothing)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import ENGINES, SLOW, tier_markers

TESTS = Path(__file__).resolve().parent


def test_tier_markers_are_registered(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert {"slow", "gpu", "engines"} <= registered


def test_every_listed_test_exists():
    """A renamed or removed test would leave its tier silently: the lists name functions that are there."""
    missing = []
    for listed in (SLOW, ENGINES):
        for file, names in listed.items():
            tree = ast.parse((TESTS / file).read_text())
            defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
            missing += [f"{file}::{name}" for name in sorted(names - defined)]
    assert not missing, missing


def test_engines_are_slow_too():
    assert tier_markers("test_export_gguf.py", "test_llamacpp_serves_the_export") == ["engines", "slow"]
    assert tier_markers("test_cli.py", "test_train_eagle3_end_to_end") == ["slow"]
    assert tier_markers("test_cli.py", "test_unknown_recipe_names_the_choices") == []


def collected(*args: str) -> set[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                            "no:cacheprovider", *args],
                           cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    return {line.split("::")[1].split("[")[0] for line in child.stdout.splitlines() if "::" in line}


def test_the_quick_tier_leaves_the_slow_tests_out():
    tree = ast.parse((TESTS / "test_cli.py").read_text())
    everything = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    quick = collected("-m", "not slow", "tests/test_cli.py")
    assert SLOW["test_cli.py"] <= everything and quick == everything - SLOW["test_cli.py"]
