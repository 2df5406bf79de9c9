"""What tests and benchmarks share: the peers' wheels (fetched and loaded at run time), vLLM's
engine-step call order (``vllm_engine``) and the baselines. Imported as ``tests.support`` (the
repository root is on ``sys.path``: the tests' conftest puts it there, ``python -m
benchmarks...`` runs from it); never from ``benchmarks``.
"""
