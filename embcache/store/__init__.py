"""Global stores: the protocol, the embedded in-process default, and Mooncake."""

from embcache.store.base import GlobalStore, TransferOutcome
from embcache.store.inprocess import Fault, InProcessStore
from embcache.store.mooncake import MooncakeStore

__all__ = ["Fault", "GlobalStore", "InProcessStore", "MooncakeStore", "TransferOutcome"]
