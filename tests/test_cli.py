"""``python -m enn_backend`` behaves like a Unix tool: --help everywhere without running the
command, --version, exit status 2 and one error line for bad arguments and files, no traceback
when the reader of its output goes away. One fresh process per case; nothing compiles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import enn_backend
from enn_backend import cli


def _enn(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS"))}
    return subprocess.run([sys.executable, "-m", "enn_backend", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def _one_error_line(res: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and text in res.stderr, res.stderr[-2000:]
    assert len([ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith(" ")]) <= 2, res.stderr


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help_and_refuses_unknown_arguments(command, capsys):
    """In this process (argparse exits before a command runs): usage on --help, status 2 on a stray flag."""
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0 and f"usage: python -m enn_backend {command}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--no-such-flag"])
    assert exc.value.code == 2 and f"python -m enn_backend {command}: error:" in capsys.readouterr().err


def test_doctor_help_does_not_run_doctor():
    res = _enn("doctor", "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m enn_backend doctor")
    ran = [ln for ln in res.stdout.splitlines() if ln.startswith(("status:", "torch ", "entry point"))]
    assert not ran, res.stdout


def test_version():
    res = _enn("--version")
    assert (res.returncode, res.stdout) == (0, f"enn_backend {enn_backend.__version__}\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_demo_on_a_device_this_torch_lacks_is_a_usage_error():
    _one_error_line(_enn("demo", "--device", "cuda"), 2, "argument --device: 'cuda': CUDA is not available")


def test_minify_of_a_file_that_is_not_a_repro_script(tmp_path):
    (tmp_path / "fault.json").write_text('{"format": "enn-fault"}')
    _one_error_line(_enn("minify", str(tmp_path / "fault.json")), 2, "is not a Python script")


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`report --json FILE | head -1`: the reader exits first; no BrokenPipeError, status 128 + SIGPIPE."""
    path = tmp_path / "report.json"
    enn_backend.reset()
    enn_backend.report().save(str(path))
    assert json.loads(path.read_text())["format"] == "enn-report"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS"))}
    proc = subprocess.Popen([sys.executable, "-m", "enn_backend", "report", "--json", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()  # the reader is gone long before the command writes
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 128 + signal.SIGPIPE, err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err


def test_doctor_on_a_fresh_home_says_the_cache_folders_are_writable(tmp_path, monkeypatch, capsys):
    """A new user has no ~/.cache yet: enn creates it, so doctor must not report it unwritable;
    a folder that cannot be made is reported."""
    from enn_backend import doctor

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.delenv("ENN_CACHE_DIR")
    monkeypatch.delenv("ENN_REPRO_DIR")
    doctor.main([])
    out = capsys.readouterr().out
    assert f"enn cache dir: {tmp_path}/home/.cache/enn (writable)" in out
    assert f"enn repro dir: {tmp_path}/home/.cache/enn/repros (writable)" in out
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ENN_REPRO_DIR", str(tmp_path / "a-file" / "repros"))
    doctor.main([])
    assert "a-file/repros (NOT writable: no repro scripts)" in capsys.readouterr().out


def test_state_clear_of_a_key_exits_1_when_there_is_no_state_at_all(tmp_path, capsys):
    """docs/TROUBLESHOOTING.md: clear exits 1 when --key matches nothing (a missing file included)."""
    assert cli.main(["state", "clear", "--key", "aten.erf", "--cache-dir", str(tmp_path)]) == 1
    assert "no entry's key contains 'aten.erf'" in capsys.readouterr().err
    assert cli.main(["state", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "nothing to clear" in capsys.readouterr().out
