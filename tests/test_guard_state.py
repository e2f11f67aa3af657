"""The guard leaves state as it found it: every tensor a step writes (parameters, gradients,
buffers, optimizer state, inputs written in place, outputs) ends as ``guard="off"`` leaves it --
bit for bit where guard="off" matches eager bit for bit, else within 1e-6 relative -- under the
default schedule and with every call checked, and no fallback is recorded on these healthy models.

Each case runs one step function N times in eager, compiled with ``guard="off"``, compiled with
the defaults and compiled with every call checked (value checks included), each from the same
weights and data, and compares a snapshot of the state after every step.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn as nn

import enn_backend
from enn_backend.guard.kernel_state import forget_loaded_states
from enn_backend.report import fallback_line

BASE = {"persist": False, "repro": False}
EVERY_CALL = {"guard_every": 1, "guard_warmup": 1, "guard_values": 1}
VARIANTS = {"guard-off": {"guard": "off"}, "defaults": {}, "every-call": EVERY_CALL}
GUARDED = ("defaults", "every-call")
RTOL = 1e-6  # where guard="off" itself differs from eager: |guarded - off| <= RTOL * max|off|
N = 25  # calls per variant

State = dict[str, torch.Tensor]
Compile = Callable[[Callable], Callable]


# ---------------------------------------------------------------------------------------------
# the shared harness


def _fresh() -> None:
    """Each variant compiles from nothing, as each test does (conftest's _fresh_report)."""
    torch._dynamo.reset()
    enn_backend.reset()
    forget_loaded_states()


def run_variants(case: Callable[[Compile], State]) -> tuple[dict[str, State], dict[str, dict]]:
    """``case(compile)`` builds its model and data from fixed seeds, runs its steps with every
    function it compiles wrapped by ``compile`` and returns the state it snapshotted. Returns the
    state of eager and of every compiled variant, and each compiled variant's report."""
    states = {"eager": case(lambda fn: fn)}
    reports = {}
    for name, opts in VARIANTS.items():
        _fresh()
        options = {**BASE, **opts}
        states[name] = case(lambda fn, options=options: torch.compile(fn, backend="enn", options=options))
        reports[name] = enn_backend.report().to_dict()
    _fresh()
    return states, reports


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def difference(got: torch.Tensor, want: torch.Tensor, bitwise: bool) -> str:
    """Empty when ``got`` is ``want`` (bit for bit, or within RTOL of ``want``'s largest
    magnitude); else one readable line: the largest absolute difference and how many differ."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} where guard='off' has {tuple(want.shape)} {want.dtype}"
    if _bitwise_equal(got, want):
        return ""
    g, w = got.double(), want.double()
    d = (g - w).abs()
    nonfinite = ~torch.isfinite(g) | ~torch.isfinite(w)
    scale = w[torch.isfinite(w)].abs().max().item() if torch.isfinite(w).any() else 0.0
    finite_d = d[~nonfinite]
    worst = finite_d.max().item() if finite_d.numel() else 0.0
    mismatch = nonfinite & ~(torch.isnan(g) & torch.isnan(w)) & (g != w)
    if not bitwise and got.is_floating_point() and not mismatch.any() and worst <= RTOL * scale:
        return ""
    differ = int(((d > 0) & ~nonfinite).sum() + mismatch.sum())
    extra = f", {int(mismatch.sum())} non-finite on one side only" if mismatch.any() else ""
    rule = "bit for bit" if bitwise or not got.is_floating_point() else f"within {RTOL:g} relative"
    return (f"max |diff| {worst:.3g} (guard='off' max |value| {scale:.3g}; {differ} of {got.numel()} elements differ"
            f"{extra}; must match {rule})")


def assert_state_contract(states: dict[str, State], reports: dict[str, dict], bitwise: bool = False,
                          shown: int = 12) -> None:
    """Every tensor of each guarded variant equals guard="off"'s: bit for bit where guard="off"
    equals eager bit for bit (or ``bitwise``), else within RTOL; no variant recorded a fallback;
    enn compiled the step, and with every call checked the guard checked every call."""
    __tracebackhide__ = True  # the failure is the message, not this frame's arguments
    off, eager = states["guard-off"], states["eager"]
    problems: list[str] = []
    for name in GUARDED:
        got = states[name]
        lines = [f"{name}: {key} missing" for key in off if key not in got]
        lines += [f"{name}: {key} written, but not by guard='off'" for key in got if key not in off]
        for key, want in off.items():
            if key in got:
                exact = bitwise or (key in eager and _bitwise_equal(want, eager[key]))
                diff = difference(got[key], want, exact)
                if diff:
                    lines.append(f"{name}: {key}: {diff}")
        problems += lines[:shown] + ([f"{name}: ... and {len(lines) - shown} more"] if len(lines) > shown else [])
    for name, rep in reports.items():
        if not rep["graphs"]:
            problems.append(f"{name}: enn compiled no graph")
        problems += [f"{name}: fallback {fallback_line(f)}" for f in rep["fallbacks"]]
    for g in reports["every-call"]["graphs"]:
        calls, checks = g["counters"].get("calls", 0), g["counters"].get("checks", 0)
        if checks != calls:
            problems.append(f"every-call: {g['id']} was checked on {checks} of its {calls} calls")
    assert not problems, ("what the guarded runs left differs from guard='off' (tensors in step order), "
                          "or a fallback:\n" + "\n".join(problems))


def snapshot(into: State, step: int, module: nn.Module | None = None, opt: torch.optim.Optimizer | None = None,
             **tensors: torch.Tensor) -> None:
    """Copy every state tensor after ``step``: the module's parameters, their gradients, its
    buffers, the optimizer's state (``step`` included), and the named tensors given."""
    tag = f"step {step:02d}"
    if module is not None:
        names = {}
        for n, p in module.named_parameters():
            names[p] = n
            into[f"{tag} param {n}"] = p.detach().clone()
            if p.grad is not None:
                into[f"{tag} grad {n}"] = p.grad.detach().clone()
        for n, b in module.named_buffers():
            into[f"{tag} buffer {n}"] = b.detach().clone()
        if opt is not None:
            for p, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        into[f"{tag} optimizer {names[p]} {k}"] = v.detach().clone()
    for n, t in tensors.items():
        into[f"{tag} {n}"] = t.detach().clone()


def _batches(seed: int, n: int, *shape: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# 1. BatchNorm in training mode


def _bn1d() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)), (8, 8)


def _bn2d() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 1)), (4, 3, 8, 8)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "accumulate"])
@pytest.mark.parametrize("make", [_bn1d, _bn2d], ids=["bn1d", "bn2d"])
def test_batchnorm_training_state(make, mode):
    """BatchNorm in training mode (with gradients and an SGD step, under no_grad, and accumulating
    the gradients of 2 micro-batches): running stats, batch counts, gradients, parameters and
    outputs after every step equal guard="off"'s, with no fallback."""
    steps = 10 if mode == "accumulate" else N

    def case(compile: Compile) -> State:
        torch.manual_seed(0)
        model, shape = make()
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        fn = compile(model)
        xs = _batches(1, 2 * steps, *shape)
        out: State = {}
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            if mode == "no_grad":
                with torch.no_grad():
                    y = fn(xs[i])
                snapshot(out, i, model, output=y)
            elif mode == "grad":
                y = fn(xs[i])
                y.square().mean().backward()
                opt.step()  # SGD leaves the gradients as they are: snapshotted with the module
                snapshot(out, i, model, output=y)
            else:
                ys = {}
                for m in range(2):
                    ys[f"output {m}"] = y = fn(xs[2 * i + m])
                    y.square().mean().backward()
                snapshot(out, i, model, **ys)
        return out

    assert_state_contract(*run_variants(case))


# ---------------------------------------------------------------------------------------------
# 2. buffers a forward updates (a counter, an exponential moving average)


class _Stats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return torch.tanh(self.lin(x - self.ema))


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_buffers_updated_in_forward(mode):
    """A forward that counts its calls and keeps an EMA of its inputs in buffers: after every
    call the counter, the EMA, the outputs (and in training the gradients and parameters) equal
    guard="off"'s, with no fallback."""

    def case(compile: Compile) -> State:
        torch.manual_seed(0)
        model = _Stats()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = compile(model)
        out: State = {}
        for i, x in enumerate(_batches(1, N, 4, 8)):
            opt.zero_grad(set_to_none=True)
            if mode == "inference":
                with torch.no_grad():
                    y = fn(x)
            else:
                y = fn(x)
                y.square().mean().backward()
                opt.step()
            snapshot(out, i, model, output=y)
        return out

    assert_state_contract(*run_variants(case))


# ---------------------------------------------------------------------------------------------
# 3. a KV cache written at a position given per call


class _KVCache(nn.Module):
    B, T, D = 2, 32, 16

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write = write
        self.q, self.k, self.v = nn.Linear(self.D, self.D), nn.Linear(self.D, self.D), nn.Linear(self.D, self.D)
        self.register_buffer("k_cache", torch.zeros(self.B, self.T, self.D))
        self.register_buffer("v_cache", torch.zeros(self.B, self.T, self.D))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x: (B, D), pos: (1,) long
        k, v = self.k(x).unsqueeze(1), self.v(x).unsqueeze(1)
        if self.write == "index_copy":
            self.k_cache.index_copy_(1, pos, k)
            self.v_cache.index_copy_(1, pos, v)
        else:
            self.k_cache[:, pos] = k
            self.v_cache[:, pos] = v
        att = (self.q(x).unsqueeze(1) @ self.k_cache.transpose(1, 2)) / math.sqrt(self.D)  # (B, 1, T)
        att = att.masked_fill(torch.arange(self.T) > pos, float("-inf")).softmax(-1)
        return (att @ self.v_cache).squeeze(1)


@pytest.mark.parametrize("write", ["index_copy", "index_put"])
def test_kv_cache_writes(write):
    """Inference that writes each call's key and value into a cache buffer at a position given
    as a tensor, then attends over the cache: after every call both caches and the output equal
    guard="off"'s, with no fallback."""

    def case(compile: Compile) -> State:
        torch.manual_seed(0)
        model = _KVCache(write).eval()
        fn = compile(model)
        out: State = {}
        with torch.no_grad():
            for i, x in enumerate(_batches(1, _KVCache.T, _KVCache.B, _KVCache.D)):
                y = fn(x, torch.tensor([i]))
                snapshot(out, i, model, output=y)
        return out

    assert_state_contract(*run_variants(case))


# ---------------------------------------------------------------------------------------------
# 4. a function that writes into its input


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_inplace_write_into_input(mode):
    """``x.mul_(0.5)`` on the input, then ``tanh(x @ w)``: after every call the input, the output
    and (in training) w's gradient equal guard="off"'s, with no fallback."""
    w0 = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))

    def case(compile: Compile) -> State:
        out: State = {}
        if mode == "inference":
            w = w0.clone()

            def f(x):
                x.mul_(0.5)
                return torch.tanh(x @ w)

            fn = compile(f)
            x = _batches(1, 1, 4, 16)[0]  # one tensor, halved by every call
            for i in range(N):
                snapshot(out, i, output=fn(x), x=x)
            return out

        w = w0.clone().requires_grad_(True)

        def f(x, w):
            x.mul_(0.5)
            return torch.tanh(x @ w).sum()

        fn = compile(f)
        for i, x in enumerate(_batches(1, N, 4, 16)):
            w.grad = None
            loss = fn(x, w)
            loss.backward()
            snapshot(out, i, output=loss, x=x, w_grad=w.grad)
        return out

    assert_state_contract(*run_variants(case))


# ---------------------------------------------------------------------------------------------
# 5. a compiled optimizer step


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam_single_tensor": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_compiled_optimizer_step(optimizer):
    """``torch.compile(opt.step)`` applied to gradients computed eagerly: after every step the
    parameters and every optimizer state tensor (``step`` included) equal guard="off"'s, with no
    fallback."""

    def case(compile: Compile) -> State:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = OPTIMIZERS[optimizer](model.parameters())
        opt_step = compile(opt.step)
        out: State = {}
        for i, x in enumerate(_batches(1, N, 6, 8)):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt_step()
            snapshot(out, i, model, opt)
        return out

    assert_state_contract(*run_variants(case))


# ---------------------------------------------------------------------------------------------
# 6. Hugging Face models training with dropout


HF_STEPS = 10  # 20 adds ~15 s per model on a 2-core CPU (every variant runs every step); 10 keeps the file fast


def _gpt2(transformers):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    assert cfg.attn_pdrop == cfg.resid_pdrop == cfg.embd_pdrop == 0.1
    return transformers.GPT2LMHeadModel(cfg)


def _bert(transformers):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=32, pad_token_id=0,
                                  attn_implementation="eager")
    assert cfg.hidden_dropout_prob == cfg.attention_probs_dropout_prob == 0.1
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_hf_training_with_dropout(make):
    """A tiny GPT-2 / BERT with transformers' default dropout (0.1) trained with SGD, the global
    seed set before every step: each step's loss, logits, gradients, parameters and the global RNG
    state after it equal guard="off"'s bit for bit, with no fallback (compiled dropout draws differ
    from eager's, so guard="off" is the only reference). 10 steps, not 20, to keep the file fast."""
    transformers = pytest.importorskip("transformers")

    def case(compile: Compile) -> State:
        torch.manual_seed(0)
        model = make(transformers)
        model.config.use_cache = False
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = compile(model)
        g = torch.Generator().manual_seed(1)
        out: State = {}
        for i in range(HF_STEPS):
            ids = torch.randint(3, 64, (2, 12), generator=g)
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + i)
            res = fn(input_ids=ids, labels=ids)
            res.loss.backward()
            opt.step()
            snapshot(out, i, model, loss=res.loss, logits=res.logits, rng_state=torch.get_rng_state())
        return out

    assert_state_contract(*run_variants(case), bitwise=True)


# ---------------------------------------------------------------------------------------------
# 7. the caller's saved-tensor hooks


def test_saved_tensor_hooks_see_the_steps_own_saved_tensors():
    """A training step under the caller's ``saved_tensors_hooks`` (how ``save_on_cpu`` and
    activation offloading work): every step packs and unpacks the same tensors (count, shapes,
    dtypes, bytes) as with guard="off". The guard's checks run a second forward with autograd on
    sampled calls (the Dynamo-graph reference); its saved tensors are its own business."""

    def case(compile: Compile) -> State:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = compile(model)
        packed: list[tuple] = []
        unpacked: list[tuple] = []

        def seen(t: torch.Tensor) -> tuple:
            return (t.dim(), *t.shape, t.element_size())

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(seen(t))
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            unpacked.append(seen(t))
            return t

        out: State = {}
        for i, x in enumerate(_batches(1, 6, 4, 8)):
            packed.clear(), unpacked.clear()
            opt.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                fn(x).square().mean().backward()
            opt.step()
            snapshot(out, i, model, packed=torch.tensor([n for t in sorted(packed) for n in t]),
                     unpacked=torch.tensor([n for t in sorted(unpacked) for n in t]))
        return out

    # bit for bit against guard="off" (eager saves what its ops save, compiled code what the partitioner keeps)
    assert_state_contract(*run_variants(case), bitwise=True)
