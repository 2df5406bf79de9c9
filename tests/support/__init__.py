"""What more than one test file, or a test and a benchmark, share: the tests' helpers (``helpers``:
seeded payloads, stored bytes, unique names, bounded polling), the overlapping fences of issue
25 (``overlap``), the peers' wheels (fetched and loaded at run time, SGLang's controller driven
as a peer: ``sglang_wheel``), vLLM's engine-step call order (``vllm_engine``) and its
``ECCPUConnector`` on CPU (``vllm_cpu_connector``), the baselines, the request mixes (``mixes``,
``server_workload``), the result row and its check (``rows``), callgrind's output
(``callgrind``), and for tests that start servers or ranks, this session's ports (``ports``) and
spawned ranks that are never left behind (``processes``) and a module's scenarios run on them
(``rank_scenarios``); the profiler that splits a cache's time by what ran (``breakdown``) and
the engine-level vLLM benchmark (``vllm_engines``), whose quick form the engine tier runs.
Imported as ``tests.support`` (the repository root is on ``sys.path``: the tests' conftest puts
it there, ``python -m benchmarks...`` runs from it); never from ``benchmarks``: a test runs a
benchmark as ``python -m benchmarks...`` and reads its output.
"""
