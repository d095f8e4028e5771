"""The shipped drafter's README is its card as measured: card.json rendered by inference/drafter_card.py,
so no figure in it was edited by hand or left from an older measurement."""

import json
from pathlib import Path

from inference.drafter_card import fastest_chain, markdown

MODEL = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle3"


def test_shipped_card_readme_is_its_measurements_rendered():
    card = json.loads((MODEL / "card.json").read_text())
    assert (MODEL / "README.md").read_text() == markdown(card)
    assert card["recipe"] == (MODEL / "RECIPE.md").read_text()  # the recipe it shows is the one shipped beside it


def test_the_card_recommends_the_chain_that_served_fastest():
    def row(k, speedup):
        return {"num_speculative_tokens": k, "speedup": speedup}
    rows = {"target_only": {"speedup": 1.0}, "speculative_chain": row(5, 0.9), "speculative_chain_k2": row(2, 1.25),
            "speculative_chain_k1": row(1, 1.2), "speculative_chain_k1_lookup": row(1, 1.3),
            "speculative_chain_min_prob0.4": row(5, 1.4)}
    assert fastest_chain(rows) == (2, 1.25)  # plain chains only: lookup and min-prob chains are other settings
    assert fastest_chain({"speculative_chain": row(5, 1.1)}) == (5, 1.1)
