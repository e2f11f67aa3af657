"""torch.compiler's cache artifacts (the "Mega-Cache"): enn's own artifact types in them.

``torch.compiler.save_cache_artifacts()`` serializes every artifact recorded through
``torch.compiler._cache.CacheArtifactManager``; ``load_cache_artifacts()`` deserializes them
and calls each one's ``populate_cache()``. An artifact type is a ``CacheArtifact`` subclass
registered with ``CacheArtifactFactory`` under a unique name. The registry, the manager and
``populate_cache`` are the same on torch 2.13, 2.14 and 2.15.

Rules this module keeps:

- A type must be registered before an artifact of it is recorded, and before bytes holding
  one are loaded: torch's loader drops *all* the bytes (a warning, ``load_cache_artifacts``
  returns None) when it meets a type nobody registered.
- ``populate_cache`` must not raise (torch's loader does not catch): the loader given here
  is called under a catch-all; a failure is logged with the artifact's type and key, and
  ``on_error`` is told (enn counts it in its report).
- Content is bytes (enn's are UTF-8 JSON); torch's serializer frames them, nothing is pickled.
"""

from __future__ import annotations

import logging
from typing import Callable

from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager

log = logging.getLogger("enn_backend.artifacts")

Loader = Callable[[str, bytes], None]


def register_cache_artifact(name: str, loader: Loader, on_error: Callable[[], None]) -> None:
    """Register artifact type ``name``: ``loader(key, content)`` puts one artifact in place on
    load; when it raises, the failure is logged, ``on_error()`` called and the load goes on.
    Registering a name again replaces its loader (a reloaded module)."""
    known = CacheArtifactFactory._artifact_types.get(name)
    if known is not None:
        if not getattr(known, "_enn_type", False):
            raise RuntimeError(f"cache artifact type {name!r} is registered by someone else: {known!r}")
        known._loader, known._on_error = staticmethod(loader), staticmethod(on_error)
        return

    class EnnArtifact(CacheArtifact):
        _enn_type = True
        _loader, _on_error = staticmethod(loader), staticmethod(on_error)

        def populate_cache(self) -> None:
            try:
                type(self)._loader(self.key, self.content)
            except Exception as exc:  # noqa: BLE001 - a bad artifact must not stop torch's load
                log.warning("enn: ignoring cache artifact %s %r (%s: %s); it is not loaded",
                            name, self.key, type(exc).__name__, exc)
                type(self)._on_error()

        @staticmethod
        def type() -> str:
            return name

    EnnArtifact.__name__ = EnnArtifact.__qualname__ = f"EnnArtifact_{name}"
    CacheArtifactFactory.register(EnnArtifact)


def record_cache_artifact(name: str, key: str, content: bytes) -> None:
    """Record one artifact for the next ``torch.compiler.save_cache_artifacts()`` (an artifact
    equal to one recorded before is dropped)."""
    CacheArtifactManager.record_artifact(name, key, content)
