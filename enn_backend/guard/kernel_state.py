"""Kernel state: what failed, keyed by what decides a kernel's behaviour.

A key is (op, backend, device capability, dtype, shape bucket) -- not a module's
identity -- so a second model, or a second process, with the same kernel on the same
hardware starts with the same knowledge (keys and entries: :mod:`.kernel_entry`). An entry records the action taken (``pinned``:
the node runs eagerly; ``fp32``: the whole graph computes in fp32), the fail count, the
first and last fault's time, the guard's reason and the last exception, and who wrote
it: torch version, enn version, machine.

Rules:

- An entry applies only under the torch and enn versions that wrote it, so an upgrade
  re-tests every kernel it pinned. Entries of other versions stay in the file (another
  virtual environment may share the cache folder) and are listed, not applied.
- An entry expires ``MAX_AGE_DAYS`` (30) after its last fault: it is ignored from then on
  and removed at the next write. A pinned kernel never runs again, so without expiry a
  transient fault (a driver or machine since fixed) would cost speed forever; after 30
  days the kernel is compiled again and, if it is still broken, the guard catches it once
  more and pins it again.
- At most ``MAX_ENTRIES`` (1000) entries: a write that would exceed it drops the entries
  whose last fault is oldest, with a warning. A file larger than ``MAX_FILE_BYTES`` (8 MiB:
  more than 1000 entries as enn writes them can take, about 7 KiB each at most, typically
  under 1 KiB) is not parsed: it is ignored with a warning and replaced at the next write.
- Every field of every entry is validated on load (type and range); an invalid entry is
  dropped with a warning, an unreadable file is ignored with a warning (and replaced at the
  next write, except a file of a newer format, which a newer enn sharing the folder wrote:
  that one is left alone and this process keeps its new entries in memory). Nothing in the
  file is executed (JSON, no pickle), and nothing in it can crash enn.

Sharing between processes: one JSON file per cache folder (``kernel_state.json``), changed
only under an exclusive ``flock`` on a lock file beside it. A writer takes the lock,
re-reads the file, applies its change to what it read (a fail count that another process
raised meanwhile is raised again, not overwritten) and replaces the file atomically
(temporary file + rename; the file keeps its mode) before it releases the lock. Readers
take no lock: the file is always whole. A compile re-reads the file when its stat
signature changed, so a pin written by another process applies to the next graph compiled
here; the guard's fast path never touches the file, and only a fault writes it.

Why this design: faults are rare, so rewriting a bounded file under a lock costs nothing
measurable; one JSON file stays easy to read; one lock makes increments exact, where one
file per entry would still need a lock (or one file per writer) for that; SQLite's locking
is unreliable on the network file systems that home folders often live on, where flock
works. The kernel releases a flock when its process dies, so a kill -9 never leaves the
state locked, and the temporary file such a writer leaves behind is removed by the next
writer (every writer holds the lock while its temporary file exists, so one found under the
lock is an orphan). A writer that cannot get the lock within ``LOCK_TIMEOUT_S`` keeps its
entry in memory and warns. Without ``fcntl`` (Windows) writes re-read and merge, unlocked.

Travelling: every entry this process records or applies is also recorded as a cache artifact
(type ``enn_kernel_state``, one per entry: :func:`.kernel_entry.entry_artifact`), so
``torch.compiler.save_cache_artifacts()`` carries it; ``load_cache_artifacts()`` merges it into
the same-named file in the cache folder the environment names (``ENN_CACHE_DIR``, else
~/.cache/enn), under the lock, the entry whose last fault is newest winning. A process must have
imported enn's backend (``torch.compile(..., backend="enn")`` does) before it loads.

Injected faults (option ``fault_inject``) never teach a real run: their state lives in
memory, for this process only, unless ``cache_dir`` is set (option or ``ENN_CACHE_DIR``);
then it goes to its own file there, ``kernel_state-inject-<hash of the spec>.json``, which
only runs with the same injection read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import socket
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Iterator

from .. import compat, file_lock
from ..options import Options
from ..report import Count, atomic_write_text, report
from .kernel_entry import (ARTIFACT, MAX_AGE_DAYS, MAX_TEXT, KernelEntry, current_versions, entry_artifact,
                           parsed_artifact, validated_entry)

log = logging.getLogger(__name__)

FORMAT = "enn-kernel-state"
VERSION = 2
FILE_NAME = "kernel_state.json"
MAX_ENTRIES = 1000
MAX_FILE_BYTES = 8 * 2**20
LOCK_TIMEOUT_S = 30.0


def _machine() -> str:
    return socket.gethostname()[:100] or "unknown"


Entries = dict[tuple[str, str, str], KernelEntry]


class KernelState:
    """Fail records: in one JSON file shared by every process that uses it, or in memory
    only (``path`` None)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._entries: Entries = {}  # the file as last read (or everything, in memory only)
        self._unsaved: Entries = {}  # recorded here but not written (the write failed)
        self._sig: tuple | None = None  # stat signature of the file last read
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.refresh()

    # ------------------------------------------------------------------ reading
    def lookup(self, key: str | None) -> KernelEntry | None:
        """The entry in force for ``key`` (this torch and enn, not expired), or None.
        Called at compile time: the file is re-read if another process changed it."""
        if not key:
            return None
        self.refresh()
        ident = (key, *current_versions())
        e = self._unsaved.get(ident) or self._entries.get(ident)
        if e is None or e.status(time.time()) != "in force":
            return None
        self._travel(e)
        return e

    def _travel(self, e: KernelEntry) -> None:
        """Record ``e`` for torch.compiler.save_cache_artifacts() (a persisted state's only)."""
        if self.path:
            compat.record_cache_artifact(ARTIFACT, *entry_artifact(os.path.basename(self.path), e))

    def entries(self) -> list[KernelEntry]:
        """Every valid entry, of every version, expired ones included (for listing)."""
        self.refresh()
        return list({**self._entries, **self._unsaved}.values())

    def refresh(self) -> None:
        """Re-read the file if it changed since it was last read."""
        if not self.path:
            return
        try:
            sig = _signature(os.stat(self.path))
        except FileNotFoundError:
            sig = None
        except OSError:
            return
        with self._lock:
            if sig != self._sig:
                self._entries, self._sig = self._read()

    def _read(self, writing: bool = False) -> tuple[Entries, tuple | None]:
        """The valid entries in the file now and the file's signature; a missing or unreadable
        file reads as empty, an invalid entry is left out (both with a warning). A file of a
        newer format (a newer enn shares the folder) reads as empty too, but is not for this
        enn to overwrite: OSError when ``writing``."""
        assert self.path
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > MAX_FILE_BYTES:
                    raise ValueError(f"{st.st_size} bytes, over the bound of {MAX_FILE_BYTES}")
                data = json.loads(f.read().decode())
        except FileNotFoundError:
            return {}, None
        except (OSError, ValueError, RecursionError) as exc:
            self._warn(f"enn: ignoring kernel state file {self.path} ({type(exc).__name__}: {exc}); "
                       "starting with no recorded faults")
            return {}, None
        try:
            return self._parse(data), _signature(st)
        except _NewerFormat as exc:
            if writing:
                raise OSError(f"{self.path} has {exc}") from None
            self._warn(f"enn: ignoring kernel state file {self.path} ({exc})")
            return {}, _signature(st)
        except ValueError as exc:
            self._warn(f"enn: ignoring kernel state file {self.path} ({exc}); starting with no recorded faults")
            return {}, _signature(st)

    def _parse(self, data: Any) -> Entries:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not an enn kernel-state file")
        if isinstance(data.get("version"), int) and data["version"] > VERSION:
            raise _NewerFormat(f"format version {data['version']}, newer than this enn's ({VERSION})")
        if data.get("version") != VERSION:
            raise ValueError(f"format version {data.get('version')!r:.20}, this enn reads version {VERSION}")
        if not isinstance(data.get("entries"), list):
            raise ValueError("no list of entries")
        now, entries, bad = time.time(), {}, []
        for i, raw in enumerate(data["entries"]):
            try:
                e = validated_entry(raw, now)
            except ValueError as exc:
                bad.append(f"entry {i}: {exc}")
                continue
            old = entries.get(e.ident)
            if old is None or e.last_time > old.last_time:
                entries[e.ident] = e
        if bad:
            self._warn(f"enn: dropped {len(bad)} invalid entr{'y' if len(bad) == 1 else 'ies'} of kernel state "
                       f"file {self.path} ({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''})")
        return self._bounded(entries)

    def _bounded(self, entries: Entries) -> Entries:
        if len(entries) <= MAX_ENTRIES:
            return entries
        newest = sorted(entries.values(), key=lambda e: e.last_time)[-MAX_ENTRIES:]
        self._warn(f"enn: kernel state {self.path or '(in memory)'} holds more than {MAX_ENTRIES} entries: "
                   f"dropped the {len(entries) - MAX_ENTRIES} whose last fault is oldest")
        return {e.ident: e for e in newest}

    def _warn(self, msg: str) -> None:
        """Log a problem once per state (a writer re-reads the file it warned about)."""
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("%s", msg)

    # ------------------------------------------------------------------ writing
    def record(self, key: str, action: str, exc: BaseException | None = None, reason: str = "") -> KernelEntry:
        """Count one more fault of ``key`` and the action taken (merged with what other
        processes wrote meanwhile)."""
        def change(entries: Entries) -> KernelEntry:
            now = time.time()
            ident = (key, *current_versions())
            old = entries.get(ident)
            if old is not None and old.status(now) != "in force":
                old = None  # an expired record starts over
            e = KernelEntry(
                key=key, action=action, fail_count=(old.fail_count if old else 0) + 1,
                first_time=old.first_time if old else now, last_time=now, reason=reason[:MAX_TEXT],
                last_exc_type=type(exc).__name__ if exc is not None else "NonFinite",
                last_exc_msg=str(exc)[:MAX_TEXT] if exc is not None else "",
                torch_version=ident[1], enn_version=ident[2], machine=_machine())
            entries[ident] = e
            return e

        e = self._update(change)
        self._travel(e)
        return e

    def merge(self, e: KernelEntry) -> None:
        """Take ``e`` (from another machine) unless this state holds a newer fault of its kernel."""
        def change(entries: Entries) -> None:
            old = entries.get(e.ident)
            if old is None or e.last_time > old.last_time:
                entries[e.ident] = e

        self._update(change)

    def clear(self, match: Callable[[KernelEntry], bool] | None = None) -> list[KernelEntry]:
        """Remove the entries ``match`` selects (every entry when None) and return them;
        OSError when the file cannot be written."""
        def change(entries: Entries) -> list[KernelEntry]:
            gone = [e for e in entries.values() if match is None or match(e)]
            for e in gone:
                del entries[e.ident]
            return gone

        with self._lock:
            gone_unsaved = change(self._unsaved)
        return self._update(change, in_memory_on_error=False) + gone_unsaved

    def _update(self, change: Callable[[Entries], Any], in_memory_on_error: bool = True) -> Any:
        """Apply ``change`` to the entries on disk under the lock and write them back. In
        memory only when there is no file; when the write fails, too, or OSError if not
        ``in_memory_on_error``."""
        with self._lock:
            if not self.path:
                result = change(self._entries)
                self._entries = self._bounded(self._entries)
                return result
            try:
                with self._locked():
                    entries, _ = self._read(writing=True)  # what other processes wrote since
                    result = change(entries)
                    self._write(entries)
                    self._entries, self._sig = entries, _signature(os.stat(self.path))
                return result
            except OSError as exc:
                if not in_memory_on_error:
                    raise
                self._warn(f"enn: could not write kernel state {self.path} ({type(exc).__name__}: {exc}); "
                           "its new entries apply in this process only")
                return change(self._unsaved)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive across processes (enn_backend.file_lock)."""
        assert self.path
        with file_lock.locked(self.path, LOCK_TIMEOUT_S):
            yield

    def _write(self, entries: Entries) -> None:
        """Write ``entries`` (expired ones and those past the bound dropped); the lock is held."""
        assert self.path
        now = time.time()
        expired = [i for i, e in entries.items() if e.status(now) == "expired"]
        for i in expired:
            del entries[i]
        if expired:
            log.info("enn: removed %d kernel state entr%s older than %d days from %s",
                     len(expired), "y" if len(expired) == 1 else "ies", MAX_AGE_DAYS, self.path)
        bounded = self._bounded(entries)
        if bounded is not entries:
            entries.clear()
            entries.update(bounded)
        self._remove_orphans()
        data = {"format": FORMAT, "version": VERSION, "entries": [asdict(e) for e in entries.values()]}
        atomic_write_text(self.path, json.dumps(data, indent=1))

    def _remove_orphans(self) -> None:
        """Temporary files of this file that a killed writer left (atomic_write_text names them
        ``.tmp-<random><file name>``); the lock is held, so none is being written."""
        assert self.path
        folder, name = os.path.split(self.path)
        for f in os.listdir(folder or "."):
            if f.startswith(".tmp-") and f.endswith(name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, f))
                    log.info("enn: removed %s, a temporary file a killed writer left", os.path.join(folder, f))


class _NewerFormat(ValueError):
    pass


def _signature(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# Process-wide: one KernelState per state file (or per in-memory slot), and whether the pins were
# announced; both under _STATES_LOCK (each KernelState locks its own entries).
_STATES: dict[str, KernelState] = {}
_STATES_LOCK = threading.Lock()
_pins_announced = False


def state_path(opts: Any) -> str | None:
    """The state file for these options; None: kept in memory for this process only
    (persistence off, or injected faults without an explicit ``cache_dir``)."""
    if not opts.persist:
        return None
    if opts.fault_inject:
        if not opts.cache_dir:
            return None
        name = "kernel_state-inject-" + hashlib.sha256(opts.fault_inject.encode()).hexdigest()[:12] + ".json"
        return os.path.join(opts.cache_dir, name)
    return os.path.join(opts.resolved_cache_dir(), FILE_NAME)


def state_for(opts: Any) -> KernelState:
    """The process-wide kernel state for these options."""
    return _state_at(state_path(opts), opts.fault_inject)


def _state_at(path: str | None, fault_inject: str = "") -> KernelState:
    slot = path or f"memory:{fault_inject}"
    with _STATES_LOCK:
        if slot not in _STATES:
            _STATES[slot] = KernelState(path)
        return _STATES[slot]


def state_command(state: KernelState, sub: str, key: str | None = None) -> str:
    """The command, ready to paste, that runs ``python -m enn_backend state <sub>`` on
    ``state``'s file (``--key`` ``key`` when given): the default file of enn's cache folder needs
    no argument, one in another folder ``--cache-dir``, any other file (an injected fault's
    state) ``--file``."""
    folder, name = os.path.split(state.path or "")
    command = f"python -m enn_backend state {sub}"
    if name != FILE_NAME:
        command += f" --file {shlex.quote(state.path or '')}"
    elif folder != Options().resolved_cache_dir():
        command += f" --cache-dir {shlex.quote(folder)}"
    return command if key is None else f"{command} --key {shlex.quote(key)}"


def other_state_files(folder: str) -> list[str]:
    """The state files in ``folder`` besides the default one: those of runs with injected faults."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith("kernel_state-inject-") and n.endswith(".json")]


def unreadable(path: str) -> str | None:
    """Why the state file at ``path`` cannot be used (None: it can, or there is none)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_FILE_BYTES + 1).decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return "not an enn kernel-state file"
    version = data.get("version")
    if version != VERSION and not (isinstance(version, int) and version > VERSION):  # a newer enn's is not broken
        return f"format version {version!r:.20}, this enn reads version {VERSION}"
    return None


def announce_pins(state: KernelState, nodes: int) -> None:
    """Say once per process, at WARNING, that nodes are pinned from a state file and how
    to clear it (every compile that applies pins also adds a report line)."""
    global _pins_announced
    with _STATES_LOCK:
        if _pins_announced or not state.path:
            return
        _pins_announced = True
    log.warning("enn: kernel state %s records faults of kernels in this model: %d node(s) run eagerly, not "
                "compiled, until the entries expire (%d days after the last fault) or are cleared: %s",
                state.path, nodes, MAX_AGE_DAYS, state_command(state, "clear"))


def forget_loaded_states() -> None:
    """Drop in-memory states and the once-per-process warning (tests; the files stay)."""
    global _pins_announced
    with _STATES_LOCK:
        _STATES.clear()
        _pins_announced = False


def _load_artifact(key: str, content: bytes) -> None:
    """torch.compiler.load_cache_artifacts(): merge one travelling entry into its state file."""
    name, e = parsed_artifact(key, content, time.time())
    opts = Options.from_sources(None, None)
    if not opts.persist:
        log.info("enn: kernel state is not persisted here (ENN_PERSIST=0): not loading cache artifact %r", key)
        return
    state = _state_at(os.path.join(opts.resolved_cache_dir(), name))
    state.merge(e)
    log.debug("enn: merged kernel state entry %s from a cache artifact into %s", e.key, state.path)


compat.register_cache_artifact(ARTIFACT, _load_artifact, lambda: report().count(Count.CACHE_ARTIFACTS_IGNORED))
