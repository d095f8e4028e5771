"""Typed configs for the Hydra CLIs, and the one-line errors users see.

Every Hydra config group mirrors a dataclass. `to_dataclass` merges the composed YAML into
that dataclass, so an unknown key or a value of the wrong type fails here, with the key's
full name and the keys that are allowed, never deep inside training.
"""

import dataclasses
import difflib
import functools
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException


def _project_root() -> Path:
    """The folder that holds conf/, data/ and models/: the checkout's root, or in an installed wheel the `common`
    package, where setup.py packs them."""
    here = Path(__file__).resolve().parent
    return here if (here / "conf").is_dir() else here.parent


PROJECT_ROOT = _project_root()
# `${project_root:}` in conf/ names files shipped with the code (the default target, the shipped data).
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)


def run_dir_of(resume: str | None, new: str) -> str:
    """`${run_dir:${resume},<new>}` in conf/config.yaml: a resumed run continues in the run directory
    it names (resume=<run dir> or <run dir>/checkpoints/<file>), a new run gets `new`."""
    if resume is None:
        return new
    path = Path(resume)
    if path.suffix == ".ckpt":
        path = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return str(path)


OmegaConf.register_new_resolver("run_dir", run_dir_of, replace=True)


class UserError(Exception):
    """Bad input a user can fix; the CLI prints it as one line, without a traceback."""


# What to pass for a mandatory (`???`) key, by its full name or its last part.
REQUIRED_VALUES = {
    "drafter": "an export folder",
    "source": "an export folder",
    "runs": "[run directories]",
    "model_dir": "a folder train.pretrain saved",
    "out": "an output folder",
    "target": "a conf/target name, a Hugging Face folder or hub id, or a .gguf",
    "eval.path": "a prompts file",
}


def missing_value_message(keys: list[str]) -> str:
    """'drafter=<an export folder> is required': the keys a command cannot run without."""
    wanted = [f"{key}=<{REQUIRED_VALUES.get(key) or REQUIRED_VALUES.get(key.rpartition('.')[2], 'a value')}>"
              for key in keys]
    return f"{' and '.join(wanted)} {'is' if len(wanted) == 1 else 'are'} required"


def unknown_key_message(full_key: str, existing) -> str:
    """An unknown key, the existing keys nearest to it, and all the keys at its level."""
    parent, _, name = full_key.rpartition(".")
    existing = [str(k) for k in existing if k != "hydra"]  # Hydra's own settings: not what a typo meant
    prefix = f"{parent}." if parent else ""
    nearest = difflib.get_close_matches(name, existing, n=3)
    hint = f"did you mean {' or '.join(repr(prefix + k) for k in nearest)}? " if nearest else ""
    where = f"under {parent}" if parent else "at the top level"
    return f"unknown config key '{full_key}': {hint}allowed {where}: {', '.join(existing)}"


def to_dataclass(cls, cfg: DictConfig, key: str = ""):
    """Build dataclass `cls` from `cfg`; unknown keys and bad values raise UserError."""
    prefix = f"{key}." if key else ""
    try:
        _refuse_converted_scalars(cls, OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else cfg, prefix)
        merged = OmegaConf.merge(OmegaConf.structured(cls), cfg)
        config = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        full_key = ".".join(k for k in (key, str(e.full_key or e.key)) if k)
        allowed = [f.name for f in dataclasses.fields(_owner_of(cls, str(e.full_key or e.key)))]
        raise UserError(unknown_key_message(full_key, allowed)) from None
    except MissingMandatoryValue as e:
        raise UserError(missing_value_message([".".join(k for k in (key, str(e.full_key)) if k)])) from None
    except OmegaConfBaseException as e:
        full_key = ".".join(k for k in (key, str(e.full_key or _failing_key(cls, cfg))) if k)
        raise UserError(f"bad value for '{full_key}': {_first_line(e)}") from None
    _refuse_non_finite(config, prefix)
    return config


def _field_kinds(annotation) -> set:
    """{int} for int, {int, NoneType} for int | None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation))
    return {annotation}


def _refuse_converted_scalars(cls, raw, prefix: str) -> None:
    """OmegaConf turns any number into a bool (2 -> true) and a bool into a number (true -> 1)."""
    if not isinstance(raw, dict):
        return
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value, kinds = raw[f.name], _field_kinds(f.type) - {type(None)}
        if dataclasses.is_dataclass(f.type):
            _refuse_converted_scalars(f.type, value, f"{prefix}{f.name}.")
        elif kinds == {bool} and isinstance(value, (int, float)) and not isinstance(value, bool):
            require(False, prefix + f.name, value, "true or false")
        elif kinds & {int, float} and isinstance(value, bool):
            require(False, prefix + f.name, value, "a number")


def _refuse_non_finite(config, prefix: str) -> None:
    """No key takes nan or inf (a learning rate of inf passes `> 0`)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            _refuse_non_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            require(math.isfinite(value), prefix + f.name, value, "a finite number")


def _owner_of(cls, dotted_key: str):
    """The dataclass (nested inside `cls`) that would hold `dotted_key`."""
    for part in dotted_key.split(".")[:-1]:
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        if not dataclasses.is_dataclass(types.get(part)):
            break
        cls = types[part]
    return cls


def one_of(key: str, value, allowed) -> None:
    """Fail with a one-line error unless `value` is among `allowed`."""
    try:
        known = value in allowed
    except TypeError:  # a list or a mapping where a name belongs
        known = False
    if not known:
        raise UserError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


def require(ok: bool, key: str, value, rule: str) -> None:
    """One-line error for a config value that breaks `rule`, e.g. require(n > 0, "trainer.max_steps", n, ">= 1")."""
    if not ok:
        raise UserError(f"{key}={value!r} is not valid: must be {rule}")


def at_least(minimum, **values) -> None:
    """require(value >= minimum) for each keyword (dotted keys spelled with __)."""
    for key, value in values.items():
        require(value is not None and value >= minimum, key.replace("__", "."), value, f">= {minimum}")


def _failing_key(cls, cfg) -> str:
    """The first key whose value alone fails to merge, descending into nested dataclasses: OmegaConf
    names none when a list meets a dict."""
    structured, types = OmegaConf.structured(cls), {f.name: f.type for f in dataclasses.fields(cls)}
    for name in cfg:
        try:
            OmegaConf.merge(structured, {name: cfg[name]})
        except OmegaConfBaseException as e:
            if e.full_key:
                return str(e.full_key)
            inner = _failing_key(types[name], cfg[name]) if dataclasses.is_dataclass(types.get(name)) else ""
            return f"{name}.{inner}" if inner else name
    return ""


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _one_line(e: BaseException) -> str:
    """Hydra's messages span lines (options listed one per line); fold them into one."""
    from hydra.errors import OverrideParseException

    text = str(e).split("Config search path")[0]  # where Hydra looked: noise for a typo
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    if isinstance(e, OverrideParseException):  # its message lacks the override it could not parse
        text = f"cannot parse {e.override!r}: {text}"
    cause = e.__cause__
    if isinstance(cause, OmegaConfBaseException):
        text = f"{text} ({_first_line(cause)})"
    return text


def exit_on_user_error(task: Callable) -> Callable:
    """Wrap a Hydra task so a UserError ends the process with its one line (not Hydra's log)."""

    @functools.wraps(task)
    def wrapped(*args, **kwargs):
        try:
            if args and isinstance(args[0], DictConfig):
                check_no_missing(args[0])
                check_resolvable(args[0])
            return task(*args, **kwargs)
        except UserError as e:
            if os.environ.get("SPECULATORS_TRACEBACK") == "1":
                raise
            sys.exit(f"error: {e}")

    return wrapped


def check_no_missing(cfg: DictConfig) -> None:
    """Every `???` key given, before the task starts (and loads a model)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(missing_value_message(missing))


def check_resolvable(cfg: DictConfig) -> None:
    """Resolve every ${...} now, so a bad one fails naming its key (a lazy read would not)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise UserError(f"bad value for '{e.full_key}': {_first_line(e)}") from None


def run_command(config_name: str, config_class: type, task: Callable, config_dir: str = "conf") -> None:
    """`python -m <module>` of a task taking one config: Hydra reads conf/<config_name>.yaml (under
    `config_dir`) and the command line into `config_class`; bad input ends in one line (run_cli)."""
    import hydra

    @hydra.main(config_path=str(PROJECT_ROOT / config_dir), config_name=config_name, version_base="1.3")
    @exit_on_user_error
    def main(cfg: DictConfig) -> None:
        task(to_dataclass(config_class, cfg))

    run_cli(main)


NAMING_KEYS = ("target.name_or_path=", "target.gguf_file=")


def with_named_target(overrides: list[str]) -> list[str]:
    """Naming a target on the command line picks `target=yours`: a recipe's default target (conf=eagle3's
    SmolLM2) brings its own settings (feature layers, data, starting weights) that must not reach another model."""
    names_one = any(o.startswith(NAMING_KEYS) and o.split("=", 1)[1] not in ("", "null") for o in overrides)
    picks_one = any(o.split("=", 1)[0].lstrip("+~") == "target" for o in overrides)
    return ["target=yours", *overrides] if names_one and not picks_one else overrides


def run_cli(hydra_main: Callable[[], None]) -> None:
    """Run a @hydra.main function; config and input errors end in one line on stderr.

    HYDRA_FULL_ERROR=1 keeps the full traceback for debugging, as Hydra documents.
    """
    from hydra.errors import HydraException

    saved = {name: os.environ.get(name) for name in ("HYDRA_FULL_ERROR", "SPECULATORS_TRACEBACK")}
    want_traceback = saved["HYDRA_FULL_ERROR"] == "1"
    os.environ["SPECULATORS_TRACEBACK"] = "1" if want_traceback else "0"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra's errors reach us instead of its printer
    try:
        sys.argv[1:] = with_named_target(sys.argv[1:])
        hydra_main()
    except (UserError, HydraException, OmegaConfBaseException) as e:
        if want_traceback:
            raise
        sys.exit(f"error: {_user_message(e)}")
    finally:  # a command run in-process (a test, a caller) leaves the environment as it found it
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _user_message(e: BaseException) -> str:
    """One line for an error out of Hydra: an override of an unknown key names the keys that exist
    (Hydra advises `+key=` to add it, which only moves the error to the dataclass)."""
    from hydra.errors import ConfigCompositionException

    cause = e.__cause__
    if (isinstance(e, ConfigCompositionException) and isinstance(cause, (ConfigKeyError, ConfigAttributeError))
            and isinstance(cause.parent_node, DictConfig) and cause.full_key):
        return unknown_key_message(str(cause.full_key), cause.parent_node.keys())
    if isinstance(e, MissingMandatoryValue) and e.full_key:
        return missing_value_message([str(e.full_key)])
    return _one_line(e)

