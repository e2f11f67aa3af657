"""``python -m enn_backend bench``: run the benchmark and accuracy suite.

    python -m enn_backend bench --quick                  # CPU preset, < 5 minutes on 2 cores
    python -m enn_backend bench --preset gpu             # one H100/H200, < 8 minutes
    python -m enn_backend bench --preset gpu --autotune  # + inductor max-autotune (longer)
    python -m enn_backend bench --preset real            # third-party models (HF, timm, torchvision), one H100, < 7 minutes
    python -m enn_backend bench --preset real-cpu --only hf_llama_eager,hf_bert_sdpa   # the same, tiny, on the CPU
    python -m enn_backend bench --preset real-defaults   # HF models as users leave them, next to their twins, one H200
    python -m enn_backend bench --preset host-bound      # host-bound training steps, default mode and CUDA graphs, one H200
    python -m enn_backend bench --models gpt2_naive,bert --modes train --dtypes fp32,bf16
    python -m enn_backend bench --render bench/results/cpu/quick.json   # re-render Markdown/PNGs
    python -m enn_backend bench --tool host_tax --device cpu             # a tool: bench/host_tax.py (below)

Results go to ``--out DIR``, else ``$ENN_BENCH_OUT``, else ``bench/<device>/`` in enn's cache folder
(``cache_dir`` / ``ENN_CACHE_DIR``, else ``~/.cache/enn``): never into the working directory unless
asked (the project's committed results are written with ``--out bench/results/<device>``). The
JSON and Markdown are rewritten after every workload, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

import torch

from .. import models
from ..models.real import AS_LEFT
from ..options import Options
from . import tools
from .backends import BACKENDS
from .plots import device_folder, write_outputs
from .runner import BenchConfig, run_suite
from .steps import DTYPES, MODES
from .summary import summarize

# The quick CPU preset: the models whose patterns enn targets (hand-written attention
# with a causal / padding / additive-bias mask, GEMM + bias + GELU), at the tiny size.
# Left out to stay under 5 minutes on 2 cores: gpt2_sdpa, t5, sliding, vit, convnet.
QUICK_MODELS = ["mlp", "gpt2_naive", "bert", "llama", "alibi"]

# GPU order: the ANCHORS workload first, then the attention patterns enn targets, so a
# budget cut drops the least telling workloads.
GPU_MODELS = ["gpt2_sdpa", "gpt2_naive", "llama", "bert", "alibi", "t5", "sliding", "mlp", "vit", "convnet"]

# The real-model presets run third-party models (enn_backend.models.REAL: transformers, timm,
# torchvision from random configs) in the order of REAL, the most telling first. GPU: 2 layers,
# T = 1024-4096, bf16; no warm-compile pass so that the compiles fit (11 timing rounds cost
# seconds; host-bound steps need them to settle): the budget
# stops starting new workloads at 330 s (the slowest, LLaMA at T=4096, runs early), which keeps the
# run under 7 minutes on one H100; what it cut is listed as skipped (run it with --only).
# A sibling of the gpu preset: bench/gpu_session.sh runs it as its own stage ("real").
# The real preset leaves out the models run as users leave them (the _defaults and _ckpt variants
# of enn_backend.models.real.AS_LEFT); real-cpu has them all.
# ResNet-50 runs in the host-bound preset only (ResNet-18 stands for the convnets in real).
_AS_LEFT_VARIANTS = {v for variants in AS_LEFT.values() for v in variants}
NOT_IN_REAL = _AS_LEFT_VARIANTS | {"tv_resnet50"}
REAL_PRESET = dict(models=[m for m in models.names("real") if m not in NOT_IN_REAL], modes=["train", "infer"],
                   backends=["eager", "inductor", "enn"], warm_compile=False, host_vs_kernel=True)

# real-defaults: each twin of AS_LEFT followed by its _defaults and _ckpt variants, so
# that each pair sits side by side; the real preset's timing, enn against Inductor only (eager's
# timing would cost about a workload's time over the run). Its 20 workloads take longer than 7
# minutes on one H200 (about 9 by the real preset's times per workload), so the budget, as the real
# preset's, stops starting new ones at 330 s (under 7 minutes in all) and lists the rest as skipped:
# run those with --only ... --name real-defaults-part2. Its own gpu_session.sh stage ("realdefaults").
REAL_DEFAULTS_MODELS = [m for twin, variants in AS_LEFT.items() for m in (twin, *variants)]

# host-bound: the real models whose training steps leave the GPU idle (host-bound), under Inductor
# and enn each in its default mode and with CUDA graphs (reduce-overhead), host and kernel time per
# step.
HOST_BOUND_MODELS = ["tv_resnet50", "timm_vit_small", "hf_t5", "hf_bert_sdpa", "hf_gpt2_eager"]

PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(device="cpu", size="cpu-small", models=QUICK_MODELS, modes=["train", "infer"], dtypes=["fp32"],
                  backends=["eager", "inductor", "enn"], rounds=9, sample_s=0.03, budget_s=230.0, threads=1),
    "cpu": dict(device="cpu", size="cpu-small", models=models.names(), modes=["train", "infer"], dtypes=["fp32", "bf16"],
                backends=["eager", "inductor", "enn"], rounds=7, sample_s=0.1, budget_s=None),
    # gpu-real sizes use 2 layers (6 for gpt2_sdpa, the ANCHORS stack) so that 20 workloads x
    # 2 cold compiles fit in 8 minutes; no warm-compile pass (add --warm-compile, or run a
    # subset); the budget stops starting new workloads at 380 s and lists what it skipped.
    "gpu": dict(device="cuda", size="gpu-real", models=GPU_MODELS, modes=["train", "infer"], dtypes=["bf16"],
                backends=["eager", "inductor", "enn"], rounds=15, rep_ms=40.0, budget_s=380.0, warm_compile=False),
    "real": dict(REAL_PRESET, device="cuda", size="gpu-real", dtypes=["bf16"], rounds=11, rep_ms=25.0, budget_s=330.0),
    "real-cpu": dict(REAL_PRESET, models=models.names("real"), device="cpu", size="cpu-small", dtypes=["fp32"], rounds=5,
                     sample_s=0.1, budget_s=None, threads=1),
    "real-defaults": dict(REAL_PRESET, models=REAL_DEFAULTS_MODELS, backends=["inductor", "enn"], device="cuda",
                          size="gpu-real", dtypes=["bf16"], rounds=11, rep_ms=25.0, budget_s=330.0),
    "host-bound": dict(REAL_PRESET, models=HOST_BOUND_MODELS, modes=["train"],
                       backends=["inductor", "inductor-reduce-overhead", "enn", "enn-reduce-overhead"], device="cuda",
                       size="gpu-real", dtypes=["bf16"], rounds=11, rep_ms=25.0, budget_s=330.0),
}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m enn_backend bench", description=__doc__, epilog=tools.help_text(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick CPU preset (same as --preset quick)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named preset (default: quick)")
    p.add_argument("--models", type=_csv, help=f"comma-separated models (zoo: {', '.join(models.names())}; "
                                                f"third-party: {', '.join(models.names('real'))})")
    p.add_argument("--only", type=_csv, help="run only these models of the preset (in the preset's order)")
    p.add_argument("--modes", type=_csv, help="train,infer")
    p.add_argument("--dtypes", type=_csv, help="fp32,bf16 (bf16 = autocast over fp32 parameters)")
    p.add_argument("--backends", type=_csv, help="eager,inductor,enn[,enn-guard-off,inductor-max-autotune,enn-max-autotune]")
    p.add_argument("--autotune", action="store_true", help="also run inductor (and enn) with mode=max-autotune-no-cudagraphs")
    p.add_argument("--size", choices=models.SIZES, help="model size (default from the preset)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default from the preset)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, help="CPU: torch.set_num_threads for the run (quick preset: 1)")
    p.add_argument("--budget", type=float, help="seconds after which no new workload starts (0: no budget)")
    p.add_argument("--no-warm-compile", dest="warm_compile", action="store_false", default=None,
                   help="skip the warm (disk cache) compile measurement")
    p.add_argument("--warm-compile", dest="warm_compile", action="store_true",
                   help="measure the warm (disk cache) compile time (default on CPU presets)")
    p.add_argument("--no-profile", action="store_true", help="do not profile workloads where enn is slower")
    p.add_argument("--out", help="output folder (default: $ENN_BENCH_OUT, else bench/<device>/ in enn's cache folder)")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when a goal is missed")
    p.add_argument("--name", help="file stem of the outputs (default: the preset name)")
    p.add_argument("--render", metavar="JSON", help="only re-render the Markdown and PNGs of a saved result")
    p.add_argument("--list", action="store_true", help="list the zoo models, presets and tools, then exit")
    p.add_argument("--tool", metavar="NAME", help="run the tool bench/NAME.py (listed below) with the arguments "
                                                  "that follow NAME; it comes first")
    return p


def build_config(args: argparse.Namespace, argv: list[str]) -> BenchConfig:
    preset = "quick" if args.quick or not args.preset else args.preset
    base = dict(PRESETS[preset])
    for key in ("models", "modes", "dtypes", "backends", "size", "device", "rounds", "threads"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    if args.budget is not None:
        base["budget_s"] = args.budget or None
    if args.autotune:
        base["backends"] = list(base["backends"]) + [b for b in ("inductor-max-autotune", "enn-max-autotune")
                                                      if b not in base["backends"]]
    if args.only:
        bad = [x for x in args.only if x not in base["models"]]
        if bad:
            raise SystemExit(f"enn bench: --only {', '.join(bad)}: not in the {preset} preset's models ({', '.join(base['models'])})")
        base["models"] = [m for m in base["models"] if m in args.only]
    for key, known in (("models", models.names("all")), ("modes", MODES), ("dtypes", list(DTYPES)), ("backends", list(BACKENDS))):
        bad = [x for x in base[key] if x not in known]
        if bad:
            raise SystemExit(f"enn bench: unknown {key} {', '.join(bad)}; known: {', '.join(known)}")
    if args.warm_compile is not None:
        base["warm_compile"] = args.warm_compile
    return BenchConfig(**base, profile_slow=not args.no_profile,
                       preset=preset, command="python -m enn_backend bench " + shlex.join(argv))


def output_folder(out: str | None, device: str) -> str:
    """``--out``, else ``$ENN_BENCH_OUT``, else ``bench/<device>`` in enn's cache folder."""
    return out or os.environ.get("ENN_BENCH_OUT") or os.path.join(
        Options.from_sources(None).resolved_cache_dir(), "bench", device)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--tool"] and len(argv) > 1:
        return tools.run(argv[1], argv[2:])  # the rest is the tool's: it parses its own options
    args = parser().parse_args(argv)
    if args.tool is not None:
        parser().error("--tool NAME comes first: the arguments after NAME are the tool's")
    if args.list:
        for name in models.names("all"):
            print(f"{name:<18} {models.spec(name).description}")
        print()
        for name, p in PRESETS.items():
            print(f"preset {name:<8} {p['device']} {p['size']} models={','.join(p['models'])} dtypes={','.join(p['dtypes'])}")
        print()
        print(tools.help_text())
        return 0
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        out = args.out or os.path.dirname(os.path.abspath(args.render))
        stem = args.name or os.path.splitext(os.path.basename(args.render))[0]
        result["summary"] = summarize(result)
        written = write_outputs(result, out, stem)
        print("\n".join(f"wrote {p}" for p in written.values()))
        return 0

    cfg = build_config(args, argv)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print("enn bench: this preset needs a CUDA device and none is available", file=sys.stderr)
        return 2
    print(f"enn bench: preset {cfg.preset}, {len(cfg.models)} models x {len(cfg.modes)} modes x {len(cfg.dtypes)} dtypes, "
          f"backends {', '.join(cfg.backends)}, size {cfg.size}, device {cfg.device}", flush=True)
    stem = args.name or cfg.preset

    def out_dir(result: dict[str, Any]) -> str:
        return output_folder(args.out, device_folder(result))

    def partial(result: dict[str, Any]) -> None:
        snapshot = {**result, "partial": True, "summary": summarize(result)}
        path = write_outputs(snapshot, out_dir(result), stem, plots=False)["markdown"]
        print(f"{time.strftime('%H:%M:%S')} enn bench: partial results in {path}", file=sys.stderr, flush=True)

    result = run_suite(cfg, on_workload=partial)
    written = write_outputs(result, out_dir(result), stem)
    print(summary_text(result))
    print("\n".join(f"wrote {p}" for p in written.values()))
    failed = any(not g["met"] for g in result["summary"]["goals"])
    return 1 if failed and args.strict else 0


def summary_text(result: dict[str, Any]) -> str:
    s = result["summary"]
    label = {id(w): f"{w['model']} {w['mode']} {w['dtype']}" for w in result["workloads"]}
    width = max([28, *map(len, label.values())])
    lines = ["", f"{'workload':<{width}} {'eager ms':>9} {'inductor ms':>11} {'enn ms':>9} {'enn/ind':>8} {'acc enn':>8}"]
    for w in result["workloads"]:
        b = w.get("backends", {})

        def ms(name: str) -> str:
            v = (b.get(name) or {}).get("time_ms")
            return f"{v:.3f}" if isinstance(v, float) and v == v else "-"

        sp = w.get("speedup_enn_vs_inductor")
        acc = ((b.get("enn") or {}).get("accuracy") or {}).get("passed")
        lines.append(f"{label[id(w)]:<{width}} {ms('eager'):>9} {ms('inductor'):>11} "
                     f"{ms('enn'):>9} {(f'{sp:.3f}' if sp else '-'):>8} {('pass' if acc else 'FAIL' if acc is False else '-'):>8}")
    geo = s["geomean_enn_vs_inductor"]
    lines.append("geomean enn/inductor: " + ", ".join(f"{k} {v:.3f}" for k, v in geo.items() if v))
    for g in s["goals"]:
        lines.append(f"goal: {g['goal']}: target {g['target']}, measured {g['measured']}, "
                     f"{'met' if g['met'] else 'NOT met: ' + g['miss']}")
    for x in result.get("skipped", []):
        lines.append(f"skipped: {x['model']} {x['mode']} {x['dtype']}: {x['why']}")
    lines.append(f"wall time {result['wall_s']:.0f} s")
    return "\n".join(lines)
