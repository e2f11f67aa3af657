"""README.md, the front door: a page a user reads in five minutes.

It stays short and states the project as it is: no test counts (CI shows them), an options table
faithful to enn_backend/options.py (every option, its ``ENN_*`` variable and its default; no
variable that options.py does not know), links that resolve, file paths that exist, and shell
commands that work when pasted -- the install and test commands as .ci/run runs them, and every
other command run here in a fresh process with a fresh home folder (docs/TROUBLESHOOTING.md's
walkthrough is run the same way: tests/test_debug_walkthrough.py).
"""

from __future__ import annotations

import enum
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the pages the README sends its reader to for what it no longer holds: their links are checked too
LINKED_DOCS = [ROOT / "docs" / "ARCHITECTURE.md", ROOT / "docs" / "GUARD.md", ROOT / "bench" / "HISTORY.md"]
MAX_LINES = 300

OPTIONS_HEADER = "| option | env var | default | what it does |"
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)
ENN_VAR = re.compile(r"\bENN_[A-Z0-9_]+")


def readme() -> str:
    return README.read_text()


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (a ``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def options_rows(text: str) -> dict[str, tuple[str, str]]:
    """option -> (env var cell, default cell) of the README's options table."""
    lines = text.splitlines()
    start = lines.index(OPTIONS_HEADER) + 2  # past the header and its |---| line
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, env, default, *_ = _cells(line)
        rows[name.strip("`")] = (env, default)
    return rows


def shell_commands(text: str) -> list[str]:
    """Every command line of the README's shell blocks, its trailing comment removed."""
    out = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.splitlines():
            line = line.removeprefix("$ ").split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def ci_test_command() -> str:
    """The test command .ci/run runs (its ``tests=(...)`` array)."""
    m = re.search(r"^tests=\((.*)\)\s*$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert m, ".ci/run names its test command as tests=(...)"
    return m.group(1).strip()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


# ----------------------------------------------------------------------------- the page
def test_readme_is_short():
    n = len(readme().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; the front door stays within {MAX_LINES}"


def test_readme_has_no_test_counts():
    counts = re.findall(r"\b\d+ (?:passed|failed|skipped|xfailed|xpassed|errors?|deselected)\b", readme())
    assert not counts, f"test counts belong to CI's output, not the README: {counts}"


# ----------------------------------------------------------------------------- options
def test_every_enn_variable_in_the_readme_is_one_options_py_knows():
    known = set(ENN_VAR.findall((ROOT / "enn_backend" / "options.py").read_text()))
    unknown = sorted(set(ENN_VAR.findall(readme())) - known)
    assert not unknown, f"README names ENN_* variables that enn_backend/options.py does not know: {unknown}"


def test_the_options_table_is_faithful_to_options_py():
    from enn_backend.options import OVERRIDE_ENV, Options

    rows = options_rows(readme())
    names = [f.name for f in fields(Options)]
    assert set(rows) == set(names), (f"missing from the README's options table: {sorted(set(names) - set(rows))}; "
                                     f"not options: {sorted(set(rows) - set(names))}")
    for f in fields(Options):
        env_cell, default_cell = rows[f.name]
        env = f.metadata["env"]
        if env:
            assert f"`{env}`" in env_cell, (f.name, env_cell)
            assert ("(override)" in env_cell) == (env in OVERRIDE_ENV), (f.name, env_cell)
        else:
            assert not ENN_VAR.search(env_cell), (f.name, env_cell)
        value = f.default.value if isinstance(f.default, enum.Enum) else f.default
        shown = default_cell.strip("`")
        if value in ("", (), None):
            assert shown in ("''", "none"), (f.name, default_cell)
        else:
            assert shown == str(value), (f.name, default_cell, value)


# ----------------------------------------------------------------------------- links and paths
@pytest.mark.parametrize("doc", [README, *LINKED_DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc.name}: links that lead nowhere: {broken}"


def test_file_paths_the_readme_names_exist():
    # a path: folders, then a file name with an extension or a trailing slash (not `true/false`)
    paths = [t for t in re.findall(r"`([^`\s]+)`", readme())
             if re.fullmatch(r"[\w-]+(?:/[\w*-]+)*/[\w*-]+\.[\w*]+|[\w-]+(?:/[\w*-]+)+/", t)]
    missing = [p for p in paths if not glob.glob(str(ROOT / p.rstrip("/")))]
    assert not missing, f"README names files that are not in the repository: {missing}"


# ----------------------------------------------------------------------------- commands
def test_the_readme_shows_ci_s_test_command():
    assert ci_test_command() in shell_commands(readme())


def _pip_install_ok(cmd: str) -> list[str]:
    """What is wrong with a ``pip install`` line: extras pyproject.toml lacks, a torch pin outside
    the range it supports, a target that is not this checkout."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project.get("optional-dependencies", {}))
    torch_req = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    words = shlex.split(cmd)[2:]
    problems = []
    for before, word in zip(["", *words], words):
        if before == "-e":
            m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", word)
            if not m:
                problems.append(f"-e {word}: not this checkout")
            elif m.group(1):
                problems += [f"extra {e!r} is not in pyproject.toml" for e in m.group(1).split(",") if e not in extras]
        elif word.startswith("torch=="):
            if word.split("==")[1] not in torch_req.specifier:
                problems.append(f"{word} is outside pyproject.toml's {torch_req}")
    return problems


def _inline_commands(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [c for c in re.findall(r"`([^`\n]+)`", prose) if c.startswith(("python -m enn_backend", "pip install"))]


def test_install_commands_match_pyproject():
    installs = [c for c in shell_commands(readme()) + _inline_commands(readme()) if c.startswith("pip install")]
    assert installs
    problems = {c: _pip_install_ok(c) for c in installs}
    assert not any(problems.values()), problems


def test_enn_commands_named_inline_exist():
    from enn_backend.cli import COMMANDS

    for cmd in _inline_commands(readme()):
        if cmd.startswith("python -m enn_backend"):
            words = cmd.split()[3:]
            assert not words or words[0] in (*COMMANDS, "--help", "--version"), cmd


def _runnable() -> list[str]:
    """The README's shell commands that this test runs as pasted: all but the installs (they
    would change this environment; checked above against pyproject.toml) and the whole suite."""
    return [c for c in shell_commands(readme()) if not c.startswith("pip install") and c != ci_test_command()]


def test_the_readme_has_commands_to_run():
    assert any(c.endswith(" doctor") for c in _runnable()) and any(c.endswith(" demo") for c in _runnable())


@pytest.mark.slow
@pytest.mark.parametrize("cmd", _runnable())
def test_readme_command_works_when_pasted(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "TORCH_LOGS", "TORCH_TRACE"))}
    env["HOME"] = str(tmp_path / "home")  # a new user's: no enn cache folder, no kernel state yet
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    res = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"$ {cmd}\nexit {res.returncode}\n{(res.stdout + res.stderr)[-3000:]}"
