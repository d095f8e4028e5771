"""The drafter families by name. Defining a Drafter subclass with a `family` registers it
(speculators.drafter.FAMILIES); a family's name is also its module: speculators/<name>.py, or a module of
your own on the Python path, imported the first time the name is asked for."""

import importlib
import re

from common.config import one_of
from speculators.drafter import FAMILIES

BUILT_IN = ("eagle", "eagle3", "peagle", "medusa", "dflash", "dspark")


def family(name: str):
    """The class of drafter family `name`, importing its module when it is not registered yet."""
    if name not in FAMILIES and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", str(name)):
        import_family(name)
    one_of("drafter.family", name, FAMILIES)
    return FAMILIES[name]


def import_family(name: str) -> None:
    for module in (f"speculators.{name}", name):
        try:
            importlib.import_module(module)
            return
        except ModuleNotFoundError as e:
            if e.name != module:  # the family's module is there but imports something missing
                raise


for _name in BUILT_IN:
    importlib.import_module(f"speculators.{_name}")
