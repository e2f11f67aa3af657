"""A kernel's NaN that the model itself turns finite downstream, in third-party code.

HF LLaMA with its default SDPA attention: a NaN in the key projection reaches the attention
kernel, which reads a row of NaN scores as fully masked and returns zeros (ATen's CPU flash
kernel does). The logits are then finite and wrong. The guard judges its localization trials by
value (arbitrated by fp64), not by "no NaN left", and compares values in graphs whose SDPA call
has dropout off (the op is tagged random for its optional dropout, which at p=0 draws nothing).
"""

from __future__ import annotations

import operator
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import enn_backend
from enn_backend.guard.graph_edit import has_random_ops, is_pinnable

transformers = pytest.importorskip("transformers")


def test_attention_kernel_turns_nan_keys_into_zeros():
    """The premise, as this torch computes it: what the guard must not take for a recovery."""
    q, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    k = torch.full((1, 2, 1, 8), float("nan"))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
    assert torch.isfinite(out).all()


def _one_op_graph(op, *args, **kwargs) -> torch.fx.GraphModule:
    """A graph of one call (built, not run: CUDA kernels' nodes on any machine)."""
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    args = tuple({"q": q, "k": k, "v": v}.get(a, a) if isinstance(a, str) else a for a in args)
    g.output(g.call_function(op, args, kwargs))
    return torch.fx.GraphModule({}, g)


@pytest.mark.parametrize("p, drawn", [(None, False), (0.0, False), (0, False), (0.1, True)])
def test_sdpa_draws_random_numbers_only_with_dropout(p, drawn):
    aten = torch.ops.aten
    calls = [  # dropout_p positional, as a keyword, and left at its default (None)
        (aten._scaled_dot_product_flash_attention_for_cpu.default, ("q", "k", "v") + (() if p is None else (p,)), {}),
        (aten._scaled_dot_product_efficient_attention.default, ("q", "k", "v", None, True),
         {} if p is None else {"dropout_p": p}),
        (aten._scaled_dot_product_cudnn_attention.default, ("q", "k", "v", None, True) + (() if p is None else (p,)), {}),
        (aten._scaled_dot_product_flash_attention.default, ("q", "k", "v") + (() if p is None else (p,)), {}),
    ]
    for op, args, kwargs in calls:
        assert torch.Tag.nondeterministic_seeded in op.tags  # why the question arises at all
        assert has_random_ops(_one_op_graph(op, *args, **kwargs)) is drawn, op
    q = torch.randn(1, 2, 4, 8)
    assert has_random_ops(make_fx(lambda q: q + torch.rand_like(q))(q))
    assert has_random_ops(make_fx(lambda q: F.dropout(q, 0.1))(q))


def _hidden_nan_steps(device: str, options: dict, dtype: torch.dtype = torch.float32) -> dict:
    """HF LLaMA (SDPA attention), a NaN injected after every ``mm`` of the compiled forward: every
    step equals eager, the faulting one included, and the fault is pinned with the rest compiled.
    Returns the graph's report record."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=1, vocab_size=128, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    cfg.use_cache = False
    model = transformers.LlamaForCausalLM(cfg).eval().to(device)
    ids = torch.randint(3, 128, (8, 1), device=device)  # one token: the CPU flash kernel runs it (first test)
    compiled = torch.compile(model, backend="enn", options={"fault_inject": "aten.mm:nan:fwd", "persist": False,
                                                            "repro": False, **options})
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        want = model(input_ids=ids).logits
        for step in range(3):
            got = compiled(input_ids=ids).logits
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"step {step}: {m}")
    rep = enn_backend.report().to_dict()
    faults = [f for f in rep["fallbacks"] if f["kind"] == "nonfinite"]
    assert faults and "pinned" in faults[0]["action"], rep["fallbacks"]
    (graph,) = rep["graphs"]
    assert graph["path"] == "inductor" and len(graph["pinned"]) > 0  # the rest stays compiled
    return graph


@pytest.mark.parametrize("options", [{}, {"guard_values": 0}], ids=["defaults", "no-value-checks"])
def test_nan_hidden_by_attention_is_localized_by_value(options):
    """With the value checks off (``guard_values=0``) the localization's own judgment is all that
    stands in the way."""
    _hidden_nan_steps("cpu", options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", [{}, {"guard_values": 0}], ids=["defaults", "no-value-checks"])
def test_nan_in_a_cuda_graph_with_sdpa_is_localized_by_value(options, dtype):
    """The same on CUDA, where value checks now run in graphs with SDPA (fp32: memory-efficient
    kernel; bf16 autocast: flash / cuDNN). The localization's verdicts: every pinned op is an
    ``mm`` (where the NaN was injected) and every linear layer's ``mm`` is pinned, the key
    projection's among them, whose NaN the attention kernel may hide (H100, each trial's verdict:
    bench/results/gpu-h100/hidden_nan_cuda.log, 9 ``mm`` pinned; the CPU pins the 8 linear layers')."""
    graph = _hidden_nan_steps("cuda", options, dtype)
    sites = [graph["sites"].get(name, {}) for name in graph["pinned"]]
    assert all(s.get("op") == "aten.mm.default" for s in sites), sites
    linear = {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"} | \
        {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")} | {"lm_head"}
    assert linear <= {s.get("module") for s in sites}, (sorted(linear), sites)


def _efficient_attention_backward(read_bias_grad: bool) -> torch.fx.GraphModule:
    """SDPA's memory-efficient backward without a bias, traced with fake tensors (the kernel is
    CUDA's; its fake kernel runs anywhere). ``read_bias_grad``: a node reads the undefined bias
    gradient (made by hand: a trace writes None into the output instead)."""
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default

    def backward(grad, q, k, v, out, lse, seed, offset):
        return op(grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False])[:3]

    grad, q, k, v, out = (torch.randn(1, 2, 4, 8) for _ in range(5))
    lse, seed, offset = torch.randn(1, 2, 32), torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    gm = make_fx(backward, tracing_mode="fake")(grad, q, k, v, out, lse, seed, offset)
    if read_bias_grad:
        (node,) = [n for n in gm.graph.nodes if n.target is op]
        with gm.graph.inserting_after(node):
            bias_grad = gm.graph.call_function(operator.getitem, (node, 3))
        out_node = gm.graph.output_node()
        out_node.args = (tuple(out_node.args[0]) + (bias_grad,),)
    return gm


def test_a_result_that_is_undefined_is_pinned_when_nothing_reads_it():
    """SDPA's memory-efficient backward returns no bias gradient without a bias (an undefined
    tensor, None in the node's value), which enn::pinned (tensors only) cannot return: pinning
    it failed the whole localization with a cast error (seen on the H100), and left that kernel,
    when enn emitted it, unpinned in the guard's eager reference. enn::pinned returns an empty
    tensor in its place; a node whose undefined result is read is not pinned."""
    from enn_backend.guard.graph_edit import pin_nodes

    gm = _efficient_attention_backward(read_bias_grad=False)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default]
    assert node.meta["val"][3] is None and is_pinnable(node)
    pinned = pin_nodes(gm, [node.name])
    (p,) = [n for n in pinned.graph.nodes if n.target is torch.ops.enn.pinned.default]
    assert [tuple(t.shape) for t in p.meta["val"]] == [(1, 2, 4, 8)] * 3 + [(0,)]

    gm = _efficient_attention_backward(read_bias_grad=True)
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default]
    assert not is_pinnable(node)


def test_a_pinned_kernel_sees_size_one_dimensions_laid_out_as_eager_lays_them_out():
    """Inductor may give a size-1 dimension stride 0 (a broadcast mask); SDPA's
    memory-efficient kernel refuses a bias whose last stride is not 1 even then, so every trial
    that pinned it raised on the H100 ("(*bias): last dimension must be contiguous") and the
    localization ended with the whole graph eager. The pinned op restrides such dimensions, and
    only those (the same kernel checks that the query's strides are aligned)."""
    from enn_backend.custom_ops.pinned import _eager_layout

    bias = torch.randn(8, 1, 1, 1).as_strided((8, 4, 1, 1), (1, 0, 0, 0))
    fixed = _eager_layout(bias)
    assert fixed.stride() == (1, 0, 1, 1) and torch.equal(fixed, bias)
    assert fixed.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()  # a view, no copy
    query = torch.randn(8, 1, 4, 16).transpose(1, 2)  # [8, 4, 1, 16]: its size-1 stride (64) is aligned: kept
    assert _eager_layout(query) is query
