"""Flash checkpoints: asynchronous persistence with checksums, commit markers and resharding on load."""
