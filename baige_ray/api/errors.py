"""Errors raised to users of baige-ray."""

from __future__ import annotations


class BaigeError(Exception):
    """Base class of every error baige-ray raises on purpose."""


class ClusterError(BaigeError):
    """The Ray cluster cannot host the request (too few devices, unreachable address)."""


class WorkerError(BaigeError):
    """A worker actor failed while running a step; carries the rank and the cause."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"worker rank {rank}: {message}")
        self.rank = rank


class CheckpointError(BaigeError):
    """A checkpoint is missing, truncated or fails its checksum."""
