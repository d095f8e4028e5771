"""The import graph of the packages, read from the source (imports inside functions included):
imports point down, common, kernels < speculators < inference < train < benchmarks (train may use
inference, inference never train), and no module is part of a cycle. Importing a module registers no
Hydra config: every command finds its groups in its own config folder."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {"common": 0, "forge_kernels": 0, "speculators": 1, "inference": 2, "engines": 2, "train": 3, "benchmarks": 4}
FOLDERS = {"forge_kernels": ("forge_kernels", "kernels")}  # kernels/ is imported as forge_kernels


def modules() -> dict[str, Path]:
    found = {}
    for package in RANK:
        for folder in FOLDERS.get(package, (package,)):
            for path in sorted((ROOT / folder).rglob("*.py")):
                parts = (package, *path.relative_to(ROOT / folder).with_suffix("").parts)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module; `from module import name` the module
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def test_imports_point_down():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
              if RANK[b.split(".")[0]] > RANK[a.split(".")[0]] or (a.startswith("inference") and b.startswith("train"))]
    assert not upward, "imports that run up: " + "; ".join(sorted(upward))


def test_no_import_cycles():
    edges = graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


VLLM_VENV_ONLY = {"engines.vllm_hidden_connector"}  # subclasses vLLM's connector: importable in vLLM's venv only


def test_no_module_registers_a_config_at_import_time():
    names = sorted(set(modules()) - VLLM_VENV_ONLY)
    code = ("from hydra.core.config_store import ConfigStore\n"
            "import importlib, sys\n"
            "before = str(ConfigStore.instance().repo)\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    if str(ConfigStore.instance().repo) != before:\n"
            "        sys.exit(f'{name} registered a config')\n")
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
