"""`compress eval --tasks`: lm-eval's evaluator over the runtime (slimlm.eval.lm_eval_model), with the
offline task pack registered, and the result written as lm-eval writes it plus what the runtime did."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from slimlm import devices
from slimlm.errors import SlimlmError
from slimlm.eval import taskpack


class _QuietCustomDataset(logging.Filter):
    """lm-eval warns once per task that reads a custom dataset; for the bundled pack that is by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def check_tasks(names: list[str]) -> None:
    """Refuse a task neither the bundled pack nor lm-eval knows (lm-eval is indexed only for other names)."""
    if not set(names) <= {taskpack.GROUP, *taskpack.STANDARD}:
        task_manager(names)


def task_manager(names: list[str]):
    """A TaskManager that knows the task pack; lm-eval's own tasks (~6 s to index) only when asked for."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.api.task").addFilter(_QuietCustomDataset())
    manager = TaskManager(include_path=str(taskpack.TASKS_DIR), include_defaults=False)
    if any(n not in manager.all_tasks for n in names):
        manager = TaskManager(include_path=str(taskpack.TASKS_DIR), include_defaults=True)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise SlimlmError(
            f"unknown task {', '.join(unknown)}; bundled (offline): {taskpack.GROUP} (all of them), "
            f"{', '.join(taskpack.STANDARD)}; lm-eval's own tasks (e.g. hellaswag) need the Hugging Face hub"
        )
    return manager


def evaluate(
    model: str,
    tasks: list[str],
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | None = None,
    seed: int = 1234,
    **engine_args,
) -> dict:
    """lm-eval's results dict (results, configs, versions, n-shot, n-samples, ...) plus a "slimlm" entry:
    the model, the engine settings, and the eval's wall time and tokens per second."""
    import lm_eval
    from datasets.exceptions import DatasetNotFoundError

    from slimlm.eval.lm_eval_model import SlimlmLM

    manager = task_manager(tasks)
    lm = SlimlmLM(pretrained=model, batch_size=batch_size, **engine_args)
    start = time.time()
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except (ConnectionError, DatasetNotFoundError) as e:  # a hub task, offline
        raise SlimlmError(
            f"a task's data could not be fetched ({type(e).__name__}: {str(e)[:160]}); offline, "
            f"use the bundled tasks: {taskpack.GROUP} or {', '.join(taskpack.STANDARD)}"
        ) from None
    seconds = time.time() - start
    results.pop("samples", None)
    results["slimlm"] = {
        "model": str(lm.engine.model_dir),
        "engine": {**dataclasses.asdict(lm.engine.config), "dtype": devices.dtype_name(lm.engine.dtype)},
        "seconds": round(seconds, 1),
        "tokens_computed": lm.tokens_computed,
        "tokens_per_second": round(lm.tokens_computed / seconds, 1),
    }
    return results


def to_json(results: dict) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)
