"""Global stores: the protocol and Mooncake. With no store a cache has no global tier; the
fault-injecting test double is ``embcache.testing.FaultInjectingStore``."""

from embcache.driver.global_store import GlobalStore, TransferOutcome
from embcache.store.mooncake import MooncakeStore

__all__ = ["GlobalStore", "MooncakeStore", "TransferOutcome"]
