"""The `compress` command: bad input gives one line on stderr and a non-zero exit code, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimlm import devices
from slimlm.cli import main
from tests.conftest import transformers_logits_error


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, fragment):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


@pytest.fixture
def out_dir(tmp_path):
    return str(tmp_path / "out")


def test_unknown_model(capsys, out_dir):
    code, _, err = run_cli(capsys, "rtn", "--model", "nosuchmodel", "--out", out_dir)
    assert_one_line_error(code, err, "unknown model 'nosuchmodel'")


def test_missing_directory(capsys, out_dir, tmp_path):
    code, _, err = run_cli(capsys, "eval", str(tmp_path / "no" / "such" / "dir"))
    assert_one_line_error(code, err, "unknown model")


def test_hub_unreachable(capsys, out_dir):
    code, _, err = run_cli(capsys, "rtn", "--model", "meta-llama/Llama-3.1-8B", "--out", out_dir)
    assert_one_line_error(code, err, "--model smollm2-135m")


def test_unsupported_architecture(capsys, tiny_llama, tmp_path, out_dir):
    import shutil

    d = tmp_path / "opt"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="opt", architectures=["OPTForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "rtn", "--model", str(d), "--out", out_dir)
    assert_one_line_error(code, err, "unsupported architecture OPTForCausalLM")


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--group-size", "128"], "--group-size 128 does not divide the input dim of"),
        (["--group-size", "32", "--calib", "c7"], "unknown text source 'c7'"),
        (["--group-size", "32", "--calib", "c4"], "offline, use --calib owt"),
    ],
)
def test_bad_quantization_settings(capsys, tiny_llama, out_dir, flags, fragment):
    code, _, err = run_cli(capsys, "rtn", "--model", str(tiny_llama), "--out", out_dir, *flags)
    assert_one_line_error(code, err, fragment)
    assert not os.path.exists(out_dir)


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--bits", "5"], "argument --bits: invalid choice: 5 (choose from 2, 3, 4, 8)"),
        (["--group-size", "48"], "argument --group-size: invalid choice: 48 (choose from -1, 32, 64, 128)"),
    ],
)
def test_unsupported_formats_are_refused_by_the_parser(capsys, tiny_llama, out_dir, flags, fragment):
    """At parse time, so a recipe's --check refuses them too."""
    with pytest.raises(SystemExit) as e:
        run_cli(capsys, "rtn", "--model", str(tiny_llama), "--out", out_dir, *flags)
    assert e.value.code == 2 and fragment in capsys.readouterr().err
    assert not os.path.exists(out_dir)


def test_empty_calibration_file(capsys, tiny_llama, tmp_path, out_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run_cli(
        capsys, "gptq", "--model", str(tiny_llama), "--calib", str(empty), "--group-size", "32", "--out", out_dir
    )
    assert_one_line_error(code, err, "empty.txt holds no text")


def test_rtn_then_eval_end_to_end(capsys, tiny_llama, calib_txt, out_dir):
    common = ["--model", str(tiny_llama), "--calib", str(calib_txt), "--num-samples", "4", "--seq-len", "32"]
    code, out, err = run_cli(
        capsys, "rtn", *common, "--group-size", "32", "--out", out_dir, "--ppl", str(calib_txt), "--ppl-tokens", "256"
    )
    assert code == 0, err
    assert "baseline" in out and "rtn w4 g32 sym" in out and f"checkpoint: {out_dir}" in out
    results = json.loads(open(os.path.join(out_dir, "eval.json")).read())
    assert results["quantized"]["size_bytes"] < results["baseline"]["size_bytes"]

    code, _, err = run_cli(capsys, "rtn", *common, "--group-size", "32", "--out", out_dir)
    assert_one_line_error(code, err, "exists; pass --overwrite")

    code, out, _ = run_cli(capsys, "eval", out_dir, "--ppl", str(calib_txt), "--seq-len", "32", "--max-tokens", "256")
    assert code == 0
    assert json.loads(out.splitlines()[-1])["perplexity"] == pytest.approx(results["quantized"]["perplexity"])

    model_file = os.path.join(out_dir, "model.safetensors")
    with open(model_file, "r+b") as f:
        f.truncate(os.path.getsize(model_file) // 2)
    code, _, err = run_cli(capsys, "eval", out_dir, "--ppl", str(calib_txt), "--seq-len", "32")
    assert_one_line_error(code, err, "is truncated or corrupt")


def test_eval_tasks_writes_lm_evals_results_and_the_runtimes(capsys, tiny_llama, tmp_path):
    out = tmp_path / "eval.json"
    code, printed, err = run_cli(
        capsys,
        "eval",
        str(tiny_llama),
        "--tasks",
        "slimlm_piqa,slimlm_lambada_openai",
        "--limit",
        "3",
        "--output",
        str(out),
    )
    assert code == 0, err
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"slimlm_piqa", "slimlm_lambada_openai"}
    assert {"acc,none", "acc_stderr,none", "acc_norm,none"} <= set(results["results"]["slimlm_piqa"])
    assert results["n-samples"]["slimlm_piqa"]["effective"] == 3 and "configs" in results and "versions" in results
    assert results["slimlm"]["tokens_computed"] > 0 and results["slimlm"]["engine"]["dtype"] == "float32"
    assert results["slimlm"]["perplexity"] is None and "slimlm_piqa" in printed


# A command that forks a child and sends it SIGTERM, as Pool.terminate() does to lm-eval's bootstrap pool.
FORK_THEN_TERMINATE = """
import os, signal, sys, time
from slimlm import cli
def command(a):
    ready, running = os.pipe()
    pid = os.fork()
    if pid == 0:  # a signal that lands before Python's after-fork reset would be dropped: say when past it
        os.write(running, b"x")
        time.sleep(30)
        os._exit(0)
    os.read(ready, 1)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    print("child", "killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM else "survived")
cli.COMMANDS["lm-eval"] = command
before = signal.getsignal(signal.SIGTERM)
cli.main(["lm-eval"])
print("handler", "restored" if signal.getsignal(signal.SIGTERM) is before else "left")
"""


def test_sigterm_ends_a_forked_child_and_the_handler_is_put_back():
    """Only the CLI's own process unwinds on SIGTERM: a child that caught it instead would survive
    Pool.terminate(), and the parent would wait for it forever (a CI run hung in lm-eval's bootstrap)."""
    run = subprocess.run([sys.executable, "-c", FORK_THEN_TERMINATE], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["child", "killed", "handler", "restored"], run.stdout + run.stderr


def test_an_interrupted_eval_writes_nothing_and_leaves_nothing_queued(capsys, tiny_llama, tmp_path, monkeypatch):
    from slimlm.eval import batch

    engines = []
    real_step = batch.Engine.step

    def step_then_interrupt(engine, *args, **kwargs):
        engines.append(engine)
        real_step(engine, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(batch.Engine, "step", step_then_interrupt)
    out = tmp_path / "eval.json"
    code, _, err = run_cli(
        capsys, "eval", str(tiny_llama), "--tasks", "slimlm_piqa", "--limit", "4", "--output", str(out)
    )
    assert code == 130 and "interrupted" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert engines and not engines[0].has_unfinished() and not engines[0].requests


def test_console_script_exit_code_and_message(tmp_path):
    """The installed entry point, as a user runs it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "slimlm.cli", "rtn", "--model", "nosuchmodel", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown model 'nosuchmodel'") and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "command,flags",
    [
        ("gptq", ["--act-order"]),
        ("gptq", ["--no-act-order", "--format", "gptq"]),
        ("gptq", ["--compute-dtype", "float32"]),
        ("awq", ["--search-batches", "1"]),
        ("awq+gptq", ["--search-batches", "1", "--then", "gptq"]),
    ],
)
def test_gptq_and_awq_commands(capsys, tiny_llama, calib_txt, tmp_path, command, flags):
    out = tmp_path / "q"
    code, stdout, err = run_cli(
        capsys,
        command.split("+")[0],
        "--model",
        str(tiny_llama),
        "--calib",
        str(calib_txt),
        "--num-samples",
        "8",
        "--seq-len",
        "32",
        "--group-size",
        "32",
        "--out",
        str(out),
        *flags,
    )
    assert code == 0, err
    meta = json.loads((out / "slimlm.json").read_text())
    assert meta["method"] == command and len(meta["layers"]) == 2
    assert meta["arguments"].get("act_order", "weight") == (None if "--no-act-order" in flags else "weight")
    auto = "bfloat16" if devices.fast_bf16_matmul(torch.device("cpu")) else "float32"
    assert meta["calibration"]["compute_dtype"] == ("float32" if "--compute-dtype" in flags else auto)
    code, _, err = run_cli(capsys, "eval", str(out), "--ppl", str(calib_txt), "--seq-len", "32", "--max-tokens", "128")
    assert code == 0, err


def test_gptq_format_refuses_asymmetric(capsys, tiny_llama, out_dir):
    code, _, err = run_cli(
        capsys, "awq", "--model", str(tiny_llama), "--group-size", "32", "--format", "gptq", "--out", out_dir
    )
    assert_one_line_error(code, err, "--format gptq writes symmetric 4- or 8-bit weights only")


@pytest.mark.parametrize("tied,flag,bits", [(True, [], 8), (False, ["4"], 4)])
def test_quantize_lm_head(capsys, calib_txt, tmp_path, tied, flag, bits):
    """A tied lm_head is untied: quantized (8-bit unless asked), while the embeddings stay float, its own
    scheme a config group of its own; transformers and the runtime both read it."""
    import torch

    from slimlm.formats import reader
    from tests.conftest import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src", tied=tied)
    out = tmp_path / "q"
    # plain GPTQ: the float target's fit to 256 tokens makes larger logits, whose fp32 rounding in the two
    # runtimes then differs by ~2e-4
    flags = ["--num-samples", "8", "--seq-len", "32", "--group-size", "32", "--no-float-target"]
    flags += ["--quantize-lm-head", *flag]
    code, _, err = run_cli(capsys, "gptq", "--model", str(src), "--calib", str(calib_txt), *flags, "--out", str(out))
    assert code == 0, err
    quantized, rest = reader.read_checkpoint(out)
    assert "lm_head" in quantized and "lm_head.weight" not in rest
    assert quantized["lm_head"].args.bits == bits and quantized["model.layers.0.mlp.up_proj"].args.bits == 4
    assert rest["model.embed_tokens.weight"].dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert transformers_logits_error(out) < 1e-4
    # the runtime reads the quantized lm_head too: its log-probabilities are transformers' on the same files
    from transformers import AutoModelForCausalLM

    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams
    from tests.runtime.conftest import model_logprobs

    ids = list(range(5, 40))
    got = LLM(str(out)).generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.allclose(torch.tensor(got), model_logprobs(theirs, ids), atol=1e-4)


@pytest.mark.parametrize(
    "flags,head_bits",
    [([], 8), (["--float-lm-head"], None), (["--format", "gptq"], None), (["--format", "gptq", "--bits", "8"], 8)],
)
def test_lm_head_is_8_bit_unless_kept_float_or_the_format_cannot_hold_it(
    capsys, tiny_llama, tmp_path, flags, head_bits
):
    from slimlm.formats import reader

    out = tmp_path / "q"
    code, _, err = run_cli(capsys, "rtn", "--model", str(tiny_llama), "--group-size", "32", *flags, "--out", str(out))
    assert code == 0, err
    quantized, _ = reader.read_checkpoint(out)
    assert (quantized["lm_head"].args.bits if "lm_head" in quantized else None) == head_bits
    assert json.loads((out / "slimlm.json").read_text())["arguments"]["lm_head_bits"] == head_bits


def test_gptq_format_refuses_an_lm_head_of_other_bits(capsys, tiny_llama, out_dir):
    code, _, err = run_cli(
        capsys,
        "rtn",
        "--model",
        str(tiny_llama),
        "--group-size",
        "32",
        "--format",
        "gptq",
        "--quantize-lm-head",
        "--out",
        out_dir,
    )
    assert_one_line_error(code, err, "--format gptq stores one scheme for every linear")


def test_lm_head_bits_the_kernels_do_not_cover_are_refused(capsys, tiny_llama, out_dir):
    with pytest.raises(SystemExit) as exc:
        main(["rtn", "--model", str(tiny_llama), "--quantize-lm-head", "5", "--out", out_dir])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--quantize-lm-head: invalid choice: 5 (choose from 4, 8)" in err.splitlines()[-1]


def test_generate_serves_good_prompts_and_names_the_rejected_one(capsys, tiny_llama):
    code, out, err = run_cli(
        capsys, "generate", str(tiny_llama), "--prompt", "the city", "--prompt", "", "--max-tokens", "3"
    )
    assert_one_line_error(code, err, "prompt 2: the prompt is empty")
    assert err.count("finish:") == 1  # prompt 1 was still served


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be a positive integer"),
    ],
)
def test_generate_rejects_bad_sampling_parameters(capsys, tiny_llama, flags, fragment):
    code, _, err = run_cli(capsys, "generate", str(tiny_llama), "--prompt", "the city", *flags)
    assert_one_line_error(code, err, fragment)


def test_generate_rejects_a_prompt_longer_than_the_context(capsys, tiny_llama):
    long_prompt = " ".join(["the city river music"] * 200)  # well over the tiny model's 512 positions
    code, _, err = run_cli(capsys, "generate", str(tiny_llama), "--prompt", long_prompt)
    assert_one_line_error(code, err, "model's context holds 512")


def test_a_kv_budget_too_small_for_its_policy_is_named_by_its_flags(capsys, tiny_llama):
    code, _, err = run_cli(
        capsys, "generate", str(tiny_llama), "--prompt", "x", "--kv-policy", "window", "--kv-budget", "20"
    )
    assert_one_line_error(code, err, "--kv-budget 20 is too small for --kv-policy window: it keeps at least 32")
    code, out, _ = run_cli(
        capsys, "generate", str(tiny_llama), "--prompt", "the city", "--kv-policy", "snapkv", "--kv-budget", "64"
    )
    assert code == 0 and out


def test_an_int4_cache_on_a_head_dimension_it_cannot_rotate_is_one_line(capsys, tmp_path):
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(tmp_path / "hd24", hidden=96)  # 4 heads of 24
    code, _, err = run_cli(capsys, "generate", str(model), "--prompt", "x", "--kv-cache-dtype", "int4")
    assert_one_line_error(
        code,
        err,
        "power-of-two head dimension; this model's is 24 (use int8, calibrated by compress kv, or a float cache)",
    )


def test_generate_rejects_a_malformed_memory_size(capsys, tiny_llama):
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(tiny_llama), "--prompt", "x", "--kv-cache-memory", "lots"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'lots' is not a size; write e.g. 512M or 2G" in err.splitlines()[-1]


def test_without_group_size_the_largest_that_fits_is_used_and_said(capsys, tiny_llama, calib_txt, tmp_path):
    code, _, err = run_cli(capsys, "rtn", "--model", str(tiny_llama), "--out", str(tmp_path / "q"))
    assert code == 0, err
    assert "--group-size not given: using 32" in err  # in-dims 64 and 96: 128 and 64 do not divide both
    assert json.loads((tmp_path / "q" / "slimlm.json").read_text())["arguments"]["group_size"] == 32


def test_kv_then_generate_and_eval_on_the_quantized_cache(capsys, tiny_llama, calib_txt, tmp_path):
    out = tmp_path / "kv"
    code, _, err = run_cli(
        capsys,
        "kv",
        str(tiny_llama),
        "--kv-dtype",
        "int8",
        "--calib",
        str(calib_txt),
        "--num-samples",
        "8",
        "--seq-len",
        "32",
        "--out",
        str(out),
    )
    assert code == 0, err
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme["type"] == "int" and scheme["strategy"] == "attn_head"  # int8's default: per head
    code, _, err = run_cli(
        capsys,
        "generate",
        str(out),
        "--prompt",
        "the city",
        "--max-tokens",
        "4",
        "--speculative",
        "ngram",
        "--num-speculative-tokens",
        "2",
    )
    assert code == 0 and "drafts accepted" in err, err
    code, _, err = run_cli(capsys, "generate", str(tiny_llama), "--prompt", "x", "--kv-cache-dtype", "int8")
    assert_one_line_error(code, err, "has no KV-cache scales, which an int8 KV cache needs")


def test_kv_flags_that_do_not_fit_are_named(capsys, tiny_llama, out_dir, tmp_path):
    code, _, err = run_cli(capsys, "rtn", "--model", str(tiny_llama), "--kv-strategy", "tensor", "--out", out_dir)
    assert_one_line_error(code, err, "--kv-strategy applies to a quantized KV cache; add --kv-dtype")
    code, _, err = run_cli(
        capsys, "rtn", "--model", str(tiny_llama), "--kv-dtype", "fp8", "--format", "gptq", "--out", out_dir
    )
    assert_one_line_error(code, err, "--format gptq has no place for KV-cache scales")
    code, _, err = run_cli(
        capsys, "generate", str(tiny_llama), "--prompt", "x", "--speculative", "ngram", "--num-speculative-tokens", "99"
    )
    assert_one_line_error(code, err, "num_speculative_tokens must be an integer in 1..block_size (16)")
    code, _, err = run_cli(
        capsys, "generate", str(tiny_llama), "--prompt", "x", "--speculative", str(tmp_path / "no-such-draft")
    )
    assert_one_line_error(code, err, "unknown model")


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--port", "70000"], "--port 70000 is not a TCP port"),
        (["--kv-cache-memory", "1K"], "a KV cache pool of 1024 bytes holds less than one block"),
        (
            ["--kv-cache-memory", "64K", "--max-model-len", "512"],
            "fewer than one sequence of 512 tokens; give --kv-cache-memory at least 0.2 MiB or lower --max-model-len",
        ),
        (
            ["--speculative", "ngram", "--num-speculative-tokens", "99"],
            "num_speculative_tokens must be an integer in 1..",
        ),
    ],
)
def test_serve_refuses_bad_settings_before_listening(capsys, tiny_llama, flags, fragment):
    code, _, err = run_cli(capsys, "serve", str(tiny_llama), *flags)
    assert_one_line_error(code, err, fragment)


def test_serve_names_a_port_it_cannot_bind(capsys, tiny_llama):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", str(tiny_llama), "--port", str(port), "--kv-cache-memory", "4M")
    assert_one_line_error(code, err, f"could not serve on 127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize("command,flag", [("gptq", "--compute-dtype"), ("awq", "--search-dtype")])
def test_a_dtype_it_does_not_offer_is_refused(capsys, tiny_llama, out_dir, command, flag):
    with pytest.raises(SystemExit) as exc:
        main([command, "--model", str(tiny_llama), flag, "fp16", "--out", out_dir])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"{flag}: invalid choice: 'fp16' (choose from 'auto', 'float32', 'bfloat16')" in err.splitlines()[-1]
    assert not os.path.exists(out_dir)


def _numeric_options() -> list[tuple[str, list[str], str]]:
    """(command, its required arguments, flag) for every option of every command that parses a number."""
    import argparse

    from slimlm.cli import build_parser

    required = {
        "model": ["m"],
        "recipe": ["r.yaml"],
        "runs": ["run"],
        "--out": ["--out", "o"],
        "--prompt": ["--prompt", "p"],
        "--kv-heads": ["--kv-heads", "2"],
        "--kv-dtype": ["--kv-dtype", "fp8"],
        "--target-params": ["--target-params", "0.5"],
    }
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    found = []
    for command, parser in sub.choices.items():
        base = []
        for action in parser._actions:  # noqa: SLF001
            key = action.option_strings[0] if action.option_strings else action.dest
            if action.required or not action.option_strings and action.nargs is None:
                base += required[key] if key in required else []
        for action in parser._actions:  # noqa: SLF001
            words = getattr(action.type, "__name__", None) in ("task_list", "weight_format")
            if action.option_strings and action.type not in (None, str, Path) and not words and not action.choices:
                found.append((command, base, action.option_strings[0]))
    return found


NUMBERS = [
    "nan",
    "-nan",
    "inf",
    "-inf",
    "1e300",
    "1e400",
    "-1e400",
    "0",
    "-0",
    "-1",
    "1e-320",
    "0.5",
    "7",
    "2**70",
    str(2**70),
    "1_000",
    " 3",
    "0x10",
    "",
    "1e30",
]
ALLOWS_INF = {("bench", "--rate"), ("bench", "--slo-ttft"), ("bench", "--slo-itl")}  # all at once; no bound


@pytest.mark.parametrize("command,base,flag", _numeric_options(), ids=lambda v: v if isinstance(v, str) else "")
def test_no_numeric_option_lets_nan_or_an_unintended_inf_through(capsys, command, base, flag):
    """Any text given to a number flag is a parse error (exit 2, one argparse line) or a number the command
    can take: never NaN, and infinity only where it means something."""
    import math

    from slimlm.cli import build_parser

    for text in NUMBERS:
        try:
            args = build_parser().parse_args([command, *base, flag, text])
        except SystemExit as e:
            assert e.code == 2
            assert f"argument {flag}" in capsys.readouterr().err.splitlines()[-1]
            continue
        values = getattr(args, flag.lstrip("-").replace("-", "_"))
        for v in values if isinstance(values, list | tuple) else [values]:
            if isinstance(v, float):
                assert not math.isnan(v), (command, flag, text)
                assert math.isfinite(v) or (command, flag) in ALLOWS_INF, (command, flag, text)


def test_gqa_training_that_cannot_fit_is_one_line_and_writes_nothing(
    capsys, tiny_llama, calib_txt, tmp_path, monkeypatch
):
    """The training memory check (distill.check_memory) through the command: one line naming --train, exit 2,
    no --out, and nothing but its lock in the run directory."""
    monkeypatch.setattr(devices, "available_memory", lambda device: 1)
    out = tmp_path / "gqa"
    code, _, err = run_cli(
        capsys, "gqa", "--model", str(tiny_llama), "--kv-heads", "1", "--uptrain-tokens", "256", "--seq-len", "32",
        "--train-data", str(calib_txt), "--eval-data", str(calib_txt), "--calib", str(calib_txt),
        "--num-samples", "2", "--out", str(out),
    )  # fmt: skip
    assert_one_line_error(code, err, "gradients and AdamW moments")
    assert "--train, e.g. k_proj,v_proj" in err
    assert not out.exists()
    assert [p.name for p in (tmp_path / ".gqa.train").iterdir()] == [".lock"]  # the resumable run: no checkpoint


@pytest.mark.parametrize("command", ["gptq", "awq"])
def test_a_float_target_outside_zero_to_one_is_named_before_any_work(capsys, tiny_llama, out_dir, command):
    extra = ["--then", "gptq"] if command == "awq" else []
    flags = ["--group-size", "32", "--float-target", "1.5", *extra, "--out", out_dir]
    with pytest.raises(SystemExit):  # the flag's own check, as argparse says it
        run_cli(capsys, command, "--model", str(tiny_llama), *flags)
    assert capsys.readouterr().err.splitlines()[-1].endswith("argument --float-target: '1.5' must be in [0, 1]")
    assert not Path(out_dir).exists()


def test_a_negative_number_in_exponent_form_is_a_value_not_a_flag(capsys):
    with pytest.raises(SystemExit):
        main(["gptq", "--out", "o", "--float-target", "-1e-9"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("argument --float-target: '-1e-9' must be in [0, 1]")
