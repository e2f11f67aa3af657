"""docs/TROUBLESHOOTING.md's walkthrough, run command by command in fresh processes.

The walkthrough section holds a ```python <file>``` block (written to a temporary folder)
and ```console``` blocks: ``$ <command>`` lines (``# exit N`` gives the expected exit code,
default 0) followed by the output the doc shows. Each shown line must appear in the real
output (numbers may differ); a line starting with ``...`` must appear inside some line. The
doc's user has the home folder ``/home/me``; the commands run with a fresh one, which holds
enn's cache folder (``~/.cache/enn``: kernel state, repro scripts) as for a new user.

It is also the end-to-end test of the debugging tools: an injected NaN in a transformer
block makes the guard write a repro that exits 3 (the fault reproduces) standalone, and ``minify`` shrinks it to
a handful of nodes that still fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "TROUBLESHOOTING.md"
_NUMBER = r"\d+(?:\.\d+)?"


def parse_walkthrough(text: str) -> tuple[dict[str, str], list[tuple[str, int, list[str]]]]:
    section = text.split("<!-- walkthrough:start -->", 1)[1].split("<!-- walkthrough:end -->", 1)[0]
    files: dict[str, str] = {}
    steps: list[tuple[str, int, list[str]]] = []
    for info, body in re.findall(r"```([^\n]*)\n(.*?)```", section, flags=re.S):
        words = info.split()
        if words[:1] == ["python"] and len(words) == 2:
            files[words[1]] = body
        elif words[:1] == ["console"]:
            for line in body.splitlines():
                if line.startswith("$ "):
                    cmd, _, comment = line[2:].partition("#")
                    m = re.search(r"exit (\d+)", comment)
                    steps.append((cmd.strip(), int(m.group(1)) if m else 0, []))
                elif line.strip():
                    steps[-1][2].append(line)
    return files, steps


def _pattern(text: str) -> str:
    parts = re.split(f"({_NUMBER})", text)
    return "".join(_NUMBER if i % 2 else re.escape(p) for i, p in enumerate(parts))


def missing_lines(expected: list[str], output: str) -> list[str]:
    lines = [ln.strip() for ln in output.splitlines()]
    missing = []
    for want in expected:
        if want.strip() == "...":
            continue
        if want.startswith("..."):
            pat = re.compile(_pattern(want[3:].strip()))
            ok = any(pat.search(ln) for ln in lines)
        else:
            pat = re.compile(_pattern(want.strip()))
            ok = any(pat.fullmatch(ln) for ln in lines)
        if not ok:
            missing.append(want)
    return missing


def test_parser_reads_the_walkthrough():
    files, steps = parse_walkthrough(DOC.read_text())
    assert "train.py" in files
    assert [code for _, code, _ in steps] == [0, 0, 0, 3, 0, 3]
    assert any("minify" in cmd for cmd, _, _ in steps)


def test_missing_lines_rejects_wrong_output():
    assert missing_lines(["enn minify: nonfinite reproduces with 1 of 52 nodes"],
                         "enn minify: nonfinite reproduces with 3 of 60 nodes\n") == []
    assert missing_lines(["FAULT REPRODUCES (nonfinite) (exit 3)"], "fault does not reproduce (exit 0)\n")
    assert missing_lines(["... node=erf"], "x node=mm y\n")


@pytest.mark.slow
def test_walkthrough_commands(tmp_path):
    files, steps = parse_walkthrough(DOC.read_text())
    work = tmp_path / "work"  # the working directory, apart from the home folder as a user's is
    work.mkdir()
    for name, body in files.items():
        (work / name).write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS", "TORCH_TRACE"))}
    home = tmp_path / "home"
    env["HOME"] = str(home)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for cmd, code, expected in steps:
        res = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        out = res.stdout + res.stderr
        assert res.returncode == code, f"$ {cmd}\nexit {res.returncode}, want {code}\n{out[-3000:]}"
        missing = missing_lines([ln.replace("/home/me", str(home)) for ln in expected], out)
        assert not missing, f"$ {cmd}\nlines shown in the doc but not printed: {missing}\n--- output:\n{out[-3000:]}"

    # The minimized repro is at most a handful of nodes and names the culprit.
    assert sorted(os.listdir(work)) == sorted([*files, "enn_report.json"])  # nothing else in the working directory
    folder = home / ".cache" / "enn" / "repros" / "g0-forward-nonfinite-erf"
    mini = _expect(folder / "minified" / "repro.py")
    assert mini["kind"] == "nonfinite"
    assert "erf" in mini["nodes"] and len(mini["nodes"]) <= 5, mini
    assert _expect(folder / "repro.py")["nodes"] == ["erf"] and (folder / "inputs.pt").exists()


def _expect(script: Path) -> dict:
    import ast

    line = next(ln for ln in script.read_text().splitlines() if ln.startswith("EXPECT = "))
    return ast.literal_eval(line[len("EXPECT = "):])
