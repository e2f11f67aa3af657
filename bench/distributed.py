"""enn under torch.distributed: DDP and FSDP2 training of a small HF decoder, with faults on one rank.

    python bench/distributed.py --backend gloo --device cpu --world-size 2 [--out FILE.md]
    python bench/distributed.py --backend nccl --device cuda --world-size 2     # 2 GPUs
    python bench/distributed.py --backend nccl --device cuda --world-size 1     # NCCL path, 1 GPU

The script is its own launcher: each scenario starts ``--world-size`` worker processes of this
file (rendezvous over MASTER_ADDR/MASTER_PORT on localhost, one GPU per rank on cuda) and kills
them past ``--timeout`` seconds, so nothing hangs. Scenarios, for DDP (Dynamo's DDP optimizer
splits the graph at DDP's buckets, which are made small here) and FSDP2 (``fully_shard`` on each
decoder layer and the model):

- clean: eager, inductor and enn train ``--steps`` steps from the same weights (a LlamaConfig
  decoder, random weights, bf16 autocast on cuda); parameters after the last step against
  eager's on every rank; then ``--rounds`` interleaved rounds of ``--timed`` steps each: step
  time median and spread (interquartile range, % of the median) per backend.
- nan: enn with a NaN injected on rank 0 only (``fault_inject``): every rank's ``pinned`` sets
  (graph id -> pinned node names), parameters against eager's (a fault-free run), the time the
  recovery cost (slowest step of the faulty run minus the clean enn run's).
- compile: a lowering that raises at compile time on rank 0 only, under guard=strict (every
  rank must fail with the same error) and the default guard (every rank must finish).
- overhead (DDP): enn guard off vs guard defaults vs checking every call, under DDP and in a
  single process (no process group): steady-state step time after the guard's warm-up.

Each worker prints one ``RESULT {json}`` line; the launcher compares the ranks and prints a
markdown table (written to ``--out`` too). tests/test_distributed.py runs these functions.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from enn_backend.bench.timing import speed_verdict, spread_pct

HERE = os.path.abspath(__file__)
FAULT = "aten.rsqrt:nan:fwd"  # RMSNorm's: in every decoder layer's forward graph, under DDP and FSDP2
COMPILE_FAULT = "aten.rsqrt:nan:compile"  # an enn lowering raises while Inductor compiles
# Sizes: DDP's buckets hold 1 MiB (the least Dynamo's DDP optimizer accepts: DDP's first bucket),
# so the MLPs are wide enough for the optimizer to split each model into several Dynamo graphs.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32)
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
ENN = {"persist": False, "repro": False}  # no kernel state or repro scripts written by a benchmark


# ------------------------------------------------------------------ launcher
def launch(job: dict[str, Any], *, world_size: int, backend: str, device: str, timeout: float) -> list[dict[str, Any]]:
    """Run ``job`` on ``world_size`` worker processes; each rank's RESULT (or its failure:
    ``{"rc", "error"}``; ``timed_out`` when the run was killed at ``timeout`` seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = {**job, "backend": backend, "device": device, "timeout": timeout}
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_NVLS_ENABLE": "0"}
        procs.append(subprocess.Popen([sys.executable, HERE, "--worker", json.dumps(job)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    deadline, results = time.monotonic() + timeout, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            out, err = p.communicate()
            timed_out = True
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        res = json.loads(line[len("RESULT "):]) if line else {}
        res.update(rc=p.returncode, timed_out=timed_out)
        if p.returncode != 0 or line is None:
            res["stderr"] = err[-4000:]
        results.append(res)
    return results


# ------------------------------------------------------------------ worker
def _model(cfg: dict[str, Any]) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**cfg, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def _wrap(model: Any, wrapper: str, device: Any) -> Any:
    import torch

    model = model.to(device)
    if wrapper == "ddp":
        # small buckets: Dynamo's DDP optimizer (on by default) splits the graph at each
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    return model  # "none": one process


def _params(model: Any) -> list[Any]:
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().float().cpu().clone())
    return out


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


class _Run:
    """One model (eager or compiled), its optimizer, its step and its step times."""

    def __init__(self, base: Any, wrapper: str, device: Any, variant: dict[str, Any]) -> None:
        import torch

        self.name, self.times, self.timed = variant["name"], [], variant["timed"]
        self.model = _wrap(copy.deepcopy(base), wrapper, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        kind = variant["kind"]
        self.fn = self.model if kind == "eager" else torch.compile(
            self.model, backend=kind, **({"options": variant["options"]} if kind == "enn" else {}))
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(self, ids: Any) -> None:
        import torch

        t0 = time.perf_counter()
        with self.autocast:
            loss = self.fn(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)


def variant(name: str, kind: str = "enn", fault_rank0: str = "", timed: bool = True, fails: bool = False,
            pins: bool = False, **options: Any) -> dict[str, Any]:
    """A run of a job: ``kind`` eager | inductor | enn (with ``options`` and, on rank 0 only,
    ``fault_inject=fault_rank0``); ``timed``: in the interleaved timing rounds; ``fails``: every
    rank must raise (the same error); ``pins``: the guard must pin something."""
    return {"name": name, "kind": kind, "options": {**ENN, **options}, "fault_rank0": fault_rank0, "timed": timed,
            "fails": fails, "pins": pins}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import enn_backend
    from enn_backend.report import reset

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(job["device"], int(os.environ.get("LOCAL_RANK", 0)) if job["device"] == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wrapper = job["wrapper"]
    if wrapper != "none":
        dist.init_process_group(job["backend"], rank=rank, world_size=world, timeout=timedelta(seconds=job["timeout"]),
                                **({"device_id": device} if device.type == "cuda" else {}))
    base = _model(TINY if job.get("size") == "tiny" else SMALL)
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank its own batch
    ids = torch.randint(3, base.config.vocab_size, (2, 16), generator=gen).to(device)
    result: dict[str, Any] = {"rank": rank, "world_size": world, "runs": {}}
    params: dict[str, list[Any]] = {}

    def train(v: dict[str, Any]) -> _Run:
        reset()
        if rank == 0 and v["fault_rank0"]:
            v = {**v, "options": {**v["options"], "fault_inject": v["fault_rank0"]}}
        run = _Run(base, wrapper, device, v)
        info: dict[str, Any] = {"fails": v["fails"], "pins": v["pins"]}
        try:
            for _ in range(job["steps"]):
                run.step(ids)
            params[run.name] = _params(run.model)
        except Exception as exc:  # noqa: BLE001 - reported per run, compared across ranks
            lines = f"{type(exc).__name__}: {exc}".splitlines()
            info["error"] = next((x for x in lines if "enn:" in x), lines[0] if lines else "")[:1000]
            info["traceback"] = traceback.format_exc()[-3000:]
        info["steps_s"] = list(run.times)
        if v["kind"] == "enn":
            rep = enn_backend.report().to_dict()
            info["pinned"] = {g["id"]: g["pinned"] for g in rep["graphs"]}
            info["units"] = len({g["unit"] for g in rep["graphs"]})
            info["fallbacks"] = [(f["kind"], f["node"], f["graph"], f["action"][:200]) for f in rep["fallbacks"]]
        result["runs"][run.name] = info
        return run

    # The timed runs first, side by side: their graphs stay in Dynamo's cache for the rounds.
    # Then each fault run after torch.compiler.reset(): its options differ between ranks, so
    # Dynamo would reuse an earlier run's graphs on some ranks only (the guard needs every rank
    # to compile the same graphs).
    timed = [train(v) for v in job["variants"] if v["timed"]]
    timed = [r for r in timed if "error" not in result["runs"][r.name]]
    for i in range(job.get("rounds", 0)):  # interleaved, the order rotated each round
        for r in timed[i % len(timed):] + timed[:i % len(timed)]:
            n0 = len(r.times)
            for _ in range(job["timed"]):
                r.step(ids)
            result["runs"][r.name].setdefault("round_s", []).append(statistics.mean(r.times[n0:]))
    del timed
    for v in job["variants"]:
        if not v["timed"]:
            torch.compiler.reset()
            train(v)
    for name, info in result["runs"].items():
        if "eager" in params and name in params:
            info["max_diff"] = _max_diff(params[name], params["eager"])
    if job.get("exchange") and world > 1:  # what one agreed call costs: the guard's exchange alone
        from enn_backend.guard.ranks import gather_levels

        times = []
        for _ in range(220):
            t0 = time.perf_counter()
            gather_levels(0)
            times.append(time.perf_counter() - t0)
        result["exchange_s"] = times[20:]
    if wrapper != "none":
        dist.destroy_process_group()
    return result


# ------------------------------------------------------------------ scenarios
def check(results: list[dict[str, Any]], tol: float) -> list[str]:
    """What is wrong with one launch's rank results (empty: all is well): a rank that failed or
    timed out, runs whose ``pinned`` sets or errors differ between ranks, parameters off eager's."""
    bad = [f"rank {i}: rc {r['rc']}{' (timed out)' if r['timed_out'] else ''}: {r.get('stderr', '')[-1500:]}"
           for i, r in enumerate(results) if r["rc"] != 0 or r["timed_out"]]
    if bad:
        return bad
    first = results[0]["runs"]
    for name, run in first.items():
        others = [r["runs"][name] for r in results[1:]]
        if any(o.get("pinned") != run.get("pinned") for o in others):
            bad.append(f"{name}: pinned sets differ between ranks: {[r['runs'][name].get('pinned') for r in results]}")
        if any(o.get("error") != run.get("error") for o in others):
            bad.append(f"{name}: errors differ between ranks: {[r['runs'][name].get('error') for r in results]}")
        if run["pins"] and not any(run.get("pinned", {}).values()):
            bad.append(f"{name}: nothing pinned (the fault was not met?): {run.get('fallbacks')}")
        if bool(run.get("error")) != run["fails"] and not any("errors differ" in b for b in bad):
            bad.append(f"{name}: " + (f"raised {run['error']}\n\n```\n{run.get('traceback', '')}```" if run.get("error")
                                      else "should have failed on every rank"))
        for r in results:
            d = r["runs"][name].get("max_diff")
            if d is not None and not d <= tol:
                bad.append(f"{name}: rank {r['rank']}: parameters differ from eager's by {d:.3g} (> {tol:g})")
    return bad


def train_job(wrapper: str, size: str, steps: int, rounds: int = 0, timed: int = 0,
              runs: tuple[str, ...] = ("eager", "inductor", "enn", "enn nan@rank0", "enn compile-fault@rank0",
                                       "enn compile-fault@rank0 strict"), **enn: Any) -> dict:
    """The ``runs`` of one wrapper, of: eager, inductor, enn, enn with a NaN on rank 0, enn with a
    compile fault on rank 0 (default guard: every rank finishes), the same under guard=strict
    (every rank fails); ``enn``: options for every enn run."""
    every = [variant("eager", "eager"), variant("inductor", "inductor"), variant("enn", **enn),
             variant("enn nan@rank0", fault_rank0=FAULT, timed=False, pins=True, **enn),
             variant("enn compile-fault@rank0", fault_rank0=COMPILE_FAULT, timed=False, **enn),
             variant("enn compile-fault@rank0 strict", fault_rank0=COMPILE_FAULT, timed=False, fails=True,
                     **{**enn, "guard": "strict"})]
    return {"wrapper": wrapper, "size": size, "steps": steps, "rounds": rounds, "timed": timed,
            "variants": [v for v in every if v["name"] in runs]}


def overhead_job(wrapper: str, size: str, steps: int, rounds: int, timed: int) -> dict:
    variants = [variant("enn guard=off", guard="off"), variant("enn defaults"),
                variant("enn every call", guard_every=1, guard_warmup=0)]
    return {"wrapper": wrapper, "size": size, "steps": steps, "rounds": rounds, "timed": timed, "variants": variants,
            "exchange": True}


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med * 1e3:.{1 if med >= 1e-3 else 3}f} ms ±{spread_pct(xs):.0f}%"


def train_rows(wrapper: str, results: list[dict[str, Any]]) -> list[str]:
    runs0 = results[0]["runs"] if results and "runs" in results[0] else {}
    rows = []
    for name, run in runs0.items():
        per_rank = [r["runs"][name] for r in results]
        diff = max((p.get("max_diff", 0.0) for p in per_rank), default=0.0)
        pinned = sorted({n for g in run.get("pinned", {}).values() for n in g})
        same = all(p.get("pinned") == run.get("pinned") for p in per_rank)
        err = run.get("error")
        same_err = all(p.get("error") == err for p in per_rank)
        extra = ""
        if name.startswith("enn nan") and run.get("steps_s") and runs0.get("enn", {}).get("steps_s"):
            extra = (f"first step {run['steps_s'][0]:.1f} s with the fault's recovery, "
                     f"{runs0['enn']['steps_s'][0]:.1f} s clean (both with the compile)")
        rows.append(f"| {wrapper} | {name} | {'failed: ' + err[:140] if err else 'ok'}"
                    f"{' (same error on every rank)' if err and same_err else ''} | "
                    f"{'-' if err else f'{diff:.2g}'} | {', '.join(pinned) or '-'} "
                    f"{'(same on every rank)' if same else '(DIFFER)'} | {run.get('units', '-')} | "
                    f"{_ms(run.get('round_s', []))} {extra} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--wrappers", default="ddp,fsdp2")
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--steps", type=int, default=4, help="training steps compared with eager")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--timed", type=int, default=5, help="steps per backend per timing round")
    ap.add_argument("--overhead-steps", type=int, default=25,
                    help="steps before the overhead timing (past the guard's warm-up of 20 calls)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch, then every rank is killed")
    ap.add_argument("--no-overhead", action="store_true", help="skip the guard-overhead launches")
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    tol = 1e-4 if args.device == "cpu" else 2e-2  # fp32 vs bf16 autocast
    launch_args = dict(world_size=args.world_size, backend=args.backend, device=args.device, timeout=args.timeout)
    lines = [f"world size {args.world_size}, {args.backend}, {args.device}, model {args.size}, {args.steps} steps "
             f"compared with eager (tolerance {tol:g}); timing: {args.rounds} interleaved rounds x {args.timed} steps, "
             "median step time ± spread (interquartile range, % of the median), rank 0", "",
             "| wrapper | run | outcome | max abs diff vs eager (all ranks) | pinned | Dynamo graphs | step time |",
             "|---|---|---|---|---|---|---|"]
    problems: list[str] = []
    verdicts: list[str] = []
    for wrapper in [w for w in args.wrappers.split(",") if w]:  # (--wrappers "": the overhead launches only)
        t0 = time.monotonic()
        res = launch(train_job(wrapper, args.size, args.steps, args.rounds, args.timed), **launch_args)
        problems += [f"{wrapper}: {p}" for p in check(res, tol)]
        lines += train_rows(wrapper, res) + [f"| {wrapper} | (launch) | {time.monotonic() - t0:.0f} s wall | | | | |"]
        runs0 = res[0].get("runs", {})
        if runs0.get("inductor", {}).get("round_s") and runs0.get("enn", {}).get("round_s"):
            verdict = speed_verdict(runs0["inductor"]["round_s"], runs0["enn"]["round_s"], "inductor", "enn")
            verdicts.append(f"{wrapper}, rank 0: {verdict}")
    lines += [""] + verdicts
    if not args.no_overhead:
        lines += ["", "Guard overhead, steady state (after the warm-up), median step time ± spread, rank 0:", "",
                  "| setting | enn guard=off | enn defaults | enn every call checked | defaults vs off |",
                  "|---|---|---|---|---|"]
    exchange: list[float] = []
    for wrapper, world in () if args.no_overhead else (("ddp", args.world_size), ("none", 1)):
        job = overhead_job(wrapper, args.size, args.overhead_steps, args.rounds, args.timed)
        res = launch(job, **{**launch_args, "world_size": world})
        problems += [f"overhead {wrapper}: {p}" for p in check(res, tol)]
        runs = res[0].get("runs", {})
        exchange += res[0].get("exchange_s", [])
        med = {k: statistics.median(v["round_s"]) for k, v in runs.items() if v.get("round_s")}
        ratio = med["enn defaults"] / med["enn guard=off"] if len(med) == 3 else float("nan")
        label = f"DDP, {world} ranks" if wrapper == "ddp" else "one process"
        lines.append(f"| {label} | " + " | ".join(_ms(runs.get(k, {}).get("round_s", [])) for k in
                     ("enn guard=off", "enn defaults", "enn every call")) + f" | {ratio:.3f}x |")
    if exchange:
        lines += ["", f"One agreed call's exchange alone (an all-gather of two ints over the guard's gloo group), "
                      f"{len(exchange)} calls: {_ms(exchange)} per call, rank 0"]
    if problems:
        lines += ["", "Problems:", ""] + [f"- {p}" for p in problems]
    text = "\n".join(lines)
    print(text)
    if args.out:
        from enn_backend.report import atomic_write_text

        cmd = "python bench/distributed.py " + shlex.join(sys.argv[1:])
        atomic_write_text(args.out, f"`{cmd}`\n\n{text}\n")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
