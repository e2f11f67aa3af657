"""The runtime guard: every compiled graph, forward and backward, runs behind it.

fast path -> exception or NaN/Inf? -> re-run the graph's eager copy on the same inputs
  eager finite        -> the compiled code is at fault: bisect to the culprit node(s),
                         pin them to eager (enn::pinned), recompile, keep the rest compiled
  eager non-finite    -> retry in fp32 without autocast; finite -> precision fault, pin the
                         graph to fp32; still non-finite -> the model's own NaN: return eager's
                         result, blame nothing

Modules: ``runtime`` (GuardedGraph, the callable Inductor's output is wrapped in: the fast
path), ``ladder`` (its fallback ladder), ``ranks`` (one guard for all ranks of a distributed
run), ``calls`` (what it holds of a call; EnnGuardError), ``screen`` (NaN/Inf and value
screens), ``localize`` (bisection), ``graph_edit`` (pin / plant / promote rewrites),
``kernel_entry`` (kernel keys, one record) and ``kernel_state`` (the records, persisted as
JSON), ``faults`` (what ENN_FAULT_INJECT planted).
"""
