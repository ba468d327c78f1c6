"""The parallel layout of a job and the canonical state it reshards through: the vocabulary every
layer above shares (planner, checkpoints, models, engines, runtime)."""
