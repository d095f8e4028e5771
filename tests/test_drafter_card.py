"""The shipped drafter's README is its card as measured: card.json rendered by benchmarks/drafter_card.py,
so no figure in it was edited by hand or left from an older measurement."""

import json
from pathlib import Path

from benchmarks.drafter_card import fastest_setting, markdown

MODEL = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle3"


def test_shipped_card_readme_is_its_measurements_rendered():
    card = json.loads((MODEL / "card.json").read_text())
    assert (MODEL / "README.md").read_text() == markdown(card)
    assert card["recipe"] == (MODEL / "RECIPE.md").read_text()  # the recipe it shows is the one shipped beside it


def test_the_card_recommends_the_chain_setting_that_served_fastest():
    def row(k, speedup):
        return {"k": k, "speedup": speedup}
    lookup = {"prompt_lookup_max": 3, "prompt_lookup_min": 2, "prompt_lookup_tokens": 5}
    rows = {"target_only": {"speedup": 1.0}, "speculative_tree": row(5, 2.0), "speculative_chain": row(5, 0.9),
            "speculative_chain_k2": row(2, 1.25), "speculative_chain_k1_lookup": row(1, 1.2)}
    assert fastest_setting(rows, lookup) == ("k=2", "K=2", 1.25)  # trees are another mode
    rows["speculative_chain_k1_lookup"] = row(1, 1.3)
    assert fastest_setting(rows, lookup) == (
        "k=1 drafting.prompt_lookup_max=3 drafting.prompt_lookup_min=2 "
        "drafting.prompt_lookup_tokens=5", "K=1 behind n-gram lookup", 1.3)
    rows["speculative_chain_min_prob0.4"] = row(5, 1.4)
    assert fastest_setting(rows, lookup)[0] == "k=5 drafting.chain_min_prob=0.4"
