"""One front door to enn's measurements (issue 39): ``python -m enn_backend bench``.

``bench/`` holds no script that ``python -m enn_backend bench --help`` does not name, except those
bench/README.md names with the reason they stay; the tools it names are scripts that exist; every
script path the README names exists; a tool runs through the door with its own options; the
scripts retired from ``bench/`` left their logs behind, each with the command that made it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from enn_backend.bench import cli, tools

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
README = BENCH / "README.md"
HISTORY = BENCH / "HISTORY.md"
KEPT_HEADING = "## Scripts kept outside the front door"
RETIRED_HEADING = "## Retired scripts"
# a path to a .py or .sh file: folders, then a name (``bench/NAME.py`` is the README's placeholder)
SCRIPT_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh))\b")


def _scripts() -> list[Path]:
    return sorted([*BENCH.glob("*.py"), *BENCH.glob("*.sh")])


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def _first_cells(section: str) -> list[str]:
    """The first cell of each body row of the section's tables, backticks removed."""
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [row.split("|")[1].strip().strip("`") for row in rows]


def kept_with_a_reason() -> dict[str, str]:
    """bench/README.md's scripts kept outside the front door: file name -> reason."""
    section = _section(README.read_text(), KEPT_HEADING)
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {Path(row.split("|")[1].strip().strip("`")).name: row.split("|")[2].strip() for row in rows}


@pytest.fixture(scope="module")
def help_text() -> str:
    res = subprocess.run([sys.executable, "-m", "enn_backend", "bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_every_bench_script_is_named_by_the_help_or_kept_with_a_reason(help_text):
    kept = kept_with_a_reason()
    assert all(len(reason) > 20 for reason in kept.values()), kept
    loose = [p.name for p in _scripts()
             if not re.search(rf"(?<![\w.]){re.escape(p.stem)}(?![\w])", help_text) and p.name not in kept]
    assert not loose, (f"bench/ scripts that `python -m enn_backend bench --help` does not name and "
                       f"bench/README.md ('{KEPT_HEADING}') does not keep with a reason: {loose}")


def test_the_help_names_only_scripts_that_exist(help_text):
    assert set(tools.TOOLS) <= {p.stem for p in BENCH.glob("*.py")}
    assert not set(tools.TOOLS) & set(kept_with_a_reason()), "a script is either a tool or kept with a reason"
    for name in tools.TOOLS:
        assert re.search(rf"^  {name} ", help_text, re.M), name


def test_the_readme_lists_every_tool():
    listed = _first_cells(_section(README.read_text(), "## The tools"))
    assert listed == list(tools.TOOLS), "bench/README.md's tools table: the tools of enn_backend/bench/tools.py, in order"


def test_every_script_path_the_bench_readme_names_exists():
    named = {m for m in SCRIPT_PATH.findall(README.read_text()) if "NAME" not in m}
    assert named, "the README names its scripts"
    missing = sorted(p for p in named if not (ROOT / p).is_file() and not (BENCH / p).is_file())
    assert not missing, f"bench/README.md names scripts that do not exist: {missing}"


def test_a_tool_runs_through_the_front_door_with_its_own_options():
    res = subprocess.run([sys.executable, "-m", "enn_backend", "bench", "--tool", "distributed", "--", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "--world-size" in res.stdout  # distributed.py's own argparse answered
    assert "python bench/distributed.py --help" in res.stderr  # the command it stands for


def test_an_unknown_tool_or_a_misplaced_tool_flag_is_refused(capsys):
    assert cli.main(["--tool", "no_such_tool"]) == 2
    assert "unknown tool 'no_such_tool'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--quick", "--tool", "host_tax"])
    assert exc.value.code == 2
    assert "--tool NAME comes first" in capsys.readouterr().err


def test_the_gpu_session_stages_call_scripts_and_tools_that_exist():
    text = (BENCH / "gpu_session.sh").read_text()
    for name in re.findall(r"--tool ([a-z0-9_]+)", text):
        assert name in tools.TOOLS, name
    for path in re.findall(r"python3? (bench/[a-z0-9_]+\.py)", text):
        assert (ROOT / path).is_file(), path


def test_retired_scripts_left_their_logs_with_the_commands_that_made_them():
    section = _section(HISTORY.read_text(), RETIRED_HEADING)
    assert re.search(r"removed from `bench/` in commit [0-9a-f]{7,40}\b", section), "the commit that retired them"
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows
    for row in rows:
        script, _what, logs, last = (c.strip() for c in row.strip().strip("|").split(" | "))
        script = script.strip("`")
        assert not (BENCH / script).exists(), f"{script} is listed as retired but is still in bench/"
        assert f"python bench/{script}" in logs, f"{script}: the command that made its logs"
        files = re.findall(r"`((?:cpu|gpu-h\d+)/[\w.]+)`", logs)
        assert files and all((BENCH / "results" / f).is_file() for f in files), (script, files)
        assert re.fullmatch(r"[0-9a-f]{7,40}", last), (script, last)
