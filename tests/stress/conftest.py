"""Fixtures for the stress tests: the real-master fixtures of ``tests/mooncake_store``, re-exported.

The root ``tests/conftest.py`` puts the repository root on ``sys.path``, so ``tests`` imports as
a namespace package. Only the function-scoped master is re-exported: the stress test kills and
restarts it, which a master shared by the session must never see.
"""

from tests.mooncake_store.conftest import MooncakeMaster, private_mooncake_master

__all__ = ["MooncakeMaster", "private_mooncake_master"]
