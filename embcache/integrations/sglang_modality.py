"""Which pool a SGLang modality uses, as SGLang 0.5.23 picks its pools, and what its width is.

SGLang keeps a vision pool (IMAGE, VIDEO: IMAGE's dim, else VIDEO's) and an audio pool (AUDIO's
dim, else the vision dim); any other modality has no pool and is not cached. Modalities compare
by name, so SGLang's ``Modality`` enum and plain strings both work. A modality without a pool is
logged once per ``ModalityDims`` (SGLang logs it at every ``prefetch`` and ``insert_batch``).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("embcache.integrations.sglang")  # the adapter's logger

VISION = ("IMAGE", "VIDEO")
AUDIO = "AUDIO"


def modality_name(modality: object) -> str | None:
    """The name SGLang compares: ``modality.name``, or the string itself; None otherwise."""
    name = getattr(modality, "name", modality)
    return name if isinstance(name, str) else None


class ModalityDims:
    """The embedding width of each modality that has a pool. Thread-safe."""

    def __init__(self, hidden_dims: dict[Any, int]) -> None:
        self.hidden_dims = dict(hidden_dims)
        by_name = {modality_name(m): d for m, d in self.hidden_dims.items()}
        vision = by_name.get("IMAGE") or by_name.get("VIDEO")
        self._dims: dict[str | None, int] = dict.fromkeys(VISION, vision) if vision else {}
        audio = by_name.get(AUDIO) or vision
        if audio:
            self._dims[AUDIO] = audio
        self._warned: dict[str, object] = {}  # modalities without a pool, already logged

    def known(self) -> list[str]:
        """The modalities given a dim, as text, sorted (for messages)."""
        return sorted(map(str, self.hidden_dims))

    def dim(self, modality: object) -> int | None:
        """The width of ``modality``'s embeddings; None when it has no pool. O(1)."""
        return self._dims.get(modality_name(modality))

    def dim_or_warn(self, modality: object, method: str) -> int | None:
        """``dim``; the first time a modality has no pool, one warning naming ``method``."""
        dim = self._dims.get(modality_name(modality))  # (``dim``)
        if dim is not None:
            return dim
        token = object()
        if self._warned.setdefault(repr(modality), token) is token:
            logger.warning(
                "%s: unknown modality %r, no pool for it: its items are not cached and fall back "
                "to the encoder (warned once per modality; hidden_dims has %s: give its dim "
                "there to cache it)",
                method,
                modality,
                self.known(),
            )
        return dim
