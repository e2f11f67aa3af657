"""Kernel state shared by processes: merged updates, validated entries, bounds, versions, the CLI."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import shlex
import socket
import time

import pytest
import torch

import enn_backend
from enn_backend import cli
from enn_backend.guard import kernel_state as K
from enn_backend.options import Options

KEY = "aten.addmm|inductor-cpu|cpu|float32|4x16"  # the first Linear of _mlp() on a [4, 8] input
KEY2 = "aten.addmm|inductor-cpu|cpu|float32|4x4"  # its second Linear
SHARED = "aten.erf|inductor-cpu|cpu|float32|64"
DAY = 86400.0


def _entry(key: str, age_s: float = 60.0, **changes) -> dict:
    torch_version, enn_version = K.current_versions()
    now = time.time()
    e = {"key": key, "action": "pinned", "fail_count": 1, "first_time": now - age_s, "last_time": now - age_s,
         "reason": "NaN/Inf in compiled output", "last_exc_type": "NonFinite", "last_exc_msg": "",
         "torch_version": torch_version, "enn_version": enn_version, "machine": "test"}
    return {**e, **changes}


def _write_state(folder, entries: list[dict]) -> str:
    path = os.path.join(folder, K.FILE_NAME)
    with open(path, "w") as f:
        json.dump({"format": K.FORMAT, "version": K.VERSION, "entries": entries}, f)
    return path


def _on_disk(folder) -> dict[str, dict]:
    with open(os.path.join(folder, K.FILE_NAME)) as f:
        return {e["key"]: e for e in json.load(f)["entries"]}


def _state(folder) -> K.KernelState:
    return K.KernelState(os.path.join(folder, K.FILE_NAME))


# ----------------------------------------------------------------------------- processes
N_PROCS, N_SHARED = 4, 5


def _writer(folder: str, own_key: str, barrier) -> None:
    state = _state(folder)  # every process has read the (empty) file before any of them writes
    barrier.wait()
    state.record(own_key, "pinned", reason="own kernel")
    for _ in range(N_SHARED):
        state.record(SHARED, "pinned", RuntimeError("shared kernel"))


@pytest.fixture(scope="module")
def shared_folder(tmp_path_factory):
    """N_PROCS spawned processes writing one state folder at the same time."""
    folder = str(tmp_path_factory.mktemp("shared"))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(N_PROCS)
    procs = [ctx.Process(target=_writer, args=(folder, f"aten.mm|inductor-cpu|cpu|float32|{i}x8", barrier))
             for i in range(N_PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    return folder


def test_processes_pinning_different_kernels_keep_every_entry(shared_folder):
    keys = set(_on_disk(shared_folder))
    assert keys == {SHARED} | {f"aten.mm|inductor-cpu|cpu|float32|{i}x8" for i in range(N_PROCS)}


def test_concurrent_increments_of_one_key_are_all_counted(shared_folder):
    e = _on_disk(shared_folder)[SHARED]
    assert e["fail_count"] == N_PROCS * N_SHARED
    assert e["last_exc_type"] == "RuntimeError" and e["last_exc_msg"] == "shared kernel"
    assert not [f for f in os.listdir(shared_folder) if f.startswith(".tmp-")]


def test_a_pin_written_by_another_process_applies_at_the_next_lookup(tmp_path):
    here, there = _state(tmp_path), _state(tmp_path)  # two processes' views of one folder
    assert here.lookup(KEY) is None
    there.record(KEY, "pinned", reason="elsewhere")
    assert here.lookup(KEY) is not None and here.lookup(KEY).reason == "elsewhere"


def test_a_writer_that_cannot_get_the_lock_keeps_its_entry_in_memory(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(K, "LOCK_TIMEOUT_S", 0.2)
    state = _state(tmp_path)
    fd = os.open(state.path + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the lock
        with caplog.at_level(logging.WARNING, logger="enn_backend"):
            state.record(KEY, "pinned", reason="r")
    finally:
        os.close(fd)
    assert "could not write kernel state" in caplog.text and "held by another process" in caplog.text
    assert state.lookup(KEY) is not None and not os.path.exists(state.path)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field,value", [("fail_count", "x"), ("fail_count", 0), ("fail_count", True),
                                         ("action", "maybe"), ("last_time", float("inf")),
                                         ("first_time", "yesterday"), ("reason", ["a"]), ("machine", None)])
def test_an_invalid_field_drops_the_entry_with_a_warning(tmp_path, caplog, field, value):
    _write_state(tmp_path, [_entry(KEY, **{field: value}), _entry(KEY2)])
    state = _state(tmp_path)
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        assert state.lookup(KEY) is None and state.lookup(KEY2) is not None
        e = state.record(KEY, "pinned", reason="met again")  # the bad entry is not counted on
    assert e.fail_count == 1
    assert caplog.text.count(f"dropped 1 invalid entry of kernel state file {state.path}") == 1, caplog.text
    assert field in caplog.text
    assert set(_on_disk(tmp_path)) == {KEY, KEY2} and _on_disk(tmp_path)[KEY]["fail_count"] == 1


def test_an_entry_with_missing_or_unknown_fields_is_dropped(tmp_path, caplog):
    bad = [{k: v for k, v in _entry(KEY).items() if k != "torch_version"}, {**_entry(KEY2), "code": "import os"}]
    _write_state(tmp_path, bad)
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        assert _state(tmp_path).entries() == []
    assert "dropped 2 invalid entries" in caplog.text and "torch_version" in caplog.text and "code" in caplog.text


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), torch.randn(4, 8)


def test_a_model_compiles_with_a_corrupt_entry_and_applies_only_valid_current_pins(tmp_path, monkeypatch, caplog):
    """End to end: one valid pin (applied, announced once at WARNING), one entry with a corrupt
    field (dropped with a warning), one entry of another torch version (not applied)."""
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    _write_state(tmp_path, [_entry(KEY), _entry("aten.relu|inductor-cpu|cpu|float32|4x16", fail_count="x"),
                            _entry(KEY2, torch_version="1.0.0")])
    model, x = _mlp()
    with caplog.at_level(logging.INFO, logger="enn_backend"), torch.no_grad():
        for _ in range(2):  # a second compile in this process: a report line, no second warning
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="enn", options={"attention": False, "epilogue": False})
            torch.testing.assert_close(compiled(x), model(x))
            torch.testing.assert_close(compiled(x), model(x))
    fallbacks = enn_backend.report().to_dict()["fallbacks"]
    assert [(f["kind"], f["node"]) for f in fallbacks] == [("pinned_from_state", "addmm")] * 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("fail_count must be a positive integer" in w for w in warnings) == 1, warnings
    announced = [w for w in warnings if "run eagerly" in w]
    assert len(announced) == 1 and f"python -m enn_backend state clear --cache-dir {tmp_path}" in announced[0]


def test_strict_mode_names_the_persisted_pin_that_hides_a_kernel_and_the_command_that_clears_it(
        tmp_path, monkeypatch, caplog):
    """guard='strict' after a faulting run: the kernel kernel state pinned is not compiled, so strict
    cannot check it; a warning and the report say which pin and how to clear it (and that works)."""
    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    _write_state(tmp_path, [_entry(KEY)])
    model, x = _mlp()
    with caplog.at_level(logging.WARNING, logger="enn_backend"), torch.no_grad():
        compiled = torch.compile(model, backend="enn", options={"guard": "strict", "attention": False, "epilogue": False})
        torch.testing.assert_close(compiled(x), model(x))
    [fb] = enn_backend.report().to_dict()["fallbacks"]
    assert fb["kind"] == "pinned_from_state" and fb["node"] == "addmm"
    assert f"guard='strict' does not check them (kernels {KEY})" in fb["reason"]
    warned = [r.getMessage() for r in caplog.records if "guard='strict' does not check" in r.getMessage()]
    assert len(warned) == 1 and "pinned_from_state" in warned[0]
    command = shlex.split(fb["action"].split("clear the pin: ")[1])
    assert command == ["python", "-m", "enn_backend", "state", "clear", "--cache-dir", str(tmp_path), "--key", KEY]
    assert cli.main(command[3:]) == 0 and _on_disk(tmp_path) == {}


@pytest.mark.parametrize("content", ["{\"format\": \"enn-kernel-state\", \"vers", "garbage\x00\x01", "[" * 100000,
                                     "{\"format\": \"enn-kernel-state\", \"version\": 1, \"entries\": []}"],
                         ids=["truncated", "garbage", "deep", "old-version"])
def test_an_unreadable_file_is_ignored_once_and_replaced_at_the_next_write(tmp_path, caplog, content):
    path = os.path.join(tmp_path, K.FILE_NAME)
    with open(path, "w") as f:
        f.write(content)
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        state = _state(tmp_path)
        assert state.lookup(KEY) is None
        state.record(KEY, "pinned", reason="r")
    assert caplog.text.count("ignoring kernel state file") == 1, caplog.text
    assert set(_on_disk(tmp_path)) == {KEY}


def test_a_file_of_a_newer_format_is_left_alone(tmp_path, caplog):
    path = os.path.join(tmp_path, K.FILE_NAME)
    newer = json.dumps({"format": K.FORMAT, "version": K.VERSION + 1, "entries": [{"key": KEY, "new": 1}]})
    with open(path, "w") as f:
        f.write(newer)
    state = _state(tmp_path)
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        state.record(KEY, "pinned", reason="r")
    assert "newer than this enn's" in caplog.text and "apply in this process only" in caplog.text
    assert state.lookup(KEY) is not None and open(path).read() == newer


# ----------------------------------------------------------------------------- bounds
def test_past_the_entry_bound_the_oldest_entries_are_dropped_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(K, "MAX_ENTRIES", 5)
    _write_state(tmp_path, [_entry(f"k{i}", age_s=1000 - i) for i in range(5)])  # k0 is the oldest
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        _state(tmp_path).record(KEY, "pinned", reason="r")
    assert set(_on_disk(tmp_path)) == {"k1", "k2", "k3", "k4", KEY}
    assert "holds more than 5 entries: dropped the 1 whose last fault is oldest" in caplog.text


def test_a_file_past_the_size_bound_is_not_parsed(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(K, "MAX_FILE_BYTES", 2000)
    _write_state(tmp_path, [_entry(KEY, reason="x" * 400), _entry(KEY2, reason="y" * 400),
                            _entry(SHARED, reason="z" * 400), _entry("k", reason="w" * 400)])
    assert os.path.getsize(os.path.join(tmp_path, K.FILE_NAME)) > 2000
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        assert _state(tmp_path).lookup(KEY) is None
    assert "over the bound of 2000" in caplog.text


def test_entries_expire_after_max_age_days(tmp_path):
    assert K.MAX_AGE_DAYS == 30
    _write_state(tmp_path, [_entry(KEY, age_s=31 * DAY), _entry(KEY2, age_s=29 * DAY)])
    state = _state(tmp_path)
    assert state.lookup(KEY) is None and state.lookup(KEY2) is not None
    state.record(SHARED, "pinned", reason="r")  # a write removes the expired entry
    assert set(_on_disk(tmp_path)) == {KEY2, SHARED}


def test_an_entry_of_another_torch_or_enn_version_is_not_applied(tmp_path):
    _write_state(tmp_path, [_entry(KEY, torch_version="2.0.0", fail_count=7), _entry(KEY2, enn_version="0.0.1")])
    state = _state(tmp_path)
    assert state.lookup(KEY) is None and state.lookup(KEY2) is None
    assert {e.status(time.time()) for e in state.entries()} == {"other version"}
    e = state.record(KEY, "pinned", reason="re-tested, still broken")  # a new entry, the old one kept
    assert e.fail_count == 1 and e.torch_version == torch.__version__
    with open(state.path) as f:
        versions = sorted((x["key"], x["torch_version"]) for x in json.load(f)["entries"])
    assert versions == sorted([(KEY, "2.0.0"), (KEY, torch.__version__), (KEY2, torch.__version__)])


# ----------------------------------------------------------------------------- files
def test_orphan_temporary_files_are_removed_by_the_next_writer(tmp_path):
    orphan = tmp_path / f".tmp-0123abcd{K.FILE_NAME}"  # left by a writer killed mid-write
    other = tmp_path / ".tmp-0123abcdreport.json"  # another file's: not ours to remove
    orphan.write_text("{")
    other.write_text("{")
    _state(tmp_path).record(KEY, "pinned", reason="r")
    assert not orphan.exists() and other.exists()


def test_the_file_keeps_its_mode(tmp_path):
    state = _state(tmp_path)
    old = os.umask(0o027)
    try:
        state.record(KEY, "pinned", reason="r")  # a new file: 0666 less the umask, as open() makes it
        assert oct(os.stat(state.path).st_mode & 0o777) == oct(0o640)
        os.chmod(state.path, 0o664)
        state.record(KEY2, "pinned", reason="r")
        assert oct(os.stat(state.path).st_mode & 0o777) == oct(0o664)
    finally:
        os.umask(old)


def test_injected_fault_state_never_reaches_the_default_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    inject = Options(fault_inject="aten.addmm:nan:fwd")  # no cache_dir: the default folder
    assert K.state_path(inject) is None
    K.state_for(inject).record(KEY, "pinned", reason="injected")
    assert K.state_for(inject).lookup(KEY) is not None  # this process remembers it
    assert not (tmp_path / "home").exists()
    assert K.state_for(Options()).lookup(KEY) is None  # the real state does not

    explicit = Options(fault_inject="aten.addmm:nan:fwd", cache_dir=str(tmp_path / "mine"))
    K.state_for(explicit).record(KEY, "pinned", reason="injected")
    assert [p.name for p in (tmp_path / "mine").glob("kernel_state*.json")] == [os.path.basename(K.state_path(explicit))]
    assert K.state_for(Options(cache_dir=str(tmp_path / "mine"))).lookup(KEY) is None


# ----------------------------------------------------------------------------- CLI
def test_state_list_and_clear(tmp_path, capsys):
    state = _state(tmp_path)
    state.record(KEY, "pinned", RuntimeError("boom"), reason="exception in compiled kernel")
    state.record(KEY2, "pinned", reason="NaN/Inf in compiled output")
    _write_state(tmp_path, list(_on_disk(tmp_path).values()) + [_entry(SHARED, torch_version="2.0.0")])
    where = ["--cache-dir", str(tmp_path)]

    assert cli.main(["state", "list", *where]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(KEY + " "))
    key, action, fails, age, *status, torch_version, machine = row.split()[:8]
    assert (action, fails, status, torch_version, machine) == ("pinned", "1", ["in", "force"], torch.__version__,
                                                                socket.gethostname())
    assert age.endswith("s") and row.endswith("exception in compiled kernel")
    assert "other version" in next(line for line in out.splitlines() if line.startswith(SHARED))
    assert "3 entries, 2 in force" in out

    assert cli.main(["state", "list", "--json", *where]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {(e["key"], e["status"]) for e in data["entries"]} == {(KEY, "in force"), (KEY2, "in force"),
                                                                  (SHARED, "other version")}

    assert cli.main(["state", "clear", "--key", "4x16", *where]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and set(_on_disk(tmp_path)) == {KEY2, SHARED}
    assert cli.main(["state", "clear", "--key", "no-such-kernel", *where]) == 1
    assert "no entry's key contains 'no-such-kernel'" in capsys.readouterr().err
    assert cli.main(["state", "clear", *where]) == 0
    assert "removed 2 entries" in capsys.readouterr().out and _on_disk(tmp_path) == {}
    assert cli.main(["state", "list", *where]) == 0
    assert "no kernel state in" in capsys.readouterr().out


def test_the_clear_commands_state_list_prints_work_when_pasted(tmp_path, capsys):
    folder = tmp_path / "a folder"  # a space: the printed commands must quote it
    folder.mkdir()
    _write_state(folder, [_entry(KEY, age_s=60.0), _entry(KEY2, age_s=120.0)])
    assert cli.main(["state", "list", "--cache-dir", str(folder)]) == 0
    hint = capsys.readouterr().out.split("Clear: ")[1].splitlines()[0]
    every, one = hint.removesuffix(")").split(" (one kernel: ")
    assert shlex.split(one)[-2:] == ["--key", KEY]  # the most recent fault
    assert cli.main(shlex.split(one)[3:]) == 0 and set(_on_disk(folder)) == {KEY2}
    assert cli.main(shlex.split(every)[3:]) == 0 and _on_disk(folder) == {}


def test_state_cli_errors(tmp_path, capsys):
    for argv in (["state"], ["state", "list", "--bogus"], ["state", "drop"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["state", "clear", "--help"])
    assert exc.value.code == 0 and "--key TEXT" in capsys.readouterr().out
    (tmp_path / "file").write_text("")
    assert cli.main(["state", "list", "--cache-dir", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_doctor_shows_the_pins_in_force_and_how_to_clear_them(tmp_path, monkeypatch, capsys):
    from enn_backend import doctor

    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    _write_state(tmp_path, [_entry(KEY), _entry(KEY2, action="fp32"), _entry(SHARED, age_s=40 * DAY)])
    doctor.main([])
    out = capsys.readouterr().out
    assert "kernel state: 2 pin(s) in force (1 kernel(s) run eagerly, 1 graph(s) in fp32)" in out
    assert "1 more expired or of another torch/enn version" in out
    assert f"clear them: python -m enn_backend state clear --cache-dir {tmp_path}" in out


def test_doctor_finds_an_unreadable_state_file_and_says_how_to_start_afresh(tmp_path, monkeypatch, capsys):
    from enn_backend import doctor

    monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path))
    (tmp_path / K.FILE_NAME).write_text("garbage{")
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "kernel state: UNREADABLE" in out and "status: PROBLEMS FOUND" in out
    command = shlex.split(out.split("start it afresh: ")[1].splitlines()[0])
    assert cli.main(command[3:]) == 0
    assert doctor.main([]) == 0


def test_the_state_of_a_run_with_injected_faults_is_listed_and_its_hints_run_as_printed(tmp_path, capsys):
    """A run with fault_inject keeps its pins in a state file of its own: `state list` on the folder
    names it, and every command enn prints for it -- list, clear, clear one key -- works when pasted."""
    _write_state(tmp_path, [])
    path = K.state_path(Options(fault_inject="aten.addmm:nan", cache_dir=str(tmp_path)))
    with open(path, "w") as f:
        json.dump({"format": K.FORMAT, "version": K.VERSION, "entries": [_entry(KEY), _entry(KEY2)]}, f)
    state = K.KernelState(path)
    assert cli.main(["state", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no kernel state in" in out and f"also 2 entries of a run with injected faults (fault_inject) in {path}" in out
    listing = shlex.split(out.split(f"{path}: ")[1].splitlines()[0])
    assert listing == shlex.split(K.state_command(state, "list"))
    assert cli.main(listing[3:]) == 0 and KEY in capsys.readouterr().out
    one = shlex.split(K.state_command(state, "clear", KEY))
    assert one[-2:] == ["--key", KEY] and cli.main(one[3:]) == 0
    assert [e.key for e in K.KernelState(path).entries()] == [KEY2]
    assert cli.main(shlex.split(K.state_command(state, "clear"))[3:]) == 0
    assert K.KernelState(path).entries() == []
