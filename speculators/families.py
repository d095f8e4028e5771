"""The drafter families, registered once: name -> model class (which names its config class)."""

from speculators.config import one_of
from speculators.eagle import EagleDrafter
from speculators.eagle3 import Eagle3Drafter

FAMILIES = {"eagle": EagleDrafter, "eagle3": Eagle3Drafter}


def family(name: str):
    one_of("drafter.family", name, FAMILIES)
    return FAMILIES[name]
