"""enn's custom ops (installed as ``enn_backend.custom_ops``).

Every op here is a functional ``torch.library.custom_op`` in the ``enn`` namespace with
a fake (meta) implementation, and passes ``torch.library.opcheck`` (tests/test_opcheck.py).

- ``enn::pinned``   runs one ATen op eagerly from inside compiled code: the safe path
                    of a node the guard has pinned.
- ``enn::fault``    the fault-injection op (ENN_FAULT_INJECT): raises or returns NaN/Inf.
- ``enn::ranged``   runs one op inside a named profiler range (option ``nvtx``).

Importing this package registers the ops with torch.library; it changes nothing else.
"""

from . import faults, pinned  # noqa: F401  (registration side effect: ops only)
from . import attention  # noqa: F401
from . import precision  # noqa: F401
from . import gemm  # noqa: F401
from . import ranged  # noqa: F401

__all__ = ["faults", "pinned"]
