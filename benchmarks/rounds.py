"""Interleaved timing: the one loop behind every benchmark here (bench, compare, quant_bench, quant_report).

Within each round every way decodes a prompt before any way starts the next prompt, so all ways
see the same machine load (a background job, a slower minute) in every round; speeds are medians
over rounds. A way is a function of a prompt's token ids. `count(result, wall_seconds)` says how
many tokens a result holds and how long they took; by default len(result) over the call's wall time.
"""

import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class Rounds:
    tokens: list[int] = field(default_factory=list)  # per round, summed over the prompts
    seconds: list[float] = field(default_factory=list)
    results: list = field(default_factory=list)  # the first round's result per prompt

    def tokens_per_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]

    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s())


def interleaved(ways: dict[Hashable, Callable], prompts: list[list[int]], repeats: int,
                count: Callable | None = None) -> dict[Hashable, Rounds]:
    timed = {name: Rounds() for name in ways}
    for round_ in range(repeats):
        for rounds in timed.values():
            rounds.tokens.append(0)
            rounds.seconds.append(0.0)
        for ids in tqdm(prompts, desc=f"round {round_ + 1}/{repeats}", unit="prompt"):
            for name, way in ways.items():
                started = time.perf_counter()
                result = way(ids)
                wall = time.perf_counter() - started
                tokens, seconds = count(result, wall) if count else (len(result), wall)
                timed[name].tokens[-1] += tokens
                timed[name].seconds[-1] += seconds
                if round_ == 0:  # greedy: every round returns the same
                    timed[name].results.append(result)
    return timed
