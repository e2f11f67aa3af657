"""On the GPU, the guard leaves a model's state as Inductor does: torchvision ResNet-50 trained
3 steps in bf16 autocast ends with BatchNorm running statistics no further from eager's than
Inductor's are, and the same number of batches tracked (the guard's re-runs write nothing)."""

from __future__ import annotations

import pytest
import torch

import enn_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _train(backend: str | None, options: dict | None = None) -> dict[str, torch.Tensor]:
    torchvision = pytest.importorskip("torchvision")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().train()
    step = model if backend is None else torch.compile(model, backend=backend, options=options)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        x = torch.randn(16, 3, 224, 224, device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(x).float().square().mean()
        loss.backward()
    return {n: b.detach().float().clone() for n, b in model.named_buffers()}


def _distance(state: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> float:
    return max((state[n] - eager[n]).abs().max().item() for n in eager if "running" in n)


def test_resnet50_batchnorm_statistics_within_inductors_distance_of_eager():
    eager = _train(None)
    inductor = _train("inductor")
    enn_backend.reset()
    enn = _train("enn")
    fallbacks = list(enn_backend.report().fallbacks)
    off = _train("enn", {"guard": "off"})
    d_inductor, d_enn, d_off = _distance(inductor, eager), _distance(enn, eager), _distance(off, eager)
    print(f"max |running stat - eager's|: inductor {d_inductor:.3g}, enn {d_enn:.3g}, enn guard off {d_off:.3g}")
    tracked = [n for n in eager if n.endswith("num_batches_tracked")]
    assert all(torch.equal(enn[n], eager[n]) for n in tracked)
    assert d_enn <= max(2 * d_inductor, 1e-3), (d_enn, d_inductor)
    assert not fallbacks, [str(f) for f in fallbacks]
