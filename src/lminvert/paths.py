"""Where lminvert keeps cached artefacts, how it writes files safely, and output checks made before any work.

Every cache entry and result file is written under a unique temporary name in its final directory and then
renamed into place, so two processes preparing the same model or table at once never see (or leave) a half
written file: the rename is atomic, and the loser of a race for a directory discards its own copy. A cache entry
that takes long to build is built by one process at a time (:func:`building`): another one asking for it meanwhile
waits, then reads it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from .errors import LminvertError

log = logging.getLogger(__name__)
# one-time builds that took a while, reported without --verbose: the command-line tool shows this logger at INFO, so a
# first run's silent minutes (a layer's or a defence's calibrations, a first-position table) are explained
ONCE = logging.getLogger("lminvert.once")
SLOW = 5.0  # seconds: a build at least this long is reported on ONCE
NOTICE = 30.0  # seconds: a build still running this long is announced on ONCE while it runs (some take many minutes)
WAIT = 3600.0  # seconds a process waits for another building the same cache entry, then builds it itself
_held = threading.local()  # this thread holds a build lock (nested builds take none)
_built = [0.0]  # seconds this process spent in outermost builds of cache entries (and waiting for another's)
_adding = threading.Lock()


def clock() -> float:
    """The search clock: ``time.time()`` less the seconds this process has spent so far building cache entries or
    waiting for another process to (:func:`building`). Time bounds (``max_seconds``) are set and read on it, so a first
    run's one-time builds, announced on ``ONCE``, do not spend a search's bound. Builds in a worker process pause that
    process's clock only."""
    return time.time() - _built[0]


def past(deadline: float | None) -> bool:
    """Whether the time bound ``deadline`` (on :func:`clock`; None: none) has passed: every search's test."""
    return deadline is not None and clock() > deadline


def clock_offset() -> float:
    """Seconds :func:`clock` lags ``time.time()`` in this process: a deadline plus this is a wall-clock time, which
    another process turns back into its own clock by subtracting its own (a task sent to a worker)."""
    return _built[0]


def cache_dir() -> Path:
    """``$LMINVERT_CACHE`` if set, else ``~/.cache/lminvert``; created on first use."""
    root = os.environ.get("LMINVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lminvert")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a unique temporary path beside ``path``; on success it replaces ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _announce(what: str) -> None:
    ONCE.info(
        "one-time: building %s, running for %.0f s so far (it can take minutes; kept in the cache, not built again)",
        what,
        NOTICE,
    )


@contextlib.contextmanager
def building(path: str | Path, wait: float = WAIT, what: str | None = None) -> Iterator[bool]:
    """One process at a time builds the cache entry kept at ``path`` (an exclusive lock on ``.<name>.lock`` beside
    it, released by the system if the process dies); yields whether this one waited for another, which then most
    likely wrote the entry: read it again before building. A thread already inside such a build takes no lock for
    the entries its build asks for (a process holds one at most, so two processes never wait on each other); after
    ``wait`` seconds it builds anyway (the file is written atomically either way). A build of ``SLOW`` seconds or more
    that did not wait is reported on ``ONCE``, as ``what`` (default: the entry's file name); one still running after
    ``NOTICE`` seconds is announced there while it runs (a first run's minutes of silence explained as they pass). The
    time from the call until the build ends stops :func:`clock`."""
    if getattr(_held, "lock", False):
        yield False
        return
    began = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.parent / f".{path.name}.lock"))
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process building %s", path.name)
        waited = True
        try:
            lock.acquire(timeout=wait)
        except Timeout:
            log.warning("another process has been building %s for %.0f s: building it here too", path.name, wait)
    _held.lock = True
    start = time.perf_counter()
    notice = threading.Timer(NOTICE, _announce, (what or path.name,))
    notice.daemon = True
    notice.start()
    try:
        yield waited
        took = time.perf_counter() - start
        if took >= SLOW and not waited:
            ONCE.info("one-time: %s took %.0f s, kept in the cache for later runs", what or path.name, took)
    finally:
        notice.cancel()
        with _adding:
            _built[0] += time.perf_counter() - began
        _held.lock = False
        if lock.is_locked:
            lock.release()


@contextlib.contextmanager
def atomic_dir(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a unique temporary directory beside ``path``; on success it becomes ``path``.

    If another process created ``path`` in the meantime, its copy is kept and ours is discarded (both were
    built from the same inputs); ``replace=True`` removes an existing ``path`` first (a forced rebuild).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if replace:
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if not path.is_dir():
                raise
            # a concurrent writer finished first, or a stale directory is in the way: keep the finished one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write JSON atomically (unique temporary file, then rename)."""
    path = Path(path)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LminvertError(
            f"cannot read {path} ({type(exc).__name__}): not a JSON file lminvert wrote, or cut short (a run's own "
            "file: delete it to recompute)"
        ) from exc


def _probe_directory(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=".lminvert-write-check.", dir=directory)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise LminvertError(f"cannot write {what} ({reason}): choose another --out") from None


def check_output_file(path: str | Path, suffix: str | tuple[str, ...] | None = None) -> Path:
    """Fail now, before any work, if ``path`` cannot be written (or has none of the ``suffix`` es)."""
    path = Path(path)
    allowed = (suffix,) if isinstance(suffix, str) else suffix
    if allowed is not None and path.suffix not in allowed:
        raise LminvertError(f"--out must end in {' or '.join(allowed)}, got '{path.name}'")
    if path.is_dir():
        raise LminvertError(f"--out {path} is a directory: give a file path")
    _probe_directory(path.parent, f"{path}")
    if path.exists() and not os.access(path, os.W_OK):
        raise LminvertError(f"cannot write {path} (permission denied): choose another --out")
    return path


def check_output_dir(path: str | Path) -> Path:
    """Fail now, before any work, if directory ``path`` cannot be created and written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise LminvertError(f"--out {path} is a file: give a directory")
    _probe_directory(path, f"into {path}")
    return path
