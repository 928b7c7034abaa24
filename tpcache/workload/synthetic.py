"""A seeded multi-turn conversation workload, needing no external file.

Conversations share one of a few system prompts; each turn resends the whole history plus a new
user message, so later turns hit the cache for everything before them. Lengths follow a
log-normal spread like chat traffic. The output is Mooncake-format ``Request``s (512-token blocks),
so it replays exactly like a trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from tpcache.workload.trace import TRACE_BLOCK_TOKENS, Request


@dataclass
class SyntheticWorkload:
    seed: int = 0
    conversations: int = 200
    system_prompts: int = 8
    system_prompt_tokens: int = 2048
    mean_turns: float = 4.0
    user_tokens_median: int = 600
    answer_tokens_median: int = 400
    concurrent: int = 16  # conversations interleaved at once

    def requests(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        next_id = 0

        def new_ids(n: int) -> list[int]:
            nonlocal next_id
            ids = list(range(next_id, next_id + n))
            next_id += n
            return ids

        prompts = [new_ids(max(1, self.system_prompt_tokens // TRACE_BLOCK_TOKENS)) for _ in range(self.system_prompts)]
        active: list[dict] = []
        started = 0
        while active or started < self.conversations:
            while len(active) < self.concurrent and started < self.conversations:
                prompt = prompts[min(int(rng.paretovariate(1.2)) - 1, self.system_prompts - 1)]
                turns = max(1, round(rng.expovariate(1 / self.mean_turns)))
                active.append({"ids": list(prompt), "tokens": len(prompt) * TRACE_BLOCK_TOKENS, "turns": turns})
                started += 1
            conv = active[rng.randrange(len(active))]
            user = self._lognormal(rng, self.user_tokens_median)
            total = conv["tokens"] + user
            conv["ids"] += new_ids(-(-total // TRACE_BLOCK_TOKENS) - len(conv["ids"]))
            yield Request(input_length=total, hash_ids=tuple(conv["ids"]), output_length=0)
            # The answer joins the history; the partial last block is rewritten with new content.
            answer = self._lognormal(rng, self.answer_tokens_median)
            conv["tokens"] = total + answer
            full = total // TRACE_BLOCK_TOKENS
            conv["ids"] = conv["ids"][:full] + new_ids(-(-conv["tokens"] // TRACE_BLOCK_TOKENS) - full)
            conv["turns"] -= 1
            if conv["turns"] <= 0:
                active.remove(conv)

    @staticmethod
    def _lognormal(rng: random.Random, median: int) -> int:
        return max(1, int(rng.lognormvariate(math.log(median), 0.8)))
