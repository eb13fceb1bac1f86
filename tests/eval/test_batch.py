"""Evaluation's engine loop: input order kept, shared contexts computed once, bounded work in flight."""

from slimlm.eval import batch
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.sampling import SamplingParams


def test_outputs_in_input_order_and_followers_reuse_the_leaders_context(tiny_llama):
    engine = Engine(str(tiny_llama), EngineConfig(max_num_seqs=2, block_size=16))
    context = list(range(3, 53))  # 3 full blocks of 16 and 2 tokens
    prompts = [context + [60 + i] for i in range(5)] + [list(range(100, 130))]
    params = [
        SamplingParams(
            max_tokens=1 + 3 * (i % 2),
            temperature=0,
            prompt_logprobs=0,
            prompt_logprobs_from=min(len(context), len(p) - 1),
        )
        for i, p in enumerate(prompts)
    ]
    after = [0, 0, 0, 0, 0, 5]
    in_flight, peak = set(), 0
    add, finished = engine.add_request, []

    def counting_add(prompt, p):
        nonlocal peak
        request_id = add(prompt, p)
        in_flight.add(request_id)
        peak = max(peak, len(in_flight))
        return request_id

    def counting_step(**kwargs):
        outs = Engine.step(engine, **kwargs)
        for out in outs:
            if out.finished:
                in_flight.discard(out.request_id)
                finished.append(out.request_id)
        return outs

    engine.add_request, engine.step = counting_add, counting_step
    outputs = batch.run(engine, prompts, params, after, progress=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    # all of the context but its last token, whose logits score each follower's answer
    assert outputs[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 49 for o in outputs[1:5])
    assert peak <= 2 * engine.config.max_num_seqs
    assert finished.index(outputs[0].request_id) < min(finished.index(o.request_id) for o in outputs[1:5])
    # the scores do not depend on where the context's K/V came from
    fresh = Engine(str(tiny_llama), EngineConfig(prefix_caching=False))
    alone = batch.run(fresh, prompts, params, progress=False)
    for a, b in zip(outputs, alone, strict=True):
        assert abs(a.prompt_logprobs[0] - b.prompt_logprobs[0]) < 1e-5
    assert batch.computed_tokens(prompts, outputs) < batch.computed_tokens(prompts, alone)
    generated = sum(len(o.outputs[0].token_ids) for o in alone)
    assert generated > len(prompts)  # some requests generate more than one token
    assert batch.computed_tokens(prompts, alone) == sum(map(len, prompts)) + generated  # nothing came from a cache


def test_an_interrupted_run_leaves_nothing_in_the_engine(tiny_llama):
    engine = Engine(str(tiny_llama), EngineConfig(max_num_seqs=2, block_size=16))
    prompts = [list(range(3, 40 + i)) for i in range(4)]
    params = [SamplingParams(max_tokens=8, temperature=0) for _ in prompts]
    steps = 0

    def failing_step(**kwargs):
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return Engine.step(engine, **kwargs)

    engine.step = failing_step
    try:
        batch.run(engine, prompts, params, progress=False)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interruption did not reach the caller")
    assert not engine.has_unfinished()
    assert Engine.step(engine) == []  # and aborting them reported nothing


def test_leaders_make_a_star_of_equal_contexts_and_wait_only_for_long_enough_shared_starts():
    question = list(range(100, 120))
    winogrande = list(range(200, 212))  # two sentences that differ after 12 words
    prefixes = [
        question + [1],  # 0: the first answer's context
        winogrande + [5, 6],  # 1
        question + [1],  # 2: the second and third answers wait for the first, not for each other
        list(range(100, 100 + batch.MIN_SHARED - 1)) + [9],  # 3: shares one token too few with the question
        winogrande + [7, 8],  # 4: the other option waits for the first
        question + [1],  # 5
        question + [1, 2, 3],  # 6: shares all of the others' context and more: waits for the first
    ]
    assert batch.leaders(prefixes) == [0, 1, 0, 3, 1, 0, 0]


def test_leaders_wait_for_the_closest_when_it_shares_more_than_its_own_leader():
    a, b, c = [1] * 10, [1] * 10 + [2] * 10, [1] * 10 + [2] * 10 + [3]
    assert batch.leaders([c, b, a]) == [1, 2, 2]  # b shares 10 with a; c shares 20 with b, only 10 with a
