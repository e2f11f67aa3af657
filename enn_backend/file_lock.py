"""An exclusive lock across processes for a file enn rewrites (kernel state, the kernel-choice
cache): a ``flock`` on ``<file>.lock``, a file never replaced, so every writer locks the same
one. Closing the descriptor releases the lock. Without ``fcntl`` (Windows) writers re-read and
merge unlocked."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def locked(path: str, timeout_s: float) -> Iterator[None]:
    """Hold the lock of ``path``; TimeoutError if another process holds it for ``timeout_s``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path}.lock held by another process for {timeout_s:.0f}s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)
