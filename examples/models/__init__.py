"""Published model configs (config.json exactly as released, planner YAMLs) and the tables the benchmarks
read, with their citations in SOURCES.md. Installed as `baige_ray.published` so they ship in the wheel:
`baige-ray plan qwen2.5-0.5b ...` finds them by name on any node (baige_ray/catalog.py)."""
