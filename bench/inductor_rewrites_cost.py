"""What keeping Inductor's own graph rewrites off enn's compiles costs in speed (zoo models).

    OMP_NUM_THREADS=1 python bench/inductor_rewrites_cost.py [--models bert,vit] [--modes train,infer]
                                                             [--rounds 7] [--steps 5]
    OMP_NUM_THREADS=1 python bench/inductor_rewrites_cost.py --micro   # the attention alone

Variants, each an enn compile of the same zoo model (fp32; CPU: cpu-small, one thread;
``--device cuda``: gpu-real):

- ``enn``: enn's defaults; Inductor's attention rewrites (fuse_attention) are off
  (compat.inductor_attention_rewrites_off);
- ``enn+fuse_attention``: the same with Inductor's attention rewrites allowed (enn before
  pytorch/pytorch#196468 was handled);
- ``enn-pattern_matcher``: every Inductor pattern pass off (``pattern_matcher=False``: pre-grad,
  joint-graph and post-grad patterns), the upper bound of what dropping Inductor's rewrites costs.

``--micro`` times BERT's attention alone (``softmax(q @ k^T / 8 + mask) @ v``, the spelling
Inductor's patterns fuse) at larger sequence lengths, where the fused kernel matters most.

Steps are timed interleaved in rounds (the order rotated each round); the table gives the median
step time of each variant and ``enn``'s time over it (above 1: keeping the rewrites off costs
that factor), and how many attentions Inductor's patterns fused when allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types
from typing import Any, Callable

import torch

from enn_backend import compat
from enn_backend.backend import enn
from enn_backend import models
from enn_backend.bench.timing import steady_state_warmup

VARIANTS = ("enn", "enn+fuse_attention", "enn-pattern_matcher")


def fresh_enn() -> Callable[..., Any]:
    """enn as a backend object of its own: Dynamo reuses a compiled graph only under the same
    backend object (its guards do not tell two instances of a module apart), so each variant
    compiles its own graphs under its own context and never runs another variant's."""
    return lambda gm, example_inputs: enn(gm, example_inputs)


def _variant(name: str) -> Any:
    if name == "enn+fuse_attention":
        return _attention_rewrites_allowed()
    if name == "enn-pattern_matcher":
        return compat.inductor_config.patch(pattern_matcher=False)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _attention_rewrites_allowed() -> Any:
    off = compat.inductor_attention_rewrites_off
    compat.inductor_attention_rewrites_off = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        compat.inductor_attention_rewrites_off = off  # type: ignore[assignment]


def build_step(model_name: str, mode: str, variant: str, device: torch.device) -> tuple[Callable[[], Any], int]:
    """A compiled step of ``model_name`` and how many attentions Inductor's patterns fused."""
    torch.manual_seed(0)
    size = "gpu-real" if device.type == "cuda" else "cpu-small"
    model, make_inputs, loss_fn = models.build(model_name, size, device=device)
    batch = make_inputs()
    fn = torch.compile(model, backend=fresh_enn())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def train() -> None:
        opt.zero_grad()
        loss_fn(fn(*batch.args), batch.target).backward()
        opt.step()

    def infer() -> None:
        with torch.no_grad():
            fn(*batch.args)

    step = train if mode == "train" else infer
    before = compat.dynamo_counters["inductor"]["fuse_attention"]
    with compat.no_aot_autograd_cache(), _variant(variant):
        for _ in range(steady_state_warmup()):  # compiles, then past the guard's checked calls
            step()
    return step, compat.dynamo_counters["inductor"]["fuse_attention"] - before


def bert_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (q @ k.transpose(-2, -1) / 8.0 + mask).softmax(dim=-1) @ v


def build_micro(seq: int, mode: str, variant: str, device: torch.device) -> tuple[Callable[[], Any], int]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, seq, 64, generator=g).to(device).requires_grad_(mode == "train") for _ in range(3))
    mask = torch.zeros(4, 1, 1, seq, device=device)
    mask[1, ..., seq // 2:] = torch.finfo(torch.float32).min  # a padded sample, as BERT's mask
    # a code object of its own: Dynamo caches per code object, up to a recompile limit (8)
    name = f"attention_{seq}_{mode}_{VARIANTS.index(variant)}"
    own = types.FunctionType(bert_attention.__code__.replace(co_name=name), globals())
    fn = torch.compile(own, backend=fresh_enn())

    def train() -> None:
        fn(q, k, v, mask).sum().backward()

    def infer() -> None:
        with torch.no_grad():
            fn(q, k, v, mask)

    step = train if mode == "train" else infer
    before = compat.dynamo_counters["inductor"]["fuse_attention"]
    with compat.no_aot_autograd_cache(), _variant(variant):
        for _ in range(steady_state_warmup()):
            step()
    return step, compat.dynamo_counters["inductor"]["fuse_attention"] - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", action="store_true", help="BERT's attention alone, sequence lengths 128 and 512")
    ap.add_argument("--device", default="cpu", help="cpu (cpu-small zoo, one thread) or cuda (gpu-real zoo)")
    ap.add_argument("--models", default="gpt2_naive,bert,llama,t5,vit")
    ap.add_argument("--modes", default="train,infer")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.device}{', one thread' if device.type == 'cpu' else ''}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print("| model | mode | enn ms | enn+fuse_attention ms (enn / it) | enn-pattern_matcher ms (enn / it) "
          "| attentions Inductor fused (enn+fuse_attention) |")
    print("|---|---|---|---|---|---|")
    cases = [(f"bert_attention T{seq}", lambda mode, v, seq=seq: build_micro(seq, mode, v, device))
             for seq in (128, 512)] if args.micro else \
        [(m, lambda mode, v, m=m: build_step(m, mode, v, device)) for m in args.models.split(",")]
    for model_name, build in cases:
        for mode in args.modes.split(","):
            steps, fused = {}, {}
            for v in VARIANTS:  # no Dynamo reset in between: a reset would recompile the earlier
                steps[v], fused[v] = build(mode, v)  # variants while timed, outside their context
            compiles = compat.dynamo_counters["stats"]["unique_graphs"]
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(args.rounds):
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
                for v in order:
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        steps[v]()
                    sync()
                    times[v].append((time.perf_counter() - t0) * 1e3 / args.steps)
            if compat.dynamo_counters["stats"]["unique_graphs"] != compiles:
                raise RuntimeError(f"{model_name} {mode}: a variant recompiled while timed")
            med = {v: statistics.median(t) for v, t in times.items()}
            base = med["enn"]
            print(f"| {model_name} | {mode} | {base:.2f} | {med['enn+fuse_attention']:.2f} "
                  f"({base / med['enn+fuse_attention']:.2f}x) | {med['enn-pattern_matcher']:.2f} "
                  f"({base / med['enn-pattern_matcher']:.2f}x) | {fused['enn+fuse_attention']} (enn: {fused['enn']}) |",
                  flush=True)


if __name__ == "__main__":
    main()
