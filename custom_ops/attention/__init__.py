"""``enn::attention`` and ``enn::attention_backward``: fused attention with what the pattern recognized.

``enn::attention(q, k, v, bias, mask, alibi, scale, causal, window, dropout_p, masked_rows, backend, seed=None)``
returns ``(out, lse)``:

- ``q`` ``[B, Hq, Tq, D]``, ``k`` ``[B, Hkv, Tk, D]``, ``v`` ``[B, Hkv, Tk, Dv]``; ``Hq`` a multiple of
  ``Hkv`` (grouped-query attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``).
- ``bias``: optional additive float mask/bias, broadcastable to ``[B, Hq, Tq, Tk]``.
- ``mask``: optional boolean keep-mask (True = attend), broadcastable to ``[B, Hq, Tq, Tk]``.
- ``alibi``: optional per-head slopes ``[Hq]``; adds ``slopes[h] * (j - i)`` to the scores.
- ``causal``: key ``j`` is kept for query ``i`` only if ``j <= i`` (top-left aligned, like SDPA).
- ``window``: if > 0, also only keys with ``i - j < window`` (a sliding-window band).
- ``dropout_p``: dropout on the probabilities, ``explicit`` backend only: the mask ``u > p`` (``u``
  uniform, drawn from a generator seeded by ``seed``, an int64 scalar tensor), scaled by
  ``1 / (1 - p)``. ``enn::attention_backward`` takes the same ``dropout_p`` and ``seed`` and draws
  the same mask again. Its own random stream: eager's values in distribution, not bitwise.
- ``masked_rows``: ``"eager"`` gives NaN for a query row whose keys are all masked (what the
  hand-written ``softmax(masked_fill(-inf))`` gives in eager), ``"zero"`` gives 0 there.
- ``backend``: the kernel the policy chose (enn_backend/passes/attention/policy.py), one of
  :class:`Backend`: ``explicit`` (enn's own fp32 math), ``cpu_flash`` (ATen's CPU flash kernel),
  ``flash`` / ``efficient`` / ``cudnn`` / ``math`` (SDPA on CUDA with that backend forced), ``flex``
  (FlexAttention, compiled).

``lse`` is the log-sum-exp of each query row in fp32 ``[B, Hq, Tq]`` where the backend gives it
(``explicit``, ``cpu_flash``), else an empty tensor; the backward uses it to avoid a recompute.
The CUDA backends recompute the forward inside the backward (one extra forward pass): it is
correct by construction on every torch version, at the cost of that recompute.
"""

from __future__ import annotations

from . import safe_paths  # noqa: F401  (registration: the safe paths of the ops and of the emitted kernels)
from .backends import BACKENDS, LSE_BACKWARD, MASKED_ROWS, Backend  # noqa: F401
from .masks import (  # noqa: F401
    SATURATED, SATURATED_FLOOR, alibi_bias, band_mask_mod, dead_rows, floors_saturated, full_bias, kernel_bias,
    normalize_mask, saturated_counts, structural_keep)
from .op import attention, attention_backward, default_scale  # noqa: F401
