"""One training loop for uptraining and distillation, on accelerate.

The student learns the teacher's next-token distributions: loss = T² · KL(teacher_T ‖ student_T) per token
(T the temperature), optionally mixed with the language-model loss on the text itself. The teacher is the
model before the change, run without gradients on the same windows; its logits are computed on the fly
rather than cached: a cache would hold vocab-size floats per token (49152 × 2 bytes ≈ 100 KB per token for
the default model, 10 GB per 100 K tokens), while one teacher forward costs a third of a training step.

One optimizer step consumes `global_batch` windows, split over the processes and then into micro-batches
(gradient accumulation), so the same global batch gives the same loss curve on 1 process or many (DDP via
`accelerate launch`; the same code on CPU, one GPU or many). AdamW, linear warmup then cosine decay,
gradient clipping, bf16 autocast where the device has it. The data order is fixed by the seed, and every
`checkpoint_every` steps the model, optimizer, scheduler, RNG and step are written atomically to the run
directory (safetensors and JSON, no pickle): the same command after a kill resumes there and continues
the same curve. The log is JSON lines (step, tokens, loss, lr, grad norm, eval); the curve is a PNG.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from slimlm import devices
from slimlm.errors import FieldError, SlimlmError
from slimlm.formats.atomic import staging
from slimlm.formats.writer import state_tensors


@dataclass
class TrainConfig:
    train_tokens: int  # the budget: steps = train_tokens // (global_batch * seq_len)
    seq_len: int = 512
    global_batch: int = 8  # windows per optimizer step, over all processes and micro-batches
    micro_batch: int = 2  # windows per forward pass
    lr: float = 1e-4
    warmup: float = 0.05  # fraction of the steps
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    lm_weight: float = 0.0  # 0: pure distillation; 1: pure language-model loss
    train: tuple[str, ...] = ()  # parameter-name parts to train (e.g. k_proj, v_proj); empty: all
    checkpoint_every: int = 25
    eval_every: int = 25
    seed: int = 0
    compute_dtype: str = "auto"  # the passes' dtype (devices.COMPUTE_DTYPES); the trained weights stay fp32

    @property
    def steps(self) -> int:
        return self.train_tokens // (self.global_batch * self.seq_len)


def precision(config: TrainConfig) -> torch.dtype:
    """The dtype the passes run in: auto is bf16 autocast where bf16 products are fast (GPUs with bf16, CPUs
    with AVX-512 BF16 or AMX), else fp32. The student's weights stay fp32, and so do the teacher's embeddings
    and norms (compact_teacher): a teacher held wholly in bf16 runs its residual stream in bf16, and the
    student learned from it far worse (benchmarks/gqa.py --parts precision)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return devices.compute_dtype(config.compute_dtype, torch.float32, device)


def compact_teacher(teacher: nn.Module, config: TrainConfig) -> None:
    """Under bf16 autocast, the teacher's linear weights held in bf16: autocast multiplies in bf16 anyway, so
    the products are the same (tested) at half the memory (the 1.5B: 2.6 GB), and its embeddings and norms
    stay fp32, so its residual stream does too. In place: for a teacher that nothing needs after the run."""
    if precision(config) == torch.bfloat16:
        embeddings = teacher.get_input_embeddings().weight  # a head tied to them stays fp32 with them
        for module in teacher.modules():
            if isinstance(module, nn.Linear) and module.weight is not embeddings:
                module.to(torch.bfloat16)


def autocast(config: TrainConfig, device: torch.device):
    """The passes in their precision: bf16 autocast (fp32 weights, bf16 products) or plain. Not accelerate's
    mixed_precision: its state is per process, and one process may train with several configs."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision(config) == torch.bfloat16)


LOGIT_ELEMENTS = 2**25  # logits in one slice of tokens (128 MiB of fp32): 220 tokens at the 1.5B's 151,936


def final_hidden(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's normed output [B, S, H], through the model's own forward (so DDP sees the
    pass) but without its head: `logits_to_keep` of no position computes no logits at all."""
    none = torch.zeros(0, dtype=torch.long, device=x.device)
    return model(x, output_hidden_states=True, logits_to_keep=none, use_cache=False).hidden_states[-1]


def _slices(tokens: int, vocab: int) -> list[slice]:
    rows = max(1, LOGIT_ELEMENTS // vocab)
    return [slice(start, start + rows) for start in range(0, tokens, rows)]


class _HeadLoss(torch.autograd.Function):
    """distill_loss from the last hidden states through both heads, a slice of tokens at a time: the logits
    are never whole (1,024 tokens × 151,936 fp32 logits are 622 MB and the loss needs several such arrays),
    and each slice's gradient is taken with it (softmax minus target), so the backward pass recomputes
    nothing; it only scales what the forward pass kept: the gradients of the hidden states and the head."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, temperature, lm_weight):
        t = temperature
        h, ht = hidden.flatten(0, 1), teacher_hidden.flatten(0, 1)
        tokens, scored = len(h), int((targets >= 0).sum())
        grad_h = torch.zeros_like(h)
        exact = torch.promote_types(h.dtype, torch.float32)  # softmax and sums at least in fp32
        grad_w = torch.zeros_like(weight, dtype=exact) if ctx.needs_input_grad[1] else None
        kl, ce = h.new_zeros((), dtype=exact), h.new_zeros((), dtype=exact)
        for rows in _slices(tokens, len(weight)):
            z = F.linear(h[rows], weight).to(exact)
            log_q = F.log_softmax(z / t, dim=-1)
            log_p = F.log_softmax(F.linear(ht[rows], teacher_weight).to(exact) / t, dim=-1)
            p = log_p.exp()
            kl += (p * (log_p - log_q)).sum()
            # d/dz of T²·KL(p ‖ softmax(z/T)) is T·(softmax(z/T) − p)
            grad_z = (log_q.exp() - p) * ((1 - lm_weight) * t / tokens)
            if lm_weight:
                log_s = log_q if t == 1 else F.log_softmax(z, dim=-1)
                kept = targets[rows] >= 0  # the window's last token has no next token to predict
                index = targets[rows][kept].unsqueeze(1)
                ce -= log_s[kept].gather(1, index).sum()
                one_hot = torch.zeros_like(log_s[kept]).scatter_(1, index, 1.0)
                grad_z[kept] += (log_s[kept].exp() - one_hot) * (lm_weight / scored)
            grad_h[rows] = (grad_z.to(weight.dtype) @ weight).to(h.dtype)
            if grad_w is not None:
                grad_w += grad_z.t() @ h[rows].to(exact)
        ctx.save_for_backward(grad_h.view_as(hidden), grad_w)
        ctx.weight_dtype = weight.dtype
        loss = (1 - lm_weight) * kl * t * t / tokens
        return loss + lm_weight * ce / scored if lm_weight else loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_h * grad_loss, grad_w, None, None, None, None, None


def distill_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    teacher_hidden: torch.Tensor,
    teacher_head: nn.Linear,
    ids: torch.Tensor,
    temperature: float,
    lm_weight: float,
) -> torch.Tensor:
    """Mean over tokens of T²·KL(p_teacher ‖ p_student) at temperature T, mixed with next-token cross entropy,
    from the models' last hidden states [B, S, H] and their (bias-free) heads."""
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], dim=1).flatten()
    return _HeadLoss.apply(hidden, head.weight, teacher_hidden, teacher_head.weight, targets, temperature, lm_weight)


@torch.no_grad()
def mean_nll(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token negative log-likelihood of `windows` (exp of it is the perplexity), the logits a slice
    of tokens at a time."""
    head = model.get_output_embeddings()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        x = windows[start : start + batch_size].to(head.weight.device)
        h, targets = final_hidden(model, x)[:, :-1].flatten(0, 1), x[:, 1:].flatten()
        for rows in _slices(len(h), len(head.weight)):
            total += F.cross_entropy(head(h[rows]).float(), targets[rows], reduction="sum").item()
        count += len(h)
    return total / count


def lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """Linear warmup to 1, then cosine decay toward 0 (reached one step after the last)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * progress))


def trainable(model: nn.Module, parts: tuple[str, ...]) -> list[nn.Parameter]:
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(not parts or any(part in name for part in parts))
        if p.requires_grad:
            params.append(p)
    if not params:
        raise FieldError("train", f"{','.join(parts)} matches no parameter of the model")
    return params


def check(config: TrainConfig, num_windows: int, num_processes: int = 1) -> None:
    """One-line errors for a budget or batch shape that cannot run, before anything is loaded or trained."""
    per_process, rest = divmod(config.global_batch, num_processes)
    if rest or per_process % config.micro_batch:
        raise SlimlmError(
            f"the global batch {config.global_batch} must split into {num_processes} process(es) "
            f"× micro-batches of {config.micro_batch}"
        )
    tokens_per_step = config.global_batch * config.seq_len
    if config.steps < 1:
        raise SlimlmError(
            f"a training budget of {config.train_tokens} tokens is less than one global batch "
            f"({config.global_batch} × {config.seq_len} = {tokens_per_step} tokens)"
        )
    if config.steps * config.global_batch > num_windows:
        need = config.steps * config.global_batch
        raise SlimlmError(
            f"{config.train_tokens} training tokens need {need} windows of {config.seq_len}, but the "
            f"text gives {num_windows}: lower the budget or add text"
        )


def _backward(
    accelerator, student: nn.Module, teacher: nn.Module, mine: torch.Tensor, config: TrainConfig
) -> torch.Tensor:
    """One optimizer step's passes over this process's windows `mine`, micro-batch by micro-batch: the
    gradients accumulated in the student; returns the step's loss."""
    micro_steps = len(mine) // config.micro_batch
    head, teacher_head = accelerator.unwrap_model(student).get_output_embeddings(), teacher.get_output_embeddings()
    total = torch.zeros((), device=accelerator.device)
    for m in range(micro_steps):
        x = mine[m * config.micro_batch : (m + 1) * config.micro_batch].to(accelerator.device)
        with torch.no_grad(), autocast(config, accelerator.device):
            target = final_hidden(teacher, x)
        last = m == micro_steps - 1  # gradients are averaged over processes once, on the last micro-batch
        with nullcontext() if last else accelerator.no_sync(student), autocast(config, accelerator.device):
            hidden = final_hidden(student, x)
            loss = distill_loss(hidden, head, target, teacher_head, x, config.temperature, config.lm_weight)
            loss = loss / micro_steps
        accelerator.backward(loss)
        total += loss.detach()
    return total


def _diverged(step: int, start: int, config: TrainConfig, what: str) -> FieldError:
    saved = max(start, min(step, config.steps - 1) // config.checkpoint_every * config.checkpoint_every)
    resume = f"a rerun resumes from step {saved}" if saved else "no checkpoint was reached"
    advice = f"nothing written; lower the learning rate, {{lr}} ({resume})"
    return FieldError("lr", f"training diverged at step {step + 1} ({what}): {advice}")


def _check_final(student: nn.Module, log: list[dict], step: int, start: int, config: TrainConfig) -> None:
    """The last update is checked after it is made: every weight finite, and the last evaluation too (a model
    whose weights are 1e30 is finite and useless: its perplexity is not)."""
    bad = next((name for name, p in student.named_parameters() if not torch.isfinite(p).all()), None)
    scores = {k: v for k, v in (log[-1] if log else {}).items() if k.startswith("eval")}
    if bad is not None:
        raise _diverged(step, start, config, f"{bad} is not finite after the last update")
    if any(not math.isfinite(v) for v in scores.values()):
        raise _diverged(step, start, config, f"the final evaluation is {scores}")


def activation_bytes(config, tokens: int) -> tuple[int, int]:
    """An upper estimate of what one micro-batch of `tokens` keeps for its backward pass: plainly, and with
    each decoder layer recomputed there (gradient checkpointing: only the layers' inputs are kept). Per token
    and layer a pass keeps about 10 hidden-wide and 4 MLP-wide fp32 tensors (the norms' and projections'
    inputs, q, k, v, the attention output, the MLP's gate, up and product); the head's slices on top."""
    hidden, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    layer = tokens * (10 * hidden + 4 * ffn) * 4
    head = 6 * min(tokens * config.vocab_size, LOGIT_ELEMENTS) * 4  # a slice's logits, both distributions, ...
    return layers * layer + head, layers * tokens * hidden * 4 + layer + head


def check_memory(
    params: list[nn.Parameter], device: torch.device, processes: int = 1, activations: tuple[int, int] = (0, 0)
) -> bool:
    """Whether the run must recompute its layers in the backward pass to fit (gradient checkpointing), or a
    one-line refusal, before the first step, of a run whose trained parameters' gradients and AdamW moments
    (three copies of them) and `activation_bytes` do not fit in what is free now, the models loaded, for each
    of `processes` sharing this memory: without this the first step is killed for memory minutes in, with no
    message (the 1.5B at 24 GB)."""
    count = sum(p.numel() for p in params)
    optimizer = sum(3 * p.numel() * p.element_size() for p in params)
    free = devices.available_memory(device)
    plain, recomputed = activations
    if processes * (optimizer + plain) <= free:
        return False
    if processes * (optimizer + recomputed) <= free:
        return True
    raise SlimlmError(
        f"training {count / 1e9:.2f} B parameters needs {processes * optimizer / 2**30:.1f} GiB for their gradients "
        f"and AdamW moments and {processes * recomputed / 2**30:.1f} GiB of activations (each layer recomputed), "
        f"and {free / 2**30:.1f} GiB is free on {device}; train part of the model (--train, e.g. k_proj,v_proj), "
        "lower --micro-batch or --seq-len, or use a machine with more memory"
    )


def _fit_memory(accelerator, student: nn.Module, params: list[nn.Parameter], config: TrainConfig, progress: bool):
    """check_memory for this run; when only recomputed layers fit, turns recomputation on and says so."""
    sharing = accelerator.num_processes if accelerator.device.type == "cpu" else 1
    activations = activation_bytes(student.config, config.micro_batch * config.seq_len)
    recompute = check_memory(params, accelerator.device, sharing, activations)
    if recompute:  # ~1/3 more work: the layers run twice
        student.activation_checkpointing_enable({"use_reentrant": False})
        if progress and accelerator.is_main_process:
            print(
                f"training: the activations of {config.micro_batch}×{config.seq_len} tokens "
                f"(~{activations[0] / 2**30:.1f} GiB) do not fit beside the models: each layer is recomputed "
                "in the backward pass (gradient checkpointing)",
                file=sys.stderr,
                flush=True,
            )
    return recompute


def _optimizer(student: nn.Module, config: TrainConfig):
    """The trained parameters, AdamW over them, and the warmup-then-cosine schedule."""
    params = trainable(student, config.train)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, round(config.warmup * config.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config.steps, warmup))
    return params, optimizer, scheduler


def _evaluated(accelerator, student: nn.Module, evaluate: Callable[[nn.Module], dict], config: TrainConfig) -> dict:
    """evaluate(student), in eval mode, on the main process while the others wait: {} on the others."""
    figures = {}
    if accelerator.is_main_process:
        student.eval()
        with autocast(config, accelerator.device):  # the model as it trains: in its compute dtype
            figures = evaluate(accelerator.unwrap_model(student))
        student.train()
    accelerator.wait_for_everyone()
    return figures


def train(
    student: nn.Module,
    teacher: nn.Module,
    windows: torch.Tensor,
    config: TrainConfig,
    run_dir: Path,
    evaluate: Callable[[nn.Module], dict] | None = None,
    progress: bool = True,
    identity: dict | None = None,
) -> list[dict]:
    """Train `student` in place toward `teacher` on `windows` [N, seq_len]; returns the log (one dict per
    step). Resumes from run_dir's checkpoint when one is there, written by the same configuration and the same
    `identity` (what else the caller's run is: its source, its options, its data)."""
    from accelerate import Accelerator
    from tqdm import tqdm

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    check(config, len(windows), accelerator.num_processes)
    run_dir = Path(run_dir)
    params, optimizer, scheduler = _optimizer(student, config)
    recompute = _fit_memory(accelerator, student, params, config, progress)
    teacher.requires_grad_(False).eval().to(accelerator.device)
    student.train()
    student, optimizer = accelerator.prepare(student, optimizer)
    main = accelerator.is_main_process
    fingerprint = {**_fingerprint(config), "identity": identity or {}}
    start, log = _resume(run_dir, fingerprint, accelerator.unwrap_model(student), optimizer, scheduler, main)
    if start == 0 and evaluate is not None:  # where the curve starts: the changed model before training
        figures = _evaluated(accelerator, student, evaluate, config)
        if main:
            log.append({"step": 0, "tokens": 0, **figures})
            _append_log(run_dir, log[-1])

    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(config.seed))
    per_process = config.global_batch // accelerator.num_processes
    rank = accelerator.process_index
    bar = tqdm(total=config.steps, initial=start, desc="training", unit="step", disable=not (progress and main))
    clock = time.perf_counter()
    for step in range(start, config.steps):
        batch = order[step * config.global_batch : (step + 1) * config.global_batch]
        mine = batch[rank * per_process : (rank + 1) * per_process]
        total = _backward(accelerator, student, teacher, windows[mine], config)
        grad_norm = accelerator.clip_grad_norm_(params, config.max_grad_norm)
        loss_value = accelerator.reduce(total, "mean").item()
        if not (math.isfinite(loss_value) and math.isfinite(float(grad_norm))):  # before the step: weights intact
            bar.close()  # the error on a line of its own
            raise _diverged(step, start, config, f"loss {loss_value}, gradient norm {float(grad_norm)}")
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        entry = {
            "step": step + 1,
            "tokens": (step + 1) * config.global_batch * config.seq_len,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm),
        }
        if evaluate is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            entry.update(_evaluated(accelerator, student, evaluate, config))
        log.append(entry)
        tokens_per_s = (step + 1 - start) * config.global_batch * config.seq_len / (time.perf_counter() - clock)
        bar.set_postfix(loss=f"{entry['loss']:.4f}", tok_s=f"{tokens_per_s:.0f}")
        bar.update()
        if main:
            _append_log(run_dir, entry)
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            if main:
                _save(run_dir, fingerprint, accelerator.unwrap_model(student), optimizer, scheduler, step + 1)
            accelerator.wait_for_everyone()
    bar.close()
    student = accelerator.unwrap_model(student)
    _check_final(student, log, config.steps - 1, start, config)
    if recompute:
        student.activation_checkpointing_disable()
    student.eval()
    if main:
        plot(log, run_dir / "curve.png")
    return log


# ---- run directory: checkpoint and log --------------------------------------------------------------


def _fingerprint(config: TrainConfig) -> dict:
    keep = asdict(config)
    keep.pop("checkpoint_every")
    keep.pop("eval_every")
    return json.loads(json.dumps(keep))


def _save(run_dir: Path, fingerprint: dict, model: nn.Module, optimizer, scheduler, step: int) -> None:
    tensors = {f"model.{k}": v for k, v in state_tensors(model).items()}
    state = optimizer.state_dict()
    for index, values in state["state"].items():
        for key, value in values.items():
            tensors[f"optim.{index}.{key}"] = value.detach().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {
        "step": step,
        "config": fingerprint,
        "param_groups": state["param_groups"],
        "scheduler": scheduler.state_dict(),
    }
    with staging(run_dir / "checkpoint") as tmp:
        save_file(tensors, tmp / "state.safetensors")
        (tmp / "state.json").write_text(json.dumps(meta))


def _resume(
    run_dir: Path, fingerprint: dict, model: nn.Module, optimizer, scheduler, main: bool
) -> tuple[int, list[dict]]:
    """The step to start from and the log so far (entries past the checkpoint dropped: they are redone;
    only the main process rewrites the log)."""
    checkpoint = run_dir / "checkpoint"
    log_path = run_dir / "log.jsonl"
    if not (checkpoint / "state.json").exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        if main:
            log_path.write_text("")
        return 0, []
    meta = json.loads((checkpoint / "state.json").read_text())
    if meta["config"] != fingerprint:
        stored, identity = meta["config"].get("identity", {}), fingerprint["identity"]
        differ = sorted({k for k in {*stored, *identity} if stored.get(k) != identity.get(k)} or {"training options"})
        raise SlimlmError(
            f"{run_dir} holds a run with another {', '.join(differ)} than this one; delete it or "
            "rerun with the same ones"
        )
    tensors = load_file(checkpoint / "state.safetensors")
    names = dict(model.named_parameters())
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = set(model.state_dict()) - set(weights) - _tied(model)
    if missing:
        raise SlimlmError(f"the checkpoint in {checkpoint} lacks {sorted(missing)[:3]}; delete the run directory")
    with torch.no_grad():
        for name, value in weights.items():
            (names[name] if name in names else model.get_buffer(name)).copy_(value)
    state = {"state": {}, "param_groups": meta["param_groups"]}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, field = key.split(".", 2)
            state["state"].setdefault(int(index), {})[field] = value
    optimizer.load_state_dict(state)
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    step = meta["step"]
    log = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    log = [e for e in log if e["step"] <= step]
    if main:
        log_path.write_text("".join(json.dumps(e) + "\n" for e in log))
    return step, log


def _tied(model: nn.Module) -> set[str]:
    """Names that state_tensors leaves out because they share storage with an earlier one."""
    return set(model.state_dict()) - set(state_tensors(model))


def _append_log(run_dir: Path, entry: dict) -> None:
    with open(run_dir / "log.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def plot(log: list[dict], path: Path) -> None:
    """Training loss, and the evaluation perplexity where there is one, against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [e for e in log if "loss" in e]  # the step-0 entry is an evaluation only
    lines = ax.plot([e["tokens"] for e in steps], [e["loss"] for e in steps], label="training loss")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (distillation)")
    evals = [e for e in log if "eval_ppl" in e]
    if evals:
        right = ax.twinx()
        lines += right.plot(
            [e["tokens"] for e in evals],
            [e["eval_ppl"] for e in evals],
            "o-",
            color="C1",
            label="evaluation perplexity",
        )
        right.set_yscale("log")  # a conversion can cost orders of magnitude: the recovery reads on a log scale
        right.set_ylabel("evaluation perplexity (log)")
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
