"""The ``ENN_*`` variables enn names as valid (in the warning about a misspelt one) are enn's own:
each is an option's variable or one that enn's code reads, never one only the tests read."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from enn_backend import options as options_module
from enn_backend.options import Options

PACKAGE = Path(options_module.__file__).resolve().parent


def _listed_as_valid(monkeypatch, caplog) -> set[str]:
    monkeypatch.setattr(options_module, "_warned_env", set())
    with caplog.at_level(logging.WARNING, logger="enn_backend.options"):
        Options.from_sources({}, environ={"ENN_NO_SUCH_VARIABLE": "1"})
    [message] = [r.getMessage() for r in caplog.records if "ENN_NO_SUCH_VARIABLE" in r.getMessage()]
    return set(re.findall(r"\bENN_[A-Z0-9_]+", message.split("Valid: ", 1)[1]))


def test_every_variable_listed_as_valid_is_read_by_enn_itself(monkeypatch, caplog):
    listed = _listed_as_valid(monkeypatch, caplog)
    option_vars = {f.metadata["env"] for f in dataclasses.fields(Options) if f.metadata["env"]}
    assert option_vars <= listed
    code = "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py") if p != Path(options_module.__file__).resolve())
    unread = sorted(v for v in listed - option_vars if not re.search(rf"\b{v}\b", code))
    assert not unread, f"listed as valid, but no module of enn_backend reads them (a test's variable?): {unread}"
