"""How ``CacheCore.begin_lookup`` looks a request's items up: its flags as one parameter object.

``LookupFlags`` names each flag once: ask the store about misses (``ask_store``), reserve the
misses left for the request's own insert (``reserve``), and say what the request may read once
the lookup is over (``serve``). Instances are shared and never changed: ``LOOKUP_FLAGS`` holds
every combination, keyed ``(ask_store, reserve, serve)``, so a caller on the hit path builds
none (keywords through the step runner cost a dict and a keyword parse per call; one table
read costs neither).
"""

from __future__ import annotations

from typing import Final, final


@final
class LookupFlags:
    """One combination of ``begin_lookup``'s flags (module docstring); read-only by contract."""

    __slots__ = ("ask_store", "reserve", "serve")

    def __init__(self, *, ask_store: bool, reserve: bool, serve: bool) -> None:
        self.ask_store = ask_store
        self.reserve = reserve
        self.serve = serve

    def __repr__(self) -> str:
        return (
            f"LookupFlags(ask_store={self.ask_store}, reserve={self.reserve}, serve={self.serve})"
        )


LOOKUP_FLAGS: Final[dict[tuple[bool, bool, bool], LookupFlags]] = {
    (ask, reserve, serve): LookupFlags(ask_store=ask, reserve=reserve, serve=serve)
    for ask in (False, True)
    for reserve in (False, True)
    for serve in (False, True)
}
