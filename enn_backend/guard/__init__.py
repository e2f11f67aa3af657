"""The runtime guard: every compiled graph, forward and backward, runs behind it.

fast path -> exception or NaN/Inf? -> re-run the graph's eager copy on the same inputs
  eager finite        -> the compiled code is at fault: bisect to the culprit node(s),
                         pin them to eager (enn::pinned), recompile, keep the rest compiled
  eager non-finite    -> retry in fp32 without autocast; finite -> precision fault, pin the
                         graph to fp32; still non-finite -> the model's own NaN: return eager's
                         result, blame nothing

Modules: ``faults`` (ENN_FAULT_INJECT), ``graph_edit`` (pin / plant / promote rewrites),
``kernel_state`` (what failed, persisted as JSON), ``localize`` (bisection),
``runtime`` (GuardedGraph, the callable Inductor's output is wrapped in).
"""
