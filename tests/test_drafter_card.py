"""The shipped drafter's README is its card as measured: card.json rendered by inference/drafter_card.py,
so no figure in it was edited by hand or left from an older measurement."""

import json
from pathlib import Path

from inference.drafter_card import markdown

MODEL = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle3"


def test_shipped_card_readme_is_its_measurements_rendered():
    card = json.loads((MODEL / "card.json").read_text())
    assert (MODEL / "README.md").read_text() == markdown(card)
    assert card["recipe"] == (MODEL / "RECIPE.md").read_text()  # the recipe it shows is the one shipped beside it
