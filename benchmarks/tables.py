"""Where every benchmark's result goes: one JSON of the figures and one markdown table beside it."""

import json
import statistics
from collections.abc import Callable
from pathlib import Path


def spread(values: list[float]) -> dict:
    """Mean over prompts, its standard deviation and the standard error of the mean."""
    n = len(values)
    sd = statistics.stdev(values) if n > 1 else float("nan")
    return {"mean": statistics.fmean(values), "sd": sd, "se": sd / n**0.5 if n > 1 else float("nan"), "n": n}


def paired(a: list[float], b: list[float]) -> dict:
    """a - b prompt by prompt (the same prompts, the same target outputs): mean and its standard error."""
    return spread([x - y for x, y in zip(a, b)])


def write_result(out: Path, result: dict, table: str, json_name: str, md_name: str,
                 plot: Callable[[Path], None] | None = None) -> Path:
    """<out>/<json_name> (the figures) and <out>/<md_name> (`table`), and `plot`'s figure beside them as the
    JSON's name in .png; prints the table and where they are."""
    out.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        plot((out / json_name).with_suffix(".png"))
    (out / json_name).write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / md_name).write_text(table if table.endswith("\n") else table + "\n")
    print(table)
    print(f"results: {out / json_name}, {out / md_name}")
    return out / json_name
