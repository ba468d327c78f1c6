"""The rollouts a policy trainer publishes, by training step, for its training workers to read.

One actor per run, named after it. Step s's rollouts are the global samples
[s * batch_size, (s + 1) * batch_size): training step s reads exactly them, whichever layout,
rank or replacement worker asks. An iteration's rollouts may serve several steps (several updates
on one batch): they are published once for all of them. The first step's stay (an engine settles its
data-parallel buckets on sample 0 whenever it is built, after a recovery too); of the others only the
newest `keep` steps' do: a recovery redoes at most the step in progress.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RolloutBoard:
    def __init__(self, batch_size: int, keep: int = 2):
        if batch_size < 1 or keep < 1:
            raise ValueError(f"RolloutBoard(batch_size={batch_size}, keep={keep}) is invalid: expected both >= 1")
        self.batch_size, self.keep = batch_size, keep
        self._steps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def publish(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, steps: int = 1) -> None:
        """The rollouts of steps [step, step + steps)."""
        if inputs.shape[0] != self.batch_size or targets.shape[0] != self.batch_size:
            raise ValueError(f"step {step}'s rollouts hold {inputs.shape[0]} inputs and {targets.shape[0]} "
                             f"targets: expected the batch size, {self.batch_size}")
        for each in range(step, step + steps):
            self._steps[each] = (inputs, targets)
        for old in sorted(self._steps)[1:-self.keep]:
            del self._steps[old]

    def published(self) -> list[int]:
        return sorted(self._steps)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index in indices:
            step, row = divmod(int(index), self.batch_size)
            if step not in self._steps:
                raise KeyError(f"sample {index} is of step {step}, whose rollouts are not on the board "
                               f"(it holds steps {self.published()})")
            inputs, targets = self._steps[step]
            rows.append((inputs[row], targets[row]))
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
