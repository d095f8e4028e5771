"""The drafter families, registered once: name -> model class (which names its config class)."""

from speculators.config import one_of
from speculators.dflash import DFlashDrafter
from speculators.eagle import EagleDrafter
from speculators.eagle3 import Eagle3Drafter
from speculators.medusa import MedusaDrafter
from speculators.peagle import PEagleDrafter

FAMILIES = {"eagle": EagleDrafter, "eagle3": Eagle3Drafter, "peagle": PEagleDrafter, "medusa": MedusaDrafter,
            "dflash": DFlashDrafter}


def family(name: str):
    one_of("drafter.family", name, FAMILIES)
    return FAMILIES[name]
