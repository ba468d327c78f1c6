"""baige-ray: elastic, topology-aware training and serving of large models on Ray.

Names are imported on first use (PEP 562): a worker process that only trains does not pay for Ray
Serve, and `import baige_ray` stays cheap.
"""

from __future__ import annotations

from baige_ray.lazy_exports import lazy_exports

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it here)

_EXPORTS = {
    "BaigeError": "baige_ray.api",
    "CheckpointError": "baige_ray.api",
    "ClusterError": "baige_ray.api",
    "ClusterSession": "baige_ray.topology.connect",
    "ConversationDataset": "baige_ray.models.conversation_dataset",
    "CorpusConfig": "baige_ray.models.corpus",
    "DeviceInfo": "baige_ray.api.device",
    "DisaggregationOptions": "baige_ray.serving",
    "ElasticConfig": "baige_ray.api.elastic",
    "ExpertParallelServing": "baige_ray.serving",
    "FaultPlan": "baige_ray.elastic.faults",
    "GRPOConfig": "baige_ray.rl.config",
    "GRPOTrainer": "baige_ray.rl.trainer",
    "GPTConfig": "baige_ray.models.gpt",
    "HFModel": "baige_ray.models.hf",
    "InfeasiblePlanError": "baige_ray.api",
    "KVCacheConfig": "baige_ray.serving",
    "LayoutMemoryError": "baige_ray.api",
    "MoEConfig": "baige_ray.models.moe",
    "ModelPlugin": "baige_ray.models.plugin",
    "ParallelLayout": "baige_ray.parallel.layout",
    "PolicyLossConfig": "baige_ray.models.policy_loss",
    "Result": "baige_ray.api",
    "RolloutFaultPlan": "baige_ray.rl.faults",
    "RolloutOptions": "baige_ray.rl.trainer",
    "RunConfig": "baige_ray.api",
    "ScalingConfig": "baige_ray.api",
    "ServeHandleInfo": "baige_ray.serving",
    "ServingError": "baige_ray.api",
    "SplitSizing": "baige_ray.rl.split_sizing",
    "StepMetrics": "baige_ray.api",
    "TokenDataset": "baige_ray.models.token_dataset",
    "TrainConfig": "baige_ray.api",
    "TrainingJob": "baige_ray.jobs.launch",
    "WorkerError": "baige_ray.api",
    "fit": "baige_ray.jobs.fit",
    "launch": "baige_ray.jobs.launch",
    "load_descriptor": "baige_ray.topology.descriptor",
    "load_model": "baige_ray.runtime.checkpoint_io",
    "load_tokenizer": "baige_ray.models.tokenizer",
    "merge_adapter": "baige_ray.models.adapters",
    "open_cluster": "baige_ray.topology.connect",
    "parse_layout": "baige_ray.parallel.layout",
    "register_model": "baige_ray.models.plugin",
    "serve": "baige_ray.serving",
    "train_bpe_tokenizer": "baige_ray.models.tokenizer",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
