"""Property-based fuzz of what callers hand the runtime: any value either validates or is refused with a
SlimlmError, and a refused request leaves the engine serving the next one exactly as before."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimlm import SlimlmError
from slimlm.runtime.engine import EngineConfig
from slimlm.runtime.llm import LLM
from slimlm.runtime.sampling import SamplingParams

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-5, 300), max_size=3),
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


SAMPLING_FIELDS = [
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "logprobs",
    "prompt_logprobs",
]


@FUZZ
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), ANY, max_size=4))
def test_sampling_params_validate_or_refuse(kwargs):
    try:
        SamplingParams(**kwargs)
    except SlimlmError:
        pass


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            ["dtype", "kv_cache_memory", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"]
        ),
        ANY,
        max_size=3,
    )
)
def test_engine_config_validates_or_refuses(kwargs):
    try:
        EngineConfig(**kwargs)
    except SlimlmError:
        pass


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


PROMPTS = st.one_of(
    st.text(max_size=12),  # includes lone surrogates
    st.lists(st.one_of(st.integers(-3, 400), st.booleans(), st.floats(), st.text(max_size=1)), max_size=6),
    st.integers(),
    st.none(),
)


@settings(max_examples=40, deadline=None)
@given(PROMPTS)
def test_any_prompt_is_served_or_refused_alone(llm, prompt):
    greedy = SamplingParams(max_tokens=2, temperature=0)
    before = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    outs = llm.generate([prompt, [5, 6, 7]], greedy)
    assert outs[0].error or outs[0].outputs[0].finish_reason in ("stop", "length")
    assert outs[1].outputs[0].token_ids == before
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats().free_blocks == llm.engine.stats().total_blocks
