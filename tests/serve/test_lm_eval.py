"""lm-eval's own `local-completions` model against the server scores task-pack documents exactly as the
in-process backend does (same per-document outcomes, log-likelihoods within float noise)."""

from __future__ import annotations

import math

import lm_eval

from slimlm.eval import harness
from slimlm.eval.lm_eval_model import SlimlmLM
from tests.serve.conftest import ENGINE, NAME

TASKS = ["slimlm_arc_easy", "slimlm_piqa", "slimlm_lambada_openai"]


def test_local_completions_over_http_equals_the_in_process_backend(server, chat_llama):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    manager = harness.task_manager(TASKS)
    remote = LocalCompletionsAPI(
        model=NAME,
        base_url=f"{server}/v1/completions",
        tokenizer=str(chat_llama),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        batch_size=4,
        max_length=512,
        num_concurrent=2,
    )
    local = SlimlmLM(pretrained=str(chat_llama), progress=False, **ENGINE)
    runs = {
        name: lm_eval.simple_evaluate(
            model=lm, tasks=TASKS, limit=6, task_manager=manager, log_samples=True, verbosity="ERROR"
        )
        for name, lm in [("http", remote), ("local", local)]
    }
    for task in TASKS:
        mine, theirs = runs["http"]["samples"][task], runs["local"]["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in theirs]
        for a, b in zip(mine, theirs, strict=True):
            for x, y in zip(a["resps"], b["resps"], strict=True):
                assert math.isclose(x[0][0], y[0][0], abs_tol=1e-3) and x[0][1] == y[0][1], task
        acc = "acc,none"
        assert runs["http"]["results"][task][acc] == runs["local"]["results"][task][acc], task
