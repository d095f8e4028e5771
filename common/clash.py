"""vLLM's `speculators` (PyPI `speculators`) uses our import name `speculators`. Installed into the environment that
holds speculators-forge, pip writes its files over ours (or ours over its) without a warning, and imports then mix the
two packages. `refuse_import_name_clashes` stops such an environment in one line, before anything imports the mixed
package; `import common` runs it. (Hugging Face's `kernels`, which transformers requires, has its name to itself: our
kernels/ is imported as forge_kernels.)
"""

import importlib.metadata
import importlib.util
from pathlib import Path

OURS = "speculators-forge"
HOME = Path(__file__).resolve().parent.parent  # where our packages are: the checkout, or site-packages
# Our import name -> the other project's distribution that uses it, and whose it is.
RIVALS = {"speculators": ("speculators", "vLLM's")}
FIX = f"install {OURS} in a venv of its own (python -m venv <dir>), apart from the other"


def import_name_clash(name: str) -> str | None:
    """Why import name `name` is not only ours, in one line; None when it is."""
    rival, whose = RIVALS[name]
    try:
        other = importlib.metadata.distribution(rival)
    except importlib.metadata.PackageNotFoundError:
        other = None
    if other is not None:
        where = Path(other.locate_file("")).resolve()
        them = f"{whose} {rival} {other.version}"
        if where == HOME:
            return (f"{them} and {OURS} are both installed in {HOME} and both provide the import package '{name}': "
                    f"pip wrote one's files over the other's without a warning, so '{name}' now mixes the two; {FIX}")
        return f"{them} ({where}) and {OURS} ({HOME}) both provide the import package '{name}'; {FIX}"
    spec = importlib.util.find_spec(name)
    found = Path(spec.origin).resolve().parent if spec and spec.origin else None
    if found != HOME / name:
        return f"import package '{name}' is {found or 'missing'}, not {OURS}'s {HOME / name}; {FIX}"
    return None


def refuse_import_name_clashes() -> None:
    """Exit with one line when another project's package holds one of our import names."""
    for name in RIVALS:
        problem = import_name_clash(name)
        if problem:
            raise SystemExit(f"error: {problem}")
