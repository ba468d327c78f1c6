"""The model interface: what every layer of the stack needs to know about a model family.

A model is a plug-in, never an `isinstance` branch in the engines, the elastic controller,
the planner or the server (torchtitan keeps a registry of models in the same spirit, each with
its own parallelize and pipeline functions). A user-facing model config (`GPTConfig`,
`HFModel`, ...) is registered with the `ModelPlugin` subclass that knows how to:

- build its parameters for the pipeline stages one rank holds (on the meta device first where
  the weights come from disk, so a rank materializes only its own stages);
- carve it into pipeline stages that keep the full model's parameter names (canonical names:
  state moves between layouts by name), and list each stage's transformer blocks in order;
- tensor-parallelize one block (a DTensor plan relative to the block);
- compute the loss, open its default training data, describe itself to the planner (`ModelSpec`);
- write its final checkpoint, and build an inference model from canonical state.

`plugin_for(config)` finds the plug-in by the config's type; `register_model` adds one.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from baige_ray.models.generation import KVDecoder, TextCodec, VLLMSource
    from baige_ray.parallel.layout import ParallelLayout
    from baige_ray.planner.model_spec import ModelSpec

# Modules whose import registers the built-in plug-ins; looked up lazily so that importing the
# registry does not import transformers.
_BUILTIN_PLUGIN_MODULES = ("baige_ray.models.gpt_plugin", "baige_ray.models.mlp", "baige_ray.models.hf.plugin")
_REGISTRY: dict[type, type[ModelPlugin]] = {}


IGNORE_INDEX = -100  # a target the loss does not train (a prompt, padding): PyTorch's and transformers' convention


def token_divisor(targets: torch.Tensor, tokens_per_sample: float | None, count: Callable[[torch.Tensor], int]) -> float:
    """What a loss summed over `targets`' trained tokens is divided by: `tokens_per_sample` x the samples
    (the step's own mean), or else the trained tokens `count` finds in them (at least 1: a batch with
    none trains nothing and has loss 0)."""
    if tokens_per_sample is not None:
        return tokens_per_sample * targets.shape[0] or 1.0  # a step that trains no token: its sum is 0
    return max(1, count(targets))


class SampleSource(Protocol):
    """Training data addressed by global sample index: any rank reads exactly the samples of any step."""

    fingerprint: str

    def batch(self, indices: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class ProvidedSamples(ABC):
    """A sample source that is its own data (TrainJob.data): no plug-in opens it. Its samples must be
    what the model and the job's objective take."""

    fingerprint: str

    @abstractmethod
    def batch(self, indices: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PolicySamples(ABC):
    """Samples the policy being trained draws itself as each step begins (on-policy reinforcement learning
    with the rollouts on the training ranks, rl/hybrid.py): the engine hands it a decoder over the rank's
    own weights (`ModelPlugin.policy_decoder`), so no weights move between a trainer and an engine."""

    fingerprint: str

    @abstractmethod
    def policy_batch(self, decoder: KVDecoder, step: int, indices: Sequence[int],
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `indices` of step `step`, drawn from the policy `decoder` runs."""

    @abstractmethod
    def report(self, step: int) -> dict[str, Any]:
        """What drawing step `step`'s samples on this rank found, for the step's metrics: "rewards" of the
        samples it trains at their "positions" in the step's batch (gathered over the job into the whole
        batch's) and seconds (the slowest rank's count)."""


class ModelPlugin(ABC):
    """One model family as the stack sees it; `config` is the user's (small, picklable) model config."""

    engine: str | None = None  # an engine of the model's own (engines/factory.py); None: torch or DeepSpeed

    def __init__(self, config: Any):
        self.config = config

    # ---- shape ---------------------------------------------------------------------------

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Transformer blocks: the units pipeline stages are made of."""

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Tokens per training sequence."""

    def describe(self) -> str:
        return type(self.config).__name__

    # ---- building ------------------------------------------------------------------------

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The whole model on CPU with its initial weights (the caller seeds torch's generator first)."""

    @abstractmethod
    def build_stage(self, model: nn.Module, first_layer: int, last_layer: int, *, is_first: bool,
                    is_last: bool) -> nn.Module:
        """Blocks [first, last) of `model` (plus embeddings if first, head if last) under their canonical names.

        The stage's forward takes token ids (first stage) or hidden states and returns hidden
        states, or logits (last stage)."""

    @abstractmethod
    def stage_blocks(self, stage: nn.Module) -> list[nn.Module]:
        """The stage's transformer blocks in order (FSDP wraps and TP parallelizes each)."""

    def build_stages(self, stage_ranges: Sequence[tuple[int, int, bool, bool]], device: torch.device,
                     seed: int) -> list[nn.Module]:
        """The stages one rank holds, each (first layer, last layer, is first, is last), with weights on `device`.

        By default every rank builds the same full model from `seed`, then keeps its part; a plug-in
        whose weights come from disk overrides this to materialize only its own stages."""
        torch.manual_seed(seed)
        model = self.build_model().to(device)
        return [self.build_stage(model, first, last, is_first=is_first, is_last=is_last)
                for first, last, is_first, is_last in stage_ranges]

    def build_probe_layers(self, count: int, device: torch.device) -> nn.Module:
        """Up to `count` of the model's own blocks with fresh random weights, as a middle pipeline stage
        (hidden states in and out; `stage_blocks` lists them): what calibration times as the model's
        layer. Nothing else of the model is allocated, so a model of any size costs its layers alone."""
        with torch.device("meta"):
            model = self.build_model()
        stage = self.build_stage(model, 0, min(count, self.num_layers), is_first=False, is_last=False)
        stage.to_empty(device=device)
        with torch.no_grad():
            for param in stage.parameters():
                if param.dim() >= 2:
                    nn.init.normal_(param, std=0.02)
                else:  # norms' scales (and biases: their values do not change the time)
                    nn.init.ones_(param)
        return stage

    # ---- parallelism ---------------------------------------------------------------------

    def layer_costs(self) -> tuple[float, ...]:
        """Relative forward cost of each transformer block; equal unless blocks differ (dense and MoE)."""
        return (1.0,) * self.num_layers

    def layers_per_stage(self, layout: ParallelLayout) -> tuple[int, ...]:
        """Blocks of each pipeline stage: the layout's own split if it has one, else split by cost
        where blocks differ, else as evenly as possible."""
        from baige_ray.parallel.layout import balanced_stage_layers

        costs = self.layer_costs()
        if layout.stage_layers is not None or len(set(costs)) <= 1:
            return layout.layers_per_stage(self.num_layers)
        return balanced_stage_layers(costs, layout.num_stages)

    def check_layout(self, layout: ParallelLayout) -> None:
        """ValueError, on the driver before any actor starts, for a layout this model cannot run."""
        if layout.pp > 1 or layout.tp > 1:
            self.layers_per_stage(layout)
        if layout.tp > 1:
            self.tensor_parallel_plan(layout.tp)
            self._check_sequence_split(layout)
        if layout.ep > 1:
            self.check_expert_parallel(layout.ep)
        if layout.cp > 1:
            self._check_context_parallel(layout)

    def _check_context_parallel(self, layout: ParallelLayout) -> None:
        from baige_ray.parallel.context_parallel import SequenceShard

        if not self.supports_context_parallel:
            raise ValueError(f"ParallelLayout.cp={layout.cp} is invalid for {self.describe()}: context parallelism "
                             "needs a dense Hugging Face causal LM (its attention is replaced by one across the group)")
        SequenceShard(layout.cp, 0).check_length(self.seq_len)
        if layout.tp > 1 and layout.sequence_parallel and (self.seq_len // layout.cp) % layout.tp:
            raise ValueError(f"ParallelLayout.cp={layout.cp} with tp={layout.tp} is invalid for sequences of "
                             f"{self.seq_len} tokens: sequence parallelism splits each CP rank's {self.seq_len // layout.cp} "
                             f"tokens over tp; expected a seq_len divisible by cp x tp, or sequence_parallel=False")

    def _check_sequence_split(self, layout: ParallelLayout) -> None:
        if layout.sequence_parallel and self.seq_len % layout.tp and self.sequence_parallel_plan(layout.tp) is not None:
            raise ValueError(f"ParallelLayout.sequence_parallel=True is invalid with tp={layout.tp} for sequences of "
                             f"{self.seq_len} tokens: each TP rank holds an equal slice of the sequence; expected a "
                             f"seq_len divisible by {layout.tp}, or sequence_parallel=False")

    @property
    def max_pipeline_stages(self) -> int | None:
        """The most pipeline stages the model can be split into (None: one per block)."""
        return None

    @property
    def supports_adapters(self) -> bool:
        """Whether LoRA adapters (TrainJob.adapter) can train on it: peft wraps its Linear modules."""
        return False

    @property
    def supports_packed_documents(self) -> bool:
        """Whether its stages take `positions` (each token's position in its document, restarting where a
        packed sequence starts the next) and keep attention inside each document."""
        return False

    @property
    def supports_context_parallel(self) -> bool:
        """Whether its stages attend through transformers' attention interface and take explicit positions,
        as context parallelism needs (`enable_context_parallel`)."""
        return False

    def enable_context_parallel(self, stage: nn.Module) -> None:
        """Make `stage` attend across its context-parallel group inside a context-parallel forward."""
        raise ValueError(f"context parallelism is not available for {self.describe()}: expected a dense Hugging Face "
                         "causal LM")

    @property
    def supports_uneven_data_parallel(self) -> bool:
        """Whether data-parallel replicas may hold shares of the global batch that differ by a sequence."""
        return True

    @abstractmethod
    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """DTensor parallel styles keyed by module name relative to one block; raises ValueError when
        the model cannot be split `tp` ways (heads, KV heads or FFN width not divisible)."""

    def sequence_parallel_plan(self, tp: int) -> dict[str, Any] | None:
        """The block plan of tensor parallelism with sequence parallelism (parallel/sequence_parallel.py):
        norms on each rank's slice of the sequence, row-parallel outputs reduce-scattered over it. None
        where the model has none; the engine then runs `tensor_parallel_plan`, the sequence whole."""
        return None

    def shard_vocabulary(self, stage: nn.Module, tp_mesh) -> None:
        """Split the token embedding and the output head `stage` holds by vocabulary rows over the
        tensor-parallel ranks; by default they stay whole on every rank."""

    def tensor_parallel_replicated_names(self) -> tuple[str, ...]:
        """Block-relative parameter names kept whole on every tensor-parallel rank although each rank
        computes only part of their gradient (norms applied per head): gradients are summed over TP."""
        return ()

    @property
    def ties_pipeline_ends(self) -> bool:
        """Whether the first and the last pipeline stage share parameters (a head tied to the input
        embedding): each holds a copy, and the engine sums the copies' gradients."""
        return False

    def pipeline_tied_parameters(self, stage: nn.Module) -> list[nn.Parameter]:
        """The parameters `stage` shares with the other end of the pipeline (empty for a middle stage)."""
        return []

    def check_expert_parallel(self, ep: int) -> None:
        """ValueError naming the field when the model's experts cannot be split `ep` ways."""
        raise ValueError(f"ParallelLayout.ep={ep} is invalid for {self.describe()}: the model has no experts")

    def expert_modules(self, stage: nn.Module) -> list[nn.Module]:
        """The stage's expert layers: each has `enable_expert_parallel(ep_mesh)`, which keeps the rank's
        experts as a DTensor slice by expert index and routes tokens over the mesh's group."""
        return []

    def inference_expert_layers(self, model: nn.Module) -> list[nn.Module]:
        """The expert layers of a `build_inference_model` model, for expert-parallel serving: each has
        `expert_weights()`, `expert_kernel()` and `run_experts_with(runner)`."""
        return []

    @property
    def has_auxiliary_loss(self) -> bool:
        """Whether forwards attach auxiliary losses (models/aux_loss.py) the reported loss must include."""
        return False

    # ---- training ------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, targets: torch.Tensor,
             tokens_per_sample: float | None = None) -> torch.Tensor:
        """Next-token cross entropy over the trained tokens (targets of IGNORE_INDEX are not trained): their
        sum divided by `tokens_per_sample` x the batch's samples, or their mean when it is None.

        `tokens_per_sample` is the whole step's trained tokens per sample (Engine.loss): the engines' mean
        over micro-batches is then the mean over every trained token of the step, however unevenly the
        micro-batches hold them. Without masked targets it is seq_len, and this is the batch mean."""
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
        return per_token / token_divisor(targets, tokens_per_sample, self.trained_tokens)

    def trained_tokens(self, targets: torch.Tensor) -> int:
        """How many of `targets` the loss trains."""
        return int((targets != IGNORE_INDEX).sum())

    @abstractmethod
    def open_data(self, data: Any) -> SampleSource | None:
        """The sample source for `data` (None: the plug-in's default data, if it has one)."""

    @abstractmethod
    def model_spec(self, *, global_batch: int, dtype_bytes: int = 2) -> ModelSpec:
        """The model as the planner prices it."""

    # ---- output --------------------------------------------------------------------------

    @abstractmethod
    def save_final(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        """Write the final checkpoint (canonical weights) under `directory`; returns its path."""

    @abstractmethod
    def build_inference_model(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        """A model for serving, in eval mode, with `weights` (canonical names) loaded."""

    def build_decoder(self, weights: dict[str, torch.Tensor]) -> KVDecoder:
        """The model with `weights` loaded, as the serving engine drives it (models/generation.py)."""
        raise ValueError(f"{self.describe()} cannot be served: it does not generate text")

    def policy_decoder(self, stage: nn.Module) -> KVDecoder:
        """A decoder over a rank's training module of the whole model (one stage, no tensor parallelism),
        on its own parameters: what it generates follows every optimizer step, nothing copied."""
        raise ValueError(f"{self.describe()} cannot sample from its training module: it does not generate text")

    def text_codec(self) -> TextCodec:
        """Between text and this model's token ids."""
        raise ValueError(f"{self.describe()} cannot be served: it does not generate text")

    def check_vllm(self) -> None:
        """ValueError, on the driver before any replica starts, when vLLM cannot serve this model."""
        raise ValueError(f"{self.describe()} has no vLLM implementation: serve it with engine='builtin'")

    @contextlib.contextmanager
    def vllm_source(self) -> Iterator[VLLMSource]:
        """Where vLLM loads this model's config and tokenizer from, for serve(engine="vllm"); only for models
        `check_vllm` accepts (the directory may last only as long as the context)."""
        self.check_vllm()
        raise NotImplementedError(f"{self.describe()} accepts vLLM but names no directory for it")
        yield

    def vllm_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical weights under the names and layout of the model class vLLM runs for this model."""
        return weights

    def save_hf_directory(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        """The model as a Hugging Face directory (config.json, safetensors, tokenizer) that
        transformers' `from_pretrained` and vLLM load; returns its path."""
        raise ValueError(f"{self.describe()} has no Hugging Face form")


def register_model(config_type: type) -> Callable[[type[ModelPlugin]], type[ModelPlugin]]:
    """Class decorator: `@register_model(MyConfig) class MyPlugin(ModelPlugin): ...`."""

    def register(plugin_type: type[ModelPlugin]) -> type[ModelPlugin]:
        _REGISTRY[config_type] = plugin_type
        return plugin_type

    return register


def plugin_for(config: Any) -> ModelPlugin:
    """The plug-in of `config`'s model family; ValueError naming the supported configs otherwise."""
    _import_builtin_plugins()
    for config_type in type(config).__mro__:
        if config_type in _REGISTRY:
            return _REGISTRY[config_type](config)
    supported = sorted(config_type.__name__ for config_type in _REGISTRY)
    raise ValueError(f"model={config!r} is invalid: expected a model config of a registered family, one of {supported}")


def config_type_named(name: str) -> type:
    """The registered model config class called `name` (how checkpoints name their model)."""
    _import_builtin_plugins()
    for config_type in _REGISTRY:
        if config_type.__name__ == name:
            return config_type
    raise ValueError(f"model class {name!r} is not registered: expected one of {sorted(t.__name__ for t in _REGISTRY)}")


def _import_builtin_plugins() -> None:
    for module in _BUILTIN_PLUGIN_MODULES:
        importlib.import_module(module)


def stage_ranges(layers_per_stage: Sequence[int], stage_indices: Sequence[int]) -> list[tuple[int, int, bool, bool]]:
    """(first layer, last layer, is first, is last) of each stage in `stage_indices`."""
    ranges = []
    for index in stage_indices:
        first = sum(layers_per_stage[:index])
        ranges.append((first, first + layers_per_stage[index], index == 0, index == len(layers_per_stage) - 1))
    return ranges
