"""The drafter families by name. Defining a Drafter subclass with a `family` registers it
(speculators.drafter.FAMILIES); a family's name is also its module: speculators/<name>.py, or a module of
your own on the Python path, imported the first time the name is asked for."""

from common.registry import import_built_in, look_up
from speculators.drafter import FAMILIES

BUILT_IN = ("eagle", "eagle3", "peagle", "medusa", "dflash", "dspark")


def family(name: str):
    """The class of drafter family `name`, importing its module when it is not registered yet."""
    return look_up(FAMILIES, name, "speculators", "drafter.family")


import_built_in("speculators", BUILT_IN)
