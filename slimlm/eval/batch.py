"""Run a fixed list of prompts through the engine, the way evaluation wants it: a bounded number in
flight (the scheduler always has work, memory stays bounded), progress shown, outputs in input order, and
optional ordering — request i starts only after request after[i] has finished, so a context several
requests share is computed once and then served to the others from the prefix cache."""

from __future__ import annotations

from collections import deque

from tqdm import tqdm

from slimlm.runtime.engine import Engine, RequestOutput
from slimlm.runtime.sampling import SamplingParams


def run(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    after: list[int] | None = None,
    desc: str = "requests",
    progress: bool = True,
) -> list[RequestOutput]:
    """`after[i] == i` (or no `after`): request i may start at once."""
    after = after or list(range(len(prompts)))
    waiting: dict[int, list[int]] = {}
    ready = deque()
    for i, first in enumerate(after):
        (ready.append(i) if first == i else waiting.setdefault(first, []).append(i))
    results: list[RequestOutput | None] = [None] * len(prompts)
    in_flight: dict[str, int] = {}
    window = 2 * engine.config.max_num_seqs
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress)
    try:
        while ready or in_flight:
            while ready and len(in_flight) < window:
                i = ready.popleft()
                in_flight[engine.add_request(prompts[i], params[i])] = i
            for out in engine.step(detokenize=False):
                if out.finished:
                    i = in_flight.pop(out.request_id)
                    results[i] = out
                    ready.extendleft(reversed(waiting.pop(i, [])))  # first, while the shared blocks are cached
                    bar.update()
    finally:  # interrupted: nothing of this call stays queued in the engine
        for request_id in in_flight:
            engine.abort(request_id, report=False)
        bar.close()
    return results


def computed_tokens(prompts: list[list[int]], outputs: list[RequestOutput]) -> int:
    """Tokens the engine ran a forward pass for: prompts less their prefix-cache hits, plus the outputs."""
    pairs = zip(prompts, outputs, strict=True)
    return sum(len(p) - o.num_cached_tokens + len(o.outputs[0].token_ids) for p, o in pairs)
