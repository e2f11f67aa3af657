"""The choice cache: measured kernel choices on disk, keyed by :class:`.key.ChoiceKey`.

One JSON file per cache folder, ``kernel_choices.json`` in enn's cache folder (``cache_dir`` /
``ENN_CACHE_DIR``, else ~/.cache/enn). Rules:

- JSON only, never pickle: nothing in the file is executed, and nothing in it can crash enn.
- Every entry is validated when read. An entry that is malformed, or *foreign* (its digest is not
  the hash of its key: written by something else, or edited), is skipped and logged; a file that
  cannot be parsed is ignored with a warning and replaced at the next write.
- A lookup matches the whole key, versions and device included: an entry measured under another
  torch, library or GPU stays in the file (another environment may share the folder) and never
  applies here.
- Writes hold an exclusive ``flock`` on ``kernel_choices.json.lock``, re-read the file, merge, and
  replace it atomically (temporary file + rename): readers never see half a file, and two
  processes measuring at once both keep their entries.
- At most ``MAX_ENTRIES`` entries; a write past it drops the oldest.
- Travelling: every entry this process measures or uses is also recorded as a cache artifact
  (type ``enn_kernel_choice``), so ``torch.compiler.save_cache_artifacts()`` carries it and
  ``load_cache_artifacts()`` merges it into the file of the cache folder the environment names.

``python -m enn_backend registry list|clear`` shows and removes entries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import __version__, compat, file_lock
from ..options import Options
from ..report import Count, atomic_write_text, report
from .key import ChoiceKey

log = logging.getLogger(__name__)

FORMAT = "enn-kernel-choices"
VERSION = 1
FILE_NAME = "kernel_choices.json"
ARTIFACT = "enn_kernel_choice"
MAX_ENTRIES = 4096
MAX_FILE_BYTES = 16 * 2**20
LOCK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ChoiceEntry:
    """One measured choice: the kernel that won for ``key``, and every candidate's time."""

    key: ChoiceKey
    kernel: str
    timings_ms: tuple[tuple[str, float], ...]  # (kernel, median ms) per candidate timed
    time: float  # when it was measured (seconds since the epoch)
    enn_version: str

    @property
    def digest(self) -> str:
        return self.key.digest()

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "key": self.key.to_json(), "kernel": self.kernel,
                "timings_ms": {k: v for k, v in self.timings_ms}, "time": self.time, "enn_version": self.enn_version}

    @classmethod
    def from_json(cls, raw: Any) -> "ChoiceEntry":
        """The entry ``raw`` describes; ValueError when it is malformed or foreign."""
        if not isinstance(raw, dict) or set(raw) != {"digest", "key", "kernel", "timings_ms", "time", "enn_version"}:
            raise ValueError(f"not an entry: {raw!r:.80}")
        key = ChoiceKey.from_json(raw["key"])
        if raw["digest"] != key.digest():
            raise ValueError(f"foreign entry: digest {raw['digest']!r:.30} is not its key's hash")
        timings = raw["timings_ms"]
        if not (isinstance(timings, dict) and all(isinstance(k, str) and isinstance(v, (int, float))
                                                  and not isinstance(v, bool) for k, v in timings.items())):
            raise ValueError("timings_ms must map kernel names to numbers")
        if not isinstance(raw["kernel"], str) or not raw["kernel"]:
            raise ValueError("kernel must be a name")
        if not isinstance(raw["time"], (int, float)) or isinstance(raw["time"], bool):
            raise ValueError("time must be a number")
        if not isinstance(raw["enn_version"], str):
            raise ValueError("enn_version must be a string")
        return cls(key, raw["kernel"], tuple((k, float(v)) for k, v in timings.items()), float(raw["time"]),
                   raw["enn_version"])


def make_entry(key: ChoiceKey, kernel: str, timings_ms: dict[str, float]) -> ChoiceEntry:
    return ChoiceEntry(key, kernel, tuple(sorted(timings_ms.items())), time.time(), __version__)


class ChoiceCache:
    """Measured choices in one JSON file shared by every process that uses it, or in memory
    only (``path`` None)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._entries: dict[str, ChoiceEntry] = {}  # digest -> entry, the file as last read
        self._sig: tuple | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.refresh()

    # ------------------------------------------------------------------ reading
    def get(self, key: ChoiceKey) -> ChoiceEntry | None:
        self.refresh()
        e = self._entries.get(key.digest())
        if e is not None:
            self._travel(e)
        return e

    def entries(self) -> list[ChoiceEntry]:
        self.refresh()
        return sorted(self._entries.values(), key=lambda e: -e.time)

    def refresh(self) -> None:
        """Re-read the file if it changed since it was last read."""
        if not self.path:
            return
        try:
            st = os.stat(self.path)
            sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            sig = None
        except OSError:
            return
        with self._lock:
            if sig != self._sig:
                self._entries, self._sig = self._read(), sig

    def _read(self) -> dict[str, ChoiceEntry]:
        assert self.path
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size > MAX_FILE_BYTES:
                    raise ValueError(f"over {MAX_FILE_BYTES} bytes")
                data = json.loads(f.read().decode())
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("not an enn kernel-choice file")
            if data.get("version") != VERSION or not isinstance(data.get("entries"), list):
                raise ValueError(f"format version {data.get('version')!r:.20}, this enn reads version {VERSION}")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:
            self._warn(f"enn: ignoring kernel-choice cache {self.path} ({type(exc).__name__}: {exc}); "
                       "choices are measured again")
            return {}
        entries: dict[str, ChoiceEntry] = {}
        for i, raw in enumerate(data["entries"]):
            try:
                e = ChoiceEntry.from_json(raw)
            except ValueError as exc:
                self._warn(f"enn: skipped entry {i} of kernel-choice cache {self.path}: {exc}")
                continue
            entries[e.digest] = e
        return entries

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("%s", msg)

    # ------------------------------------------------------------------ writing
    def put(self, entry: ChoiceEntry) -> None:
        """Keep ``entry`` (replacing the key's older one); in memory only when the write fails."""
        self._update(lambda entries: entries.__setitem__(entry.digest, entry))
        self._travel(entry)

    def merge(self, entry: ChoiceEntry) -> None:
        """Take ``entry`` (from another machine) unless this cache holds a newer one for its key."""
        def change(entries: dict[str, ChoiceEntry]) -> None:
            old = entries.get(entry.digest)
            if old is None or entry.time > old.time:
                entries[entry.digest] = entry

        self._update(change)

    def clear(self, match: Callable[[ChoiceEntry], bool] | None = None) -> list[ChoiceEntry]:
        """Remove the entries ``match`` selects (all when None) and return them; OSError when the
        file cannot be written."""
        def change(entries: dict[str, ChoiceEntry]) -> list[ChoiceEntry]:
            gone = [e for e in entries.values() if match is None or match(e)]
            for e in gone:
                del entries[e.digest]
            return gone

        return self._update(change, keep_in_memory=False)

    def _update(self, change: Callable[[dict[str, ChoiceEntry]], Any], keep_in_memory: bool = True) -> Any:
        with self._lock:
            if not self.path:
                return change(self._entries)
            try:
                with self._locked():
                    entries = self._read()
                    result = change(entries)
                    if len(entries) > MAX_ENTRIES:
                        for e in sorted(entries.values(), key=lambda e: e.time)[:len(entries) - MAX_ENTRIES]:
                            del entries[e.digest]
                    data = {"format": FORMAT, "version": VERSION, "entries": [e.to_json() for e in entries.values()]}
                    atomic_write_text(self.path, json.dumps(data, indent=1))
                    st = os.stat(self.path)
                    self._entries, self._sig = entries, (st.st_ino, st.st_size, st.st_mtime_ns)
                return result
            except OSError as exc:
                if not keep_in_memory:
                    raise
                self._warn(f"enn: could not write kernel-choice cache {self.path} ({type(exc).__name__}: {exc}); "
                           "new choices apply in this process only")
                return change(self._entries)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive across processes (enn_backend.file_lock)."""
        assert self.path
        with file_lock.locked(self.path, LOCK_TIMEOUT_S):
            yield

    def _travel(self, e: ChoiceEntry) -> None:
        """Record ``e`` for torch.compiler.save_cache_artifacts() (a persisted cache's only)."""
        if self.path:
            compat.record_cache_artifact(ARTIFACT, e.digest, json.dumps(e.to_json(), sort_keys=True).encode())


# Process-wide: one ChoiceCache per file (or the in-memory one), under _CACHES_LOCK.
_CACHES: dict[str, ChoiceCache] = {}
_CACHES_LOCK = threading.Lock()


def cache_path(opts: Options) -> str | None:
    """The cache file for these options; None (memory only) when persistence is off."""
    return os.path.join(opts.resolved_cache_dir(), FILE_NAME) if opts.persist else None


def cache_at(path: str | None) -> ChoiceCache:
    slot = path or "memory"
    with _CACHES_LOCK:
        if slot not in _CACHES:
            _CACHES[slot] = ChoiceCache(path)
        return _CACHES[slot]


def cache_for(opts: Options) -> ChoiceCache:
    """The process-wide choice cache for these options."""
    return cache_at(cache_path(opts))


def forget_loaded_caches() -> None:
    """Drop the in-memory caches (tests; the files stay)."""
    with _CACHES_LOCK:
        _CACHES.clear()


def _load_artifact(key: str, content: bytes) -> None:
    """torch.compiler.load_cache_artifacts(): merge one travelling choice into the cache file."""
    entry = ChoiceEntry.from_json(json.loads(content.decode()))
    if entry.digest != key:
        raise ValueError(f"artifact key {key!r:.30} is not its entry's digest")
    opts = Options.from_sources(None, None)
    if not opts.persist:
        log.info("enn: kernel choices are not persisted here (ENN_PERSIST=0): not loading cache artifact %r", key)
        return
    cache_for(opts).merge(entry)


compat.register_cache_artifact(ARTIFACT, _load_artifact, lambda: report().count(Count.CACHE_ARTIFACTS_IGNORED))
