"""Execution engines: turn a parallel layout into real torch.distributed training inside a worker."""
