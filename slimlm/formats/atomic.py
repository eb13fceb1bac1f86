"""Directory writes that either happen completely or not at all, and never touch what slimlm did not write.

A checkpoint (or cache entry) is built in a temp dir beside its target, `.NAME.tmp-XXXX`, which the writing
process holds an flock on until it is done: a temp dir nobody holds belongs to a run that died (kill -9,
power loss) and is removed by the next run that writes NAME. The finished dir is put in place by an atomic
exchange (renameat2 RENAME_EXCHANGE), so at every instant the target is either the old complete dir or the
new complete one; the old one is then deleted from the temp name.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slimlm.errors import FieldError, SlimlmError

# Files a Hugging Face / slimlm checkpoint directory holds: the only things --overwrite may delete.
CHECKPOINT_MARKERS = ("config.json", "slimlm.json")
REPORT_GENERATOR = '<meta name="generator" content="slimlm">'  # in every report: what --overwrite may replace
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def check_output(out: Path, overwrite: bool, sources: list[Path] = ()) -> Path:
    """Refuse, before any work, an --out that would lose data or cannot be written; returns it resolved."""
    out = Path(out).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise FieldError("out", f"{out} is the current directory or one of its parents; name a new directory")
    for source in sources:
        source = Path(source).resolve()
        if out == source or out in source.parents:
            raise FieldError("out", f"{out} is or contains the source model {source}; name another directory")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FieldError("out", f"{out} exists and is not a directory; name a directory")
        if not overwrite:
            raise FieldError("out", f"{out} exists; pass {{overwrite}} to replace it")
        if not replaceable(out):
            raise FieldError(
                "out",
                f"{out} is a non-empty directory that is not a checkpoint (no config.json/slimlm.json, or it "
                "has subdirectories); slimlm replaces only checkpoints: name another directory",
            )
    busy = [p.name for p in _temp_dirs(out) if _held(p)]
    if busy:
        raise FieldError("out", f"{out} is being written by another slimlm run ({busy[0]}); wait or name another")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise FieldError("out", f"{out} cannot be written: {ancestor} is not a writable directory")
    return out


def check_file(path: Path, overwrite: bool, field: str, inputs: list[Path] = ()) -> Path:
    """Refuse, before any work, a results file (report, eval/bench/plan JSON) that would lose data: a
    directory, a file in a checkpoint's directory, one of the command's `inputs`, or an existing file unless
    `overwrite` — and then only one of the kind the command writes (JSON, HTML), never, say, a model's tokenizer
    or a notes file. `field`: the setting that named it, for the error."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise FieldError(field, f"{path} is a directory; name a file")
    if path.name in CHECKPOINT_MARKERS or path.suffix == ".safetensors" or is_checkpoint(path.parent):
        raise FieldError(field, f"{path} is in a checkpoint's directory; name a file outside the checkpoint")
    if any(path.resolve() == Path(i).expanduser().resolve() for i in inputs):
        raise FieldError(field, f"{path} is one of this command's inputs; name another file")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise FieldError(field, f"{path} exists; pass {{overwrite}} to replace it")
        if not _same_kind(path):
            raise FieldError(field, f"{path} exists and is not a slimlm result (JSON or report); name another file")
    return path


def is_checkpoint(d: Path) -> bool:
    """Whether `d` is a checkpoint's directory: config.json, slimlm.json or weights in it."""
    return d.is_dir() and (any((d / m).exists() for m in CHECKPOINT_MARKERS) or any(d.glob("*.safetensors")))


def _same_kind(path: Path) -> bool:
    """Whether an existing file is of a kind results are written as: a JSON document (eval, bench, plan, whatever
    its name) or a report slimlm wrote. Anything else (a symlink, notes, a tokenizer's text) is not replaced."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(64 << 20)
    except OSError:
        return False
    if REPORT_GENERATOR.encode() in head[:4096]:
        return True
    try:
        json.loads(head)
        return True
    except ValueError:
        return False


def write_file(path: Path, text: str, overwrite: bool, field: str) -> None:
    """`text` into `path` whole or not at all (a temp file beside it, renamed into place), after check_file."""
    path = check_file(path, overwrite, field)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            f.write(text)
        try:
            os.replace(f.name, path)
        finally:
            Path(f.name).unlink(missing_ok=True)
    except OSError as e:
        raise SlimlmError(f"cannot write {path}: {e.strerror or e}") from None


_CLAIMED: set[Path] = set()  # what this process holds: a recipe holds its stages, then each step its own out


@contextmanager
def claim(paths: list[Path]) -> Iterator[None]:
    """Hold every path a command writes (a checkpoint, a report, a JSON) for the command's whole run: a second
    slimlm command that would write one of them is refused at its start, in one line, whatever its kind, rather
    than mixing its output with this one's or losing its work at the end. The lock is an flock on a file in the
    cache named by the path's hash (nothing is left beside the output), gone with the process that held it.
    Under accelerate, the main process (RANK 0) holds for the group."""
    held = []
    try:
        if os.environ.get("RANK", "0") == "0":
            for path in sorted({Path(p).expanduser().resolve() for p in paths}):
                if path not in _CLAIMED:
                    held.append((path, *_lock(path)))
                    _CLAIMED.add(path)
        yield
    finally:
        for path, fd, lock in held:
            lock.unlink(missing_ok=True)  # before the unlock: a waiter then sees the file gone and retries
            os.close(fd)
            _CLAIMED.discard(path)


def _lock(path: Path) -> tuple[int, Path]:
    from slimlm.cache import cache_dir

    locks = cache_dir() / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SlimlmError(
            f"cannot hold {path} for this run: the lock directory {locks} cannot be made ({e.strerror}); set "
            "SLIMLM_CACHE to a writable directory"
        ) from None
    lock = locks / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            busy = f"{path} is being written by another slimlm command ({holder}); wait for it or name another"
            raise SlimlmError(busy) from None
        try:  # the holder before us may have removed the file between our open and our lock: take the new one
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200] if sys.argv and sys.argv[0] else "python"
    os.pwrite(fd, f"pid {os.getpid()}: {command}".encode(), 0)
    return fd, lock


def replaceable(d: Path) -> bool:
    """An empty dir, or a checkpoint: config.json or slimlm.json, and no subdirectories to lose."""
    entries = list(d.iterdir())
    if not entries:
        return True
    return any((d / m).is_file() for m in CHECKPOINT_MARKERS) and not any(e.is_dir() for e in entries)


@contextmanager
def atomic_dir(out: Path, overwrite: bool = False, sources: list[Path] = ()) -> Iterator[Path]:
    """Yield a temp dir beside `out`; on success it replaces `out`, on any failure (or signal) it vanishes,
    with the parent directories this call created."""
    out = check_output(out, overwrite, sources)
    with staging(out) as tmp:
        yield tmp
        if out.exists() and not overwrite:
            raise SlimlmError(f"{out} appeared while this run was writing it (another run?); nothing was replaced")


@contextmanager
def staging(target: Path) -> Iterator[Path]:
    """The mechanism under atomic_dir, without its checks (the asset cache uses it directly)."""
    target = Path(target)
    created = _make_parents(target.parent)
    for stale in _temp_dirs(target):
        if not _held(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    hold = os.open(tmp, os.O_RDONLY)
    fcntl.flock(hold, fcntl.LOCK_EX)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a checkpoint gets the permissions mkdir would give
        yield tmp
        for f in tmp.iterdir():  # and its files those open() would give (some writers go through tempfiles)
            if f.is_file():
                os.chmod(f, 0o666 & ~umask)
        _commit(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                break
        raise
    finally:
        os.close(hold)


@contextmanager
def hold(d: Path, busy: str) -> Iterator[Path]:
    """Hold directory `d` (made if missing) for this process: an flock on its file `.lock` (not on `d`, which
    _commit locks to put things into it); a second holder is refused with `busy`. A killed holder's lock goes
    with it, so a rerun may resume."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SlimlmError(busy) from None
        yield d
    finally:
        os.close(fd)


def _commit(tmp: Path, target: Path) -> None:
    parent = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(parent, fcntl.LOCK_EX)  # one commit at a time in this directory
        if not target.exists():
            os.replace(tmp, target)
            return
        if _libc.renameat2(_AT_FDCWD, bytes(tmp), _AT_FDCWD, bytes(target), _RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise OSError(err, os.strerror(err), str(target))
            # no atomic exchange on this filesystem: two renames, the old copy parked under a temp name
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
            os.replace(target, old / "old")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
            return
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old target
    finally:
        os.close(parent)


def _temp_dirs(target: Path) -> list[Path]:
    if not target.parent.is_dir():
        return []
    return sorted(target.parent.glob(f".{target.name}.tmp-*"))


def _held(path: Path) -> bool:
    """Whether a live process holds this temp dir (its flock); a dead writer's lock is gone with it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _make_parents(d: Path) -> list[Path]:
    missing = []
    while not d.exists():
        missing.append(d)
        d = d.parent
    created = []
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise SlimlmError(f"cannot create {m}: {e.strerror or e}") from None
        created.append(m)
    return created
