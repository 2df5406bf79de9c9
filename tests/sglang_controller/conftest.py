"""The real ``mooncake_master`` fixtures of ``tests/mooncake_store`` (skip locally without the
binary, fail in CI), for the SGLang contract tests that share a global store."""

from tests.mooncake_store.conftest import key_prefix, mooncake_master

__all__ = ["key_prefix", "mooncake_master"]
