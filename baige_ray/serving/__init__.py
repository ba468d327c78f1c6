"""Ray Serve hosting of trained models and the train/infer device pool."""

from baige_ray.serving.app import (
    ServeHandleInfo,
    ServeOptions,
    busy_seconds,
    reload_adapter,
    reload_weights,
    replica_devices,
    replica_states,
    scale_replicas,
    serve,
    serving_load,
    shutdown,
)
from baige_ray.serving.disaggregation import DisaggregationOptions
from baige_ray.serving.disaggregation_scaling import rebalance, scale_sides, side_loads
from baige_ray.serving.expert_parallel import ExpertParallelServing
from baige_ray.serving.kv_blocks import KVCacheConfig
from baige_ray.serving.requests import GenerateRequest, RequestError, RequestLimits, parse_generate_request

__all__ = [
    "DisaggregationOptions",
    "ExpertParallelServing",
    "GenerateRequest",
    "KVCacheConfig",
    "RequestError",
    "RequestLimits",
    "ServeHandleInfo",
    "ServeOptions",
    "busy_seconds",
    "parse_generate_request",
    "rebalance",
    "reload_adapter",
    "reload_weights",
    "replica_devices",
    "replica_states",
    "scale_replicas",
    "scale_sides",
    "serve",
    "serving_load",
    "shutdown",
    "side_loads",
]
