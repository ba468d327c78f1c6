"""baige-ray: elastic, topology-aware training and serving of large models on Ray."""

from baige_ray.api import (
    BaigeError,
    CheckpointError,
    ClusterError,
    InfeasiblePlanError,
    LayoutMemoryError,
    Result,
    RunConfig,
    ScalingConfig,
    ServingError,
    StepMetrics,
    TrainConfig,
    WorkerError,
)
from baige_ray.api.device import DeviceInfo
from baige_ray.models.corpus import CorpusConfig
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.hf import HFModel
from baige_ray.models.plugin import ModelPlugin, register_model
from baige_ray.models.token_dataset import TokenDataset
from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer
from baige_ray.runtime.checkpoint_io import load_model
from baige_ray.elastic.config import ElasticConfig
from baige_ray.elastic.faults import FaultPlan
from baige_ray.elastic.job import TrainingJob, launch
from baige_ray.runtime.fit import fit
from baige_ray.serving import DisaggregationOptions, ExpertParallelServing, ServeHandleInfo, serve
from baige_ray.topology.connect import ClusterSession, open_cluster
from baige_ray.topology.descriptor import load_descriptor

__version__ = "0.1.0"

__all__ = [
    "BaigeError",
    "CheckpointError",
    "ClusterError",
    "ClusterSession",
    "CorpusConfig",
    "DeviceInfo",
    "DisaggregationOptions",
    "ExpertParallelServing",
    "ElasticConfig",
    "FaultPlan",
    "GPTConfig",
    "HFModel",
    "InfeasiblePlanError",
    "LayoutMemoryError",
    "ModelPlugin",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "ServeHandleInfo",
    "ServingError",
    "StepMetrics",
    "TokenDataset",
    "TrainConfig",
    "TrainingJob",
    "WorkerError",
    "fit",
    "launch",
    "load_descriptor",
    "load_model",
    "load_tokenizer",
    "open_cluster",
    "register_model",
    "serve",
    "train_bpe_tokenizer",
]
