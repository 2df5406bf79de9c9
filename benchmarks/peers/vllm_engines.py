"""vLLM's own encoder-cache connectors and embcache's in the same real engines: the command line
of ``tests/support/vllm_engines.py`` (where the workload, the contenders, the rows and the proof
of failures are described; it lives there because the engine tier's tests run its quick form).

    python -m benchmarks.peers.vllm_engines [--quick] [--contenders a,b] [--master HOST:PORT]
        [--json OUT]
"""

from __future__ import annotations

from tests.support.vllm_engines import main

if __name__ == "__main__":
    raise SystemExit(main())
