"""Blame in the user's terms: every op the report, the logs and repro scripts name is shown as
its module path and source line first, its FX node name second (enn_backend.blame)."""

from __future__ import annotations

import ast
import json
import logging
import os
import re

import pytest
import torch

import enn_backend
from enn_backend import blame
from enn_backend.report import format_report


def test_module_path_is_the_dotted_path_a_user_writes():
    assert blame.module_path("L['self'].transformer.h.0.attn") == "transformer.h.0.attn"
    assert blame.module_path("L['self']._modules['layers']['0']._modules['mlp']") == "layers.0.mlp"
    assert blame.module_path("L['self'].layers[1].mlp") == "layers.1.mlp"
    assert blame.module_path("L['self']") == ""
    assert blame.module_path("L['fn']._modules['2']") == "2"  # a torch.nn module compiled directly
    assert blame.module_path("L['model'].fc") == "model.fc"  # a module the compiled function took
    assert blame.module_path("something else") == "something else"


def _site(node: str, module: str | None, line: int | None) -> dict:
    s = {"node": node, "op": "aten.mm.default"}
    if module is not None:
        s |= {"module": module, "module_type": "Linear"}
    if line is not None:
        s |= {"file": "/src/model.py", "line": line, "function": "forward", "code": "y = self.fc(x)"}
    return s


def test_describe_groups_by_line_and_counts_every_op_it_leaves_out():
    sites = [_site("mm", "h.0.fc", 3), _site("mm_1", "h.0.fc", 3), _site("mm_2", "h.1.fc", 3), _site("mm_3", None, 7),
             _site("mm_4", None, None), _site("mm_5", "h.2.fc", 3)]
    assert blame.describe_all(sites[:4]) == ("h.0.fc (model.py:3, in forward) [mm, mm_1]; h.1.fc (model.py:3, in forward) "
                                             "[mm_2]; model.py:7, in forward [mm_3]")
    # five groups, four shown: the one left out holds one op, and the count says so
    assert blame.describe_all(sites).endswith("; mm_4; and 1 more op")
    assert blame.describe_all(sites, limit=2).endswith("[mm_2]; and 3 more ops")
    assert blame.where("<graph>", []) == "the whole graph" and blame.where("<none>", []) == ""


def test_report_text_is_a_table_without_python_reprs():
    data = {"graphs": [{"id": "g0/forward", "path": "inductor", "compute_nodes": 12, "compiled_nodes": 11,
                        "pinned": ["mm_1"], "compile_time_s": 1.5, "fusions": {},
                        "sites": {"mm_1": _site("mm_1", "h.0.fc", 3)},
                        "kernel_choices": [{"node": "addmm", "choice": "inductor", "reason": "r",
                                            "site": _site("addmm", "h.0.proj", 9)}]}],
            "fusions": {}, "fallbacks": [{"kind": "nonfinite", "graph": "g0/forward", "phase": "forward",
                                          "node": "mm_1", "sites": [_site("mm_1", "h.0.fc", 3)],
                                          "reason": "NaN/Inf in compiled output", "action": "pinned 1 op(s) to eager"}]}
    text = format_report(data)
    assert "{" not in text and "fusions: none" in text
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("graph"))
    assert lines[header].split() == ["graph", "path", "ops", "compiled", "pinned", "compile", "s", "fusions"]
    assert lines[header + 2].split() == ["g0/forward", "inductor", "12", "11", "1", "1.50", "-"]
    assert "  g0/forward  h.0.fc (model.py:3, in forward) [mm_1]" in lines
    assert "  g0/forward  h.0.proj (model.py:9, in forward) [addmm]: inductor (r)" in lines
    assert ("  [nonfinite] g0/forward at h.0.fc (model.py:3, in forward) [mm_1]: NaN/Inf in compiled output "
            "-> pinned 1 op(s) to eager") in lines


# ----------------------------------------------------------------------------- a Hugging Face model
transformers = pytest.importorskip("transformers")


def _source_line(site: dict) -> str:
    with open(site["file"]) as f:
        return f.read().splitlines()[site["line"] - 1]


@pytest.mark.slow
def test_hf_model_faults_are_blamed_on_module_and_source_line(tmp_path, caplog):
    """GPT-2 with a NaN injected into the forward's `mm` (the LM head: the only mm of the forward)
    and into the backward's `tanh` (GELU of the MLP): the report, the log and the repro name
    the modules and the source lines, the JSON keeps the FX names beside them."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=1,
                                  eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    options = {"fault_inject": "aten.mm:nan:fwd,aten.tanh:nan:bwd", "persist": False, "repro_dir": str(tmp_path)}
    ids = torch.randint(3, 64, (2, 8))
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        logits = torch.compile(model, backend="enn", options=options)(input_ids=ids).logits
        logits.sum().backward()
    assert torch.isfinite(logits).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())

    data = enn_backend.report().to_dict()
    faults = {f["phase"]: f for f in data["fallbacks"] if f["kind"] == "nonfinite"}
    fwd, bwd = faults["forward"], faults["backward"]
    assert fwd["node"] == "mm" and [s["module"] for s in fwd["sites"]] == ["lm_head"]
    assert bwd["node"] == "tanh" and [s["module"] for s in bwd["sites"]] == ["transformer.h.0.mlp.act"]
    head, act = fwd["sites"][0], bwd["sites"][0]
    assert os.path.basename(head["file"]) == "modeling_gpt2.py" and "self.lm_head(" in _source_line(head)
    assert os.path.basename(act["file"]) == "activations.py" and "torch.tanh(" in _source_line(act)
    assert head["op"] == "aten.mm.default" and act["op"] == "aten.tanh.default" and act["module_type"] == "NewGELUActivation"

    head_text = f"lm_head (modeling_gpt2.py:{head['line']}, in forward) [mm]"
    act_text = f"transformer.h.0.mlp.act (activations.py:{act['line']}, in {act['function']}) [tanh]"
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("enn fallback")]
    assert any(f"[nonfinite] g0/forward at {head_text}: NaN/Inf" in m for m in logged), logged
    assert any(f"[nonfinite] g0/backward at {act_text}: NaN/Inf" in m for m in logged), logged
    text = str(enn_backend.report())
    assert f"g0/forward   {head_text}" in text and f"g0/backward  {act_text}" in text, text
    assert "node(s)" not in text and "{" not in text and "prime" not in text

    # a count a reason gives matches the ops it names (or says how many it leaves out): GPT-2's
    # GELU input is read by 4 ops of its backward, and the epilogue pass names 3 of them
    counted = 0
    for c in (c for g in data["graphs"] for c in g["kernel_choices"]):
        m = re.search(r"read by (\d+) other (?:op|node)\(s\) \(([^)]*)\)", c["reason"])
        if m:
            named = m.group(2).split(" and ")
            more = int(named[1].split()[0]) if len(named) > 1 else 0
            assert int(m.group(1)) == len(named[0].split(", ")) + more, c["reason"]
            counted += 1
        assert c["site"]["node"] == c["node"] and "module" in c["site"]
    assert counted

    # the repro script's header and data name the same site
    [path] = [e["repro"] for g in data["graphs"] if g["id"] == "g0/forward" for e in g["events"] if "repro" in e]
    source = open(path).read()
    doc = ast.get_docstring(ast.parse(source))
    assert doc.splitlines()[0] == f"enn repro: nonfinite in graph g0/forward (forward), blamed: {head_text}"
    assert f"    {head_text}: aten.mm.default" in doc and _source_line(head).strip() in doc
    expect = ast.literal_eval(next(ln for ln in source.splitlines() if ln.startswith("EXPECT = "))[9:])
    assert expect["nodes"] == ["mm"] and expect["sites"] == [head]
    assert json.load(open(os.path.join(os.path.dirname(path), "fault.json")))["sites"] == [head]
