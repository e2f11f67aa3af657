"""Inductor's own silent miscompiles: enn keeps Inductor's attention rewrites off its compiles
(compat.inductor_attention_rewrites_off), and the upstream corpus in minifier_repros/ is
consistent. CPU, tiny shapes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import threading
from typing import Any

import pytest
import torch

import enn_backend
from enn_backend import compat


@pytest.fixture(autouse=True)
def _compile_afresh():
    """Joint-graph passes (where the attention patterns apply) do not run on a cache hit: each
    compile here must run them, whatever an earlier test of the session compiled."""
    with compat.no_aot_autograd_cache(), compat.inductor_config.patch(fx_graph_cache=False):
        yield


def attention(q, k, v):
    return (q @ k.transpose(-2, -1) * 0.125).softmax(dim=-1) @ v


def over_heads(q, k, v):  # pytorch/pytorch#196468: not attention, Inductor rewrites it as such
    return (q @ k.transpose(-2, -1) * 0.125).softmax(dim=1) @ v


def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 16, 8, generator=g) for _ in range(3)]


def inductor_attention_fusions() -> int:
    return compat.dynamo_counters["inductor"]["fuse_attention"]


def test_inductor_attention_rewrites_recognized():
    """enn finds Inductor's attention patterns among the joint-graph patterns (a torch that
    registers them differently fails here, not silently at run time)."""
    compat.dynamo_counters.clear()
    torch.compile(attention, backend="inductor")(*qkv())  # Inductor registers its patterns lazily
    assert compat.inductor_attention_rewrites() >= 27  # 2.11: 27 patterns, each in several variants
    assert inductor_attention_fusions() == 1


def test_enn_compiles_without_inductor_attention_rewrites():
    """Under enn, Inductor's patterns rewrite nothing (the softmax over heads stays eager's), and
    backend="inductor" in the same process keeps them."""
    x = qkv()
    compat.dynamo_counters.clear()
    out = torch.compile(over_heads, backend="enn")(*x)
    torch.testing.assert_close(out, over_heads(*x))
    out = torch.compile(attention, backend="enn")(*x)
    torch.testing.assert_close(out, attention(*x))
    assert inductor_attention_fusions() == 0
    assert "apply" not in compat.attention_rewrites._joint_patterns().__dict__  # the registry is as Inductor made it

    torch._dynamo.reset()
    plain = torch.compile(attention, backend="inductor")(*x)
    torch.testing.assert_close(plain, attention(*x))
    assert inductor_attention_fusions() == 1
    if compat.TORCH_VERSION < (2, 15):  # the upstream bug, on the torch versions it affects
        wrong = torch.compile(over_heads, backend="inductor")(*x)
        assert (wrong - over_heads(*x)).abs().max() > 0.1


def test_other_threads_keep_inductor_attention_rewrites():
    """The patterns are off only for the thread inside enn's compile: a plain Inductor compile in
    another thread meanwhile still fuses attention."""
    compat.dynamo_counters.clear()
    x = qkv()
    done = []
    with compat.inductor_attention_rewrites_off():
        t = threading.Thread(target=lambda: done.append(torch.compile(attention, backend="inductor")(*x)))
        t.start()
        t.join()
    assert done and inductor_attention_fusions() == 1


def test_unrecognized_attention_patterns_are_reported(monkeypatch, caplog):
    """A torch whose attention patterns enn cannot tell apart gets a warning, not silence."""
    monkeypatch.setattr(compat.attention_rewrites, "is_inductor_attention_rewrite", lambda entry: False)
    monkeypatch.setattr(compat.attention_rewrites, "_attention_warned", [])
    x = qkv()
    with caplog.at_level("WARNING", logger="enn_backend"):
        torch.compile(lambda q, k, v: attention(q, k, v) * 2, backend="enn")(*x)
    assert any("does not recognize" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- known miscompiles
def aten_graph(fn, *args):
    return compat.make_fx(fn)(*args)


def known_bad_model(f, f2, i8, u8, h):
    return (
        f // f2,                                    # pinned: floating floor division (#197895)
        torch.div(f, f2, rounding_mode="floor"),    # pinned: the same, as AOT Autograd hands it over
        torch.div(f, f2, rounding_mode="trunc"),    # not: trunc
        torch.div(i8, 3, rounding_mode="floor"),    # not: integer floor division is exact
        torch.remainder(f, 3.0),                    # pinned: floating remainder (#198057)
        torch.remainder(i8, 3),                     # not: integer remainder
        torch.any(u8),                              # pinned: any of uint8 (#198081)
        torch.any(u8 > 0),                          # not: any of bool
        torch.bmm(i8[None], i8.t()[None]),          # pinned before 2.15: integer bmm (#191308)
        torch.bmm(f[None], f2.t()[None]),           # not: floating bmm
        torch.ldexp(h, f),                          # pinned: ldexp promoting its mantissa (#197091)
        torch.ldexp(f, f2),                         # not: same dtypes
        torch.argmax(f),                            # pinned before 2.15: argmax over all dims (#193751)
        torch.argmax(f, 1),                         # not: over one dim
    )


def known_bad_inputs():
    g = torch.Generator().manual_seed(0)
    f, f2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g).abs() + 1
    return f, f2, torch.randint(-5, 5, (3, 4), dtype=torch.int8, generator=g), \
        torch.randint(0, 3, (3, 4), dtype=torch.uint8, generator=g), f.half()


def pinned_ops(gm, version):
    by_name = {n.name: n for n in gm.graph.nodes}
    return [(str(by_name[name].target), reason) for name, reason in compat.known_miscompiles(gm, version)]


def test_known_miscompiles_pin_exactly_the_affected_nodes():
    gm = aten_graph(known_bad_model, *known_bad_inputs())
    pinned = pinned_ops(gm, (2, 13))
    assert [op for op, _ in pinned] == [
        "aten.floor_divide.default", "aten.div.Tensor_mode", "aten.remainder.Scalar", "aten.any.default",
        "aten.bmm.default", "aten.ldexp.Tensor", "aten.argmax.default"]
    issues = [197895, 197895, 198057, 198081, 191308, 197091, 193751]
    for (op, reason), issue in zip(pinned, issues):
        assert f"pytorch/pytorch#{issue}" in reason and "2.13" in reason, reason


def test_known_miscompiles_follow_the_torch_version():
    """Entries fixed upstream stop pinning from their release on; open ones pin on every version."""
    gm = aten_graph(known_bad_model, *known_bad_inputs())
    before, after = pinned_ops(gm, (2, 14)), pinned_ops(gm, (2, 15))
    gone = {op for op, _ in before} - {op for op, _ in after}
    assert gone == {"aten.bmm.default", "aten.argmax.default"}
    assert all("open" in reason for _, reason in after)
    assert compat.known_miscompiles(gm) == compat.known_miscompiles(gm, compat.TORCH_VERSION)


# ----------------------------------------------------------------------------- the corpus
REPROS = pathlib.Path(__file__).resolve().parent.parent / "minifier_repros"


def corpus() -> dict[str, Any]:
    """Every ``repro_upstream_*.py`` script, imported by file name (they import their shared
    checker, minifier_repros/upstream_corpus.py, as a sibling module)."""
    if str(REPROS) not in sys.path:
        sys.path.append(str(REPROS))
    mods = {}
    for path in sorted(REPROS.glob("repro_upstream_*.py")):
        spec = importlib.util.spec_from_file_location(f"_corpus_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods[path.name] = mod
    return mods


def test_corpus_scripts_name_their_issue_versions_and_mechanism():
    mods = corpus()
    from upstream_corpus import MECHANISMS  # noqa: PLC0415 - importable once corpus() ran

    for name, mod in mods.items():
        if not hasattr(mod, "MECHANISM"):
            continue  # a guard repro written by enn itself (debug/repro.py), not a corpus script
        assert name.startswith(f"repro_upstream_{mod.ISSUE}_"), name
        assert f"https://github.com/pytorch/pytorch/issues/{mod.ISSUE}" in mod.__doc__, name
        assert mod.MECHANISM in MECHANISMS and "Covered by:" in mod.__doc__ and "Torch:" in mod.__doc__, name
        assert mod.FIXED_IN is None or (isinstance(mod.FIXED_IN, tuple) and len(mod.FIXED_IN) == 2), name


def test_every_known_miscompile_has_its_corpus_script():
    mods = corpus()
    for entry in compat.KNOWN_MISCOMPILES:
        mod = mods[entry.test]
        assert (mod.ISSUE, mod.MECHANISM, mod.FIXED_IN) == (entry.issue, "known_bad", entry.fixed_in), entry.test
    known = {e.test for e in compat.KNOWN_MISCOMPILES}
    assert all(name in known for name, m in mods.items() if getattr(m, "MECHANISM", "") == "known_bad")


def test_known_miscompiles_alone_give_eager_results(monkeypatch):
    """Every known_bad script of the corpus returns eager's result under enn's defaults with the
    guard's value check off: the graph compiler's up-front pins alone cover them."""
    monkeypatch.setenv("ENN_GUARD_VALUES", "0")
    mods = corpus()
    failures = {}
    for entry in compat.KNOWN_MISCOMPILES:
        (test,) = [f for name, f in vars(mods[entry.test]).items() if name.startswith("test_")]
        enn_backend.reset()
        try:
            test()
        except AssertionError as exc:
            failures[entry.test] = str(exc)[:300]
        pins = [f for f in enn_backend.report().fallbacks if f.kind == "known_miscompile"]
        live = entry.fixed_in is None or compat.TORCH_VERSION < entry.fixed_in
        assert bool(pins) == live and all(f"pytorch/pytorch#{entry.issue}" in f.reason for f in pins), pins
        assert not [f for f in enn_backend.report().fallbacks if f.kind != "known_miscompile"]
    assert not failures, failures
