"""Probes of a careless user: nothing lost, nothing silently wrong, one-line errors (issue 10, item by item).

M = a tiny random Llama; checkpoints are RTN (no calibration data needed) so each probe takes a second.
"""

import fcntl
import json
import os
import re
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimlm import SlimlmError, models
from slimlm.formats import atomic
from tests.test_cli import assert_one_line_error, run_cli


def rtn(capsys, model, out, *extra):
    return run_cli(capsys, "rtn", "--model", str(model), "--group-size", "32", "--out", str(out), *extra)


@pytest.fixture
def quantized(capsys, tiny_llama, tmp_path):
    code, _, err = rtn(capsys, tiny_llama, tmp_path / "q")
    assert code == 0, err
    return tmp_path / "q"


def edit_config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"] if "quant" in str(changes) else None
    for key, value in changes.items():
        if key.startswith("quant_"):
            weights[key.removeprefix("quant_")] = value
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


def drop_manifest_hashes(d):
    """Edits below change tensors on purpose: without this the sha256 check would catch them first."""
    (d / "slimlm.json").unlink()


# ---- 1. --overwrite never deletes what slimlm did not write --------------------------------------------


def test_out_containing_the_source_is_refused(capsys, tiny_llama, tmp_path):
    src = tmp_path / "proj" / "models" / "src"
    shutil.copytree(tiny_llama, src)
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    code, _, err = rtn(capsys, src, tmp_path / "proj", "--overwrite")
    assert_one_line_error(code, err, "contains the source model")
    assert (src / "model.safetensors").exists() and (tmp_path / "proj" / "notes.txt").exists()
    code, _, err = rtn(capsys, src, src, "--overwrite")
    assert_one_line_error(code, err, "is or contains the source model")


def test_out_that_is_the_working_directory_is_refused(capsys, tiny_llama, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", ".."):
        code, _, err = rtn(capsys, tiny_llama, out, "--overwrite")
        assert_one_line_error(code, err, "current directory or one of its parents")
    assert (work / "keep.txt").exists()


# ---- 2. two runs, one --out -----------------------------------------------------------------------------


def test_a_second_run_while_one_is_writing_fails(capsys, tiny_llama, tmp_path):
    busy = tmp_path / ".q.tmp-other"
    busy.mkdir()
    fd = os.open(busy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a live writer holds
    try:
        code, _, err = rtn(capsys, tiny_llama, tmp_path / "q")
        assert_one_line_error(code, err, "is being written by another slimlm run")
    finally:
        os.close(fd)
    assert not (tmp_path / "q").exists()


def test_an_out_that_appears_during_the_write_is_not_replaced(tmp_path):
    out = tmp_path / "q"
    with pytest.raises(SlimlmError, match="appeared while this run was writing"):
        with atomic.atomic_dir(out) as tmp:
            (tmp / "config.json").write_text("{}")
            out.mkdir()  # the other run finished first
            (out / "theirs").write_text("x")
    assert (out / "theirs").exists() and [p.name for p in tmp_path.iterdir()] == ["q"]


# ---- 3. temp dirs, signals, parents ------------------------------------------------------------------


def test_stale_temp_dirs_are_cleaned_and_failed_parents_removed(capsys, tiny_llama, tmp_path):
    stale = tmp_path / ".q.tmp-dead"  # a killed run's leftovers: nobody holds them
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    code, _, err = rtn(capsys, tiny_llama, tmp_path / "q")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(tmp_path / "a" / "b" / "c"):
            raise RuntimeError("killed")
    assert not (tmp_path / "a").exists()


def test_checkpoint_directories_get_the_umask_permissions(quantized):
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(quantized.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((quantized / "model.safetensors").stat().st_mode) == 0o666 & ~umask


# ---- 4. everything checked before any work ---------------------------------------------------------------


def test_bad_ppl_source_and_unwritable_out_fail_before_work(capsys, tiny_llama, tmp_path):
    code, _, err = rtn(capsys, tiny_llama, tmp_path / "q", "--ppl", "nosuch")
    assert_one_line_error(code, err, "unknown text source 'nosuch'")
    assert not (tmp_path / "q").exists()
    (tmp_path / "file").write_text("x")
    code, _, err = rtn(capsys, tiny_llama, tmp_path / "file" / "q")
    assert_one_line_error(code, err, "is not a writable directory")


# ---- 5, 6, 8. checkpoints are checked against their config, their model and for finiteness -------------


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(quant_group_size=64), "implies|does not divide"),  # a group count that no longer fits
        (dict(quant_group_size=-1), "implies"),  # per channel: one scale per row, not 2
        (dict(quant_group_size=0), "weights.group_size is 0"),
        (dict(quant_num_bits=2), r"weight_packed is \[\d+, \d+\] torch.int32, the quantization_config implies"),
        (dict(quant_num_bits="4"), r"weights.num_bits is '4'"),
        (dict(quantization_config=None), "quantization_config is None, not an object"),
        (dict(hidden_size="64"), "hidden_size is '64', not a positive integer"),
        (dict(model_type="bert"), r"unsupported model_type 'bert' \(architectures LlamaForCausalLM\)"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_edited_configs_are_named_not_served(capsys, quantized, changes, fragment):
    drop_manifest_hashes(quantized)
    edit_config(quantized, **changes)
    for command in (
        ["eval", str(quantized), "--max-tokens", "64", "--seq-len", "32", "--ppl", "wiki"],
        ["generate", str(quantized), "--prompt", "the"],
    ):
        code, _, err = run_cli(capsys, *command)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert re.search(fragment, err), err


def test_missing_num_bits_and_config_not_an_object(capsys, quantized):
    drop_manifest_hashes(quantized)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"]
    (quantized / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", str(quantized), "--prompt", "the")
    assert_one_line_error(code, err, "weights.num_bits is None")
    (quantized / "config.json").write_text("[1, 2]")
    code, _, err = run_cli(capsys, "generate", str(quantized), "--prompt", "the")
    assert_one_line_error(code, err, "is not a JSON object")
    (quantized / "config.json").write_bytes(b"\xff\xfe{")
    code, _, err = run_cli(capsys, "generate", str(quantized), "--prompt", "the")
    assert_one_line_error(code, err, "cannot read")


def rewrite_tensors(d, change):
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale"), "has no model.layers.0.self_attn.q_proj"),
        (
            lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight_shape", torch.tensor([96, 32])),
            "up_proj.weight_packed is [96, 8] torch.int32, the quantization_config implies [96, 4]",
        ),
        (
            lambda t: t["model.layers.1.mlp.down_proj.weight_scale"].__setitem__((0, 0), float("nan")),
            "tensor model.layers.1.mlp.down_proj.weight_scale holds NaN or Inf",
        ),
        (lambda t: t["model.norm.weight"].__setitem__(0, float("inf")), "tensor model.norm.weight holds NaN or Inf"),
        (lambda t: t.__setitem__("extra.weight", torch.zeros(2)), "holds tensor extra.weight that its config.json"),
    ],
    ids=["missing-scale", "false-shape", "nan-scale", "inf-norm", "unexpected"],
)
def test_tensors_that_do_not_match_are_named(capsys, quantized, change, fragment):
    drop_manifest_hashes(quantized)
    rewrite_tensors(quantized, change)
    for command in (
        ["generate", str(quantized), "--prompt", "the"],
        ["eval", str(quantized), "--max-tokens", "64", "--seq-len", "32"],
    ):
        code, _, err = run_cli(capsys, *command)
        assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("command", [["rtn", "--model"], ["gptq", "--num-samples", "2", "--seq-len", "32", "--model"]])
def test_a_nan_in_the_source_is_refused_by_every_compress_command(capsys, tiny_llama, tmp_path, command):
    """RTN would give the group a scale of 1.0 and round its weights to about zero, then write a checkpoint
    that loads and generates: the source read refuses it, for every job, with the tensor's name."""
    source = tmp_path / "nan-source"
    shutil.copytree(tiny_llama, source)
    rewrite_tensors(source, lambda t: t["model.layers.1.mlp.down_proj.weight"].__setitem__((0, 0), float("nan")))
    code, _, err = run_cli(capsys, *command, str(source), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, "tensor model.layers.1.mlp.down_proj.weight holds NaN or Inf")
    assert not (tmp_path / "o").exists()


def test_float_dir_missing_a_tensor_and_quantized_without_config(capsys, tiny_llama, quantized, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    rewrite_tensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    code, _, err = run_cli(capsys, "eval", str(broken), "--max-tokens", "64", "--seq-len", "32")
    assert_one_line_error(code, err, "has no tensor model.layers.1.mlp.up_proj.weight")
    drop_manifest_hashes(quantized)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "eval", str(quantized), "--max-tokens", "64", "--seq-len", "32")
    assert_one_line_error(code, err, "quantization_config was removed?")


# ---- 7. cached assets are verified and repaired -----------------------------------------------------------


def test_a_corrupted_cached_text_asset_is_noticed_and_repaired(tmp_path, monkeypatch):
    from slimlm import assets, cache_dir

    real = cache_dir() / "wiki"
    assets.fetch("wiki", quiet=True)
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path / "cache"))
    shutil.copytree(real, tmp_path / "cache" / "wiki")
    data = tmp_path / "cache" / "wiki" / "data.jsonl"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    assert assets.state("wiki") == "corrupt" and not assets.is_cached("wiki")
    assets.fetch("wiki", quiet=True)  # repairs
    assert assets.state("wiki") == "cached" and len(assets.text_passages("wiki")) == 1000


def test_the_converted_default_model_carries_its_file_hashes():
    from slimlm import assets
    from slimlm.formats import manifest

    meta = manifest.read(assets.fetch("smollm2-135m", quiet=True))
    assert meta["method"] == "float" and "model.safetensors" in meta["files"]


# ---- 9-12. requests and engine settings -------------------------------------------------------------------


def test_sampling_parameters_follow_vllm(tiny_llama):
    from slimlm import LLM, SamplingParams

    bad_params = [
        dict(logprobs=1000),
        dict(logprobs=-1),
        dict(logprobs=True),
        dict(max_tokens=True),
        dict(prompt_logprobs=21),
        dict(seed=-1),
        dict(stop_token_ids=[-3]),
        dict(temperature=float("inf")),
    ]
    for bad in bad_params:
        with pytest.raises(SlimlmError, match="invalid sampling parameters"):
            SamplingParams(**bad)
    out = LLM(str(tiny_llama)).generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, logprobs=2))[0]
    top = out.outputs[0].top_logprobs
    assert len(top) == 3 and all(len(t) == 2 and t[0][1] >= t[1][1] for t in top)
    assert out.outputs[0].token_ids[0] == top[0][0][0]  # greedy takes the most likely token


def test_one_bad_request_never_wedges_the_engine(tiny_llama):
    from slimlm import LLM, SamplingParams

    llm = LLM(str(tiny_llama))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    good = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    outs = llm.generate([[10**6], [-1], [5, "6"], [5, True], "ok \ud800", [5, 6, 7]], greedy)
    assert all(o.error for o in outs[:5]) and outs[5].outputs[0].token_ids == good
    tiny_t = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=1e-40))[0]
    assert tiny_t.outputs[0].token_ids == good  # a temperature below 1e-5 is greedy, as in vLLM
    assert not llm.engine.has_unfinished() and llm.engine.stats().free_blocks == llm.engine.stats().total_blocks


@pytest.mark.parametrize(
    "config, fragment",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(max_num_seqs=-1), "max_num_seqs must be a positive integer"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive integer"),
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(block_size=24), "block_size must be a power of two"),
        (dict(max_model_len=-5), "max_model_len must be a positive integer"),
        (dict(kv_cache_memory=0), "kv_cache_memory must be a positive integer"),
        (dict(kv_cache_memory=-5), "kv_cache_memory must be a positive integer"),
        (dict(kv_cache_memory=4096), "give it at least"),
        (dict(kv_cache_memory=1 << 50), "does not fit in the"),
    ],
)
def test_engine_settings_are_checked(tiny_llama, config, fragment):
    from slimlm import LLM

    with pytest.raises(SlimlmError, match=fragment):
        LLM(str(tiny_llama), **config)


def test_a_block_size_below_the_speculative_default_needs_no_speculation_flag(tiny_llama):
    """num_speculative_tokens (default 4) bounds block_size only when something drafts."""
    from slimlm import LLM, SamplingParams
    from slimlm.runtime.engine import EngineConfig

    EngineConfig(block_size=2)
    with pytest.raises(SlimlmError, match=r"num_speculative_tokens must be an integer in 1..block_size \(2\)"):
        EngineConfig(block_size=2, speculative="ngram")
    out = LLM(str(tiny_llama), block_size=2).generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_cache_memory_flag(capsys, tiny_llama):
    with pytest.raises(SystemExit):
        run_cli(capsys, "generate", str(tiny_llama), "--prompt", "the", "--kv-cache-memory", "inf")
    assert "is not a size" in capsys.readouterr().err
    code, _, err = run_cli(capsys, "generate", str(tiny_llama), "--prompt", "the", "--kv-cache-memory", "1000000G")
    assert_one_line_error(code, err, "does not fit in the")


def test_abort_during_stream_ends_with_an_abort_output(tiny_llama):
    from slimlm import LLM, SamplingParams

    llm = LLM(str(tiny_llama))
    outs = []
    for out in llm.stream([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)):
        outs.append(out)
        if len(outs) == 3:
            llm.engine.abort(out.request_id)
    last = {}
    for out in outs:
        last[out.request_id] = out
    assert sorted(o.outputs[0].finish_reason for o in last.values()) == ["abort", "length"]
    assert all(o.finished for o in last.values())
    assert llm.engine.stats().free_blocks == llm.engine.stats().total_blocks


def test_generate_while_a_stream_is_open_is_refused_and_the_stream_goes_on(tiny_llama):
    """generate() would run the stream's request to completion and drop its outputs: it is refused instead;
    once the stream is exhausted or closed, the LLM takes calls again."""
    from slimlm import LLM, SamplingParams

    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    stream = llm.stream([[5, 6, 7]], params)
    first = next(stream)
    with pytest.raises(SlimlmError, match="an LLM.stream\\(\\) iterator is still open on this LLM"):
        llm.generate([[8, 9]], params)
    with pytest.raises(SlimlmError, match="still open"):
        next(llm.stream([[8, 9]], params))
    rest = list(stream)
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 6 and not first.finished
    assert len(llm.generate([[8, 9]], params)[0].outputs[0].token_ids) == 6
    again = llm.stream([[5, 6, 7]], params)
    next(again)
    again.close()  # closing early frees the LLM too
    assert llm.generate([[8, 9]], params)[0].finished


# ---- 13, 14. bounded work, one-line messages -----------------------------------------------------------


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_id, self.chars = tokenizer, tokenizer.eos_token_id, 0

    def __call__(self, text, **kwargs):
        self.chars += len(text)
        return self.tokenizer(text, **kwargs)


def test_a_huge_single_passage_is_tokenized_only_as_far_as_needed(tiny_llama):
    from slimlm import data

    tok = CountingTokenizer(models.load_tokenizer(tiny_llama))
    ids = data.token_stream(["the river city " * 1_000_000], tok, max_tokens=1000)  # 15 MB, one line
    assert len(ids) >= 1000 and tok.chars <= 2 * data.CHUNK_CHARS


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["eval", "{m}", "--seq-len", "1"], "a window needs at least 2 tokens"),
        (["eval", "{m}", "--seq-len", "-4"], "must be at least 2"),
        (["eval", "{m}", "--max-tokens", "0"], "must be a positive integer"),
        (["eval", "{m}", "--tasks", "slimlm_piqa", "--limit", "0"], "must be a document count from 1 to 1e9 or a"),
        (["eval", "{m}", "--tasks", "slimlm_piqa", "--limit", "2.5"], "must be a document count from 1 to 1e9 or a"),
        (["eval", "{m}", "--tasks", "slimlm_piqa", "--limit", "1e30"], "must be a document count from 1 to 1e9 or a"),
        (["rtn", "--model", "{m}", "--out", "{o}", "--batch-size", "0"], "must be a positive integer"),
        (["rtn", "--model", "{m}", "--out", "{o}", "--ppl-tokens", "-100"], "must be a positive integer"),
        (["rtn", "--model", "{m}", "--out", "{o}", "--seed", str(2**70)], "must be in [0, 2^63)"),
        (
            ["eval", "{m}", "--tasks", "slimlm_piqa,hellaswagg"],
            "unknown task hellaswagg; bundled (offline): slimlm_tasks (all of them), slimlm_hellaswag, slimlm_piqa",
        ),
        (["eval", "{m}", "--tasks", " , "], "--tasks: is empty"),
        (["plan", "llama-3.1-8b", "--weights", "w4g0"], "and a group >= 1 (-1: per channel)"),
    ],
)
def test_flags_out_of_range_are_argparse_errors(capsys, tiny_llama, tmp_path, argv, fragment):
    argv = [a.format(m=tiny_llama, o=tmp_path / "q") for a in argv]
    with pytest.raises(SystemExit) as e:
        run_cli(capsys, *argv)
    assert e.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["eval", "{m}", "--output", "{t}"], "is a directory; name a file"),
        (["eval", "{m}", "--seq-len", "4096"], "exceeds the model's context (512 tokens)"),
        (["eval", "{t}", "--tasks", "slimlm_piqa"], "has no config.json"),
        (["rtn", "--model", "{m}", "--out", "{o}", "--calib", "/etc/passwd"], "is neither .txt"),
        (
            ["awq", "--model", "{m}", "--out", "{o}", "--group-size", "32", "--search-batches", "0"],
            "--search-batches 0 must be a positive integer",
        ),
        (
            ["awq", "--model", "{m}", "--out", "{o}", "--group-size", "32", "--grid", "0"],
            "--grid 0 must be a positive integer (20 is the default)",
        ),
        (["generate", "{m}", "--prompt", "caf\udce9"], "is not valid text"),
        (["plan", "llama-3.1-8b", "--bench", "{t}/b.json"], "give that checkpoint"),
        (["plan", "{m}", "--bench", "{m}/config.json"], "not a compress bench JSON (KeyError: 'systems')"),
        (["bench", "{m}", "--baseline", "none", "--prefill-len", "100000"], "--prefill-len: 100000 tokens are past"),
        (
            ["generate", "{m}", "--prompt", "hi", "--max-model-len", "4096"],
            "max_model_len 4096 is past the model's context of 512 tokens",
        ),
    ],
)
def test_user_errors_are_one_line(capsys, tiny_llama, tmp_path, argv, fragment):
    argv = [a.format(m=tiny_llama, o=tmp_path / "q", t=tmp_path) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "q").exists()


def test_a_full_disk_keeps_the_old_checkpoint_and_says_so(capsys, tiny_llama, quantized, monkeypatch):
    import errno

    from slimlm.formats import shards

    before = (quantized / "model.safetensors").read_bytes()

    def full(_source, target, length=0):
        raise OSError(errno.ENOSPC, "No space left on device", target.name)

    monkeypatch.setattr(shards.shutil, "copyfileobj", full)
    code, _, err = rtn(capsys, tiny_llama, quantized, "--bits", "8", "--overwrite")
    assert_one_line_error(code, err, "No space left on device")
    assert (quantized / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in quantized.parent.iterdir()) == ["q"]


def test_a_flipped_byte_in_a_cached_model_names_the_repair(tmp_path, monkeypatch, tiny_llama):
    from slimlm import cache_dir
    from slimlm.formats import manifest, shards

    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path / "cache"))
    entry = cache_dir() / "smollm2-135m"  # stand-in: the tiny model with a manifest, where the asset lives
    shutil.copytree(tiny_llama, entry)
    manifest.write(entry, {"method": "float"}, [p.name for p in shards.weight_files(entry)])
    raw = bytearray((entry / "model.safetensors").read_bytes())
    raw[-5] ^= 0x01
    (entry / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(SlimlmError, match="cached asset smollm2-135m is damaged.*assets fetch smollm2-135m --force"):
        models.check(entry)
