"""Elastic training: the controller state machine, snapshots, fault injection."""
