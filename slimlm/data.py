"""Text sources for calibration and perplexity, and how they become fixed-length token windows.

Passages in the bundled sets are short (median ~150 tokens), so windows are cut from one stream: passages
(shuffled by `seed` for calibration, in file order for evaluation) are tokenized, joined with the EOS token
between them, and cut into consecutive, non-overlapping `seq_len`-token windows. Keeping only passages
that are long enough on their own would leave a handful of samples.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from slimlm import assets
from slimlm.errors import FieldError, SlimlmError

HUB_SOURCES = {
    # name: (dataset, config, split, data_files)
    "c4": ("allenai/c4", None, "train", {"train": "en/c4-train.00000-of-01024.json.gz"}),
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", "test", None),
}


def check_source(source: str) -> None:
    """Fail now, before any work, if `source` cannot be read (hub sources: if the hub is unreachable)."""
    if source in assets.ASSETS and assets.ASSETS[source].kind == "text":
        return
    if source in HUB_SOURCES:
        from slimlm.hub import require_hub

        require_hub(f"'{source}' ({HUB_SOURCES[source][0]})", "--calib owt (bundled) or a local .txt/.jsonl file")
        return
    _local_file(source)


def _local_file(source: str) -> Path:
    path = Path(source).expanduser()
    if path.suffix in (".txt", ".jsonl") and path.is_file():
        return path
    known = [n for n, a in assets.ASSETS.items() if a.kind == "text"] + list(HUB_SOURCES)
    if path.is_file():
        raise SlimlmError(f"text file {path} is neither .txt (passages separated by blank lines) nor .jsonl")
    if path.exists():
        raise SlimlmError(f"text source {path} is a directory, not a .txt or .jsonl file")
    if path.suffix in (".txt", ".jsonl"):
        raise SlimlmError(f"text file {path} does not exist")
    raise SlimlmError(f"unknown text source '{source}'; use one of {', '.join(known)} or a .txt/.jsonl file")


def passages(source: str) -> list[str]:
    """Passages of a named source: a bundled text asset, a hub dataset, or a local .txt/.jsonl file."""
    if source in assets.ASSETS and assets.ASSETS[source].kind == "text":
        return assets.text_passages(source)
    if source in HUB_SOURCES:
        return _hub_passages(source)
    return _file_passages(_local_file(source))


def _file_passages(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SlimlmError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SlimlmError(f"{path} is not UTF-8 text (byte {e.start}); convert it first") from None
    if path.suffix == ".txt":
        # Blank lines separate passages, as in most plain-text corpora.
        texts = [p.strip() for p in raw.split("\n\n")]
    else:
        texts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SlimlmError(f'{path}:{i} is not a JSON object with a "text" field') from None
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise SlimlmError(f"{path} holds no text")
    return texts


def _hub_passages(name: str) -> list[str]:
    import datasets

    from slimlm.hub import require_hub

    dataset, config, split, data_files = HUB_SOURCES[name]
    alternative = "--calib owt (bundled) or a local .txt/.jsonl file"
    require_hub(f"'{name}' ({dataset})", alternative)
    try:
        ds = datasets.load_dataset(dataset, config, split=split, data_files=data_files)
    except Exception as e:  # datasets raises many types for "could not get it"; all mean the same here
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise SlimlmError(
            f"cannot load '{name}' ({dataset}) from the Hugging Face hub ({reason}); use {alternative}"
        ) from None
    return [t for t in ds["text"] if t.strip()]


CHUNK_CHARS = 32_768  # a passage is tokenized this much at a time, so a huge one costs only what is used


def _chunks(text: str) -> list[str]:
    """Pieces of at most ~CHUNK_CHARS, cut before whitespace so no word is split."""
    pieces, start = [], 0
    while len(text) - start > CHUNK_CHARS:
        cut = text.rfind(" ", start + 1, start + CHUNK_CHARS)
        cut = start + CHUNK_CHARS if cut <= start else cut
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def token_stream(texts: list[str], tokenizer, max_tokens: int | None = None) -> list[int]:
    """Tokenize passages in order and join them with EOS, stopping once `max_tokens` are collected."""
    sep = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        for piece in _chunks(text):
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if max_tokens is not None and len(ids) >= max_tokens:
                return ids
        if sep is not None:
            ids.append(sep)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return ids


def windows(ids: list[int], seq_len: int, count: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows [n, seq_len]; a trailing partial window is dropped."""
    n = len(ids) // seq_len if count is None else min(count, len(ids) // seq_len)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def calibration_windows(source: str, tokenizer, num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """`num_samples` token windows of `seq_len` from `source`, deterministic for a given seed."""
    if num_samples <= 0 or seq_len <= 0:
        raise FieldError("num_samples", "and {seq_len} must be positive")
    texts = passages(source)
    random.Random(seed).shuffle(texts)
    ids = token_stream(texts, tokenizer, max_tokens=num_samples * seq_len)
    batch = windows(ids, seq_len, num_samples)
    if len(batch) < num_samples:
        raise SlimlmError(
            f"'{source}' yields only {len(batch)} windows of {seq_len} tokens ({len(ids)} tokens), "
            f"{num_samples} requested; lower --num-samples or --seq-len"
        )
    return batch
