"""Benchmarks run by `baige-ray bench NAME`; each prints one JSON object as its last line."""
