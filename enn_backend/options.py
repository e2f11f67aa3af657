"""enn's options: one frozen object, parsed once per compile.

Sources, lowest to highest precedence:

1. the defaults below;
2. ``ENN_*`` environment variables;
3. what the code says: ``torch.compile(..., mode=..., options={...})``;
4. the override variables :data:`OVERRIDE_ENV` (``ENN_DISABLE``, ``ENN_GUARD``).

Code beats the environment, as ``options=`` beats the environment-derived defaults of
``backend="inductor"``: a program that asks for an option gets it wherever it runs. The
override variables are the exception because bisecting is what they are for: "is it enn at
all?" (``ENN_DISABLE=1``) and "stop at the first fault" (``ENN_GUARD=strict``) must reach
every compile of a program without editing the code that calls ``torch.compile``, whatever
options that code passes. They are diagnostics, not configuration: no program has a reason
to stop them. Every other variable is a default that code may change.

A key of ``options=`` that is not enn's goes to Inductor's config, as the same dict does
under ``backend="inductor"`` (``"max_autotune"``, ``"triton.cudagraphs"``): it is checked
against Inductor's config as torch checks it there and kept in :attr:`Options.inductor`.
A key that is neither enn's nor Inductor's, or a bad value anywhere, raises
:class:`OptionsError` naming the valid choices (the closest keys for a misspelling). An
unknown ``ENN_*`` variable is logged once (a warning naming the valid ones) and otherwise
ignored: a stray variable in a shell must not break every compile.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import logging
import operator
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .fault_spec import FaultSpecError, parse_fault_specs


class GuardMode(str, enum.Enum):
    """What the runtime guard does around every compiled graph (option ``guard``, ``ENN_GUARD``).

    ==============  ============================================================================
    ``off``         no guard: the compiled graph runs bare; a kernel's exception or NaN reaches
                    the caller, nothing is localized, pinned or reported at run time
    ``exceptions``  catches exceptions only (no output checks); keeps every call's inputs, so
                    any call can be re-run eagerly
    ``nonfinite``   (default) also checks outputs for NaN/Inf (every call in the warm-up, then
                    every ``guard_every``-th) and compares values with eager on the first call
                    and every ``guard_values``-th
    ``values``      as ``nonfinite``, and every checked call's values are compared with eager's
    ``strict``      checks as ``nonfinite``, but raises (EnnGuardError; compile errors and
                    failing passes too) at the first fault instead of falling back
    ==============  ============================================================================

    A member compares equal to its string (``GuardMode.OFF == "off"``) and prints as it.
    """

    OFF = "off"
    EXCEPTIONS = "exceptions"
    NONFINITE = "nonfinite"
    VALUES = "values"
    STRICT = "strict"

    def __str__(self) -> str:
        return self.value

    @property
    def guarded(self) -> bool:
        """Every compiled graph runs behind the guard (enn_backend.guard.runtime.GuardedGraph)."""
        return self is not GuardMode.OFF

    @property
    def checks_outputs(self) -> bool:
        """Outputs are checked for NaN/Inf, and values compared with eager now and then."""
        return self.guarded and self is not GuardMode.EXCEPTIONS

    @property
    def checks_every_value(self) -> bool:
        """Every checked call's values are compared with eager (not only every ``guard_values``-th)."""
        return self is GuardMode.VALUES

    @property
    def keeps_inputs(self) -> bool:
        """Every call's inputs are kept, so that any call can be re-run (no call is checked ahead)."""
        return self is GuardMode.EXCEPTIONS

    @property
    def raises(self) -> bool:
        """A fault (or a compile error) raises instead of falling back."""
        return self is GuardMode.STRICT


GUARD_MODES = tuple(m.value for m in GuardMode)
ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math", "flex", "explicit")
MASKED_ROW_MODES = ("eager", "zero")
# GEMM epilogue families (custom_ops/gemm_policy.py): what `epilogue_off` may name
EPILOGUE_FAMILIES = ("bias", "relu", "gelu", "gelu_tanh", "silu", "residual")
MAX_AUTOTUNE_MEASURE_MS = 200  # measure_ms under mode="max-autotune" when the option is 0
TAIL_MODES = ("auto", "on", "off")
FP8_MODES = ("off", "rowwise", "tensorwise")  # option fp8 (custom_ops/fp8.py: the recipes)
BLOCKS_MODES = ("off", "on")  # option blocks (enn_backend/blocks.py)
COMPILE_MODES = (
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)


log = logging.getLogger(__name__)

# Environment variables that beat options= given in code (see the module docstring).
OVERRIDE_ENV = ("ENN_DISABLE", "ENN_GUARD")

# Inductor config keys enn sets for its own passes (enn_backend.backend): options= cannot set them.
ENN_INDUCTOR_HOOKS = frozenset({"joint_custom_pre_pass", "joint_custom_post_pass", "post_grad_custom_post_pass"})


class OptionsError(ValueError):
    """An unknown option or an invalid option value."""


def _meta(env: str, doc: str, codegen: bool = True, choices: tuple[str, ...] = ()) -> dict:
    return {"env": env, "doc": doc, "codegen": codegen, "choices": choices}


@dataclass(frozen=True)
class Options:
    """Every knob enn has. Each field names its environment variable."""

    disable: bool = field(
        default=False,
        metadata=_meta("ENN_DISABLE", "Behave exactly like backend='inductor' (no enn passes, no guard)."),
    )
    guard: GuardMode = field(
        default=GuardMode.NONFINITE,
        metadata=_meta(
            "ENN_GUARD",
            "Runtime guard of every compiled graph: off | exceptions | nonfinite | values (every checked call also compared with eager) | strict.",
            codegen=False,
            choices=GUARD_MODES,
        ),
    )
    guard_every: int = field(
        default=50,
        metadata=_meta(
            "ENN_GUARD_EVERY",
            "After the warm-up calls, check a graph's outputs for NaN/Inf on every N-th call (exceptions are always caught); 1: every call, synchronously (on a GPU none is read a call late).",
            codegen=False,
        ),
    )
    guard_warmup: int = field(
        default=20,
        metadata=_meta(
            "ENN_GUARD_WARMUP",
            "Check every call of a newly compiled (or recompiled) graph for this many calls, whatever guard_every says.",
            codegen=False,
        ),
    )
    guard_values: int = field(
        default=1000,
        metadata=_meta(
            "ENN_GUARD_VALUES",
            "Compare a graph's compiled results (outputs, gradients, writes into inputs) with eager's on its first call and then every N-th call (0: never); a kernel whose finite values are wrong is localized and pinned like a NaN.",
            codegen=False,
        ),
    )
    localize_budget: int = field(
        default=16,
        metadata=_meta(
            "ENN_LOCALIZE_BUDGET",
            "Most recompiles spent bisecting a fault to its culprit node(s); past it the remaining suspects are all pinned.",
            codegen=False,
        ),
    )
    fault_inject: str = field(
        default="",
        metadata=_meta(
            "ENN_FAULT_INJECT",
            "Test facility: '<op>[/<module>]:<raise|nan|inf|scale<f>>[@<n>[+]][:<fwd|bwd|compile|any>][,...]' plants faults after matching nodes in compiled code ('scale1.01': values 1% off; '@3': every 3rd call; '@5+': every call from the 5th on; '/<module>': only nodes in modules matching that glob, e.g. 'enn.fp8_mm/model.layers.3.mlp.down_proj:nan:bwd'; grammar: enn_backend/fault_spec.py).",
        ),
    )
    cache_dir: str = field(
        default="",
        metadata=_meta(
            "ENN_CACHE_DIR",
            "Where kernel state (pinned nodes, fail counts) is persisted as JSON. Empty: ~/.cache/enn.",
            codegen=False,
        ),
    )
    persist: bool = field(
        default=True,
        metadata=_meta("ENN_PERSIST", "Persist kernel state to cache_dir and load it at compile time.", codegen=False),
    )
    repro_dir: str = field(
        default="",
        metadata=_meta(
            "ENN_REPRO_DIR",
            "Where a standalone repro script is written for every blamed fault (a folder per fault). Empty: repros/ in enn's cache folder (cache_dir, else ~/.cache/enn).",
            codegen=False,
        ),
    )
    repro: bool = field(
        default=True,
        metadata=_meta("ENN_REPRO", "Write repro scripts for blamed faults.", codegen=False),
    )
    attention: bool = field(
        default=True,
        metadata=_meta("ENN_ATTENTION", "Fuse hand-written attention: into SDPA's ATen kernels, FlexAttention ops, or enn::attention."),
    )
    attention_backend: str = field(
        default="auto",
        metadata=_meta(
            "ENN_ATTENTION_BACKEND",
            "Force one attention kernel; an impossible choice falls back with a recorded reason.",
            choices=ATTENTION_BACKENDS,
        ),
    )
    attention_order: str = field(
        default="",
        metadata=_meta(
            "ENN_ATTENTION_ORDER",
            "Comma-separated preference order of attention kernels (e.g. 'flash,cudnn,efficient,math'). Empty: enn's policy.",
        ),
    )
    masked_rows: str = field(
        default="eager",
        metadata=_meta(
            "ENN_MASKED_ROWS",
            "Rows whose keys are all masked: 'eager' keeps eager's NaN, 'zero' returns 0.",
            choices=MASKED_ROW_MODES,
        ),
    )
    epilogue: bool = field(
        default=True,
        metadata=_meta("ENN_EPILOGUE", "Fuse GEMM + bias + activation into enn::gemm_bias_act."),
    )
    epilogue_off: str = field(
        default="",
        metadata=_meta(
            "ENN_EPILOGUE_OFF",
            "Comma-separated GEMM epilogue families forced onto the un-fused path (bias, relu, gelu, gelu_tanh, silu, residual, or all).",
        ),
    )
    measure_ms: int = field(
        default=0,
        metadata=_meta(
            "ENN_MEASURE_MS",
            "Time budget (ms) per kernel choice for timing the eligible kernels on the real shapes at compile time, cached in cache_dir (0: rules only; mode='max-autotune' then measures with 200).",
        ),
    )
    nvtx: bool = field(
        default=False,
        metadata=_meta(
            "ENN_NVTX",
            "Put every fused site and pinned op in a named NVTX range (and torch.profiler record): enn/<kind>/<kernel> <module path>.",
        ),
    )
    precision: bool = field(
        default=True,
        metadata=_meta("ENN_PRECISION", "Keep low-precision softmax/norm/reduction math in fp32 (decompositions and pass)."),
    )
    fp32_tail: str = field(
        default="off",
        metadata=_meta(
            "ENN_FP32_TAIL",
            "Run the output tail (final norm + projection) in fp32: off | auto (bf16 inference graphs) | on. Off by default: an fp32 vocabulary projection made GPT-2 inference 4.6x slower on an H200.",
            choices=TAIL_MODES,
        ),
    )
    blocks: str = field(
        default="off",
        metadata=_meta(
            "ENN_BLOCKS",
            "Compile each distinct repeated layer once: off | on (a graph with 2+ layers of one container is compiled as head, layers and tail; equal layers share compiled code, each keeps its own guard). Faster compiles of deep models, for some step time (enn_backend/blocks.py).",
            choices=BLOCKS_MODES,
        ),
    )
    fp8: str = field(
        default="off",
        metadata=_meta(
            "ENN_FP8",
            "Run eligible GEMMs (linear / matmul, forward and backward) as dynamically scaled FP8 GEMMs: off | rowwise | tensorwise (torchao's recipes); where the device or torch cannot, a recorded no-op (enn_backend/passes/fp8.py).",
            choices=FP8_MODES,
        ),
    )
    fp8_exclude: str = field(
        default="",
        metadata=_meta(
            "ENN_FP8_EXCLUDE",
            "Comma-separated module-path globs (fnmatch, e.g. 'lm_head,layers.0.*') whose GEMMs stay in their own dtype under fp8.",
        ),
    )
    emulate_precision_casts: bool = field(
        default=False,
        metadata=_meta(
            "ENN_EMULATE_PRECISION_CASTS",
            "Match eager's low-precision rounding where Inductor can (Inductor's emulate_precision_casts).",
        ),
    )
    mode: str = field(
        default="default",
        metadata=_meta(
            "ENN_MODE",
            "Inductor mode, as torch.compile(mode=...).",
            choices=COMPILE_MODES,
        ),
    )
    cudagraph_max_shapes: int = field(
        default=8,
        metadata=_meta(
            "ENN_CUDAGRAPH_MAX_SHAPES",
            "Under CUDA graphs (mode='reduce-overhead'), most distinct input sizes one compiled graph records (Inductor records one CUDA graph per size of a graph with dynamic shapes); further sizes run the graph compiled without CUDA graphs, reported (0: no cap).",
            codegen=False,
        ),
    )
    inductor: tuple[tuple[str, Any], ...] = field(
        default=(),
        metadata=_meta(
            "",
            "Inductor config patches, as (key, value) pairs: every key of options= that is not enn's (or options={'inductor': {...}}), checked against Inductor's config.",
        ),
    )

    # ------------------------------------------------------------------ parsing
    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_sources(
        cls,
        options: Mapping[str, Any] | None = None,
        mode: str | None = None,
        environ: Mapping[str, str] | None = None,
        inductor_config: Mapping[str, Any] | None = None,
    ) -> "Options":
        """Build options from defaults, ``ENN_*`` env vars, ``mode=`` and ``options=``, then
        the override variables (:data:`OVERRIDE_ENV`). ``inductor_config`` maps Inductor's
        config keys to the class of their values (enn_backend.compat.inductor_option_types):
        the keys of ``options=`` that are not enn's are checked against it (without it, refused)."""
        environ = os.environ if environ is None else environ
        from_env: dict[str, Any] = {}
        overrides: dict[str, Any] = {}
        known_env = {f.metadata["env"]: f for f in fields(cls) if f.metadata["env"]}
        for name, raw in environ.items():
            if not name.startswith("ENN_") or name in _NON_OPTION_ENV:
                continue
            f = known_env.get(name)
            if f is None:
                _warn_unknown_env(name, known_env)
                continue
            (overrides if name in OVERRIDE_ENV else from_env)[f.name] = _coerce(f, raw, name)
        from_code: dict[str, Any] = {}
        if mode is not None:
            from_code["mode"] = _coerce(_field("mode"), mode, "mode=")
        inductor: dict[str, Any] = {}
        for key, raw in (options or {}).items():
            if key == "inductor":
                if not isinstance(raw, (Mapping, tuple, list)):
                    raise OptionsError(f"enn: options['inductor'] must be a dict of Inductor config keys, got {raw!r}")
                for k, v in dict(raw).items():
                    inductor[_inductor_key(k, v, inductor_config, enn_keys=False)] = v
            elif key in cls.names():
                from_code[key] = _coerce(_field(key), raw, f"options[{key!r}]")
            else:
                inductor[_inductor_key(key, raw, inductor_config, enn_keys=True)] = raw
        if inductor:
            from_code["inductor"] = tuple(sorted(inductor.items()))
        return cls(**{**from_env, **from_code, **overrides})

    def __post_init__(self) -> None:
        if not isinstance(self.guard, GuardMode):  # a user's string: the enum from here on
            if self.guard not in GUARD_MODES:
                raise OptionsError(f"enn: guard must be one of {', '.join(GUARD_MODES)}; got {self.guard!r}")
            object.__setattr__(self, "guard", GuardMode(self.guard))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and type(value) is not int:
                raise OptionsError(f"enn: {f.name} must be an integer, got {value!r}")
        if self.guard_every < 1:
            raise OptionsError(f"enn: guard_every must be >= 1, got {self.guard_every}")
        if self.guard_values < 0:
            raise OptionsError(f"enn: guard_values must be >= 0, got {self.guard_values}")
        if self.guard_warmup < 0:
            raise OptionsError(f"enn: guard_warmup must be >= 0, got {self.guard_warmup}")
        if self.localize_budget < 0:
            raise OptionsError(f"enn: localize_budget must be >= 0, got {self.localize_budget}")
        if self.cudagraph_max_shapes < 0:
            raise OptionsError(f"enn: cudagraph_max_shapes must be >= 0 (0: no cap), got {self.cudagraph_max_shapes}")
        if self.attention_order:
            for name in self.attention_order.split(","):
                if name.strip() not in ATTENTION_BACKENDS[1:]:
                    raise OptionsError(
                        f"enn: attention_order entry {name!r} is not one of {', '.join(ATTENTION_BACKENDS[1:])}"
                    )
        if self.measure_ms < 0:
            raise OptionsError(f"enn: measure_ms must be >= 0, got {self.measure_ms}")
        if self.epilogue_off:
            for name in self.epilogue_off.split(","):
                if name.strip() not in (*EPILOGUE_FAMILIES, "all"):
                    raise OptionsError(
                        f"enn: epilogue_off entry {name!r} is not one of {', '.join(EPILOGUE_FAMILIES)}, all"
                    )
        if self.fp8 is False:  # a pass that failed is switched off as False (backend.py)
            object.__setattr__(self, "fp8", "off")
        if self.fault_inject:
            try:
                parse_fault_specs(self.fault_inject)
            except FaultSpecError as exc:
                raise OptionsError(str(exc)) from None

    # ------------------------------------------------------------------ hashing
    def codegen_hash(self) -> str:
        """Hash of the options that change generated code; feeds every pass uuid()."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["codegen"]}
        # default=repr: an Inductor option's value may be an object (a custom pass)
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=repr).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data (the guard mode as its string)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)

    def unfused_epilogues(self) -> frozenset[str]:
        """The epilogue families ``epilogue_off`` forces onto the un-fused path."""
        names = {n.strip() for n in self.epilogue_off.split(",") if n.strip()}
        return frozenset(EPILOGUE_FAMILIES) if "all" in names else frozenset(names)

    def measure_budget_ms(self) -> int:
        """Time per kernel choice for measurement: ``measure_ms``, else 200 under max-autotune, else 0 (rules only)."""
        if self.measure_ms > 0:
            return self.measure_ms
        return MAX_AUTOTUNE_MEASURE_MS if self.mode.startswith("max-autotune") else 0

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "enn")

    def resolved_repro_dir(self) -> str:
        return self.repro_dir or os.path.join(self.resolved_cache_dir(), "repros")


# ENN_* variables that are not options (read by tools, not by the backend).
_NON_OPTION_ENV = frozenset({"ENN_BENCH_OUT", "ENN_DEBUG_GRAPHS"})

_warned_env: set[str] = set()  # process-wide: the unknown variables warned about (a race warns twice at worst)


def _warn_unknown_env(name: str, known: Mapping[str, Any]) -> None:
    """Log an unknown ``ENN_*`` variable once per process; it has no effect."""
    if name in _warned_env:
        return
    _warned_env.add(name)
    log.warning("enn: ignoring unknown environment variable %s (a misspelling?). Valid: %s",
                name, ", ".join(sorted([*known, *_NON_OPTION_ENV])))


def _inductor_key(key: str, value: Any, inductor_config: Mapping[str, Any] | None, enn_keys: bool) -> str:
    """Inductor's name for an ``options=`` key that is not enn's (``-`` reads as ``_``),
    checked as ``backend="inductor"`` checks it: a key of its config, a value of its class."""
    name = key.replace("-", "_")
    known = inductor_config or {}
    if name not in known:
        close = difflib.get_close_matches(name, [*(Options.names() if enn_keys else ()), *known], n=3)
        raise OptionsError(
            f"enn: unknown option {key!r}: not one of enn's options ({', '.join(Options.names())}) nor a key of "
            f"Inductor's config (torch._inductor.config).{' Closest: ' + ', '.join(close) + '.' if close else ''}")
    if name in ENN_INDUCTOR_HOOKS:
        raise OptionsError(f"enn: option {key!r} is Inductor's hook for enn's own passes; enn cannot take it from options=")
    kind = known[name]
    if kind is not None and not isinstance(value, kind):
        raise OptionsError(f"enn: Inductor option {key!r} must be a {kind.__name__}, got {type(value).__name__} {value!r}")
    return name


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _field(name: str) -> dataclasses.Field:
    return next(f for f in fields(Options) if f.name == name)


def _coerce(f: dataclasses.Field, raw: Any, where: str) -> Any:
    """Convert ``raw`` to the field's type, or raise naming the valid choices."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        raise OptionsError(f"enn: {where} must be a boolean (1/0, true/false), got {raw!r}")
    if kind == "int":
        try:
            if isinstance(raw, bool):  # an int subclass, but never meant as a count
                raise TypeError
            return int(raw) if isinstance(raw, str) else operator.index(raw)
        except (TypeError, ValueError):
            raise OptionsError(f"enn: {where} must be an integer, got {raw!r}") from None
    if not isinstance(raw, str):
        raise OptionsError(f"enn: {where} must be a string, got {type(raw).__name__} {raw!r}")
    value = raw.strip()
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise OptionsError(f"enn: {where} must be one of {', '.join(choices)}; got {raw!r}")
    return value


def _plain(value: Any) -> Any:
    """An enum member as the string users write (``'nonfinite'``); other values as they are."""
    return value.value if isinstance(value, enum.Enum) else value


def options_table() -> list[tuple[str, str, str, str]]:
    """(option, env var, default, description) rows, for the README and `doctor`."""
    return [
        (f.name, f.metadata["env"], repr(_plain(f.default)), f.metadata["doc"]) for f in fields(Options)
    ]
