"""Run a fixed list of prompts through the engine, the way evaluation wants it: a bounded number in
flight (the scheduler always has work, memory stays bounded), progress shown, outputs in input order, and
optional ordering — request i starts only after request after[i] has finished, so a prefix several
requests share is computed once and then served to the others from the prefix cache (`leaders` picks the
order)."""

from __future__ import annotations

from collections import deque

from tqdm import tqdm

from slimlm.runtime.engine import Engine, RequestOutput
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.sequence import common_prefix

MIN_SHARED = 8  # tokens a request must share with an earlier one to wait for it


def leaders(prefixes: list[list[int]]) -> list[int]:
    """`after` for run(), given what each request could take from the prefix cache: every request waits for
    the one it shares the most with among those before it in sorted order (if that is at least MIN_SHARED
    tokens), or for that one's own leader when the leader shares as much: the answers to one question all
    wait for the first of them, not for each other in turn. Sentences that differ only after their first
    words (WinoGrande's two options) share those words too."""
    order = sorted(range(len(prefixes)), key=prefixes.__getitem__)
    after, shared = list(range(len(prefixes))), [0] * len(prefixes)
    for prev, i in zip(order, order[1:], strict=False):
        n = common_prefix(prefixes[prev], prefixes[i])
        if n >= MIN_SHARED:
            lead = after[prev]
            after[i], shared[i] = (lead if lead != prev and shared[prev] >= n else prev), n
    return after


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
