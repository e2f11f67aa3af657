"""The model zoo (enn_backend.models) that the benchmark, the demo and the tests share: every model
builds, trains and is deterministic; the sizes are what they claim."""

from __future__ import annotations

import pytest
import torch

from enn_backend import models


@pytest.mark.parametrize("name", models.names())
def test_zoo_model_builds_trains_and_is_deterministic(name):
    model, make_inputs, loss_fn = models.build(name, "cpu-small")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    batch = make_inputs()
    out = model(*batch.args)
    loss = loss_fn(out, batch.target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    # same seed -> same weights and inputs; another seed -> other inputs
    model2, make2, _ = models.build(name, "cpu-small")
    assert all(torch.equal(initial[k], v) for k, v in model2.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(batch.args, make2().args))
    assert any(not torch.equal(a, b) for a, b in zip(batch.args, make_inputs(1).args))
    with torch.no_grad():  # (training mode: BatchNorm uses batch statistics, so this holds for convnet too)
        torch.testing.assert_close(model2(*batch.args), out.detach())


def test_zoo_gpu_real_configs_are_real_sizes():
    assert models.config("gpt2_sdpa", "gpu-real") == dict(batch=8, seq=1024, vocab=50304, d_model=768, n_head=12, n_layer=6)
    for name in models.names():
        small, real = models.config(name, "cpu-small"), models.config(name, "gpu-real")
        assert small.keys() == real.keys()
    with pytest.raises(KeyError):
        models.config("nope")


def test_gpt_small_for_the_demo():
    model, make_inputs, loss_fn = models.gpt_small()
    assert sum(p.numel() for p in model.parameters()) < 500_000
    sdpa, _, _ = models.gpt_small(attention="sdpa")
    batch = make_inputs()
    with torch.no_grad():  # same weights, two attention spellings, same function
        torch.testing.assert_close(sdpa(*batch.args), model(*batch.args), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        models.gpt_small(attention="flash")


def test_bert_padding_mask_is_respected():
    model, make_inputs, _ = models.build("bert", "cpu-small")
    model.eval()
    ids, mask = make_inputs().args
    row = int((mask.sum(1) < mask.size(1)).nonzero()[0])  # a padded sequence
    ids2 = ids.clone()
    ids2[row, mask[row] == 0] = 7  # change only padded tokens
    with torch.no_grad():
        torch.testing.assert_close(model(ids2, mask)[row], model(ids, mask)[row])
