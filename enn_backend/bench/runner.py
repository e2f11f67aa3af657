"""Run the zoo with eager, inductor and enn side by side, in one process.

For one *workload* (model x mode x dtype) the runner

1. builds the model once and gives every backend its own deep copy (same weights);
2. accuracy: runs an fp64 copy (no autocast) as the reference, runs eager twice to
   check it agrees with itself, then each compiled backend's FIRST call - the call
   that compiles - is also its accuracy sample (loss + gradients for training,
   outputs for inference), judged by :mod:`.accuracy`;
   that first call is timed: the *cold* compile time, with each backend compiling
   into its own empty Inductor cache folder (no backend reuses another's kernels);
3. step time: every backend is timed in interleaved rounds past enn's guard warm-up
   (:mod:`.timing`); the result is the median over rounds;
4. peak memory (CUDA: max allocated during one step, above what was allocated
   before it; on CPU it is not measured);
5. the *warm* compile time: Dynamo is reset, in-memory caches are dropped and each
   backend compiles again from its now-filled disk cache (a second process start);
6. when enn is slower than inductor on the workload, a short profile of both
   (top operators by self time) is kept as evidence;
7. with ``host_vs_kernel`` (the real-model presets), every backend's step is split into kernel
   time (CUDA: the sum of device kernel time per step, from ``torch.profiler``) and its wall
   time (the timed step); on the CPU only the wall (host) time is reported.

A model whose package does not import (:func:`enn_backend.models.unavailable`) is skipped with
the reason in ``result["skipped"]``; a model trained with dropout on (``stochastic``) gets no
accuracy verdict in training (every backend draws its own random stream), with the reason.

What one training or inference step is: :mod:`.steps`; the backends and their compiles:
:mod:`.backends`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
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

from .. import __version__, compat, models
from ..report import reset as reset_report
from . import accuracy
from .backends import (BACKENDS, PAIRS, cache_dir, compile_with, enn_entry_point_installed, enn_summary, enn_units, environ,
                       graph_count, warm_up_compiler)
from .steps import autocast, result_step, timed_step, to_fp64
from .summary import summarize
from .timing import Timer, paired_ratio, peak_mem_mb, profile, sync


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
    host_vs_kernel: bool = False  # per backend: kernel vs wall time of a step (profiled on CUDA)
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


def _format_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


# ============================================================ one workload
def run_workload(name: str, mode: str, dtype: str, cfg: BenchConfig, cache_root: str, order_shift: int = 0) -> dict[str, Any]:
    device = cfg.device
    amp = autocast(device, dtype)
    tol = accuracy.tolerance(mode, dtype)
    torch.compiler.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the last workload's blocks must not count in this one's peak memory
    base, make_inputs, loss_fn = models.build(name, cfg.size, device=device, seed=0)
    stochastic = models.spec(name).stochastic if mode == "train" else ""
    base.train(mode == "train")
    batch = make_inputs(0)
    wl: dict[str, Any] = {
        "model": name, "mode": mode, "dtype": dtype, "size": cfg.size, "config": _jsonable(models.config(name, cfg.size)),
        "params": sum(p.numel() for p in base.parameters()), "tolerance": tol, "backends": {},
    }

    # ---- reference and eager self-check
    ref_model = copy.deepcopy(base).double()
    ref = result_step(ref_model, ref_model, to_fp64(batch), loss_fn, mode, contextlib.nullcontext)
    del ref_model
    eager_runs = []
    for _ in range(2):
        m = copy.deepcopy(base)
        eager_runs.append(result_step(m, m, batch, loss_fn, mode, amp))
    agrees, why = accuracy.eager_self_check(eager_runs[0], eager_runs[1], tol=tol)
    wl["eager_self_check"] = {"passed": None, "detail": f"not applicable: the model {stochastic}"} if stochastic \
        else {"passed": agrees, "detail": why}

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
    enn_units_of: dict[str, set[str]] = {}
    reset_report()
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
                units0 = enn_units()
                g0 = graph_count()
                with cache_dir(os.path.join(cache_root, f"{name}-{mode}-{dtype}-{b}")):
                    fn = compile_with(m, kwargs)
                    sync(device)
                    t0 = time.perf_counter()
                    out = result_step(fn, m, batch, loss_fn, mode, amp)
                    sync(device)
                    res.compile_cold_s = time.perf_counter() - t0
                res.graphs = graph_count() - g0
                if kwargs["backend"] == "enn":
                    enn_units_of[b] = enn_units() - units0
                if stochastic:
                    res.accuracy = {"passed": None, "reason": f"not judged: the model {stochastic}"}
                else:
                    v = accuracy.compare(out, eager_runs[0], ref, tol=tol, dtype=dtype)
                    verdicts[b] = v
                    res.accuracy = {**v.to_dict(), "reliable": agrees}
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if mode == "train" else None
            steps[b] = timed_step(fn, opt, batch, loss_fn, mode, amp)
            kept[b] = m
        except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the suite
            res.ok, res.error = False, _format_exc(exc)
            res.accuracy = {"passed": False, "reason": f"did not run: {res.error}"}
            traceback.print_exc(limit=3, file=sys.stderr)

    # ---- interleaved timing, then peak memory per backend
    timer = Timer(device, rounds=cfg.rounds, warmup=cfg.warmup, sample_s=cfg.sample_s, rep_ms=cfg.rep_ms)
    wl["timing_method"] = timer.method
    live = {b: steps[b] for b in names if b in steps}
    try:
        g0 = graph_count()
        with cache_dir(os.path.join(cache_root, f"{name}-{mode}-{dtype}-timing")):
            samples = timer.measure(live)
        if graph_count() != g0:  # a compile inside the timed loop would distort the times: say so
            wl["compiled_during_timing"] = graph_count() - g0
        for b, s in samples.items():
            results[b].samples_ms = [round(x, 5) for x in s]
            results[b].time_ms = statistics.median(s)
        for b, fn in live.items():
            results[b].peak_mem_mb = peak_mem_mb(fn, device)
    except Exception as exc:  # noqa: BLE001
        wl["timing_error"] = _format_exc(exc)
        traceback.print_exc(limit=3, file=sys.stderr)
    for b, units in enn_units_of.items():
        results[b].enn = enn_summary(units)  # after timing: runtime fallbacks count too

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
                wl["profile"] = profile({"inductor": live["inductor"], "enn": live["enn"]}, device)
            except Exception as exc:  # noqa: BLE001
                wl["profile_error"] = _format_exc(exc)
    # the other same-mode pairs (CUDA graphs, max-autotune): enn against Inductor, each in that mode
    wl["speedups"] = {f"{fast} / {slow}": paired_ratio(results[slow].samples_ms, results[fast].samples_ms)
                      for slow, fast in PAIRS[1:] if slow in results and fast in results
                      and results[slow].samples_ms and results[fast].samples_ms}
    if cfg.host_vs_kernel:
        wl["host_vs_kernel"] = host_vs_kernel(live, results, device)
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
                    fn = compile_with(m, BACKENDS[b])
                    sync(device)
                    t0 = time.perf_counter()
                    result_step(fn, m, batch, loss_fn, mode, amp)
                    sync(device)
                    res.compile_warm_s = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                res.error = f"warm compile: {_format_exc(exc)}"
        torch.compiler.reset()

    wl["backends"] = {b: asdict(r) for b, r in results.items()}
    return wl


def host_vs_kernel(live: dict[str, Callable[[], Any]], results: dict[str, BackendResult], device: str) -> dict[str, Any]:
    """Per backend: the step's wall time (its timed median), its host time (the median time a call
    takes to return, the device not waited for: the host's own work per step, as long as the launch
    queue does not fill) and, on CUDA, the device kernel time of one step (torch.profiler) and the
    share of the wall time the device spent idle."""
    timed = {b: fn for b, fn in live.items() if results[b].samples_ms}
    out: dict[str, Any] = {b: {"wall_ms": results[b].time_ms, "host_ms": host_ms(fn, device), "kernel_ms": None,
                               "idle_share": None} for b, fn in timed.items()}
    if torch.device(device).type != "cuda":
        return out
    try:
        prof = profile(timed, device, top=5)
    except Exception as exc:  # noqa: BLE001
        return {"error": _format_exc(exc), **out}
    for b, p in prof.items():
        k = p["total_ms_per_step"]
        out[b].update(kernel_ms=k, idle_share=max(0.0, 1.0 - k / out[b]["wall_ms"]) if out[b]["wall_ms"] > 0 else None,
                      top=p["top"])
    return out


def host_ms(fn: Callable[[], Any], device: str, calls: int = 7) -> float:
    """The median time of ``calls`` calls of ``fn`` from call to return, each started on an idle
    device (synchronized before, not within): the host's time to issue one step."""
    times = []
    for _ in range(calls):
        sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return statistics.median(times)


def _jsonable(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


# ============================================================ the suite
class Progress:
    """tqdm when installed, else one plain line per step."""

    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0
        try:
            if not sys.stderr.isatty():  # a log file gets one timestamped line per step, not a redrawn bar
                raise ImportError
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="workload", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None

    def start(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc)
        else:
            print(f"{time.strftime('%H:%M:%S')} [{self.n + 1}/{self.total}] {desc} ...", file=sys.stderr, flush=True)

    def done(self, note: str = "") -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(note)
            self.bar.update(1)
        elif note:
            print(f"{time.strftime('%H:%M:%S')}     {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "triton": compat.triton_version(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "enn": __version__,
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


def run_suite(cfg: BenchConfig, on_workload: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every (model, mode, dtype) workload of ``cfg``; returns the result dict (see :mod:`.summary`).
    ``on_workload(result)`` is called after each workload with the result so far (partial results)."""
    t_start = time.perf_counter()
    cache_root = tempfile.mkdtemp(prefix="enn-bench-")
    old_threads = torch.get_num_threads()
    try:
        # enn's persisted kernel state from earlier runs must not pin nodes here; repros go to the temp folder
        with environ(ENN_CACHE_DIR=os.path.join(cache_root, "enn-state"), ENN_REPRO_DIR=os.path.join(cache_root, "enn-repros")):
            result: dict[str, Any] = {
                "format": "enn-bench", "version": 1, "command": cfg.command, "preset": cfg.preset,
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device_info(cfg.device),
                "config": asdict(cfg),
                "env": {k: v for k, v in os.environ.items() if k.startswith(("ENN_", "TORCHINDUCTOR_"))
                        and k not in ("ENN_CACHE_DIR", "ENN_REPRO_DIR", "TORCHINDUCTOR_CACHE_DIR")},
                "workloads": [], "skipped": [],
            }
            by_name = enn_entry_point_installed()
            result["enn_backend_by"] = "entry point (backend='enn')" if by_name else "function (package not pip-installed)"
            if not by_name:
                print("enn bench: the 'enn' entry point is not installed (pip install -e .); passing enn's backend "
                      "function directly", file=sys.stderr)
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            result["device"]["torch_threads"] = torch.get_num_threads()
            if cfg.warm_up:
                result["warm_up_s"] = warm_up_compiler(cfg.device, cache_root, cfg.backends)
            _run_workloads(cfg, result, cache_root, t_start, on_workload)
    finally:
        torch.set_num_threads(old_threads)
        shutil.rmtree(cache_root, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - t_start
    result["summary"] = summarize(result)
    return result


def _run_workloads(cfg: BenchConfig, result: dict[str, Any], cache_root: str, t_start: float,
                   on_workload: Callable[[dict[str, Any]], None] | None) -> None:
    """Run the workloads of ``cfg`` into ``result``; past the time budget the rest are skipped, and so
    are models whose packages do not import."""
    work = [(m, mode, dt) for m in cfg.models for dt in cfg.dtypes for mode in cfg.modes if mode in models.spec(m).modes]
    missing = {m: models.unavailable(m) for m in cfg.models}
    progress = Progress(len(work))
    try:
        # Which compiled backend compiles first alternates within each (mode, dtype) group: the
        # first compile of a workload has been seen to move that workload's ratio by a few percent
        # (CPU inference), and the groups must not all favour one backend.
        firsts: dict[tuple[str, str], int] = {}
        for model, mode, dt in work:
            if cfg.budget_s is not None and time.perf_counter() - t_start > cfg.budget_s:
                result["skipped"].append({"model": model, "mode": mode, "dtype": dt, "why": f"time budget {cfg.budget_s:.0f}s spent"})
                progress.done("skipped (budget)")
                continue
            if missing[model]:
                result["skipped"].append({"model": model, "mode": mode, "dtype": dt, "why": missing[model]})
                progress.done(f"skipped {model} {mode}: {missing[model]}")
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
            progress.done((f"enn/inductor {sp:.2f}x" if sp else wl.get("error", "no ratio")) + f" ({wl['wall_s']:.0f} s)")
            if on_workload is not None:
                on_workload(result)
    finally:
        progress.close()
