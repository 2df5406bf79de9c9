"""embcache inside vLLM: ``EmbcacheECConnector``, an encoder-cache connector whose scheduler
never declares an item present that a rank cannot load (embcache/DESIGN.md, "vLLM: the
scheduler/worker split"). Importing it needs vLLM's ``ec_connector/base.py``."""

from embcache.integrations.vllm.connector import EmbcacheECConnector
from embcache.integrations.vllm.options import ConnectorOptions, parse_options
from embcache.integrations.vllm.protocol import (
    EmbcacheECMetadata,
    EmbcacheECWorkerMetadata,
    Transfer,
)
from embcache.integrations.vllm.scheduler import RankDeath, SchedulerStats
from embcache.integrations.vllm.shm import PoolHandle

__all__ = [
    "ConnectorOptions",
    "EmbcacheECConnector",
    "EmbcacheECMetadata",
    "EmbcacheECWorkerMetadata",
    "PoolHandle",
    "RankDeath",
    "SchedulerStats",
    "Transfer",
    "parse_options",
]
