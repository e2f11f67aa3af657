"""The runtime guard: every compiled graph, forward and backward, runs behind it.

fast path -> exception or NaN/Inf? -> re-run the graph's eager copy on the same inputs
  eager finite        -> the compiled code is at fault: bisect to the culprit node(s),
                         pin them to eager (enn::pinned), recompile, keep the rest compiled
  eager non-finite    -> retry in fp32 without autocast; finite -> precision fault, pin the
                         graph to fp32; still non-finite -> the model's own NaN: return eager's
                         result, blame nothing

Every re-run works on copies of what the graph may write; the caller's tensors are written once,
by the result the guard returns (``calls.Call``).

Modules: ``runtime`` (GuardedGraph, the callable Inductor's output is wrapped in: the fast
path), ``schedule`` (what each call does: the state diagram, as a pure function), ``ladder``
(the fallback ladder: the Outcome of a faulty call and the Decision the graph applies), ``seams`` (what the guard uses of the graph it
guards), ``ranks`` (one guard for all ranks of a distributed run), ``dynamo_reference`` (the
unit's check against the graph Dynamo handed over, gradients included), ``calls`` (what it
holds of a call, the re-run rule; EnnGuardError), ``screen`` (NaN/Inf and value
screens), ``localize`` (bisection), ``graph_edit`` (pin / plant / promote rewrites),
``kernel_entry`` (kernel keys, one record) and ``kernel_state`` (the records, persisted as
JSON), ``faults`` (what ENN_FAULT_INJECT planted).
"""
