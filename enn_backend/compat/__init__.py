"""Every private torch import enn uses, and every version branch, in one package.

enn supports torch 2.11 to 2.15 (pyproject.toml): the suite runs on 2.13.0 and 2.14.1 in CI
(CPU), on 2.15.0 (CPU) by hand and on 2.11 (CUDA, the lent GPU machine). Each workaround says
which torch versions need it and when it can go; each upstream behaviour a test states is a
named predicate (:mod:`.versions`), with its versions, the upstream reason and the test that
covers it. No module outside this package imports a private torch module or name
(tests/test_import_graph.py checks it); callers read ``compat.X``.

=========================  ==================================================================
``versions``               the torch version; upstream behaviours tests state, by version
``inductor``               Inductor's entry points, config, lowering table and caches
``dynamo_aot``             Dynamo's and AOT Autograd's internals: graph copy, AOT config,
                           AOTAutograd cache hits, tracing context, compile lock
``tracing``                make_fx, AOT's joint trace, the FX minifier, fake mode, size hints
``flex``                   FlexAttention's private helpers
``attention_rewrites``     Inductor's own attention rewrites, kept off enn's compiles
``compile_events``         torch's compile-time events: enn's own, and reading them back
``cache_artifacts``        enn's artifact types in torch.compiler's save/load_cache_artifacts
``miscompiles``            the table of ATen nodes Inductor is known to compute wrong
``runtime``                what the guard probes per call: torch.distributed, CUDA, Triton
=========================  ==================================================================
"""

from __future__ import annotations

from . import (  # noqa: F401
    attention_rewrites, cache_artifacts, dynamo_aot, flex, inductor, miscompiles, runtime, tracing, versions)
from .attention_rewrites import (  # noqa: F401
    inductor_attention_rewrites, inductor_attention_rewrites_off, is_inductor_attention_rewrite)
from .compile_events import compile_event  # noqa: F401
from .cache_artifacts import record_cache_artifact, register_cache_artifact  # noqa: F401
from .dynamo_aot import (  # noqa: F401
    FXGraphCacheMiss, aot_cache_hits, aot_metadata, is_aot_backward_node, aot_cache_usable, aot_entry_graph_keys, aot_entry_load, compile_lock,
    compile_split, copy_dynamo_graph, current_tracing_context, donated_inputs, dynamo_compile_context, dynamo_compile_id,
    dynamo_source_name,
    eager_backward_compile, forward_results, functorch_config, is_dynamo_control_flow, keep_out_of_aot_cache,
    mutated_flat_inputs, no_aot_autograd_cache, recompile_limit, saved_tensors_kept, tracing_context)
from .flex import (  # noqa: F401
    cpu_flex_needs_distinct_buffers, flex_attention_hop, flex_dense_to_ordered, flex_kernel_options)
from .inductor import (  # noqa: F401
    CustomGraphPass, clear_inductor_memory_caches, compile_fx, compile_fx_inner, cpp_wrapper_cannot_call,
    cpp_wrapper_config,
    device_builds_skip_vec_isa_probe, dynamo_counters,
    fallback_lowering, fx_graph_cache_counters, hash_files, inductor_cache_dir, inductor_compile_fx, inductor_config,
    ir_elements, lowering_graph,
    without_cudagraphs, inductor_config_patches, inductor_lowering, inductor_lowerings_patched, inductor_option_types,
    lifts_params, mode_config_patches, real_inputs, real_inputs_at_hand, remove_noop_ops, select_decomp_table,
    stable_topological_sort)
from .miscompiles import KNOWN_MISCOMPILES, KnownMiscompile, known_miscompiles  # noqa: F401
from .runtime import dist_initialized, is_cuda_available, triton_version  # noqa: F401
from .tracing import (  # noqa: F401
    detect_fake_mode, fake_mode_of, fx_minifier, is_fake, joint_fwd_bwd, make_fx, real_tensor_mode,
    registered_op_names, size_hint, trace_structured_artifact)
from .versions import (  # noqa: F401
    TORCH_VERSION, cpp_emulates_precision_casts, cpp_wrapper_tunes_on_real_inputs,
    emulate_precision_casts_rounds_python_scalars, export_traces_compiled_regions, inductor_compiles_nan_amax)
