"""An export format written the way a user adds one: this file, nothing else (tests/test_new_format.py writes
it with `python -m speculators.export source=SRC out=OUT format=toyfmt` and reads it back). `register_format` at
import registers the format `toyfmt`; its module has the same name, so `format=toyfmt` finds it on the Python path.

The layout: EAGLE-3 drafters, config.json {"toyfmt": 1, "speculators": <the speculators format's config>} and
the weights under `draft.<name>` in toy.safetensors; embed_tokens may be left to the target.
"""

from speculators.formats import Format, register_format
from speculators.formats import speculators as spec

PREFIX = "draft."


def write(drafter, verifier):
    config, weights = spec.write(drafter, verifier)
    return {"toyfmt": 1, "speculators": config}, {PREFIX + name: t for name, t in weights.items()}


def read(config, weights):
    return spec.read(config["speculators"], {name.removeprefix(PREFIX): t for name, t in weights.items()})


register_format(Format("toyfmt", write, read, lambda config: config["speculators"]["speculators_config"]["verifier"]
                       ["name_or_path"], lambda config: "toyfmt" in config, "toy.safetensors",
                       left_to_target=("embed_tokens.weight",), families=("eagle3",)))
