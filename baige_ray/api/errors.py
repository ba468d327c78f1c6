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


class InfeasiblePlanError(BaigeError):
    """No parallel layout fits the model on the devices given.

    Carries the per-device memory the best layout tried needs and what its devices hold,
    so the user sees how far off the request is (more devices, a smaller model or batch).
    """

    def __init__(self, message: str, *, needed_gb: float, available_gb: float, layout: str):
        super().__init__(self._text(message, needed_gb, available_gb, layout))
        self.needed_gb = needed_gb
        self.available_gb = available_gb
        self.layout = layout

    @staticmethod
    def _text(message: str, needed_gb: float, available_gb: float, layout: str) -> str:
        return (f"{message}: best layout tried ({layout}) needs {needed_gb:.1f} GB per device, "
                f"devices hold {available_gb:.1f} GB")


class LayoutMemoryError(InfeasiblePlanError):
    """An explicit layout does not fit: `budget` names what it exceeds ("device memory", "host memory of
    node 3"); the message names the layout and the bytes needed and available, and says what holds them."""

    def __init__(self, message: str, *, needed_gb: float, available_gb: float, layout: str, budget: str):
        super().__init__(message, needed_gb=needed_gb, available_gb=available_gb, layout=layout)
        self.budget = budget

    @staticmethod
    def _text(message: str, needed_gb: float, available_gb: float, layout: str) -> str:
        return message


class ServingError(BaigeError):
    """A model cannot be served: a replica's engine failed to start or to generate with it. `serve()`
    raises it with the engine's own error and leaves no application behind."""
