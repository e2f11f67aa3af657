"""enn's debugging tools: logs, saved reports, repro scripts and the minifier.

- :mod:`.log`     the one-line-per-graph info log and the TORCH_TRACE artifact
- :mod:`.repro`   writes a standalone repro folder for every blamed fault
- :mod:`.inputs`  a repro's inputs: described, saved, loaded or regenerated
- :mod:`.replay`  what a repro script runs: enn's fast path vs eager vs fp64
- :mod:`.minify`  shrinks a repro to the smallest graph that still fails
- :mod:`.cli`     ``python -m enn_backend report FILE`` / ``minify REPRO``

This package imports nothing at import time: ``TORCH_LOGS="enn_backend"`` makes
torch walk (and import) enn's packages while torch itself is being imported.
See docs/TROUBLESHOOTING.md for the walkthrough.
"""
