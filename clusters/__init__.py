"""Cluster descriptors, installed as `baige_ray.clusters` so they ship in the wheel: `open_cluster("sim-2x4")`
and `--cluster h100-rail-2048` find them by name on any node (baige_ray/catalog.py). The `ray up` configs
beside them (aws-h100, gcp-a100, onprem) ship too, but are not descriptors."""
