"""A long-context yardstick the task pack does not have: find a fact hidden in filler, seeded and offline.

Each prompt is filler (passages of a bundled text, shuffled by the seed) with facts hidden at a depth, then a
question whose answer the model must take from them:
- passkey: one five-digit pass key, stated twice in a sentence (the Landmark Attention paper's test);
- multikey: four pass keys of differently coloured doors, the question asks for one of them;
- copy: a line of twelve random words; the question gives its first three, the model must go on with the rest.
A case is right when the greedy output begins with the answer. Depths are spread evenly over the samples of a
length, so a policy that keeps only the start or the end of a prompt cannot pass by luck.

Each case runs under every KV policy (runtime.kv_policy) on one engine: the full-cache request first, then
the others, which find the prompt in the prefix cache and only compute what they must (SnapKV its observation
window). A result row carries the KV bytes the request held while it decoded: the prompt's, less what its
policy evicted. (While the prompt is computed every policy holds all of it, as in SnapKV and kvpress.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from slimlm import data
from slimlm.errors import SlimlmError
from slimlm.runtime.kv_policy import KVPolicy

TASKS = ("passkey", "multikey", "copy")
HEADER = (
    "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it.\n\n"
)
COLORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
WORDS = (
    "apple river stone cloud window garden silver market candle forest bridge orange pencil mirror ladder "
    "rocket violin basket desert island jacket lemon marble needle ocean planet quilt saddle tiger umbrella "
    "valley wagon yellow zebra anchor barrel cactus dragon engine falcon glacier harbor igloo jungle kettle "
    "lantern meadow nickel oyster parrot"
).split()


@dataclass(frozen=True)
class Case:
    task: str
    length: int  # prompt tokens, about
    depth: float  # where the fact sits, 0 = the start of the filler, 1 = its end
    prompt: list[int]
    fact: str  # the sentence the answer is in
    question: str  # what ends the prompt
    answer: str


def _facts(task: str, rng: random.Random) -> tuple[str, list[str], str, str]:
    """The fact asked about, the other facts hidden with it, the question that ends the prompt, its answer."""
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        fact = f"The pass key is {key}. Remember it. {key} is the pass key."
        return fact, [], "What is the pass key? The pass key is", f" {key}"
    if task == "multikey":
        colors = rng.sample(COLORS, 4)
        keys = [str(rng.randint(10000, 99999)) for _ in colors]
        facts = [f"The pass key of the {c} door is {k}. Remember it." for c, k in zip(colors, keys, strict=True)]
        question = f"What is the pass key of the {colors[0]} door? The pass key of the {colors[0]} door is"
        return facts[0], facts[1:], question, f" {keys[0]}"
    words = rng.sample(WORDS, 12)
    question = f"Repeat the code line. Code line: {' '.join(words[:3])}"
    return f"Code line: {' '.join(words)}.", [], question, " " + " ".join(words[3:])


def _filler(source: str, tokenizer, tokens: int, seed: int) -> list[int]:
    """At least `tokens` tokens of the source's passages, shuffled, joined by blank lines (not EOS: a document
    boundary would tell the model the facts before it belong to another text)."""
    texts = data.passages(source)
    picked, chars = [], 0
    for text in random.Random(seed).sample(texts, len(texts)):
        picked.append(text)
        chars += len(text) + 2
        if chars > 8 * tokens:  # about 4 characters a token: twice that is plenty
            break
    ids = tokenizer.encode("\n\n".join(picked), add_special_tokens=False)
    if len(ids) < tokens:
        raise SlimlmError(f"the text source {source} holds {len(ids)} tokens, fewer than the {tokens} needed")
    return ids


def make_cases(
    tokenizer, tasks: list[str], lengths: list[int], samples: int, seed: int = 0, source: str = "wiki"
) -> list[Case]:
    """`samples` cases per task and length, the asked fact at depths spread over (0, 1), any others at random
    depths, filler from the bundled text `source`."""
    filler = _filler(source, tokenizer, 2 * max(lengths), seed)
    cases = []
    for task in tasks:
        for length in lengths:
            for i in range(samples):
                rng = random.Random(f"{seed}/{task}/{length}/{i}")
                fact, others, question, answer = _facts(task, rng)
                head = tokenizer.encode(HEADER)
                tail = tokenizer.encode("\n\n" + question, add_special_tokens=False)
                pieces = [tokenizer.encode(f"\n{f}\n", add_special_tokens=False) for f in (fact, *others)]
                room = length - len(head) - len(tail) - sum(map(len, pieces))
                if room < 1:
                    raise SlimlmError(
                        f"a {task} prompt of {length} tokens holds no filler: its header, facts and question take "
                        f"{length - room}; give lengths above that"
                    )
                start = rng.randrange(max(1, len(filler) - room))
                body = filler[start : start + room]
                depth = (i + 0.5) / samples
                spots = [round(room * depth)] + [rng.randrange(room + 1) for _ in others]
                for spot, piece in sorted(zip(spots, pieces, strict=True), key=lambda sp: -sp[0]):
                    body = body[:spot] + piece + body[spot:]  # from the back: earlier spots stay where they were
                cases.append(Case(task, length, depth, head + body + tail, fact, question, answer))
    return cases


def _generate(engine, prompt: list[int], policies: list[KVPolicy], max_tokens: int) -> list:
    """One greedy request per policy, run together; their CompletionOutputs in the policies' order."""
    from slimlm.runtime.sampling import SamplingParams

    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, kv_policy=policy))
        for policy in policies
    ]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def run(engine, cases: list[Case], policies: list[KVPolicy], progress: Callable[[str], None] = print) -> list[dict]:
    """Every case under every policy, greedy: one result row each. The first policy's request computes the
    prompt alone; the others then run together on the prefix cache it left."""
    per_token = engine.runner.kv_bytes_per_token
    rows = []
    for n, case in enumerate(cases, 1):
        max_tokens = len(engine.tokenizer.encode(case.answer, add_special_tokens=False)) + 2
        outputs = _generate(engine, case.prompt, policies[:1], max_tokens)
        outputs += _generate(engine, case.prompt, policies[1:], max_tokens) if len(policies) > 1 else []
        for policy, out in zip(policies, outputs, strict=True):
            rows.append(
                {
                    "task": case.task,
                    "length": case.length,
                    "depth": case.depth,
                    "policy": policy.kind,
                    "budget": None if policy.kind == "full" else policy.budget,
                    "correct": is_right(out.text, case.answer),
                    "output_tokens": len(out.token_ids),
                    "kv_tokens": out.kv_tokens,
                    "kv_bytes": out.kv_tokens * per_token,
                }
            )
        right = sum(r["correct"] for r in rows[-len(policies) :])
        progress(
            f"  case {n}/{len(cases)} ({case.task}, {len(case.prompt)} tokens, depth {case.depth:.2f}): "
            f"right under {right} of {len(policies)} policies"
        )
    return rows


def is_right(output: str, answer: str) -> bool:
    """Greedy output that begins with the answer (spaces around either aside)."""
    return output.strip().startswith(answer.strip())


def summarize(rows: list[dict]) -> list[dict]:
    """Accuracy and mean KV bytes per request, by task, length, policy and budget."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["length"], r["policy"], r["budget"]), []).append(r)
    return [
        {
            "task": task,
            "length": length,
            "policy": policy,
            "budget": budget,
            "cases": len(group),
            "accuracy": sum(r["correct"] for r in group) / len(group),
            "kv_bytes": sum(r["kv_bytes"] for r in group) / len(group),
        }
        for (task, length, policy, budget), group in groups.items()
    ]


def table(summary: list[dict]) -> str:
    """The summary as text: one line per task, length, policy and budget."""
    header = f"{'task':9} {'length':>7} {'policy':>8} {'budget':>7} {'cases':>6} {'accuracy':>9} {'KV MiB/request':>15}"
    lines = [header]
    for s in summary:
        budget = "-" if s["budget"] is None else s["budget"]
        lines.append(
            f"{s['task']:9} {s['length']:>7} {s['policy']:>8} {budget:>7} {s['cases']:>6} {s['accuracy']:>9.2f} "
            f"{s['kv_bytes'] / 2**20:>15.2f}"
        )
    return "\n".join(lines)
