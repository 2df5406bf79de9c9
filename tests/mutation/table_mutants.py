"""Mutants of the transition table ``embcache.core.lifecycle.TRANSITIONS`` (used by
run_mutation.sh).

mutmut 3 only mutates code inside functions, so the module-level table that drives every
state change is never mutated by it. This file supplies those mutants:

- ``drop:STATE:STEP``: the table loses the entry (the step becomes a TransitionError);
- ``retarget:STATE:STEP:NEW``: the entry leads to another state.

Run ``python tests/mutation/table_mutants.py`` to list every mutant, one a line. As a pytest
plugin (``-p table_mutants`` with this folder on ``PYTHONPATH``) it applies the mutant named by
``EMBCACHE_TABLE_MUTANT`` to the table in place before any test runs.
"""

from __future__ import annotations

import os


def all_mutants() -> list[str]:
    from embcache.core.lifecycle import TRANSITIONS, EntryState

    out = []
    for (state, step), target in TRANSITIONS.items():
        out.append(f"drop:{state.name}:{step.name}")
        for other in EntryState:
            if other is not target:
                out.append(f"retarget:{state.name}:{step.name}:{other.name}")
    return out


def apply_mutant(spec: str) -> None:
    from embcache.core.lifecycle import TRANSITIONS, EntryState, Step

    kind, state_name, step_name, *rest = spec.split(":")
    key = (EntryState[state_name], Step[step_name])
    if key not in TRANSITIONS:
        raise ValueError(f"no table entry {spec!r}")
    if kind == "drop":
        del TRANSITIONS[key]
    elif kind == "retarget":
        TRANSITIONS[key] = EntryState[rest[0]]
    else:
        raise ValueError(f"unknown table mutant {spec!r}")


def pytest_configure(config: object) -> None:
    spec = os.environ.get("EMBCACHE_TABLE_MUTANT", "")
    if spec:
        apply_mutant(spec)


if __name__ == "__main__":
    print("\n".join(all_mutants()))
