"""The import graph of the four packages, read from the source (imports inside functions included):
imports point down, kernels < speculators < train, inference (train may use inference, inference
never train), and no module is part of a cycle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {"kernels": 0, "speculators": 1, "inference": 2, "train": 3}


def modules() -> dict[str, Path]:
    found = {}
    for package in RANK:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
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
