"""KV policies: the selection rules against their definitions, and the engine's output against transformers
attending over exactly the tokens the policy keeps."""

import pytest
import torch
import torch.nn.functional as F

from slimlm import SlimlmError
from slimlm.errors import FieldError
from slimlm.runtime import kv_policy
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.kv_policy import OBSERVATION, KVPolicy, snapkv_keep, window_eviction
from slimlm.runtime.sampling import SamplingParams
from tests.conftest import make_text

BLOCK = 8


def test_a_policy_names_its_kind_and_a_budget_its_parts_fit_in():
    with pytest.raises(SlimlmError, match="kv_policy 'lru' is not one of full, window, snapkv"):
        KVPolicy("lru")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(SlimlmError, match="kv_budget must be a positive integer"):
            KVPolicy("window", bad)
    KVPolicy("window", 2 * BLOCK).check(BLOCK)
    with pytest.raises(SlimlmError, match=r"kv_budget 15 is too small for kv_policy window.*kv_budget >= 16"):
        KVPolicy("window", 2 * BLOCK - 1).check(BLOCK)
    KVPolicy("snapkv", 2 * OBSERVATION).check(BLOCK)
    with pytest.raises(SlimlmError, match=f"kv_budget {2 * OBSERVATION - 1} is too small for kv_policy snapkv"):
        KVPolicy("snapkv", 2 * OBSERVATION - 1).check(BLOCK)
    KVPolicy("full", 1).check(BLOCK)
    with pytest.raises(FieldError) as caught:
        KVPolicy("snapkv", 10).check(BLOCK)
    assert caught.value.field == "kv_budget"
    assert str(caught.value) == (
        "kv_budget 10 is too small for kv_policy snapkv: it keeps at least 64 tokens; give kv_budget >= 64"
    )
    with pytest.raises(FieldError, match=r"it keeps at least 16 tokens \(the sink block and one more of 8\);"):
        KVPolicy("window", 9).check(BLOCK)


def test_a_policy_reads_as_its_flag_writes_it():
    assert [str(p) for p in (KVPolicy(), KVPolicy("window", 512), KVPolicy("snapkv", 64))] == [
        "full",
        "window:512",
        "snapkv:64",
    ]


@pytest.mark.parametrize(
    "budget, resident, evicted",
    [
        (32, 32, 0),  # within budget
        (32, 33, 1),  # one token over: a whole block goes
        (32, 40, 1),
        (32, 41, 2),
        (32, 100, 9),  # 100 - 9·8 = 28 <= 32
        (16, 24, 1),  # sink, one full block, the last (partial or not) stays
        (16, 25, 2),  # sink, full, full, partial: the two between go
        (16, 200, 23),
        (16, 17, 1),  # sink, full, one token: the full block goes
        (16, 16, 0),
    ],
)
def test_window_eviction_gives_up_whole_blocks_between_the_sink_and_the_last(budget, resident, evicted):
    assert window_eviction(budget, resident, BLOCK) == evicted
    n = window_eviction(budget, resident, BLOCK)
    last = -(-resident // BLOCK) - 1
    assert kv_policy.SINK_BLOCKS + n <= max(kv_policy.SINK_BLOCKS, last)  # the last block is never evicted


def snapkv_reference(queries, keys, prompt_len, scale, budget):
    """SnapKV as the paper states it, one KV head at a time in plain loops."""
    w, heads, _ = queries.shape
    kv_heads = keys.shape[1]
    group, start = heads // kv_heads, prompt_len - w
    kept = []
    for h in range(kv_heads):
        votes = torch.zeros(start, dtype=torch.float64)
        for g in range(group):
            for i in range(w):
                seen = prompt_len - w + i + 1  # query i sees the keys up to its own position
                logits = keys[:seen, h].double() @ queries[i, h * group + g].double() * scale
                votes += logits.softmax(0)[:start]
        pooled = torch.stack(
            [votes[max(0, p - 2) : p + 3].mean() for p in range(start)]  # average over the neighbours that exist
        )
        n = max(0, min(start, budget - (keys.shape[0] - start)))
        chosen = sorted(pooled.topk(n).indices.tolist())
        kept.append(chosen + list(range(start, keys.shape[0])))
    return torch.tensor(kept)


@pytest.mark.parametrize(
    "prompt_len, length, budget, heads",
    [(200, 200, 96, 4), (130, 137, 64, 2), (90, 90, 80, 8), (100, 200, 64, 2)],  # the last: output past the budget
)
def test_snapkv_keeps_what_the_observation_window_attends_to_most(prompt_len, length, budget, heads):
    torch.manual_seed(prompt_len)
    queries = torch.randn(OBSERVATION, heads, 16)
    keys = torch.randn(length, 2, 16) * 2
    kept = snapkv_keep(queries, keys, prompt_len, 0.25, budget)
    assert torch.equal(kept, snapkv_reference(queries, keys, prompt_len, 0.25, budget))
    tail = length - prompt_len + OBSERVATION
    assert kept.shape == (2, max(budget, tail))  # the window and the output always stay
    # a constant added to every key (a 4-bit cache's stored offset) moves no choice
    assert torch.equal(snapkv_keep(queries, keys + torch.randn(2, 16), prompt_len, 0.25, budget), kept)


# ---- the engine against transformers attending over what the policy keeps ---------------------------------


def _attention(allowed):
    """An attention function for transformers: causal, further limited to allowed(layer, query, key, positions)
    -> bool [kv_heads, q, L] (query [1, heads, q, D] and key [1, kv_heads, L, D] rotated; positions [q])."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q_len, length = query.shape[2], key.shape[2]
        group = query.shape[1] // key.shape[1]
        positions = torch.arange(length - q_len, length)
        mask = torch.arange(length)[None] <= positions[:, None]
        mask = (mask & allowed(module.layer_idx, query, key, positions)).expand(key.shape[1], q_len, length)
        scores = query @ key.repeat_interleave(group, 1).transpose(-1, -2) * scaling
        scores = scores.masked_fill(~mask.repeat_interleave(group, 0)[None], float("-inf"))
        out = scores.softmax(-1) @ value.repeat_interleave(group, 1)
        return out.transpose(1, 2).contiguous(), None

    return attend


def reference_greedy(model, prompt: list[int], n: int, allowed) -> tuple[list[int], list[float]]:
    """Greedy decoding with transformers' cache kept whole and each step's attention masked by `allowed`: the
    tokens and their log-probabilities."""
    from transformers import AttentionInterface, DynamicCache

    AttentionInterface.register("slimlm_policy_reference", _attention(allowed))
    model.set_attn_implementation("slimlm_policy_reference")
    cache, ids, out, logprobs = DynamicCache(), torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = model(ids, cache=cache, use_cache=True).logits[0, -1].log_softmax(-1)
            out.append(int(lp.argmax()))
            logprobs.append(float(lp[out[-1]]))
            ids = torch.tensor([[out[-1]]])
    return out, logprobs


def window_reads(prompt_len: int, n: int, budget: int) -> list[list[int]]:
    """For each decode position from prompt_len on, the positions its query reads under a window policy: what
    the last step's eviction left (whole blocks after the sink, oldest first), and itself."""
    kept, reads = list(range(prompt_len)), []
    for position in range(prompt_len, prompt_len + n - 1):
        evict = window_eviction(budget, len(kept), BLOCK)
        del kept[kv_policy.SINK_BLOCKS * BLOCK : (kv_policy.SINK_BLOCKS + evict) * BLOCK]
        kept.append(position)
        reads.append(list(kept))
    return reads


@pytest.fixture(scope="module")
def model_and_prompt(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(tiny_llama).encode(make_text(12, seed=5))[:150]
    return model, prompt


def engine_greedy(tiny_llama, prompt, n, policy: KVPolicy | None, **config) -> tuple[list[int], list[float]]:
    """The engine's greedy tokens and their log-probabilities (prompt chunks of 64: the window comes in two)."""
    engine = Engine(str(tiny_llama), EngineConfig(block_size=BLOCK, max_num_batched_tokens=64, **config))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0, kv_policy=policy)
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        for output in engine.step(detokenize=False):
            got = output.outputs[0]
    assert engine.blocks.num_free == engine.runner.num_blocks  # all given back
    return got.token_ids, got.logprobs


def assert_same_decoding(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-4, rtol=0)


def assert_different_decoding(got, want) -> None:
    """The full cache decodes measurably otherwise: what the policy evicted mattered, so the test can tell."""
    assert got[0] != want[0] or (torch.tensor(got[1]) - torch.tensor(want[1])).abs().max() > 1e-2


def test_a_window_decodes_as_transformers_attending_over_the_sink_and_the_recent_tokens(tiny_llama, model_and_prompt):
    model, prompt = model_and_prompt
    n, budget = 40, 3 * BLOCK
    reads = window_reads(len(prompt), n, budget)

    def allowed(layer, query, key, positions):
        if len(positions) > 1:  # the prompt: full attention
            return torch.ones(1, len(positions), key.shape[2], dtype=torch.bool)
        mask = torch.zeros(1, 1, key.shape[2], dtype=torch.bool)
        mask[..., reads[int(positions[0]) - len(prompt)]] = True
        return mask

    want = reference_greedy(model, prompt, n, allowed)
    assert_same_decoding(engine_greedy(tiny_llama, prompt, n, KVPolicy("window", budget)), want)
    assert_different_decoding(engine_greedy(tiny_llama, prompt, n, None), want)


def test_snapkv_decodes_as_transformers_attending_over_the_selection(tiny_llama, model_and_prompt):
    model, prompt = model_and_prompt
    n, budget, kept = 30, 2 * OBSERVATION, {}

    def allowed(layer, query, key, positions):
        if len(positions) > 1:  # the prompt: full attention; its last queries choose per layer and KV head
            window = query[0, :, -OBSERVATION:].transpose(0, 1)
            kept[layer] = snapkv_keep(window, key[0].transpose(0, 1), len(prompt), query.shape[-1] ** -0.5, budget)
            return torch.ones(1, len(positions), key.shape[2], dtype=torch.bool)
        mask = torch.ones(key.shape[1], 1, key.shape[2], dtype=torch.bool)  # generated tokens are all kept
        mask[:, :, : len(prompt)] = False
        mask.scatter_(2, kept[layer][:, None], True)
        return mask

    want = reference_greedy(model, prompt, n, allowed)
    assert_same_decoding(engine_greedy(tiny_llama, prompt, n, KVPolicy("snapkv", budget)), want)
    assert_different_decoding(engine_greedy(tiny_llama, prompt, n, None), want)


@pytest.mark.parametrize("policy", [KVPolicy("window", 200), KVPolicy("snapkv", 200), KVPolicy("full")])
def test_a_policy_that_evicts_nothing_changes_nothing(tiny_llama, model_and_prompt, policy):
    _, prompt = model_and_prompt
    assert engine_greedy(tiny_llama, prompt, 40, policy) == engine_greedy(tiny_llama, prompt, 40, None)
    # exactly at the budget: a snapkv prompt of as many tokens, a window that ten tokens fill to the brim
    exact = KVPolicy(policy.kind, len(prompt) + (9 if policy.kind == "window" else 0))
    assert engine_greedy(tiny_llama, prompt, 10, exact) == engine_greedy(tiny_llama, prompt, 10, None)


def test_the_engine_default_policy_applies_and_a_request_may_ask_for_its_own(tiny_llama, model_and_prompt):
    _, prompt = model_and_prompt
    windowed = engine_greedy(tiny_llama, prompt, 30, None, kv_policy="window", kv_budget=3 * BLOCK)
    assert windowed == engine_greedy(tiny_llama, prompt, 30, KVPolicy("window", 3 * BLOCK))
    assert engine_greedy(tiny_llama, prompt, 30, KVPolicy(), kv_policy="window", kv_budget=3 * BLOCK) == (
        engine_greedy(tiny_llama, prompt, 30, None)
    )
    engine = Engine(str(tiny_llama), EngineConfig(block_size=BLOCK))
    with pytest.raises(SlimlmError, match="kv_budget 8 is too small for kv_policy window"):
        engine.add_request(prompt, SamplingParams(kv_policy=KVPolicy("window", 8)))
    assert not engine.has_unfinished()
    with pytest.raises(SlimlmError, match="^kv_policy 'sink' is not one of"):
        EngineConfig(kv_policy="sink")
    with pytest.raises(SlimlmError, match="invalid engine config: block_size must be .*; kv_policy 'sink'"):
        EngineConfig(kv_policy="sink", block_size=0)
    with pytest.raises(SlimlmError, match="kv_budget 10 is too small for kv_policy snapkv"):
        EngineConfig(kv_policy="snapkv", kv_budget=10)


def test_a_snapkv_prompt_served_twice_recomputes_its_observation_window(tiny_llama, model_and_prompt):
    """The second request finds the prompt in the prefix cache (the first one's blocks went back to it when it
    compacted), but still needs the window's queries: it computes them, and decodes the same."""
    _, prompt = model_and_prompt
    engine = Engine(str(tiny_llama), EngineConfig(block_size=BLOCK))
    outs = []
    for _ in range(2):
        engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, kv_policy=KVPolicy("snapkv", 64)))
        while engine.has_unfinished():
            for output in engine.step(detokenize=False):
                if output.finished:
                    outs.append(output)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].num_cached_tokens >= len(prompt) - OBSERVATION - BLOCK  # the rest came from the cache


def test_forked_samples_share_what_snapkv_kept(tiny_llama, model_and_prompt):
    _, prompt = model_and_prompt
    engine = Engine(str(tiny_llama), EngineConfig(block_size=BLOCK))
    params = SamplingParams(max_tokens=10, n=3, seed=1, kv_policy=KVPolicy("snapkv", 64))
    engine.add_request(prompt, params)
    engine.step()  # the whole prompt, compacted once, then forked
    seqs = engine.scheduler.running
    assert len(seqs) == 3 and len({tuple(s.block_table) for s in seqs}) == 1
    assert all(s.num_resident == 64 and s.num_evicted == len(prompt) - 64 for s in seqs)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == engine.runner.num_blocks


def test_move_kv_puts_each_head_s_kept_tokens_in_order_into_the_new_blocks(tiny_llama):
    engine = Engine(str(tiny_llama), EngineConfig(block_size=BLOCK, kv_cache_memory=1 << 20))
    runner = engine.runner
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape))
    before = runner.kv_cache.clone()
    old, new = [5, 2, 9], [11, 4]
    layers, kv_heads = runner.kv_cache.shape[0], runner.kv_cache.shape[4]
    keep = torch.stack([torch.randperm(20)[:12].sort().values for _ in range(layers * kv_heads)]).view(
        layers, kv_heads, 12
    )
    runner.move_kv(old, new, keep)
    for layer in range(layers):
        for h in range(kv_heads):
            for i, p in enumerate(keep[layer, h].tolist()):
                src = before[layer, :, old[p // BLOCK], p % BLOCK, h]
                assert torch.equal(runner.kv_cache[layer, :, new[i // BLOCK], i % BLOCK, h], src)
    untouched = [b for b in range(runner.num_blocks) if b not in new]
    assert torch.equal(runner.kv_cache[:, :, untouched], before[:, :, untouched])
    assert F.mse_loss(runner.kv_cache[:, :, old], before[:, :, old]) == 0  # the source is read, not moved
