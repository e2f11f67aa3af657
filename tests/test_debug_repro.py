"""Repro folders, their replay check, the report CLI and the minifier (in-process, tiny graphs)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import enn_backend
from enn_backend import compat
from enn_backend.debug import repro as R
from enn_backend.debug.cli import minify_main, report_main
from enn_backend.debug.minify import load_script, minify
from enn_backend.debug.replay import EXIT_FAULT, EXIT_OK, EXIT_SCRIPT_ERROR, EXIT_UNDECIDED, check, compare, run_repro

FAULT = "aten.addmm:nan:fwd"
SAVED_OPTIONS = {"attention": False, "epilogue": False, "fault_inject": FAULT}  # what the repro must carry


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory):
    """One enn compile with an injected NaN: the guard blames addmm and writes a repro.
    Boolean options are on purpose: the script must spell them as Python (False, not false)."""
    torch._dynamo.reset()
    enn_backend.reset()
    repro_dir = tmp_path_factory.mktemp("repros")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    opts = {**SAVED_OPTIONS, "repro_dir": str(repro_dir), "persist": False}
    with torch.no_grad():
        out = torch.compile(m, backend="enn", options=opts)(x)
        expected = m(x)
    data = enn_backend.report().to_dict()
    paths = [e["repro"] for g in data["graphs"] for e in g["events"] if "repro" in e]
    return {"out": out, "expected": expected, "report": data, "paths": paths}


def test_guard_writes_one_repro_folder(guarded_run):
    torch.testing.assert_close(guarded_run["out"], guarded_run["expected"])
    assert len(guarded_run["paths"]) == 1
    path = guarded_run["paths"][0]
    folder = os.path.dirname(path)
    assert os.path.basename(folder) == "g0-inference-nonfinite-addmm"
    assert sorted(os.listdir(folder)) == ["fault.json", "inputs.pt", "repro.py"]
    info = json.load(open(os.path.join(folder, "fault.json")))
    assert info["kind"] == "nonfinite" and info["phase"] == "inference" and info["nodes"] == ["addmm", "addmm_1"]
    assert info["options"] == SAVED_OPTIONS
    saved = torch.load(os.path.join(folder, "inputs.pt"), weights_only=True)
    assert len(saved["inputs"]) == 5 and all(isinstance(t, torch.Tensor) for t in saved["inputs"])


def test_repro_reproduces_and_not_without_the_fault(guarded_run, capsys):
    script = load_script(guarded_run["paths"][0])
    module, inputs = script.make_module(), script.make_inputs()
    assert run_repro(module, inputs, phase=script.PHASE, options=script.OPTIONS, expect=script.EXPECT) == EXIT_FAULT
    out = capsys.readouterr().out
    assert "FAULT REPRODUCES (nonfinite)" in out and "where eager is finite" in out
    # Same graph and inputs without the injected fault: enn's fast path agrees with eager.
    assert run_repro(module, inputs, phase=script.PHASE, options={}) == EXIT_OK


def _script_line(path, name: str) -> str:
    return next(ln for ln in open(path).read().splitlines() if ln.startswith(f"{name} = "))[len(name) + 3:]


def _run_script(path):
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600)


def test_repro_script_runs_standalone_with_boolean_options(guarded_run, tmp_path):
    """The script's data are Python literals, and a reproducing fault has its own exit code."""
    folder = tmp_path / "repro"
    shutil.copytree(os.path.dirname(guarded_run["paths"][0]), folder)
    assert ast.literal_eval(_script_line(folder / "repro.py", "OPTIONS")) == SAVED_OPTIONS
    assert ast.literal_eval(_script_line(folder / "repro.py", "EXPECT"))["nodes"] == ["addmm", "addmm_1"]
    res = _run_script(folder / "repro.py")
    assert res.returncode == EXIT_FAULT, res.stdout + res.stderr[-3000:]
    assert "FAULT REPRODUCES (nonfinite)" in res.stdout and "'epilogue': False" in res.stdout


def test_repro_script_that_breaks_itself_exits_with_the_script_error_code(guarded_run, tmp_path, capsys):
    """A script whose own machinery fails (unreadable inputs; code that does not run) exits 1,
    Python's code for an uncaught exception: never the code of a reproducing fault."""
    folder = tmp_path / "repro"
    shutil.copytree(os.path.dirname(guarded_run["paths"][0]), folder)
    (folder / "inputs.pt").write_bytes(b"not a torch.save file")
    res = _run_script(folder / "repro.py")
    assert res.returncode == EXIT_SCRIPT_ERROR != EXIT_FAULT, res.stdout + res.stderr[-3000:]
    assert "SCRIPT ERROR" in res.stdout and "FAULT REPRODUCES" not in res.stdout
    # The script as an older enn wrote it (JSON's `false` in Python source): the module itself fails.
    script = folder / "repro.py"
    options = _script_line(script, "OPTIONS")
    script.write_text(script.read_text().replace(f"OPTIONS = {options}", f"OPTIONS = {json.dumps(SAVED_OPTIONS)}"))
    res = _run_script(script)
    assert res.returncode == EXIT_SCRIPT_ERROR and "NameError: name 'false' is not defined" in res.stderr, res.stderr
    assert minify_main([str(folder)]) == 2  # the minifier says so instead of dying with a traceback
    assert "cannot load" in capsys.readouterr().err


def test_minify_isolates_the_blamed_node(guarded_run, tmp_path):
    res = minify(os.path.dirname(guarded_run["paths"][0]), out=str(tmp_path / "mini"))
    assert res.kind == "nonfinite" and res.ops_after == 1 and res.checks == 1
    mini = load_script(res.path)
    assert mini.EXPECT["nodes"] == ["addmm"]
    # the minimized repro still says where the guard found the fault in the model
    assert [s["module"] for s in mini.EXPECT["original_sites"]] == ["0", "2"]
    assert "The guard blamed, in the model" in mini.__doc__ and "    0 [addmm]: aten.addmm.default" in mini.__doc__
    assert check(mini.make_module(), mini.make_inputs(), phase=mini.PHASE, options=mini.OPTIONS).kind == "nonfinite"


def test_report_cli(guarded_run, tmp_path, capsys):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(guarded_run["report"]))
    assert report_main([str(path)]) == 0
    out = capsys.readouterr().out
    # the blamed ops by module first (the Sequential's items 0 and 2: torch.nn code has no source
    # line of the user's), FX names second
    assert "[nonfinite] g0/inference at 0 [addmm]; 2 [addmm_1]: NaN/Inf in compiled output" in out, out
    assert guarded_run["paths"][0] in out
    assert report_main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "enn-report"
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    assert report_main([str(tmp_path / "other.json")]) == 2
    assert report_main([str(tmp_path / "missing.json")]) == 2


def test_report_save_round_trip(guarded_run, tmp_path):
    enn_backend.report().save(str(tmp_path / "r.json"))
    assert json.load(open(tmp_path / "r.json"))["format"] == "enn-report"


class _SymModule(torch.nn.Module):
    def forward(self, x, s0, w):
        v = torch.ops.aten.view.default(x, [s0, -1])
        return (torch.ops.aten.mm.default(v, w).relu() + self.bias,)


def test_symbolic_sizes_constants_and_regenerated_inputs(tmp_path, monkeypatch):
    mod = _SymModule()
    mod.register_buffer("bias", torch.arange(3.0))
    inputs = [torch.randn(4, 6), 2, torch.randn(12, 3)]
    gm = compat.make_fx(mod, tracing_mode="symbolic")(*inputs)
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")
    source, constants = R.graph_source(gm)
    assert constants and "class Repro(torch.nn.Module)" in source
    monkeypatch.setattr(R, "MAX_SAVED_BYTES", 0)  # too large: inputs are regenerated from metadata
    path = R.write_repro_dir(str(tmp_path / "sym"), gm, inputs, phase="forward",
                             options={"fault_inject": "aten.mm:nan:fwd"}, expect={"kind": "nonfinite"}, title="t")
    assert not os.path.exists(tmp_path / "sym" / "inputs.pt")
    assert "regenerated" in json.load(open(tmp_path / "sym" / "fault.json"))["inputs"]
    script = load_script(path)
    regen = script.make_inputs()
    assert regen[1] == 2 and regen[0].shape == (4, 6) and regen[2].stride() == (3, 1)
    module = script.make_module()
    (name,) = script.CONSTANTS  # the constant travels in constants.pt even when inputs do not
    assert torch.equal(getattr(module, name), torch.arange(3.0))
    assert check(module, regen, phase="forward", options=script.OPTIONS).kind == "nonfinite"
    assert check(module, regen, phase="forward", options={}).kind == "ok"


def test_compare_uses_the_fp64_reference():
    e = torch.tensor([1.0, 2.0, 3.0])
    ref = [e.double() + 1e-3]
    # compiled differs from eager but is as close to fp64 as eager is: accepted
    assert compare([e + 2e-3], [e], lambda: ref).kind == "ok"
    # compiled far from fp64, eager close: an accuracy fault
    assert compare([e + 0.5], [e], lambda: ref).kind == "accuracy"
    # NaN where eager is finite
    bad = e.clone()
    bad[1] = float("nan")
    v = compare([bad], [e], lambda: None)
    assert v.kind == "nonfinite" and "1/3 non-finite (1 NaN)" in v.details[0]
    # the same NaN in both is not enn's fault
    assert compare([bad], [bad.clone()], lambda: None).kind == "ok"


def test_undecided_when_eager_fails(capsys):
    class Bad(torch.nn.Module):
        def forward(self, x):
            return (torch.ops.aten.mm.default(x, x),)  # 2x3 @ 2x3: eager raises

    assert run_repro(Bad(), [torch.randn(2, 3)], phase="forward", options={}) == EXIT_UNDECIDED
    assert "UNDECIDED" in capsys.readouterr().out


class _Chain(torch.nn.Module):
    def forward(self, x, w):
        a = torch.ops.aten.mm.default(x, w)
        b = torch.ops.aten.sin.default(a)
        c = torch.ops.aten.exp.default(b)
        d = torch.ops.aten.mul.Tensor(c, 2.0)
        return (torch.ops.aten.sum.default(d),)


def test_minify_with_torch_minifier(tmp_path, capsys):
    """No blamed nodes recorded: torch's FX minifier shrinks the graph with enn's check."""
    inputs = [torch.randn(3, 4), torch.randn(4, 5)]
    gm = compat.make_fx(_Chain())(*inputs)
    path = R.write_repro_dir(str(tmp_path / "chain"), gm, inputs, phase="inference",
                             options={"fault_inject": "aten.exp:nan:fwd"}, expect={}, title="chain")
    assert minify_main([path]) == 0
    mini = load_script(str(tmp_path / "chain" / "minified"))
    assert mini.EXPECT["kind"] == "nonfinite" and "exp" in mini.EXPECT["nodes"] and len(mini.EXPECT["nodes"]) <= 2
    assert "reproduces with" in capsys.readouterr().out


def test_minify_refuses_a_repro_that_does_not_fail(tmp_path, capsys):
    inputs = [torch.randn(3, 4), torch.randn(4, 5)]
    gm = compat.make_fx(_Chain())(*inputs)
    path = R.write_repro_dir(str(tmp_path / "ok"), gm, inputs, phase="inference", options={}, expect={}, title="ok")
    assert minify_main([path]) == 2
    assert "does not fail" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_repro_round_trip(tmp_path):
    """A fault in a CUDA graph: the repro keeps the device, and reproduces (Triton kernels)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).cuda()
    x = torch.randn(32, 64, device="cuda")
    opts = {"fault_inject": "aten.addmm:nan:fwd", "repro_dir": str(tmp_path), "persist": False}
    with torch.no_grad():
        out = torch.compile(m, backend="enn", options=opts)(x)
        torch.testing.assert_close(out, m(x))
    paths = [e["repro"] for g in enn_backend.report().graphs for e in g.events if "repro" in e]
    assert paths
    script = load_script(paths[0])
    inputs = script.make_inputs()
    assert all(t.is_cuda for t in inputs if isinstance(t, torch.Tensor))
    assert check(script.make_module(), inputs, phase=script.PHASE, options=script.OPTIONS).kind == "nonfinite"
    res = minify(os.path.dirname(paths[0]), out=str(tmp_path / "mini"))
    assert res.ops_after == 1


@pytest.mark.parametrize("where", ["env", "option"])
def test_repros_go_to_the_cache_folder_never_the_working_directory(tmp_path, monkeypatch, caplog, where):
    """With no repro_dir, a blamed fault's repro lands in repros/ of enn's cache folder (option
    cache_dir, else ENN_CACHE_DIR), the log names it, and the working directory stays empty."""
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("ENN_REPRO_DIR")
    opts = {"fault_inject": FAULT, "persist": True}
    if where == "env":
        monkeypatch.setenv("ENN_CACHE_DIR", str(cache))
    else:
        monkeypatch.setenv("ENN_CACHE_DIR", str(tmp_path / "not-this-one"))
        opts["cache_dir"] = str(cache)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad(), caplog.at_level("WARNING", logger="enn_backend"):
        torch.compile(m, backend="enn", options=opts)(torch.randn(3, 4))
    [path] = [e["repro"] for g in enn_backend.report().graphs for e in g.events if "repro" in e]
    assert path == str(cache / "repros" / "g0-inference-nonfinite-addmm" / "repro.py") and os.path.isfile(path)
    assert f"enn: wrote repro script {path}" in caplog.text
    assert os.listdir(cwd) == []
