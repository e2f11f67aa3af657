"""The ``/<module>`` qualifier of ``fault_inject`` (enn_backend/fault_spec.py): a fault planted in
the nodes of one module only, and a qualifier that matches no node reported like any spec that
planted nothing. (The rest of the grammar: tests/test_guard.py.)"""

from __future__ import annotations

import pytest
import torch

import enn_backend
from enn_backend.fault_spec import FaultSpec, FaultSpecError, parse_fault_specs
from enn_backend.options import Options, OptionsError

from _models import make


def test_module_qualifier_grammar():
    (spec,) = parse_fault_specs("enn.fp8_mm/model.layers.3.mlp.down_proj:nan@50+:bwd")
    assert spec == FaultSpec("enn.fp8_mm", "nan", "bwd", every=50, onward=True, module="model.layers.3.mlp.down_proj")
    assert spec.text == "enn.fp8_mm/model.layers.3.mlp.down_proj:nan@50+:bwd"
    assert parse_fault_specs("aten.mm:inf")[0].module == ""  # no qualifier: every node of the op
    # the glob matches the whole path, as fp8_exclude's globs do
    (glob,) = parse_fault_specs("aten.mm/layers.1*:inf")
    assert glob.matches_module("layers.1") and glob.matches_module("layers.12")
    assert not glob.matches_module("layers.2") and not glob.matches_module("m.layers.1")
    assert not parse_fault_specs("aten.mm/layers.1:inf")[0].matches_module("layers.12")
    assert parse_fault_specs("aten.mm:inf")[0].matches_module("anything")
    for bad in ("aten.mm/:nan", "aten.mm/ :nan:fwd"):
        with pytest.raises(FaultSpecError, match="must be followed by a module path"):
            parse_fault_specs(bad)
        with pytest.raises(OptionsError, match="must be followed by a module path"):
            Options(fault_inject=bad)


def test_module_qualifier_plants_in_that_module_only_and_one_matching_nothing_is_reported():
    """Guard off, so the planted NaN reaches the gradients: ``aten.mm/fc1`` spoils fc1's weight
    gradient GEMM in the backward and no ``mm`` of fc2 (unqualified, both would be NaN). A
    qualifier no ``addmm`` node matches plants nothing: a ``fault_not_planted`` line naming the
    modules the op's nodes run in."""
    model, x = make("mlp")
    specs = "aten.mm/fc1:nan:bwd,aten.addmm/fc9*:inf:fwd"
    compiled = torch.compile(model, backend="enn", options={"attention": False, "epilogue": False, "persist": False,
                                                            "guard": "off", "fault_inject": specs})
    out = compiled(x)
    assert bool(torch.isfinite(out).all())  # the fwd spec planted nothing
    out.square().mean().backward()
    assert torch.isnan(model.fc1.weight.grad).all()
    assert bool(torch.isfinite(model.fc2.weight.grad).all()) and bool(torch.isfinite(model.fc2.bias.grad).all())
    lines = {f.reason.split("'")[1]: f for f in enn_backend.report().fallbacks if f.kind == "fault_not_planted"}
    assert list(lines) == ["aten.addmm/fc9*:inf:fwd"], lines
    reason = lines["aten.addmm/fc9*:inf:fwd"].reason
    assert "no node of aten.addmm runs in a module matching 'fc9*'; its nodes run in: fc1, fc2" in reason, reason
