"""Files written whole or not at all: a temporary file beside the target, then a rename over it, so that a reader, a
crash or Ctrl-C finds the old file or the new one, never half of either. And files one process at a time writes
(`exclusive`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` writes the file's content to `tmp`; it then replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text))


NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # flock's errors where a file system has none


@contextlib.contextmanager
def exclusive(path: str | Path, busy: Callable[[], object]):
    """Held by one process at a time while the block runs: an advisory lock (flock) on `path` itself, a file (made
    if missing) or a directory, so no lock file is left beside it. The operating system drops the lock of a process
    that dies: a killed run leaves none behind. Where another process holds it, `busy()` is called first: it raises to
    refuse, or returns to wait for the other process."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in NO_LOCKS:
                raise
            # A file system without locks (some network and FUSE mounts): the work goes on unguarded, as it would
            # without this lock, rather than not at all.
        yield
    finally:
        os.close(fd)
