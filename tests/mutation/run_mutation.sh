#!/usr/bin/env bash
# Mutation testing of the core, its request steps, the driver and the state machine (issues 8, 13).
#
# Usage, from the repository root:   tests/mutation/run_mutation.sh [MUTANT_NAME_OR_GLOB...]
#
# With no argument every mutant is run (39 minutes measured: 27 of mutmut, 11 of table mutants,
# with 2 workers on a loaded 2-core machine). Arguments are passed to `mutmut run` to run only
# those mutants (names as printed in the report, fnmatch globs allowed, e.g.
# 'embcache.core.eviction.*'); mutants not run are left out of the score.
#
# Needs mutmut 3 (`pip install 'mutmut>=3,<4'`) in the Python that runs the tests; set PYTHON
# to use another interpreter (for example a venv with mutmut). Nothing in the checkout is
# touched: the repo is copied to a temporary folder, tests/mutation/mutmut.cfg becomes its
# setup.cfg (mutmut reads setup.cfg when pyproject.toml has no [tool.mutmut]), and mutmut writes
# its mutants/ folder there.
#
# Two parts:
#  1. mutmut over embcache/core/{actions,cache_core,invariants,lifecycle}.py and
#     embcache/driver/cache.py with the fast test layers (tests/test_core.py, test_cache.py, test_cache_failures.py, test_mutation_killers.py,
#     tests/stateful; HYPOTHESIS_PROFILE=dev, EMBCACHE_LOCK_CHECK=1; no tla/mooncake/stress/
#     crosshair tests). mutmut only mutates code inside functions, so:
#  2. the module-level transition table embcache.core.lifecycle.TRANSITIONS is mutated
#     separately by
#     tests/mutation/table_mutants.py (drop each entry; send it to each other state), each
#     mutant run with the same fast layers and -x.
#
# Environment: MUTATION_JOBS (parallel workers, default 2), KEEP_WORKDIR=1 (keep the copy and
# print its path; `cd` there and `$PYTHON -m mutmut show NAME` gives a surviving mutant's
# diff), SKIP_TABLE=1 / SKIP_MUTMUT=1 (run one part only), TABLE_MUTANTS=FILE (run only the
# table mutants listed in FILE, an absolute path). Everything runs under nice -n 10.
# Exit status: 0 if the overall score is at least 90%, 1 if below, 2 on a setup error.
set -euo pipefail

PYTHON=${PYTHON:-python3}
JOBS=${MUTATION_JOBS:-2}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

if ! "$PYTHON" -c 'import importlib.metadata as m, sys; sys.exit(m.version("mutmut").split(".")[0] != "3")' 2>/dev/null; then
    echo "mutmut 3 is not installed for $PYTHON: pip install 'mutmut>=3,<4'" >&2
    exit 2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/embcache-mutation.XXXXXX")
if [[ "${KEEP_WORKDIR:-0}" == 1 ]]; then
    echo "work dir: $work"
else
    trap 'rm -rf "$work"' EXIT
fi
tar -C "$repo" --exclude=.git --exclude=mutants --exclude=.hypothesis --exclude=__pycache__ \
    --exclude=.pytest_cache --exclude=.mypy_cache --exclude=.ruff_cache -cf - . | tar -C "$work" -xf -
cp "$repo/tests/mutation/mutmut.cfg" "$work/setup.cfg"
cd "$work"
if "$PYTHON" -c 'import sys, tomllib; sys.exit("mutmut" not in tomllib.load(open("pyproject.toml", "rb")).get("tool", {}))'; then
    echo "pyproject.toml has a [tool.mutmut] table: mutmut will use it, not tests/mutation/mutmut.cfg" >&2
fi

export HYPOTHESIS_PROFILE=dev EMBCACHE_LOCK_CHECK=1
# Forked workers and shared cores: keep torch single-threaded.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
TESTS=(tests/test_core.py tests/test_reliability.py tests/test_admission.py tests/test_cache.py tests/test_cache_failures.py
       tests/test_mutation_killers.py tests/stateful)
MARKS="not tla and not mooncake and not stress and not crosshair"

start=$(date +%s)
echo "== baseline: fast layers, unmutated"
if ! nice -n 10 "$PYTHON" -m pytest -q -p no:cacheprovider -m "$MARKS" "${TESTS[@]}" | tail -n 3; then
    echo "the fast layers fail without any mutant: fix that first" >&2
    exit 2
fi

if [[ "${SKIP_MUTMUT:-0}" != 1 ]]; then
    echo "== mutmut run (max children $JOBS)"
    nice -n 10 "$PYTHON" -m mutmut run --max-children "$JOBS" "$@" > mutmut-run.log 2>&1 || {
        tail -c 3000 mutmut-run.log >&2; exit 2; }
fi

if [[ "${SKIP_TABLE:-0}" != 1 ]]; then
    echo "== transition-table mutants ($JOBS at a time)"
    if [[ -n "${TABLE_MUTANTS:-}" ]]; then  # a file listing some of them, one a line
        cp "$TABLE_MUTANTS" table-mutants.txt
    else
        "$PYTHON" tests/mutation/table_mutants.py > table-mutants.txt
    fi
    : > table-results.txt
    export PYTHON MARKS
    export TESTS_STR="${TESTS[*]}"
    # shellcheck disable=SC2016
    xargs -P "$JOBS" -I{} bash -c '
        if EMBCACHE_TABLE_MUTANT="$1" PYTHONPATH="tests/mutation${PYTHONPATH:+:$PYTHONPATH}" \
            timeout 300 nice -n 10 "$PYTHON" -m pytest -x -q -p no:cacheprovider -p table_mutants \
            -m "$MARKS" $TESTS_STR > /dev/null 2>&1; then
            echo "survived $1"
        else
            echo "killed $1"
        fi' _ {} < table-mutants.txt >> table-results.txt
fi

echo "== results"
"$PYTHON" - <<'EOF'
import json
from pathlib import Path

from mutmut.stats import status_by_exit_code

rows, survivors = [], []
tot = {"killed": 0, "survived": 0, "timeout": 0, "other": 0}
for mod in ("core/actions", "core/cache_core", "core/invariants", "cache", "core/lifecycle",
            "core/allocator", "core/eviction"):
    meta = Path(f"mutants/embcache/{mod}.py.meta")
    if not meta.exists():
        continue
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    c = {"killed": 0, "survived": 0, "timeout": 0, "other": 0}
    for name, code in codes.items():
        status = status_by_exit_code[code]
        if status == "not checked":  # not selected by the arguments
            continue
        key = status if status in c else "other"
        c[key] += 1
        if status not in ("killed", "timeout"):
            survivors.append(f"{name}: {status}")
    rows.append((f"embcache/{mod}.py", c))
table = Path("table-results.txt")
if table.exists():
    c = {"killed": 0, "survived": 0, "timeout": 0, "other": 0}
    for line in table.read_text().split("\n"):
        if line:
            status, name = line.split(" ", 1)
            c[status] += 1
            if status == "survived":
                survivors.append(f"TRANSITIONS {name}: survived")
    rows.append(("states.TRANSITIONS (table)", c))

print(f"{'module':30} {'total':>6} {'killed':>7} {'survived':>9} {'timeout':>8} {'other':>6} {'score':>7}")
for name, c in rows:
    n = sum(c.values())
    for k in tot:
        tot[k] += c[k]
    score = 100 * (c["killed"] + c["timeout"]) / n if n else 0.0
    print(f"{name:30} {n:6} {c['killed']:7} {c['survived']:9} {c['timeout']:8} {c['other']:6} {score:6.1f}%")
n = sum(tot.values())
score = 100 * (tot["killed"] + tot["timeout"]) / n if n else 0.0
print(f"{'overall':30} {n:6} {tot['killed']:7} {tot['survived']:9} {tot['timeout']:8} {tot['other']:6} {score:6.1f}%")
print("score counts timeouts as killed; 'other' = no tests / suspicious / segfault")
print("\nnot killed:")
print("\n".join(f"  {s}" for s in survivors) or "  none")
Path("mutation-score.txt").write_text(f"{score:.1f}\n")
Path("mutmut-not-killed.txt").write_text(
    "".join(s.split(":")[0] + "\n" for s in survivors if not s.startswith("TRANSITIONS"))
)
EOF
if [[ -s mutmut-not-killed.txt ]]; then
    echo
    echo "== diffs of the mutmut mutants not killed"
    while read -r name; do
        "$PYTHON" -m mutmut show "$name" 2>/dev/null | grep -E '^(#|[-+][^-+])' || true
    done < mutmut-not-killed.txt
fi
echo "wall time: $(( $(date +%s) - start )) s"
score=$(cat mutation-score.txt)
"$PYTHON" -c "import sys; sys.exit(float('$score') < 90.0)"
