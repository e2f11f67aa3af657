"""Hugging Face generation with a static KV cache, ``model.forward`` compiled by enn under the
default mode with the guard on (issue #43): ``model.generate(..., cache_implementation="static")``
from tiny random LLaMA-style and Qwen2-style configs (tests/_hf.py), no download.

The static cache is state the compiled graphs write on every call: each layer's keys and values
(``index_copy_`` at the new positions) and its ``cumulative_length`` (``add_``). transformers
allocates the cache lazily, inside the first (prefill) call, so the prefill graph creates it and
every decode call writes into it in place. Greedy tokens must be eager's, and after the call the
cache must hold eager's keys and values and count the same length -- on clean runs, where no
fallback may be reported, and on a run whose decode graph meets a fault, where the guard returns
eager's result and the cache must not keep the compiled call's NaN.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

import enn_backend

transformers = pytest.importorskip("transformers")

from _hf import MODELS, no_dropout  # noqa: E402

LAYERS = 1  # the cache of one layer is the state under test; each layer more costs compile time
NEW_TOKENS = 5
PROMPT = (2, 8)  # batch, prompt length
PADDED = 3  # left padding of the second prompt, as batched generation pads
# a fault in each decode call from its 2nd on (the prefill graph is called once): the rotary
# embedding's sin, one node per decode graph; the guard pins what feeds the bad results at once
DECODE_FAULT = {"fault_inject": "aten.sin:nan@2+", "localize_budget": 0, "persist": False, "repro": False}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    spec = MODELS[name]
    model = dataclasses.replace(spec, cfg=spec.cfg | {"num_hidden_layers": LAYERS}).make(transformers, "sdpa").eval()
    no_dropout(model)
    return model


def _prompt(batch: int, length: int, padded: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, MODELS["llama"].cfg["vocab_size"], (batch, length))
    mask = torch.ones_like(ids)
    mask[-1, :padded] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _generate(model: torch.nn.Module, prompt: dict[str, torch.Tensor]):
    return model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                          return_dict_in_generate=True)


def _assert_same_cache(got, want) -> None:
    """Every layer's keys, values and length equal to eager's, and written no more often than
    eager writes them (a tensor's version counts its in-place writes)."""
    assert type(got).__name__ == type(want).__name__ == "StaticCache", (type(got), type(want))
    assert len(got.layers) == len(want.layers)
    for i, (g, w) in enumerate(zip(got.layers, want.layers)):
        assert int(g.cumulative_length) == int(w.cumulative_length), (i, g.cumulative_length, w.cumulative_length)
        for part in ("keys", "values"):
            gt, wt = getattr(g, part), getattr(w, part)
            assert torch.isfinite(gt).all(), f"layer {i} {part}: non-finite values in the cache"
            torch.testing.assert_close(gt, wt, rtol=1e-4, atol=1e-5, msg=lambda m: f"layer {i} {part}: {m}")
            assert gt._version <= wt._version, (i, part, gt._version, wt._version)


def _compiled_and_eager(name: str, options: dict | None = None):
    model = _model(name)
    reference = copy.deepcopy(model)
    model.forward = torch.compile(model.forward, backend="enn", **({"options": options} if options else {}))
    return model, reference


def _graphs(report: dict) -> dict[str, dict]:
    return {g["id"]: g for g in report["graphs"]}


@pytest.mark.parametrize("name", ["qwen2"])  # LLaMA: the next test, whose first prompt is this one
def test_static_cache_generate_equals_eager(name):
    """Greedy tokens and the cache equal eager's; two graphs (prefill, decode), both compiled,
    every call guarded, no fallback."""
    model, reference = _compiled_and_eager(name)
    prompt = _prompt(*PROMPT, PADDED)
    want = _generate(reference, prompt)
    got = _generate(model, prompt)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    _assert_same_cache(got.past_key_values, want.past_key_values)
    report = enn_backend.report().to_dict()
    assert report["fallbacks"] == [], report["fallbacks"]
    graphs = list(_graphs(report).values())
    assert [g["phase"] for g in graphs] == ["inference", "inference"], graphs
    assert all(g["path"] == "inductor" and g["compiled_nodes"] == g["compute_nodes"] for g in graphs), graphs
    assert [g["counters"]["calls"] for g in graphs] == [1, NEW_TOKENS - 1]
    assert all(g["counters"]["checks"] == g["counters"]["calls"] for g in graphs)  # all in warm-up: screened


def test_static_cache_generate_new_prompt_length(caplog):
    """LLaMA as the test above, then a second, shorter prompt: the prefill graph is compiled again
    with a symbolic length (the cache keeps its size, so the decode graph is reused). Its value
    check must be judged -- the eager copy of that graph once named a symbolic size it did not
    define (the epilogue pass's residual view), its eager run raised and the check was dropped
    with a warning -- and tokens and cache equal eager's."""
    model, reference = _compiled_and_eager("llama")
    with caplog.at_level(logging.WARNING, logger="enn_backend"):
        for batch, length, padded in (PROMPT + (PADDED,), (2, 5, 2)):
            prompt = _prompt(batch, length, padded)
            want = _generate(reference, prompt)
            got = _generate(model, prompt)
            assert torch.equal(got.sequences, want.sequences), (length, got.sequences, want.sequences)
            _assert_same_cache(got.past_key_values, want.past_key_values)
    assert not [r for r in caplog.records if r.name.startswith("enn")], [r.getMessage() for r in caplog.records]
    report = enn_backend.report().to_dict()
    assert report["fallbacks"] == [], report["fallbacks"]
    graphs = list(_graphs(report).values())
    assert len(graphs) == 3, [g["id"] for g in graphs]  # prefill, decode, prefill with a symbolic length
    assert [g["counters"]["calls"] for g in graphs] == [1, 2 * (NEW_TOKENS - 1), 1], graphs
    assert all(g["path"] == "inductor" and g["compiled_nodes"] == g["compute_nodes"] for g in graphs), graphs
    assert graphs[2]["counters"].get("value_checks") == 1, graphs[2]  # a fresh compile: checked on its first call
    assert all(not g["counters"].get("value_checks_unjudged") for g in graphs), graphs


def test_static_cache_generate_recovers_a_decode_fault():
    """NaN planted in the decode graph from its 2nd call on: that call returns eager's result, the
    cache holds eager's keys and values (not the NaN the compiled call wrote in place) and length,
    the tokens are eager's, and the fault is one reported fallback of the decode graph."""
    model, reference = _compiled_and_eager("llama", DECODE_FAULT)
    prompt = _prompt(*PROMPT, PADDED)
    want = _generate(reference, prompt)
    got = _generate(model, prompt)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    cache = got.past_key_values
    for i, layer in enumerate(cache.layers):
        assert int(layer.cumulative_length) == int(want.past_key_values.layers[i].cumulative_length)
        for part in ("keys", "values"):
            assert torch.isfinite(getattr(layer, part)).all(), f"layer {i} {part}: NaN left in the cache"
            torch.testing.assert_close(getattr(layer, part), getattr(want.past_key_values.layers[i], part),
                                       rtol=1e-4, atol=1e-5)
    report = enn_backend.report().to_dict()
    graphs = _graphs(report)
    assert [f["kind"] for f in report["fallbacks"]] == ["nonfinite"], report["fallbacks"]
    decode = graphs[report["fallbacks"][0]["graph"]]
    assert decode["counters"]["calls"] == NEW_TOKENS - 1 and "sin" in decode["pinned"], decode
