"""Run the zoo with eager, inductor and enn side by side, in one process.

For one *workload* (model x mode x dtype) the runner

1. builds the model once and gives every backend its own deep copy (same weights);
2. accuracy: runs an fp64 copy (no autocast) as the reference, runs eager twice to
   check it agrees with itself, then each compiled backend's FIRST call - the call
   that compiles - is also its accuracy sample (loss + gradients for training,
   outputs for inference), judged by :mod:`.accuracy`;
   that first call is timed: the *cold* compile time, with each backend compiling
   into its own empty Inductor cache folder (no backend reuses another's kernels);
3. step time: every backend first runs untimed steps past enn's guard warm-up (the guard
   checks each of a graph's first ``guard_warmup`` calls with a host sync; that one-time
   cost is not the steady state, and ``bench/guard_overhead.py`` measures the guard itself),
   then every backend is timed in rounds, interleaved, the order rotated each
   round, so that drift (thermal, other processes) does not favour one backend;
   GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed) per round, median;
   CPU: warmed-up wall clock of a batch of steps per round; the result is the
   median over rounds;
4. peak memory (CUDA: max allocated during one step, above what was allocated
   before it; on CPU it is not measured);
5. the *warm* compile time: Dynamo is reset, in-memory caches are dropped and each
   backend compiles again from its now-filled disk cache (a second process start);
6. when enn is slower than inductor on the workload, a short profile of both
   (top operators by self time) is kept as evidence.

A training step is ``zero_grad, forward + loss (under autocast for bf16), backward,
AdamW step`` with the model compiled (the optimizer runs eagerly, as most users run it).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

import enn_backend

from .. import compat
from .. import models
from . import accuracy

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("train", "infer")

# backend name -> torch.compile keyword arguments (None: eager, no compile)
BACKENDS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "inductor": {"backend": "inductor"},
    "enn": {"backend": "enn"},
    "inductor-max-autotune": {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
    "enn-max-autotune": {"backend": "enn", "options": {"mode": "max-autotune-no-cudagraphs"}},
}


@dataclass
class BenchConfig:
    models: list[str]
    size: str = "cpu-small"
    device: str = "cpu"
    modes: list[str] = field(default_factory=lambda: ["train", "infer"])
    dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    backends: list[str] = field(default_factory=lambda: ["eager", "inductor", "enn"])
    rounds: int = 5  # interleaved timing rounds
    warmup: int = 3  # untimed steps per backend before the rounds
    sample_s: float = 0.05  # CPU: wall time of one timed batch of steps
    rep_ms: float = 40.0  # GPU: do_bench rep per round
    warm_compile: bool = True
    profile_slow: bool = True  # profile enn and inductor where enn is slower
    slow_threshold: float = 0.97  # enn/inductor speed ratio under which a workload is profiled
    budget_s: float | None = None  # stop starting new workloads after this long
    threads: int | None = None  # CPU: torch.set_num_threads for the run (None: torch's default)
    warm_up: bool = True  # one throwaway compile first, so no backend pays the compiler's start-up
    preset: str = "custom"
    command: str = ""


@dataclass
class BackendResult:
    name: str
    ok: bool = True
    error: str = ""
    time_ms: float = float("nan")
    samples_ms: list[float] = field(default_factory=list)
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    peak_mem_mb: float | None = None
    accuracy: dict[str, Any] | None = None
    graphs: int | None = None  # Dynamo graphs compiled (graph breaks show up as > 1)
    enn: dict[str, Any] | None = None  # fusions, fallbacks, graph paths (enn backends only)


# ============================================================ helpers
def _autocast(device: str, dtype: str) -> Callable[[], Any]:
    if DTYPES[dtype] is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _to_fp64(batch: models.Batch) -> models.Batch:
    args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in batch.args)
    return models.Batch(args, batch.target)


def _result_step(fn: Callable, module: torch.nn.Module, batch: models.Batch, loss_fn: Callable, mode: str,
                 autocast: Callable[[], Any]) -> list[torch.Tensor]:
    """One accuracy sample: outputs (inference) or loss + every gradient (training)."""
    if mode == "infer":
        with torch.no_grad(), autocast():
            return accuracy.flatten(fn(*batch.args))
    module.zero_grad(set_to_none=True)
    with autocast():
        loss = loss_fn(fn(*batch.args), batch.target)
    loss.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return [loss.detach()] + grads


def steady_state_warmup() -> int:
    """Untimed steps before timing: past the calls of each graph enn's guard checks one by one
    (``guard_warmup``, from options + env), so timings are the steady state for every backend."""
    from enn_backend.options import Options

    return Options.from_sources(None, None).guard_warmup + 2


def _timed_step(fn: Callable, module: torch.nn.Module, opt: torch.optim.Optimizer | None, batch: models.Batch,
                loss_fn: Callable, mode: str, autocast: Callable[[], Any]) -> Callable[[], Any]:
    if mode == "infer":
        def infer() -> Any:
            with torch.no_grad(), autocast():
                return fn(*batch.args)

        return infer

    def train() -> Any:
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(fn(*batch.args), batch.target)
        loss.backward()
        opt.step()
        return loss

    return train


@contextlib.contextmanager
def cache_dir(path: str):
    """Compile into Inductor/Triton cache folder ``path`` with empty in-memory caches."""
    old = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.makedirs(path, exist_ok=True)
    compat.clear_inductor_memory_caches()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        compat.clear_inductor_memory_caches()


def enn_entry_point_installed() -> bool:
    """Is ``backend="enn"`` resolvable through the installed entry point (``pip install -e .``)?"""
    from importlib.metadata import entry_points

    return any(ep.name == "enn" for ep in entry_points(group="torch_dynamo_backends"))


def _compile(model: torch.nn.Module, kwargs: dict[str, Any]) -> Callable:
    """``torch.compile`` with a backend of :data:`BACKENDS`.

    enn goes through its entry point (``backend="enn"``, what users write); in a source
    tree that was never pip-installed the same function is passed directly.
    """
    kwargs = dict(kwargs)
    if kwargs["backend"] == "enn" and not _ENN_BY_NAME[0]:
        from enn_backend.backend import enn

        kwargs["backend"] = enn
    return torch.compile(model, **kwargs)


_ENN_BY_NAME = [True]


def _graph_count() -> int:
    return int(compat.dynamo_counters["stats"].get("unique_graphs", 0))


def _enn_units() -> set[str]:
    """Every unit (Dynamo graph) enn's report knows of: from its graphs and from its fallbacks
    (a unit that fell back to plain Inductor as a whole has a fallback but no graph record)."""
    rep = enn_backend.report()
    return {g.unit for g in rep.graphs} | {f.graph.split("/")[0] for f in rep.fallbacks if f.graph}


def _enn_summary(units: set[str]) -> dict[str, Any]:
    """What enn's report says about the graphs of ``units`` (one backend's compiles)."""
    rep = enn_backend.report()
    graphs = [g for g in rep.graphs if g.unit in units]
    fallbacks = [f for f in rep.fallbacks if f.graph.split("/")[0] in units]
    fusions: dict[str, int] = {}
    kinds: dict[str, int] = {}
    paths: dict[str, int] = {}
    for g in graphs:
        for k, v in g.fusions.items():
            fusions[k] = fusions.get(k, 0) + v
        paths[g.path] = paths.get(g.path, 0) + 1
    for fb in fallbacks:
        kinds[fb.kind] = kinds.get(fb.kind, 0) + 1
    return {
        "fusions": fusions,
        "fallbacks": kinds,
        "fallback_details": [f"[{f.kind}] {f.phase} {f.node}: {f.reason[:160]} -> {f.action}" for f in fallbacks][:10],
        "graph_paths": paths,
        "graphs": [g.id for g in graphs],
        "pinned": sum(len(g.pinned) for g in graphs),
        "kernel_choices": [c for g in graphs for c in g.kernel_choices][:20],
    }


def _format_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


# ============================================================ timing
class Timer:
    """Median step time of several callables, measured interleaved in rounds."""

    def __init__(self, device: str, cfg: BenchConfig) -> None:
        self.device, self.cfg = device, cfg
        self.cuda = torch.device(device).type == "cuda"
        self._do_bench = None
        if self.cuda:
            try:
                from triton.testing import do_bench

                self._do_bench = do_bench
            except ImportError:
                self._do_bench = None
        self.method = ("triton.testing.do_bench" if self._do_bench else "CUDA events") if self.cuda else "wall clock"

    def _cpu_sample(self, fn: Callable[[], Any], n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e3 / n

    def _cuda_sample(self, fn: Callable[[], Any]) -> float:
        if self._do_bench is not None:
            try:
                return float(self._do_bench(fn, warmup=5, rep=self.cfg.rep_ms, return_mode="median"))
            except TypeError:  # a Triton without return_mode: quantiles=[0.5] is the median
                return float(self._do_bench(fn, warmup=5, rep=self.cfg.rep_ms, quantiles=[0.5]))
        n = 10
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def measure(self, fns: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
        names = list(fns)
        steps = max(self.cfg.warmup, steady_state_warmup())  # the same for every backend
        for name in names:  # warm up (autotuning, allocator, caches, enn's guard warm-up) before any timed round
            for _ in range(steps):
                fns[name]()
        _sync(self.device)
        reps = {}
        if not self.cuda:  # enough steps per sample for ~sample_s of wall time
            for name in names:
                t = max(self._cpu_sample(fns[name], 1), 1e-3) / 1e3
                reps[name] = max(1, min(200, math.ceil(self.cfg.sample_s / t)))
        samples: dict[str, list[float]] = {n: [] for n in names}
        for r in range(self.cfg.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                samples[name].append(self._cuda_sample(fns[name]) if self.cuda else self._cpu_sample(fns[name], reps[name]))
        return samples


def paired_ratio(slow: list[float], fast: list[float]) -> float:
    """Median over rounds of ``slow[r] / fast[r]``.

    The two samples of one round were taken back to back, so they share that
    moment's noise (another process, clocks); the median of the per-round ratios
    is steadier than the ratio of two medians on a shared machine.
    """
    return statistics.median(a / b for a, b in zip(slow, fast) if a > 0 and b > 0)


def _peak_mem_mb(fn: Callable[[], Any], device: str) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _profile(fns: dict[str, Callable[[], Any]], device: str, steps: int = 0, top: int = 8) -> dict[str, Any]:
    """Top operators/kernels by self time per step, and calls per step of every operator, per callable."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    steps = steps or (5 if cuda else 10)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        fn()
        _sync(device)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            _sync(device)
        # On CUDA a kernel's time shows twice: on the kernel's own (device) event and as the
        # device time of the CPU-side op or launcher that issued it. Time counts kernels only;
        # call counts come from every event (operators, launches and kernels).
        timed, calls = [], {}
        for ev in prof.key_averages():
            calls[ev.key[:90]] = ev.count / steps
            if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            dev_t = getattr(ev, "self_device_time_total", None)
            if dev_t is None:
                dev_t = getattr(ev, "self_cuda_time_total", 0.0)
            t = dev_t if cuda else ev.self_cpu_time_total
            timed.append({"name": ev.key[:90], "calls_per_step": ev.count / steps, "self_ms_per_step": t / 1e3 / steps})
        timed.sort(key=lambda r: -r["self_ms_per_step"])
        out[name] = {"clock": "device" if cuda else "cpu", "steps": steps,
                     "total_ms_per_step": sum(r["self_ms_per_step"] for r in timed),
                     "top": [r for r in timed if r["self_ms_per_step"] > 0][:top],
                     "calls": calls}
    return out


# ============================================================ one workload
def run_workload(name: str, mode: str, dtype: str, cfg: BenchConfig, cache_root: str, order_shift: int = 0) -> dict[str, Any]:
    device = cfg.device
    autocast = _autocast(device, dtype)
    tol = accuracy.tolerance(mode, dtype)
    torch.compiler.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the last workload's blocks must not count in this one's peak memory
    base, make_inputs, loss_fn = models.build(name, cfg.size, device=device, seed=0)
    base.train(mode == "train")
    batch = make_inputs(0)
    wl: dict[str, Any] = {
        "model": name, "mode": mode, "dtype": dtype, "size": cfg.size, "config": _jsonable(models.config(name, cfg.size)),
        "params": sum(p.numel() for p in base.parameters()), "tolerance": tol, "backends": {},
    }

    # ---- reference and eager self-check
    ref_model = copy.deepcopy(base).double()
    ref = _result_step(ref_model, ref_model, _to_fp64(batch), loss_fn, mode, contextlib.nullcontext)
    del ref_model
    eager_runs = []
    for _ in range(2):
        m = copy.deepcopy(base)
        eager_runs.append(_result_step(m, m, batch, loss_fn, mode, autocast))
    agrees, why = accuracy.eager_self_check(eager_runs[0], eager_runs[1], tol=tol)
    wl["eager_self_check"] = {"passed": agrees, "detail": why}

    # ---- per backend: model copy, optimizer, cold compile (= the accuracy sample)
    names = [b for b in cfg.backends if b in BACKENDS]
    compiled_names = [b for b in names if BACKENDS[b] is not None]
    shift = order_shift % max(1, len(compiled_names))
    cold_order = compiled_names[shift:] + compiled_names[:shift]
    wl["compile_order"] = cold_order
    results = {b: BackendResult(b) for b in names}
    steps: dict[str, Callable[[], Any]] = {}
    kept: dict[str, torch.nn.Module] = {}
    verdicts: dict[str, accuracy.Verdict] = {}
    enn_units: dict[str, set[str]] = {}
    enn_backend.reset()
    if "eager" in results:
        results["eager"].accuracy = {"passed": True, "reason": "the result compiled backends are compared with",
                                     "rel_error_compiled": accuracy.relative_error(eager_runs[0], ref)}
    for b in (["eager"] if "eager" in names else []) + cold_order:
        res = results[b]
        m = copy.deepcopy(base)
        kwargs = BACKENDS[b]
        fn: Callable = m
        try:
            if kwargs is not None:
                units0 = _enn_units()
                g0 = _graph_count()
                with cache_dir(os.path.join(cache_root, f"{name}-{mode}-{dtype}-{b}")):
                    fn = _compile(m, kwargs)
                    _sync(device)
                    t0 = time.perf_counter()
                    out = _result_step(fn, m, batch, loss_fn, mode, autocast)
                    _sync(device)
                    res.compile_cold_s = time.perf_counter() - t0
                res.graphs = _graph_count() - g0
                if kwargs["backend"] == "enn":
                    enn_units[b] = _enn_units() - units0
                v = accuracy.compare(out, eager_runs[0], ref, tol=tol, dtype=dtype)
                verdicts[b] = v
                res.accuracy = {**v.to_dict(), "reliable": agrees}
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if mode == "train" else None
            steps[b] = _timed_step(fn, m, opt, batch, loss_fn, mode, autocast)
            kept[b] = m
        except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the suite
            res.ok, res.error = False, _format_exc(exc)
            res.accuracy = {"passed": False, "reason": f"did not run: {res.error}"}
            traceback.print_exc(limit=3, file=sys.stderr)

    # ---- interleaved timing, then peak memory per backend
    timer = Timer(device, cfg)
    wl["timing_method"] = timer.method
    live = {b: steps[b] for b in names if b in steps}
    try:
        g0 = _graph_count()
        with cache_dir(os.path.join(cache_root, f"{name}-{mode}-{dtype}-timing")):
            samples = timer.measure(live)
        if _graph_count() != g0:  # a compile inside the timed loop would distort the times: say so
            wl["compiled_during_timing"] = _graph_count() - g0
        for b, s in samples.items():
            results[b].samples_ms = [round(x, 5) for x in s]
            results[b].time_ms = statistics.median(s)
        for b, fn in live.items():
            results[b].peak_mem_mb = _peak_mem_mb(fn, device)
    except Exception as exc:  # noqa: BLE001
        wl["timing_error"] = _format_exc(exc)
        traceback.print_exc(limit=3, file=sys.stderr)
    for b, units in enn_units.items():
        results[b].enn = _enn_summary(units)  # after timing: runtime fallbacks count too

    # ---- speed ratio, accuracy comparison, profile evidence
    ind, enn = results.get("inductor"), results.get("enn")
    if ind and enn and ind.ok and not enn.ok:  # enn failing where inductor runs is worse, whatever the numbers
        wl["accuracy_enn_no_worse"] = {"passed": False, "detail": "enn failed on a workload inductor runs"}
    if ind and enn and ind.ok and enn.ok and ind.time_ms > 0 and enn.time_ms > 0:
        wl["speedup_enn_vs_inductor"] = paired_ratio(ind.samples_ms, enn.samples_ms)
        wl["speedup_enn_vs_inductor_of_medians"] = ind.time_ms / enn.time_ms
        if "inductor" in verdicts and "enn" in verdicts:
            ok, why = accuracy.no_worse(verdicts["enn"], verdicts["inductor"])
            wl["accuracy_enn_no_worse"] = {"passed": ok, "detail": why}
        if cfg.profile_slow and wl["speedup_enn_vs_inductor"] < cfg.slow_threshold:
            try:
                wl["profile"] = _profile({"inductor": live["inductor"], "enn": live["enn"]}, device)
            except Exception as exc:  # noqa: BLE001
                wl["profile_error"] = _format_exc(exc)
    if "eager" in results and ind and ind.ok and results["eager"].ok and ind.samples_ms and results["eager"].samples_ms:
        wl["speedup_inductor_vs_eager"] = paired_ratio(results["eager"].samples_ms, ind.samples_ms)
    del steps, live, kept

    # ---- warm compile: reset Dynamo, drop in-memory caches, compile again from disk
    if cfg.warm_compile:
        for b in cold_order:
            res = results[b]
            if not res.ok:
                continue
            torch.compiler.reset()
            m = copy.deepcopy(base)
            try:
                with cache_dir(os.path.join(cache_root, f"{name}-{mode}-{dtype}-{b}")):
                    fn = _compile(m, BACKENDS[b])
                    _sync(device)
                    t0 = time.perf_counter()
                    _result_step(fn, m, batch, loss_fn, mode, autocast)
                    _sync(device)
                    res.compile_warm_s = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                res.error = f"warm compile: {_format_exc(exc)}"
        torch.compiler.reset()

    wl["backends"] = {b: asdict(r) for b, r in results.items()}
    return wl


def _jsonable(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


# ============================================================ the suite
class Progress:
    """tqdm when installed, else one plain line per step."""

    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="workload", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None

    def start(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc)
        else:
            print(f"[{self.n + 1}/{self.total}] {desc} ...", file=sys.stderr, flush=True)

    def done(self, note: str = "") -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(note)
            self.bar.update(1)
        elif note:
            print(f"    {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "triton": compat.triton_version(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "enn": enn_backend.__version__,
        "enn_aot_cache_hits": compat.aot_cache_usable(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["capability"] = list(torch.cuda.get_device_capability())
    else:
        info["cpu"] = platform.processor() or platform.machine()
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def _warm_up_compiler(device: str, cache_root: str) -> None:
    """Start Inductor's compile workers before any timed compile (else the first backend pays)."""
    with cache_dir(os.path.join(cache_root, "_warmup")):
        f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T + 1.0), backend="inductor")
        f(torch.randn(8, 8, device=device))
    torch.compiler.reset()


def run_suite(cfg: BenchConfig) -> dict[str, Any]:
    """Every (model, mode, dtype) workload of ``cfg``; returns the result dict (see :mod:`.plots`)."""
    t_start = time.perf_counter()
    work = [(m, mode, dt) for m in cfg.models for dt in cfg.dtypes for mode in cfg.modes]
    env_keep = {k: os.environ.get(k) for k in ("ENN_CACHE_DIR", "ENN_REPRO_DIR")}
    cache_root = tempfile.mkdtemp(prefix="enn-bench-")
    # enn's persisted kernel state from earlier runs must not pin nodes here; repros go to the temp folder
    os.environ["ENN_CACHE_DIR"] = os.path.join(cache_root, "enn-state")
    os.environ["ENN_REPRO_DIR"] = os.path.join(cache_root, "enn-repros")
    result: dict[str, Any] = {
        "format": "enn-bench", "version": 1, "command": cfg.command, "preset": cfg.preset,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device_info(cfg.device),
        "config": asdict(cfg), "env": {k: v for k, v in os.environ.items() if k.startswith(("ENN_", "TORCHINDUCTOR_"))
                                       and k not in ("ENN_CACHE_DIR", "ENN_REPRO_DIR", "TORCHINDUCTOR_CACHE_DIR")},
        "workloads": [], "skipped": [],
    }
    _ENN_BY_NAME[0] = enn_entry_point_installed()
    result["enn_backend_by"] = "entry point (backend='enn')" if _ENN_BY_NAME[0] else "function (package not pip-installed)"
    if not _ENN_BY_NAME[0]:
        print("enn bench: the 'enn' entry point is not installed (pip install -e .); passing enn's backend function directly",
              file=sys.stderr)
    progress = Progress(len(work))
    old_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    result["device"]["torch_threads"] = torch.get_num_threads()
    try:
        if cfg.warm_up:
            t0 = time.perf_counter()
            _warm_up_compiler(cfg.device, cache_root)
            result["compiler_warm_up_s"] = time.perf_counter() - t0
        # Which compiled backend compiles first alternates within each (mode, dtype) group: the
        # first compile of a workload has been seen to move that workload's ratio by a few percent
        # (CPU inference), and the groups must not all favour one backend.
        firsts: dict[tuple[str, str], int] = {}
        for model, mode, dt in work:
            if cfg.budget_s is not None and time.perf_counter() - t_start > cfg.budget_s:
                result["skipped"].append({"model": model, "mode": mode, "dtype": dt, "why": f"time budget {cfg.budget_s:.0f}s spent"})
                progress.done("skipped (budget)")
                continue
            progress.start(f"{model} {mode} {dt}")
            t0 = time.perf_counter()
            try:
                shift = firsts.get((mode, dt), 0)
                firsts[(mode, dt)] = shift + 1
                wl = run_workload(model, mode, dt, cfg, cache_root, order_shift=shift)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc(limit=5, file=sys.stderr)
                wl = {"model": model, "mode": mode, "dtype": dt, "size": cfg.size, "error": _format_exc(exc), "backends": {}}
            wl["wall_s"] = time.perf_counter() - t0
            result["workloads"].append(wl)
            sp = wl.get("speedup_enn_vs_inductor")
            progress.done(f"enn/inductor {sp:.2f}x" if sp else wl.get("error", "no ratio"))
    finally:
        progress.close()
        torch.set_num_threads(old_threads)
        shutil.rmtree(cache_root, ignore_errors=True)
        for k, v in env_keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result["wall_s"] = time.perf_counter() - t_start
    from .plots import summarize

    result["summary"] = summarize(result)
    return result
