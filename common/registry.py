"""What every extension point shares (families, export formats, quant schemes, eval sets, engines): a name is
also a module, `<package>.<name>` inside the project or `<name>` of the user's own on the Python path, imported
the first time the name is asked for; its import registers it. An unknown name is one line listing what exists."""

import importlib
import re

from common.config import one_of

MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def look_up(registry: dict, name: str, package: str, key: str, before: tuple = (), after: tuple = ()):
    """registry[name], importing `package.name` or `name` when it is not registered yet; `key` names the setting
    in the one-line error, which lists the registered names between the other allowed values `before` and `after`
    (None is returned for those)."""
    if isinstance(name, str) and name not in registry and MODULE_NAME.fullmatch(name):
        import_named(name, package)
    one_of(key, name, [*before, *registry, *after])
    return registry.get(name)


def import_named(name: str, package: str) -> None:
    for module in (f"{package}.{name}", name):
        try:
            importlib.import_module(module)
            return
        except ModuleNotFoundError as e:
            if e.name != module:  # the module is there but imports something missing: say that, not "unknown"
                raise


def import_built_in(package: str, names: tuple[str, ...]) -> None:
    for name in names:
        importlib.import_module(f"{package}.{name}")
