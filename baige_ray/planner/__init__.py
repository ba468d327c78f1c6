"""Placement-group planner: auto-parallel search over the resource graph, rank mapping, Ray placement."""
