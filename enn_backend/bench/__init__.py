"""enn's benchmark and accuracy suite.

- :mod:`.accuracy`  compiled vs eager vs an fp64 reference (the RMSE-ratio method)
- :mod:`.runner`    eager / inductor / enn side by side: step time, compile time, memory, accuracy
- :mod:`.plots`     Markdown tables and PNG plots of a result JSON
- :mod:`.cli`       ``python -m enn_backend bench ...``
"""
