"""Which target layers feed EAGLE-3, measured before target.layer_ids grows a way to name the last one.

target.layer_ids reach hidden_states[0..L-1]; the final hidden state (hidden_states[L], after the final norm)
is what the target's lm_head reads, and the hidden-state cache already stores it for the loss. In this
process every TargetOutput (from the cache, the online target or a serving session) carries that final state
in place of the feature at position REPLACED of target.layer_ids, so the same cache trains the other set:

    python results/smollm2/features/features.py REPLACED train.py <train.py overrides>
    python results/smollm2/features/features.py REPLACED benchmarks.compare <benchmarks.compare overrides>

With target.layer_ids=[2, 15, 27] and REPLACED=2 the drafter reads layers 2, 15 and the final state.
A compare runs every drafter it names with the same replacement: one set of features per compare.
"""

import sys
from pathlib import Path

from speculators import target

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/smollm2/patched.py
from patched import run_command  # noqa: E402


def replace_feature(position: int) -> None:
    built = target.TargetOutput.__init__

    def init(out, *args, **kwargs):
        built(out, *args, **kwargs)
        if len(out.aux_hidden) > position:  # target-only paths read no features
            out.aux_hidden = [out.last_hidden if i == position else h for i, h in enumerate(out.aux_hidden)]
    target.TargetOutput.__init__ = init  # a dataclass's __init__: the one constructor every path calls


def main():
    replace_feature(int(sys.argv[1]))
    run_command(sys.argv[2:])


if __name__ == "__main__":
    main()
