"""What `compress eval` and `compress bench` write (eval.json, bench.json) and `compress report` reads: one
typed definition for the writer and the reader, so a figure cannot be renamed on one side only, and a file
that is not what it claims is refused by name. Records keep any further figures a writer adds."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from slimlm.errors import SlimlmError


class Record(BaseModel):
    model_config = ConfigDict(extra="allow")


class Perplexity(Record):
    source: str
    perplexity: float
    seq_len: int
    windows: int
    tokens_scored: int
    seconds: float
    tokens_per_second: float
    engine: dict
    model: str | None = None  # the directory measured, and its weight files' bytes
    size_bytes: int | None = None


class Percentiles(Record):
    p50: float | None
    p90: float | None
    p99: float | None


class DecodeStep(Record):
    batch: int
    step_ms: float
    tok_s: float
    floor_ms: float  # the bandwidth floor: the bytes the step must read at the copy bandwidth
    floor_ratio: float


class Offline(Record):
    prefill_tok_s: float
    decode: list[DecodeStep]
    weight_bytes: int
    kv_bytes_per_token: int
    max_batch: int
    peak_rss_bytes: int | None
    other_cores: float | None = None  # cores other processes kept busy meanwhile


class Online(Record):
    output_tok_s: float
    ttft_s: Percentiles
    itl_s: Percentiles
    goodput_req_s: float
    slo_met: float
    wall_s: float
    other_cores: float | None = None


class System(Record):
    path: str
    offline: Offline
    online: Online
    http: Online | None = None


class Bench(Record):
    config: dict
    bandwidth_bytes_s: float
    matmul_flops: float
    activation_dtype: str | None = None  # what config.dtype (auto) resolved to; older results lack it
    threads: int | None = None
    systems: dict[str, System]
    warnings: list[str] = []


class LongContext(Record):
    """`compress long-context`: retrieval accuracy against the KV bytes a request held, per policy."""

    model: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    tasks: list[str]
    lengths: list[int]
    samples: int
    seconds: float
    rows: list[dict]  # one per case and policy (eval.long_context.run)
    summary: list[dict]  # by task, length, policy and budget (eval.long_context.summarize)


def read(record: type[Record], data: object, where: str) -> Record:
    """`data` as the record, or a one-line error naming the first field that is missing or wrong."""
    try:
        return record.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(map(str, first["loc"])) or "the file"
        raise SlimlmError(f"{where} is not a {record.__name__.lower()} record: {field}: {first['msg']}") from None
