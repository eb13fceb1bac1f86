"""The task pack reproduces lm-eval's standard tasks: on the same documents, our YAMLs produce exactly the
requests (context, continuation strings) and targets that lm-eval's own task definitions produce."""

from pathlib import Path

import datasets
import lm_eval
import pytest
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks._yaml_loader import load_yaml

from slimlm.eval import harness, taskpack

LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"
STANDARD_YAML = {  # lm-eval task -> its YAML in the installed lm-eval
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "sciq": "sciq/sciq.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
}
DOCS = 50


@pytest.fixture(scope="module")
def ours() -> dict:
    return harness.task_manager([taskpack.GROUP]).load([taskpack.GROUP])["tasks"]


def standard_task(name: str, docs: datasets.Dataset) -> ConfigurableTask:
    """lm-eval's own task `name`, built from its installed YAML, reading `docs` instead of the hub."""
    cfg = load_yaml(LM_EVAL_TASKS / STANDARD_YAML[name], resolve_func=True)
    for key in ("tag", "group", "task_list", "dataset_path", "dataset_name", "dataset_kwargs"):
        cfg.pop(key, None)
    splits = datasets.DatasetDict({s: docs for s in ("train", "validation", "test")})
    cfg["custom_dataset"] = lambda **_: splits
    return ConfigurableTask(config=cfg)


def requests(task: ConfigurableTask) -> list[tuple]:
    task.build_all_requests(limit=DOCS, rank=0, world_size=1)
    return [inst.args for inst in task.instances]


def test_the_pack_has_every_task_with_its_full_split(ours):
    sizes = {name: len(task.eval_docs) for name, task in ours.items()}
    assert sizes == {
        "slimlm_hellaswag": 10042,
        "slimlm_piqa": 1838,
        "slimlm_winogrande": 1267,
        "slimlm_arc_easy": 570,
        "slimlm_arc_challenge": 299,
        "slimlm_boolq": 3270,
        "slimlm_openbookqa": 500,
        "slimlm_sciq": 1000,
        "slimlm_lambada_openai": 5153,
    }


@pytest.mark.parametrize("name", list(taskpack.STANDARD))
def test_requests_equal_lm_evals_standard_task(ours, name):
    task = ours[name]
    raw = task.dataset[task.config.validation_split or task.config.test_split]
    if name == "slimlm_boolq":  # the standard reads super_glue's boolq, which carries the answer as `label`
        raw = taskpack.boolq_docs(raw)
    standard = standard_task(taskpack.STANDARD[name], raw)
    mine, theirs = requests(task), requests(standard)
    assert len(mine) >= DOCS and mine == theirs
    docs, standard_docs = list(task.eval_docs)[:DOCS], list(standard.eval_docs)[:DOCS]
    assert [task.doc_to_target(d) for d in docs] == [standard.doc_to_target(d) for d in standard_docs]
    assert [m["metric"] for m in task.config.metric_list] == [m["metric"] for m in standard.config.metric_list]


def test_lambada_text_is_rebuilt_whole(ours):
    """The bundled LAMBADA is stored as (context, continuation); the task needs the passage back."""
    task = ours["slimlm_lambada_openai"]
    doc = task.eval_docs[0]
    assert task.doc_to_text(doc).endswith("I don't care about") and task.doc_to_target(doc) == " signs"
    assert all(" " in d["text"] and not d["text"].endswith(" ") for d in task.eval_docs)
