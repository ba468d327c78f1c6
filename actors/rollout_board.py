"""The rollouts a policy trainer publishes, by iteration, for its training workers to read.

One actor per run, named after it. Iteration i's rollouts are the global samples
[i * batch_size, (i + 1) * batch_size): training step i reads exactly them, whichever layout,
rank or replacement worker asks. The first iteration stays (an engine settles its data-parallel
buckets on sample 0 whenever it is built, after a recovery too); of the others only the newest
`keep` do: a recovery redoes at most the step in progress.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RolloutBoard:
    def __init__(self, batch_size: int, keep: int = 2):
        if batch_size < 1 or keep < 1:
            raise ValueError(f"RolloutBoard(batch_size={batch_size}, keep={keep}) is invalid: expected both >= 1")
        self.batch_size, self.keep = batch_size, keep
        self._iterations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def publish(self, iteration: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if inputs.shape[0] != self.batch_size or targets.shape[0] != self.batch_size:
            raise ValueError(f"iteration {iteration}'s rollouts hold {inputs.shape[0]} inputs and {targets.shape[0]} "
                             f"targets: expected the batch size, {self.batch_size}")
        self._iterations[iteration] = (inputs, targets)
        for old in sorted(self._iterations)[1:-self.keep]:
            del self._iterations[old]

    def published(self) -> list[int]:
        return sorted(self._iterations)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index in indices:
            iteration, row = divmod(int(index), self.batch_size)
            if iteration not in self._iterations:
                raise KeyError(f"sample {index} is of iteration {iteration}, whose rollouts are not on the board "
                               f"(it holds iterations {self.published()})")
            inputs, targets = self._iterations[iteration]
            rows.append((inputs[row], targets[row]))
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
