"""Ray Serve hosting of trained models and the train/infer device pool.

Names are imported on first use (PEP 562), as in `baige_ray`: a process that imports one of the package's
modules (the serving registry actor, a router) does not import `serve()`'s whole graph, torch included
(2-3 s of CPU per actor on a 2-core machine).
"""

from __future__ import annotations

from baige_ray.lazy_exports import lazy_exports

_EXPORTS = {
    "ServeHandleInfo": "baige_ray.serving.app",
    "ServeOptions": "baige_ray.serving.app",
    "busy_seconds": "baige_ray.serving.app",
    "reload_adapter": "baige_ray.serving.app",
    "reload_weights": "baige_ray.serving.app",
    "replica_devices": "baige_ray.serving.app",
    "replica_states": "baige_ray.serving.app",
    "scale_replicas": "baige_ray.serving.app",
    "serve": "baige_ray.serving.app",
    "serving_load": "baige_ray.serving.app",
    "shutdown": "baige_ray.serving.app",
    "DisaggregationOptions": "baige_ray.serving.disaggregation",
    "rebalance": "baige_ray.serving.disaggregation_scaling",
    "scale_sides": "baige_ray.serving.disaggregation_scaling",
    "side_loads": "baige_ray.serving.disaggregation_scaling",
    "ExpertParallelServing": "baige_ray.serving.expert_parallel",
    "KVCacheConfig": "baige_ray.serving.kv_blocks",
    "GenerateRequest": "baige_ray.serving.requests",
    "RequestError": "baige_ray.serving.requests",
    "RequestLimits": "baige_ray.serving.requests",
    "parse_generate_request": "baige_ray.serving.requests",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
