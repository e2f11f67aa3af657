"""The foundation: options, training/inference parity, dynamic shapes, isolation from Inductor."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import enn_backend
from enn_backend import compat
from enn_backend import options as options_module
from enn_backend.options import OVERRIDE_ENV, GuardMode, Options, OptionsError, options_table

from _models import assert_close_step, make, train_step


# ----------------------------------------------------------------------------- options
def test_unknown_option_names_valid_ones():
    with pytest.raises(OptionsError, match="unknown option 'gaurd'.*guard"):
        Options.from_sources({"gaurd": "off"}, environ={})


def test_bad_values_are_clear_errors():
    with pytest.raises(OptionsError, match="guard.*off, exceptions, nonfinite, values, strict"):
        Options.from_sources({"guard": "sometimes"}, environ={})
    with pytest.raises(OptionsError, match="ENN_GUARD_EVERY must be an integer"):
        Options.from_sources({}, environ={"ENN_GUARD_EVERY": "often"})
    with pytest.raises(OptionsError, match="ENN_DISABLE must be a boolean"):
        Options.from_sources({}, environ={"ENN_DISABLE": "maybe"})
    with pytest.raises(OptionsError, match="fault_inject kind"):
        Options.from_sources({"fault_inject": "aten.mm:boom"}, environ={})


def test_guard_mode_is_parsed_from_the_users_string_and_printed_as_it():
    for opts in (Options.from_sources({"guard": "values"}, environ={}),
                 Options.from_sources({}, environ={"ENN_GUARD": " values"}), Options(guard="values"),
                 Options().replace(guard="values")):
        assert opts.guard is GuardMode.VALUES
    opts = Options(guard="strict")
    assert opts.to_dict()["guard"] == "strict" and type(opts.to_dict()["guard"]) is str
    assert json.dumps(opts.to_dict()).count('"guard": "strict"') == 1 and f"{opts.guard}" == "strict"
    assert dict((name, default) for name, _, default, _ in options_table())["guard"] == "'nonfinite'"
    with pytest.raises(OptionsError, match="guard must be one of off, exceptions, nonfinite, values, strict"):
        Options(guard="sometimes")
    # what each mode does (enn_backend.options.GuardMode's table)
    rows = {m.value: (m.guarded, m.checks_outputs, m.checks_every_value, m.keeps_inputs, m.raises) for m in GuardMode}
    assert rows == {"off": (False, False, False, False, False), "exceptions": (True, False, False, True, False),
                    "nonfinite": (True, True, False, False, False), "values": (True, True, True, False, False),
                    "strict": (True, True, False, False, True)}


@pytest.mark.parametrize("value", [2.7, "2.7", 3.0, True, None, "3 calls"])
def test_integer_options_reject_non_integers(value):
    with pytest.raises(OptionsError, match=r"options\['guard_every'\] must be an integer"):
        Options.from_sources({"guard_every": value}, environ={})
    if isinstance(value, str):
        with pytest.raises(OptionsError, match="ENN_GUARD_EVERY must be an integer"):
            Options.from_sources({}, environ={"ENN_GUARD_EVERY": value})
    with pytest.raises(OptionsError, match="guard_every must be an integer"):
        Options(guard_every=value)


def test_integer_options_take_integers_and_integer_strings():
    assert Options.from_sources({"guard_every": 3, "guard_warmup": " 4 "}, environ={}).guard_every == 3
    assert Options.from_sources({"guard_warmup": " 4 "}, environ={}).guard_warmup == 4
    assert Options.from_sources({}, environ={"ENN_LOCALIZE_BUDGET": "8"}).localize_budget == 8


def test_precedence_defaults_then_env_then_code():
    assert Options.from_sources({}, environ={}).guard_every == 50
    assert Options.from_sources({}, environ={"ENN_GUARD_EVERY": "7"}).guard_every == 7
    assert Options.from_sources({"guard_every": 3}, environ={"ENN_GUARD_EVERY": "7"}).guard_every == 3
    assert Options.from_sources({"cache_dir": "/code"}, environ={"ENN_CACHE_DIR": "/env"}).cache_dir == "/code"
    assert Options.from_sources({}, mode="max-autotune", environ={"ENN_MODE": "reduce-overhead"}).mode == "max-autotune"
    assert Options.from_sources({}, environ={"ENN_MODE": "reduce-overhead"}).mode == "reduce-overhead"


def test_override_variables_beat_code():
    """ENN_DISABLE and ENN_GUARD are for bisecting without editing code: they win both ways."""
    assert set(OVERRIDE_ENV) == {"ENN_DISABLE", "ENN_GUARD"}
    assert Options.from_sources({"guard": "strict"}, environ={"ENN_GUARD": "off"}).guard == "off"
    assert Options.from_sources({"guard": "off"}, environ={"ENN_GUARD": "strict"}).guard == "strict"
    assert Options.from_sources({"disable": False}, environ={"ENN_DISABLE": "1"}).disable is True
    assert Options.from_sources({"disable": True}, environ={"ENN_DISABLE": "0"}).disable is False


def test_readme_documents_the_override_variables():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    rule = next(p for p in readme.split("\n\n") if "Precedence" in p)
    assert all(f"`{name}`" in rule for name in OVERRIDE_ENV), rule


def test_unknown_env_variable_warns_once_and_is_ignored(monkeypatch, caplog):
    monkeypatch.setattr(options_module, "_warned_env", set())
    with caplog.at_level(logging.WARNING, logger="enn_backend.options"):
        for _ in range(3):
            opts = Options.from_sources({}, environ={"ENN_GAURD": "off", "ENN_GUARD_EVERY": "9"})
    assert opts == Options(guard_every=9)
    warned = [r.getMessage() for r in caplog.records if "ENN_GAURD" in r.getMessage()]
    assert len(warned) == 1 and "ENN_GUARD" in warned[0].replace("ENN_GAURD", ""), warned


def test_a_stray_env_variable_does_not_break_a_compile(monkeypatch, caplog):
    monkeypatch.setattr(options_module, "_warned_env", set())
    monkeypatch.setenv("ENN_GAURD", "off")
    m, x = make("mlp")
    with caplog.at_level(logging.WARNING, logger="enn_backend.options"):
        y = torch.compile(m, backend="enn")(x)
    torch.testing.assert_close(y, m(x))
    assert "ignoring unknown environment variable ENN_GAURD" in caplog.text


INDUCTOR = compat.inductor_option_types()


def test_keys_enn_does_not_own_are_inductors_options():
    """options= takes Inductor's keys as backend="inductor" does: flat, dotted, with '-' for '_',
    or under 'inductor'; a misspelling names the closest keys of both; a wrong type is refused."""
    opts = Options.from_sources({"max_autotune": True, "triton.cudagraphs": False, "epilogue_fusion-first": True,
                                 "guard": "off"}, environ={}, inductor_config=INDUCTOR)
    assert (opts.guard, opts.inductor) == ("off", (("epilogue_fusion_first", True), ("max_autotune", True),
                                                   ("triton.cudagraphs", False)))
    assert Options.from_sources({"inductor": {"max_autotune": True}}, environ={}, inductor_config=INDUCTOR) \
        == Options(inductor=(("max_autotune", True),))
    assert Options.from_sources({"emulate_precision_casts": True}, environ={},  # enn's own key: its option
                                inductor_config=INDUCTOR) == Options(emulate_precision_casts=True)
    with pytest.raises(OptionsError, match=r"unknown option 'max_autotun'.*Closest: max_autotune"):
        Options.from_sources({"max_autotun": True}, environ={}, inductor_config=INDUCTOR)
    with pytest.raises(OptionsError, match=r"unknown option 'triton.cudagraph'.*Closest: triton.cudagraphs"):
        Options.from_sources({"triton.cudagraph": True}, environ={}, inductor_config=INDUCTOR)
    with pytest.raises(OptionsError, match=r"unknown option 'gaurd'.*Closest: guard"):
        Options.from_sources({"gaurd": "off"}, environ={}, inductor_config=INDUCTOR)
    with pytest.raises(OptionsError, match=r"Inductor option 'max_autotune' must be a bool, got str 'yes'"):
        Options.from_sources({"inductor": {"max_autotune": "yes"}}, environ={}, inductor_config=INDUCTOR)
    with pytest.raises(OptionsError, match="hook for enn's own passes"):
        Options.from_sources({"post_grad_custom_post_pass": print}, environ={}, inductor_config=INDUCTOR)
    with pytest.raises(OptionsError, match="unknown option 'max_autotune'"):  # no Inductor config to check against
        Options.from_sources({"max_autotune": True}, environ={})
    assert opts.codegen_hash() != opts.replace(inductor=()).codegen_hash()
    # a repro saves the option as its pairs and reads them back
    assert Options.from_sources({"inductor": opts.inductor}, environ={}, inductor_config=INDUCTOR).inductor == opts.inductor


def test_inductor_options_reach_every_inductor_compile_of_a_graph():
    """The Inductor keys of options= are in Inductor's config while it compiles enn's graphs: the
    first compile and the guard's recompile after a fault (a NaN planted after the mul)."""
    seen = []

    def probe(graph):  # Inductor's post_grad_custom_pre_pass: runs inside each graph's compile
        seen.append((compat.inductor_config.size_asserts, compat.inductor_config.triton.debug_sync_graph))

    assert (compat.inductor_config.size_asserts, compat.inductor_config.triton.debug_sync_graph) == (True, False)
    f = torch.compile(lambda x: torch.sin(x) * 2, backend="enn",
                      options={"size_asserts": False, "triton.debug_sync_graph": True, "post_grad_custom_pre_pass": probe,
                               "persist": False, "fault_inject": "aten.mul:nan:fwd"})
    x = torch.randn(8)
    torch.testing.assert_close(f(x), torch.sin(x) * 2)  # the guard pinned the mul and recompiled
    assert len(seen) >= 2 and set(seen) == {(False, True)}, seen
    assert enn_backend.report().to_dict()["graphs"][0]["pinned"] == ["mul"]


def test_each_test_has_its_own_enn_state(tmp_path):
    """conftest.py gives every test its own kernel-state and repro folders (nothing is shared
    with another test, nor with the user's ~/.cache/enn)."""
    opts = Options.from_sources()
    for folder in (opts.resolved_cache_dir(), opts.resolved_repro_dir()):
        assert os.path.commonpath([folder, str(tmp_path)]) == str(tmp_path), (folder, tmp_path)


def test_codegen_hash_ignores_runtime_only_options():
    a = Options.from_sources({}, environ={})
    assert a.codegen_hash() == a.replace(guard="off", guard_every=7).codegen_hash()
    assert a.codegen_hash() != a.replace(attention=False).codegen_hash()


def test_every_option_is_documented():
    for name, env, _default, doc in options_table():  # Inductor reads its own TORCHINDUCTOR_* variables
        assert (env.startswith("ENN_") or name == "inductor") and doc, name


def test_compile_rejects_unknown_option_before_running():
    m, x = make("mlp")
    f = torch.compile(m, backend="enn", options={"nope": 1})
    with pytest.raises(Exception, match="unknown option 'nope'"):
        f(x)


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_training_parity_fp32(kind):
    model, x = make(kind)
    compiled = torch.compile(model, backend="enn")
    for _ in range(2):  # second step runs the already compiled graphs
        got = train_step(model, x, compiled)
        ref = train_step(model, x)
        assert_close_step(got, ref)
    rep = enn_backend.report().to_dict()
    phases = sorted(g["phase"] for g in rep["graphs"])
    assert phases == ["backward", "forward"], phases
    assert rep["fallbacks"] == []
    assert all(g["path"] == "inductor" and g["compiled_nodes"] > 0 for g in rep["graphs"])


def test_inference_parity_no_grad_and_inference_mode():
    model, x = make("block")
    compiled = torch.compile(model, backend="enn")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert {g["phase"] for g in enn_backend.report().to_dict()["graphs"]} == {"inference"}


def test_bf16_autocast_training():
    model, x = make("block")
    compiled = torch.compile(model, backend="enn")
    got = train_step(model, x, compiled, autocast=torch.bfloat16)
    ref = train_step(model, x, autocast=torch.bfloat16)
    assert got[0].dtype == torch.float32  # residual stream stays fp32 under autocast
    assert_close_step(got, ref, torch.bfloat16)


def test_dynamic_shapes_three_lengths_at_most_two_compiles():
    model, _ = make("block")
    compiled = torch.compile(model, backend="enn", dynamic=True)
    with torch.no_grad():
        for t in (8, 12, 20):
            x = torch.randn(2, t, 32)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    units = {g["unit"] for g in enn_backend.report().to_dict()["graphs"]}
    assert 1 <= len(units) <= 2, units


def test_mark_dynamic_training():
    model, _ = make("mlp")
    compiled = torch.compile(model, backend="enn")
    for b in (4, 6, 10):
        x = torch.randn(b, 16)
        torch._dynamo.mark_dynamic(x, 0)
        assert_close_step(train_step(model, x, compiled), train_step(model, x))
    assert len({g["unit"] for g in enn_backend.report().to_dict()["graphs"]}) <= 2


def test_enn_disable_is_plain_inductor(monkeypatch):
    monkeypatch.setenv("ENN_DISABLE", "1")
    monkeypatch.setenv("ENN_FAULT_INJECT", "aten.addmm:nan:fwd")  # would fire if enn were active
    model, x = make("mlp")
    compiled = torch.compile(model, backend="enn")
    with torch.no_grad():
        out = compiled(x)
    assert torch.isnan(out).sum() == 0
    data = enn_backend.report().to_dict()
    assert data["graphs"] == [] and data["disabled"] == {"ENN_DISABLE=1": 1}
    # the report says why it is empty
    assert "enn was disabled by ENN_DISABLE=1: 1 Dynamo graph(s) compiled by plain Inductor" in str(enn_backend.report())


def test_disabled_by_options_says_so(monkeypatch):
    monkeypatch.delenv("ENN_DISABLE", raising=False)
    model, x = make("mlp")
    with torch.no_grad():
        torch.compile(model, backend="enn", options={"disable": True})(x)
    assert enn_backend.report().to_dict()["disabled"] == {"options={'disable': True}": 1}
    assert "enn was disabled by options={'disable': True}" in str(enn_backend.report())


def test_inductor_after_enn_sees_no_enn_ops_or_config():
    from torch._inductor import config as ic
    from torch._inductor import lowering as L
    from torch._inductor.utils import run_and_get_code

    model, x = make("block")
    with torch.no_grad():  # (erf: the block's one GELU, so localizing the fault takes few recompiles)
        torch.compile(model, backend="enn", options={"fault_inject": "aten.erf:nan:fwd"})(x)
    assert enn_backend.report().to_dict()["fallbacks"], "the injected fault should have fired under enn"
    assert not [op for op in L.lowerings if "enn." in str(op)]
    assert ic.joint_custom_post_pass is None and ic.post_grad_custom_post_pass is None
    torch._dynamo.reset()
    with torch.no_grad():
        out, codes = run_and_get_code(torch.compile(model, backend="inductor"), x)
    assert not any("enn" in c for c in codes)
    assert torch.isfinite(out).all()


def test_training_graphs_split_as_under_inductor(monkeypatch):
    """enn compiles a copy of Dynamo's graph; the copy must keep what tells AOT Autograd which
    inputs are parameters and buffers. Without it the min-cut partitioner saved views of the
    weights and a mask computed from a buffer instead of the weights themselves (nanoGPT's
    training forward ran 0.64 vs 0.47 ms on CPU)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from enn_backend import compat
    from enn_backend.backend import enn

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.register_buffer("mask", torch.tril(torch.ones(16, 16)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).relu().masked_fill(self.mask == 0, 0.0))

    def saved_by_forward(backend: str) -> list[str]:
        saved: list[str] = []

        def record(gm, example_inputs, **kwargs):
            if not kwargs.get("is_backward"):
                saved.extend(sorted(str(o).rstrip("_0123456789") for o in gm.graph.output_node().args[0]))
            return compile_fx_inner(gm, example_inputs, **kwargs)

        torch._dynamo.reset()
        if backend == "inductor":
            fn = lambda gm, ex: compile_fx(gm, ex, inner_compile=record)  # noqa: E731
        else:
            monkeypatch.setattr(compat, "compile_fx_inner", record)
            fn = lambda gm, ex: enn(gm, ex, options={"guard": "off"})  # noqa: E731
        torch.manual_seed(0)
        with functorch_config.patch(enable_autograd_cache=False):  # a cache hit skips inner_compile
            torch.compile(Masked(), backend=fn)(torch.randn(16, 16, requires_grad=True)).sum().backward()
        return saved

    want = saved_by_forward("inductor")
    assert want and "permute" not in want
    assert saved_by_forward("enn") == want


# ----------------------------------------------------------------------------- caching
_CACHE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    y = torch.compile(m, backend="enn")(x)
    y.sum().backward()
    c = counters["inductor"]
    print(json.dumps({"hit": c["fxgraph_cache_hit"], "miss": c["fxgraph_cache_miss"], "bypass": c["fxgraph_cache_bypass"]}))
    """
)


def test_second_process_hits_fx_graph_cache(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        import json

        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["miss"] >= 2 and first["bypass"] == 0, first
    assert second["hit"] >= 2 and second["miss"] == 0 and second["bypass"] == 0, second
