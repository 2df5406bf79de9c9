"""The encode pipeline on the driver: one call looks up, loads, encodes and inserts.

``pipeline`` (``EncodePipeline``), ``claims`` (``FleetClaims``: one encode per key across a
fleet of workers on one global store), ``plan`` (what one call must encode and where each item's
rows go), ``tp_channel`` (the collectives of a tensor-parallel group).
"""

from embcache.errors import TensorParallelError
from embcache.pipeline.claims import ClaimStats, FleetClaims
from embcache.pipeline.pipeline import EncodePipeline, Encoder, PipelineStats

__all__ = [
    "ClaimStats",
    "EncodePipeline",
    "Encoder",
    "FleetClaims",
    "PipelineStats",
    "TensorParallelError",
]
