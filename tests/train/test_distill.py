"""The training loop: one step equals a hand-written KL + AdamW step, a run killed with SIGKILL resumes
and continues the same curve, 2 processes (gloo) give the 1-process curve, and bad budgets are named."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimlm import SlimlmError
from slimlm.train import gqa
from slimlm.train.distill import TrainConfig, check, distill_loss, lr_factor, train


@pytest.fixture
def pair(tiny_llama):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    student = copy.deepcopy(teacher)
    gqa.merge(student, [gqa.contiguous_groups(2, 1)] * 2)
    return student, teacher


def test_one_step_equals_a_hand_written_distillation_step(pair, tmp_path):
    student, teacher = pair
    reference = copy.deepcopy(student)
    windows = torch.randint(0, teacher.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(
        train_tokens=48,
        seq_len=24,
        global_batch=2,
        micro_batch=1,
        lr=1e-3,
        warmup=0.0,
        weight_decay=5.0,
        max_grad_norm=0.05,
        temperature=2.0,
        compute_dtype="float32",  # exact against the fp32 reference below, whatever the CPU
    )
    log = train(student, teacher, windows, config, tmp_path / "run", progress=False)

    t = config.temperature
    with torch.no_grad():
        p_teacher = torch.softmax(teacher(windows).logits / t, -1)
    log_student = torch.log_softmax(reference(windows).logits / t, -1)
    loss = (p_teacher * (p_teacher.log() - log_student)).sum(-1).mean() * t * t  # both windows, one mean
    loss.backward()
    assert log[-1]["loss"] == pytest.approx(loss.item(), rel=1e-4)  # both micro-batches' halves, summed
    params = [p for p in reference.parameters()]
    norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
    scale = min(1.0, config.max_grad_norm / (norm.item() + 1e-6))
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, config.lr  # AdamW's defaults; warmup of one step: the full lr
    with torch.no_grad():
        for p in params:
            g = p.grad * scale
            m, v = (1 - b1) * g, (1 - b2) * g * g
            p.mul_(1 - lr * config.weight_decay).sub_(lr * (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps))
    for (name, mine), theirs in zip(student.named_parameters(), params, strict=True):
        # 1% of one step (lr) where Adam's step is whole (|g| ≫ eps); 5% where the gradient is so near zero
        # that float sums in another order (the sliced head) move its normalised step. A wrong moment, bias
        # correction, clip or decay (5 × lr × |w| ≈ 1e-4) moves far more.
        tolerance = torch.where(theirs.grad.abs() * scale > 100 * eps, config.lr / 100, config.lr / 20)
        assert ((mine - theirs).abs() <= tolerance).all(), (name, (mine - theirs).abs().max())


def _plain_loss(hidden, head, teacher_hidden, teacher_head, ids, t, lm_weight):
    """The definition on whole logits: T²·KL(p_teacher ‖ p_student) at T, mixed with next-token CE."""
    logits = head(hidden)
    log_s = torch.log_softmax(logits / t, -1)
    log_t = torch.log_softmax(teacher_head(teacher_hidden) / t, -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean() * t * t
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return (1 - lm_weight) * kl + lm_weight * ce


@pytest.mark.parametrize("t,lm_weight", [(1.0, 0.0), (2.0, 0.0), (1.0, 0.25), (2.0, 0.25), (1.5, 1.0)])
def test_the_sliced_loss_and_its_gradients_equal_the_definition_on_whole_logits(monkeypatch, t, lm_weight):
    from slimlm.train import distill

    monkeypatch.setattr(distill, "LOGIT_ELEMENTS", 3 * 11)  # slices of 3 tokens: 10 tokens take 4, the last short
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    head, teacher_head = (torch.nn.Linear(7, 11, bias=False).double() for _ in range(2))
    ids = torch.randint(0, 11, (2, 5), generator=gen)
    loss = distill_loss(hidden, head, teacher_hidden, teacher_head, ids, t, lm_weight)
    grads = torch.autograd.grad(3 * loss, [hidden, head.weight])
    expected = _plain_loss(hidden, head, teacher_hidden, teacher_head, ids, t, lm_weight)
    expected_grads = torch.autograd.grad(3 * expected, [hidden, head.weight])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12) and expected.item() > 0
    for mine, theirs in zip(grads, expected_grads, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-14)
    assert distill_loss(hidden, head, hidden, head, ids, t, 0.0).item() == pytest.approx(0.0, abs=1e-12)
    head.weight.requires_grad_(False)  # a frozen head: no gradient for it, the hidden states' still exact
    (grad,) = torch.autograd.grad(distill_loss(hidden, head, teacher_hidden, teacher_head, ids, t, lm_weight), [hidden])
    assert torch.allclose(grad, expected_grads[0] / 3, rtol=1e-10, atol=1e-14)


def test_the_last_hidden_state_through_the_head_is_the_models_logits(pair):
    from slimlm.train.distill import final_hidden, mean_nll

    student, _ = pair
    x = torch.randint(0, student.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = student(x).logits
        assert torch.equal(student.lm_head(final_hidden(student, x)), logits)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert mean_nll(student, x, batch_size=1) == pytest.approx(nll.item(), rel=1e-6)


def test_the_learning_rate_warms_up_then_decays_to_zero():
    factors = [lr_factor(s, 10, 2) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0] and factors[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(a >= b for a, b in zip(factors[1:], factors[2:], strict=False))


@pytest.mark.parametrize(
    "config,windows,fragment",
    [
        (TrainConfig(train_tokens=100, seq_len=64, global_batch=8), 100, "less than one global batch (8 × 64 = 512"),
        (
            TrainConfig(train_tokens=10_000, seq_len=64, global_batch=8),
            20,
            "need 152 windows of 64, but the text gives 20",
        ),
        (TrainConfig(train_tokens=10_000, seq_len=64, global_batch=6, micro_batch=4), 200, "must split into 1 process"),
    ],
)
def test_budgets_and_batches_that_cannot_run_are_named(config, windows, fragment):
    with pytest.raises(SlimlmError, match=fragment.replace("(", r"\(")):
        check(config, windows)


def gqa_command(model, text, out, steps: int = 24) -> list[str]:
    return [
        "gqa",
        "--model",
        str(model),
        "--kv-heads",
        "1",
        "--calib",
        str(text),
        "--train-data",
        str(text),
        "--eval-data",
        str(text),
        "--uptrain-tokens",
        str(steps * 4 * 32),
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
        "--checkpoint-every",
        "4",
        "--eval-every",
        "8",
        "--num-samples",
        "4",
        "--out",
        str(out),
    ]


def losses(out) -> list[float]:
    return [e["loss"] for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in e]


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama, calib_txt, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "straight"
    subprocess.run(
        [sys.executable, "-m", "slimlm.cli", *gqa_command(tiny_llama, calib_txt, out)],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return out


def kill_after(command: list[str], env: dict, run_log, lines: int) -> None:
    """Start the run and SIGKILL it once its log has `lines` lines."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while not (run_log.exists() and len(run_log.read_text().splitlines()) >= lines):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_killed_run_resumes_from_its_checkpoint_and_continues_the_same_curve(
    tiny_llama, calib_txt, tmp_path, uninterrupted
):
    out = tmp_path / "killed"
    run_log = tmp_path / ".killed.train" / "log.jsonl"
    command = [sys.executable, "-m", "slimlm.cli", *gqa_command(tiny_llama, calib_txt, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    kill_after(command, env, run_log, 11)  # past the checkpoint at step 8
    assert not out.exists() and (tmp_path / ".killed.train" / "checkpoint" / "state.json").exists()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert losses(out) == pytest.approx(losses(uninterrupted), rel=1e-6, abs=1e-9)
    assert len(losses(out)) == 24 and (out / "curve.png").stat().st_size > 0


def test_two_processes_give_the_one_process_curve(tiny_llama, calib_txt, tmp_path, uninterrupted):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        "-m",
        "slimlm.cli",
        *gqa_command(tiny_llama, calib_txt, out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on 2 process(es)" in done.stderr
    mine, theirs = losses(out), losses(uninterrupted)
    assert len(mine) == 24 and mine == pytest.approx(theirs, rel=1e-4)  # float sums in another order
    assert math.isfinite(json.loads((out / "slimlm.json").read_text())["training"]["log"][-1]["eval_ppl"])


def explode_at_the_third_step(monkeypatch) -> None:
    """An infinite learning rate for the third update: step 4's loss is not finite, on any CPU and in any
    dtype (the loss's gradients are bounded, so a merely large --lr no longer overflows everywhere)."""
    from slimlm.train import distill

    real = distill.lr_factor
    monkeypatch.setattr(distill, "lr_factor", lambda s, *args: math.inf if s == 2 else real(s, *args))


def test_a_checkpoint_resumes_only_the_same_source_options_and_data(
    tiny_llama, calib_txt, tmp_path, capsys, monkeypatch
):
    """A diverged run stops at step 4 and leaves its step-2 checkpoint; a rerun that differs in the source's
    weights, the conversion or the text is refused by name, one that does not resumes (and diverges again, at
    the same step)."""
    from slimlm.cli import main
    from tests.conftest import make_text, make_tiny_llama

    out = tmp_path / "o"
    other_text = tmp_path / "other.txt"
    other_text.write_text(make_text(300, seed=7))
    other_model = make_tiny_llama(tmp_path / "other-model", seed=123)
    data = tmp_path / "data.txt"
    data.write_text(calib_txt.read_text())

    def run(model=tiny_llama, text=data, kv_heads="2"):
        argv = gqa_command(model, calib_txt, out, steps=8)
        argv[argv.index("--train-data") + 1] = str(text)
        argv[argv.index("--kv-heads") + 1] = kv_heads
        argv += ["--checkpoint-every", "2", "--global-batch", "2", "--micro-batch", "1"]
        code = main(argv)
        return code, capsys.readouterr().err.splitlines()[-1]

    explode_at_the_third_step(monkeypatch)
    code, err = run()
    assert code == 2 and "training diverged at step 4" in err and "a rerun resumes from step 2" in err
    for changed, word in (
        (dict(model=other_model), "source"),
        (dict(text=other_text), "train_data"),
        (dict(kv_heads="1"), "arguments"),
    ):
        code, err = run(**changed)
        assert code == 2 and f"holds a run with another {word} than this one" in err, err
    data.write_text(other_text.read_text())  # the same file name, other text
    code, err = run()
    assert code == 2 and "holds a run with another train_data than this one" in err, err
    data.write_text(calib_txt.read_text())
    code, err = run()
    assert code == 2 and "training diverged at step 4" in err  # resumed: the same run, the same divergence


def test_a_divergence_in_the_last_update_is_caught_before_anything_is_written(
    tiny_llama, calib_txt, tmp_path, capsys, monkeypatch
):
    """The last update cannot be checked by the next step's loss (there is none): an infinite learning rate in
    it leaves weights that are not finite. Nothing is written, and the message names --lr."""
    from slimlm.cli import main
    from slimlm.train import distill

    real = distill.lr_factor
    monkeypatch.setattr(distill, "lr_factor", lambda s, steps, *a: math.inf if s == steps - 1 else real(s, steps, *a))
    out = tmp_path / "o"
    assert main([*gqa_command(tiny_llama, calib_txt, out, steps=4), "--warmup", "0"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "error: training diverged at step 4 (model." in err and "lower the learning rate, --lr (" in err, err
    assert not out.exists()


@pytest.mark.parametrize("lr", ["1e39", "2", "0", "-1"])
def test_a_learning_rate_outside_0_1_is_refused_before_any_work(tiny_llama, calib_txt, tmp_path, capsys, lr):
    from slimlm.cli import main

    assert main([*gqa_command(tiny_llama, calib_txt, tmp_path / "o", steps=4), "--lr", lr]) == 2
    err = capsys.readouterr().err
    assert f"--lr must be in (0, 1], got {float(lr)}" in err and err.count("\n") == 1


def test_two_runs_never_train_in_one_run_directory(tiny_llama, calib_txt, tmp_path, capsys):
    from slimlm.cli import main
    from slimlm.formats import atomic

    out = tmp_path / "o"
    with atomic.hold(tmp_path / ".o.train", "held"):
        assert main(gqa_command(tiny_llama, calib_txt, out, steps=2)) == 2
    assert "another run is training in" in capsys.readouterr().err and not out.exists()


# Kill -9 inside the second checkpoint's write (step 8), at each point where a file or a rename is half done:
# the process patches its own writer to die there, so the point is exact on any machine.
DIE_PREAMBLE = """import os, signal, sys
from slimlm.cli import main
from slimlm.formats import atomic
from slimlm.train import distill
calls = []
def die():
    os.kill(os.getpid(), signal.SIGKILL)
"""
DIE_IN_CHECKPOINT = {  # the point -> the checkpoint the rerun resumes from
    ("half of state.safetensors", 4): """
real = distill.save_file
def save_file(tensors, path):
    real(tensors, path)
    if calls.append(path) or len(calls) == 2:
        data = open(path, 'rb').read()
        open(path, 'wb').write(data[: len(data) // 2])
        die()
distill.save_file = save_file
""",
    ("before state.json", 4): """
real = distill.save_file
def save_file(tensors, path):
    real(tensors, path)
    if calls.append(path) or len(calls) == 2:
        die()
distill.save_file = save_file
""",
    ("after the exchange, before the old copy is removed", 8): """
real = atomic.shutil.rmtree
def rmtree(path, *args, **kwargs):
    if '.checkpoint.tmp-' in str(path):
        die()
    real(path, *args, **kwargs)
atomic.shutil.rmtree = rmtree
""",
}


@pytest.mark.parametrize("point,resumes_at", DIE_IN_CHECKPOINT, ids=[p for p, _ in DIE_IN_CHECKPOINT])
def test_a_run_killed_inside_a_checkpoint_write_resumes_the_same_curve(
    tiny_llama, calib_txt, tmp_path, point, resumes_at, uninterrupted
):
    out = tmp_path / "killed"
    argv = gqa_command(tiny_llama, calib_txt, out)
    script = f"{DIE_PREAMBLE}{DIE_IN_CHECKPOINT[point, resumes_at]}\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_dir = tmp_path / ".killed.train"
    assert not out.exists() and json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == resumes_at
    done = subprocess.run([sys.executable, "-m", "slimlm.cli", *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert losses(out) == pytest.approx(losses(uninterrupted), rel=1e-6, abs=1e-9)
    assert not run_dir.exists() and not list(tmp_path.glob(".*.tmp-*"))  # nothing of the killed write is left


def test_the_curve_plots_loss_and_evaluation_perplexity_against_tokens(tmp_path, monkeypatch):
    """The figure itself: training loss on the left axis, the evaluation perplexity (the step-0 one included)
    on a log-scaled right axis, both against training tokens, labelled, at 840×480 pixels."""
    import struct

    import matplotlib.pyplot as plt

    from slimlm.train.distill import plot

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to look at
    log = [
        {"step": 0, "tokens": 0, "eval_ppl": 90.0},
        {"step": 1, "tokens": 64, "loss": 2.0},
        {"step": 2, "tokens": 128, "loss": 1.5, "eval_ppl": 40.0},
    ]
    plot(log, tmp_path / "curve.png")
    (fig,) = kept
    left, right = fig.axes
    (loss,), (ppl,) = left.get_lines(), right.get_lines()
    assert list(loss.get_xdata()) == [64, 128] and list(loss.get_ydata()) == [2.0, 1.5]
    assert list(ppl.get_xdata()) == [0, 128] and list(ppl.get_ydata()) == [90.0, 40.0]
    assert (ppl.get_marker(), ppl.get_linestyle(), ppl.get_color()) == ("o", "-", "C1")
    assert (left.get_xlabel(), left.get_ylabel(), right.get_ylabel()) == (
        "training tokens",
        "loss (distillation)",
        "evaluation perplexity (log)",
    )
    assert right.get_yscale() == "log" and left.get_yscale() == "linear"
    legend = left.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["training loss", "evaluation perplexity"]
    assert legend._loc == 1  # upper right
    header = (tmp_path / "curve.png").read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (840, 480)
    close(fig)


class Interrupted(Exception):
    pass


def test_the_loop_logs_checkpoints_and_resumes_in_process(pair, tmp_path, monkeypatch, capsys):
    """6 steps of 2 windows, a checkpoint every 2, an evaluation every 3: the log's every entry (step 0 is the
    evaluation before training), the checkpoint kept, the progress bar; then a run interrupted after step 5
    resumes from its step-4 checkpoint to the same log and weights, bit for bit."""
    from slimlm.train import distill

    student, teacher = pair
    start = copy.deepcopy(student)
    windows = torch.randint(0, teacher.config.vocab_size, (12, 16), generator=torch.Generator().manual_seed(2))
    config = TrainConfig(
        train_tokens=6 * 2 * 16,
        seq_len=16,
        global_batch=2,
        micro_batch=1,
        lr=1e-3,
        warmup=0.3,
        checkpoint_every=2,
        eval_every=3,
    )

    def evaluate(model):
        return {"eval_ppl": math.exp(distill.mean_nll(model, windows[:2]))}

    run = tmp_path / "runs" / "run"  # its parent made too
    log = train(student, teacher, windows, config, run, evaluate=evaluate)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any(
        line.startswith("training: 100%")
        and "6/6" in line
        and "step/s" in line
        and "loss=" in line
        and "tok_s=" in line
        for line in bar
    ), bar[-3:]
    assert [e["step"] for e in log] == list(range(7)) and log[0].keys() == {"step", "tokens", "eval_ppl"}
    warmup = round(0.3 * 6)
    for e in log[1:]:
        assert e["tokens"] == e["step"] * 2 * 16
        assert e["lr"] == pytest.approx(1e-3 * distill.lr_factor(e["step"] - 1, 6, warmup))
        assert {"loss", "lr", "grad_norm"} <= e.keys() and ("eval_ppl" in e) == (e["step"] in (3, 6))
        assert math.isfinite(e["loss"]) and e["grad_norm"] > 0
    assert [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()] == log
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4  # the last checkpoint before the end (none at the end: the run is complete)
    other = TrainConfig(**{**vars(config), "lr": 2e-3})
    message = f"{run} holds a run with another training options than this one; delete it or rerun with the same ones"
    with pytest.raises(SlimlmError, match=f"^{re.escape(message)}$"):
        train(copy.deepcopy(start), teacher, windows, other, run, progress=False)

    real_append, appended = distill._append_log, []

    def interrupt_after_step_5(run_dir, entry):
        real_append(run_dir, entry)
        appended.append(entry["step"])
        if appended.count(5) == 1 and entry["step"] == 5:
            raise Interrupted

    monkeypatch.setattr(distill, "_append_log", interrupt_after_step_5)
    interrupted = copy.deepcopy(start)
    with pytest.raises(Interrupted):
        train(interrupted, teacher, windows, config, tmp_path / "again", evaluate=evaluate, progress=False)
    resumed = copy.deepcopy(start)
    again = train(resumed, teacher, windows, config, tmp_path / "again", evaluate=evaluate, progress=False)
    assert appended == [0, 1, 2, 3, 4, 5, 5, 6]  # resumed after step 4: 5 is redone
    assert again == log
    assert [json.loads(line) for line in (tmp_path / "again" / "log.jsonl").read_text().splitlines()] == log
    for (name, mine), theirs in zip(resumed.named_parameters(), student.parameters(), strict=True):
        assert torch.equal(mine, theirs), name

    from safetensors.torch import load_file, save_file

    checkpoint = run / "checkpoint" / "state.safetensors"
    tensors = load_file(checkpoint)
    gone = sorted(k for k in tensors if k.startswith("model."))[:4]
    save_file({k: v for k, v in tensors.items() if k not in gone}, checkpoint)
    lacking = sorted(k[len("model.") :] for k in gone)[:3]
    with pytest.raises(SlimlmError, match=re.escape(f"lacks {lacking}; delete the run directory")):
        train(copy.deepcopy(start), teacher, windows, config, run, progress=False)


def test_train_parts_that_match_nothing_are_named(pair):
    from slimlm.train.distill import trainable

    with pytest.raises(SlimlmError, match="^train nope,nada matches no parameter of the model$"):
        trainable(pair[0], ("nope", "nada"))
    assert [p.requires_grad for p in trainable(pair[0], ("k_proj",))] == [True] * 2  # one k_proj a layer


def test_a_run_that_cannot_fit_is_refused_before_it_starts_and_one_that_fits_recomputed_recomputes(
    pair, tmp_path, monkeypatch, capsys
):
    """Three fp32 copies of the trained parameters (a gradient, two moments) and a micro-batch's activations
    against the memory free now, for each process sharing it: the run goes as it is when all fit, recomputes
    its layers in the backward pass (the same step, less memory) when only the recomputed activations fit, and
    is refused before any step or file when not even those fit."""
    from slimlm import devices
    from slimlm.train.distill import activation_bytes, check_memory

    student, teacher = pair
    kv = [p for n, p in student.named_parameters() if "k_proj" in n or "v_proj" in n]
    need = 3 * 4 * sum(p.numel() for p in kv)
    plain, recomputed = activation_bytes(student.config, 2 * 24)
    assert recomputed < plain
    free = {"bytes": need + plain}
    monkeypatch.setattr(devices, "available_memory", lambda device: free["bytes"])
    assert check_memory(kv, torch.device("cpu"), activations=(plain, recomputed)) is False  # exactly fits
    free["bytes"] = need + plain - 1
    assert check_memory(kv, torch.device("cpu"), activations=(plain, recomputed)) is True
    free["bytes"] = need + recomputed
    assert check_memory(kv, torch.device("cpu"), activations=(plain, recomputed)) is True
    with pytest.raises(SlimlmError, match=r"^training 0\.00 B parameters needs .* GiB for their gradients"):
        check_memory(kv, torch.device("cpu"), processes=2, activations=(plain, recomputed))
    free["bytes"] = need + recomputed - 1
    with pytest.raises(SlimlmError, match=r"free on cpu; train part of the model \(--train, e.g. k_proj,v_proj\)"):
        check_memory(kv, torch.device("cpu"), activations=(plain, recomputed))

    windows = torch.randint(0, teacher.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    config = TrainConfig(
        train_tokens=48, seq_len=24, global_batch=2, micro_batch=2, train=("k_proj", "v_proj"), compute_dtype="float32"
    )
    before = copy.deepcopy(student.state_dict())
    reference = copy.deepcopy(student)
    with pytest.raises(SlimlmError, match="gradients and AdamW moments"):
        train(student, teacher, windows, config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())
    free["bytes"] = need + recomputed  # fits with each layer recomputed: the same step
    train(student, teacher, windows, config, tmp_path / "run", progress=True)
    assert "each layer is recomputed in the backward pass" in capsys.readouterr().err
    assert not student.is_activation_checkpointing  # left as it was
    free["bytes"] = need + plain
    train(reference, teacher, windows, config, tmp_path / "plain", progress=True)
    assert "recomputed" not in capsys.readouterr().err
    for (name, mine), theirs in zip(student.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6, rtol=0), name
    assert not all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_passes_run_in_the_fast_dtype_or_the_one_asked_for(pair, tmp_path, monkeypatch):
    """auto is bf16 autocast where bf16 products are fast, else fp32; bfloat16 runs the passes under bf16
    autocast with the weights still fp32, so the same first step's loss moves by its rounding and no more."""
    from slimlm import devices
    from slimlm.train.distill import compact_teacher, precision

    for fast, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(devices, "fast_bf16_matmul", lambda device, fast=fast: fast)
        assert precision(TrainConfig(train_tokens=1)) == dtype
    assert precision(TrainConfig(train_tokens=1, compute_dtype="bfloat16")) == torch.bfloat16
    assert precision(TrainConfig(train_tokens=1, compute_dtype="float32")) == torch.float32
    student, teacher = pair
    windows = torch.randint(0, teacher.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = {}
    for dtype in ("float32", "bfloat16"):
        config = TrainConfig(train_tokens=48, seq_len=24, global_batch=2, micro_batch=1, compute_dtype=dtype)
        trained = copy.deepcopy(student)
        losses[dtype] = train(trained, teacher, windows, config, tmp_path / dtype, progress=False)
        assert {p.dtype for p in [*trained.parameters(), *teacher.parameters()]} == {torch.float32}
    first = {dtype: log[0]["loss"] for dtype, log in losses.items()}
    assert first["float32"] != first["bfloat16"] and first["bfloat16"] == pytest.approx(first["float32"], rel=0.05)
    # the teacher's linears held in bf16 under bf16 autocast: the same products, the same run
    compact_teacher(teacher, config)
    assert teacher.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert teacher.model.embed_tokens.weight.dtype == teacher.model.norm.weight.dtype == torch.float32
    assert teacher.lm_head.weight is teacher.model.embed_tokens.weight  # tied: kept fp32 with the embeddings
    log = train(copy.deepcopy(student), teacher, windows, config, tmp_path / "compact", progress=False)
    assert [e["loss"] for e in log] == [e["loss"] for e in losses["bfloat16"]]
