"""Quantized self-speculation (ML-SpecQD, arXiv:2503.13565): a low-bit copy of the target drafts for
the target itself. Nothing is trained: the copy decodes K tokens (greedy, or sampled with its own
distribution as q), the higher-precision target verifies them (inference/drafting.py, SelfProposer).
It pays when a pass of the copy is cheap beside a pass of the target and their next tokens agree.
"""

import math

from common.config import require
from speculators.target import FrozenTarget

SELF_PREFIX = "self:"  # drafter=self:<scheme> names a self-drafting copy where a drafter export goes
SELF_DRAFT_TOKENS = 5  # K unless told otherwise: a copy has no trained depth

# Bits per weight of each scheme's quantized layers: a drafting copy must have fewer than its target.
# gguf: the 4-bit files this project serves (Q4_0 / Q4_1 layers).
WEIGHT_BITS = {"none": 32, "int8": 8, "fp8": 8, "w8a8": 8, "int4": 4, "gptq_int4": 4, "gguf": 4, "mxfp4": 4,
               "nvfp4": 4}


class SelfDrafter:
    drafting_kind = "self"
    layer_ids: list[int] = []  # reads no target features: the copy computes its own
    depth = math.inf  # nothing trained: it drafts as far as asked

    def __init__(self, copy: FrozenTarget, scheme: str, k: int):
        self.copy, self.scheme, self.k = copy, scheme, k

    @classmethod
    def of(cls, copy: FrozenTarget, scheme: str, target_scheme: str, k: int) -> "SelfDrafter":
        """`copy`, the target quantized with `scheme`, drafting for the target quantized with `target_scheme`."""
        check_lower_precision(scheme, target_scheme)
        return cls(copy, scheme, k)

    def check(self, target: FrozenTarget) -> list[str]:
        """What keeps this copy from drafting for `target` (engine.check_pair)."""
        if self.copy.fingerprint() != target.fingerprint():
            return [f"the drafting copy is of target {self.copy.name_or_path} (fingerprint {self.copy.fingerprint()}), "
                    f"not of {target.name_or_path} ({target.fingerprint()})"]
        return []


def check_lower_precision(scheme: str, target_scheme: str) -> None:
    require(WEIGHT_BITS[scheme] < WEIGHT_BITS[target_scheme], "self-drafting scheme", scheme,
            f"fewer bits per weight ({WEIGHT_BITS[scheme]}) than the target's {target_scheme} "
            f"({WEIGHT_BITS[target_scheme]}): a copy as precise as its target is no cheaper to run")
