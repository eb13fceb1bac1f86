"""A server over the tiny random model (with a chat template) on a free loopback port, and the offline API
on the same model to compare it with."""

from __future__ import annotations

import re

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant{% endif %}"
)
NAME = "tiny"


@pytest.fixture(scope="session")
def chat_llama(tiny_llama, tmp_path_factory):
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_llama, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


ENGINE = dict(kv_cache_memory=16 << 20, max_num_seqs=32, max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def server(chat_llama):
    from slimlm.runtime.engine import Engine, EngineConfig
    from slimlm.serve.app import serve_in_thread

    engine = Engine(str(chat_llama), EngineConfig(**ENGINE))
    with serve_in_thread(engine, NAME) as url:
        yield url


@pytest.fixture(scope="session")
def offline(chat_llama):
    from slimlm.runtime.llm import LLM

    return LLM(str(chat_llama), **ENGINE)


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
