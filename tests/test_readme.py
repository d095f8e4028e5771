"""The README is the user's path, read in five minutes; its figures are docs/results.md's, never its own."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?:\.\d+)?x?(?![\w.])")  # 1.07x, 43.5, 0.32.0: not K=2 or 2 cores


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


def test_every_figure_in_the_readme_is_in_docs_results():
    readme, results = (ROOT / "README.md").read_text(), (ROOT / "docs" / "results.md").read_text()
    prose = re.sub(r"^    .*$", "", readme, flags=re.M)  # commands are not figures
    missing = sorted({figure for figure in FIGURE.findall(prose) if figure not in results})
    assert not missing, f"README figures absent from docs/results.md: {missing}"
