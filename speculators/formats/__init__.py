"""Export formats by name: one file each in this folder (speculators/formats/<name>.py), registered by
`register_format(Format(...))` when it is imported. A format's name is also its module: an unknown name
(`format=myfmt`, a family's `export_formats`) imports speculators/formats/<name>.py, or a module `<name>` of
your own on the Python path, the first time it is asked for. speculators/export.py does what every format
shares (validation, atomic writes, reading back); docs/new_export_format.md says how to add one."""

from dataclasses import dataclass
from typing import Callable, NamedTuple

from transformers import AutoConfig

from common.registry import import_built_in, look_up

BUILT_IN = ("speculators", "eagle", "eagle3", "dflash", "medusa", "gguf", "trtllm")


@dataclass
class Verifier:
    """The target an export is served with, as the formats record it."""

    name_or_path: str
    architectures: list[str]

    @classmethod
    def named(cls, name_or_path: str) -> "Verifier":
        """From the target's config.json when it can be read offline; its architectures are informational.
        A GGUF file has no config.json to look for (nor a hub repository to ask)."""
        if name_or_path.endswith(".gguf"):
            return cls(name_or_path, [])
        try:
            architectures = AutoConfig.from_pretrained(name_or_path).architectures or []
        except (OSError, ValueError):
            architectures = []
        return cls(name_or_path, list(architectures))

    @classmethod
    def of(cls, target) -> "Verifier":
        return cls(target.name_or_path,
                   list(getattr(target.config, "architectures", None) or [type(target.model).__name__]))


class Format(NamedTuple):
    name: str
    write: Callable | None  # (drafter, Verifier) -> (config, weights in the format's names)
    read: Callable | None  # (config, weights) -> (an empty drafter shaped by config, weights in the drafter's names)
    verifier: Callable | None  # config -> the target's name_or_path it records, or None
    detect: Callable[[dict], bool] | None = None  # config -> whether this format wrote it (None: never read back)
    weights_file: str = "model.safetensors"
    save: Callable | None = None  # (drafter, out, Verifier, overwrite) -> path: a format that is not a folder
    extra_file: str | None = None  # a torch.save file beside the weights, under its name in the weights dict
    left_to_target: tuple[str, ...] = ()  # weights an export may leave out: the target's (share_target_embedding)
    families: tuple[str, ...] = ()  # families it holds besides those whose class names it in export_formats
    beside: Callable | None = None  # (drafter, out) -> {file name: text} written beside config.json


FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    FORMATS[fmt.name] = fmt
    return fmt


def export_format(name: str) -> Format:
    """Format `name`, importing its module when it is not registered yet (an unknown name: one line)."""
    return look_up(FORMATS, name, "speculators.formats", "format")


def format_of(config: dict) -> str | None:
    """Which registered format wrote this config.json."""
    return next((fmt.name for fmt in FORMATS.values() if fmt.detect is not None and fmt.detect(config)), None)


def families_of(fmt: str) -> list[str]:
    """The drafter families a format holds, as their classes say (export_formats)."""
    from speculators.families import FAMILIES

    return [name for name, cls in FAMILIES.items() if fmt in cls.export_formats or name in FORMATS[fmt].families]


import_built_in("speculators.formats", BUILT_IN)
