"""A cheaper-shadows variant of ``adaptive`` (issue 57, point 4), measured by
``benchmarks.policy.choose_default``; not a product policy.

``adaptive`` plays every lookup in both shadow caches: two ``OrderedDict`` moves a hit, most
of what its hit path costs over ``tinylfu``'s. ``HalfShadows`` plays every second lookup only
(the others are counted, as ``tinylfu`` counts them): the shadows see half of the lookup stream,
each key's lookups alike, so the two experts' shadows are sampled the same way and their duel
compares what it compared before on half the evidence; a shadow's period (its hits' decay) is
counted in played lookups. Alternation by position, not a sample of keys by hash: a sample of
keys lost 0.4 to 0.75 point of lead on the grid (``results/variants_2026-12-03.md``), and a
hash per lookup costs more than it saves."""

from __future__ import annotations

from embcache.core.policy import AdaptivePolicy, TinyLfuPolicy


class HalfShadows(AdaptivePolicy):
    """``adaptive`` whose shadows play every second lookup (module docstring)."""

    name = "adaptive-half"

    def __init__(self) -> None:
        super().__init__()
        self._skip = False  # whether this lookup skips the shadows

    def record(self, key: str) -> None:
        """Count one lookup of ``key``; every second one is also played in the shadows."""
        skip = self._skip = not self._skip
        if skip:
            TinyLfuPolicy.record(self, key)
        else:
            AdaptivePolicy.record(self, key)
