"""enn's benchmark and accuracy suite: the one home of how enn is measured.

- :mod:`.steps`     what a training / inference step is, for every backend alike
- :mod:`.timing`    interleaved timing rounds, paired ratios, peak memory, profiles
- :mod:`.backends`  the backends compared, each compiling into its own cache; enn's report per backend
- :mod:`.accuracy`  compiled vs eager vs an fp64 reference (the RMSE-ratio method)
- :mod:`.runner`    eager / inductor / enn side by side over the zoo: step time, compile time, memory, accuracy
- :mod:`.summary`   geomeans, ratios and goal verdicts of a result
- :mod:`.markdown`, :mod:`.plots`  the Markdown report and PNG plots of a result (re-renderable from its JSON)
- :mod:`.cli`       ``python -m enn_backend bench ...``
- :mod:`.tools`     ``python -m enn_backend bench --tool NAME ...``: the measurement scripts in the
                    checkout's ``bench/`` folder (a variant of enn, a compile phase, the guard's cost)

The models come from :mod:`enn_backend.models`; the tools time with :mod:`.timing` and compile
with :mod:`.backends`; their results and the suite's live in ``bench/results/``.
"""
