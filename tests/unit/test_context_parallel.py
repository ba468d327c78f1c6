"""Context parallelism trains as one process does.

Each CP rank holds two chunks of every sequence, one from each end (parallel/context_parallel.py), and
attends across the group by all-gathered keys ("ring") or by trading heads for sequence ("ulysses").
Gloo ranks train the conformance matrix's Llama 3.2, Qwen2.5 and Qwen3 configs (published, shrunk, every flag
kept) at CP4, and at CP2 with FSDP2 over dp x cp and with TP2 (sequence parallel; Llama's under FSDP2 as
well), Llama with DeepSpeed's ZeRO-3 over dp x cp, and Mixtral's with its router loss at CP4, with expert parallelism (DDP and FSDP2), with TP2 and
with ZeRO-2, for 20 steps; their losses must be those of `transformers` trained alone, in micro-batches of a
data-parallel replica's share.
Packed documents keep their attention inside each document across the group, and every rank sends
the bytes per layer the planner's formula says.
"""

import pytest
import torch
import torch.distributed as dist

from baige_ray.parallel.context_parallel import SequenceShard, document_ids, natural_order
from baige_ray.parallel.layout import ParallelLayout, parse_layout
from tests.helpers import spawn_ranks

STEPS = 20
# Each family alone, with FSDP2 (over dp x cp) and with TP2 (sequence parallel), the two kinds in turn so that
# every kind meets every composition in some family; Llama also with ZeRO-3 (over dp x cp).
LAYOUTS = {
    # Llama's TP2 runs under FSDP2 over its CP pair: 2-D (cp, tp) shards, whose gradient norm the clip must
    # count over both dimensions (FSDP2 lays a TP-sharded dimension out as _StridedShard).
    "llama": ("cp=4", "dp=2,cp=2,engine=fsdp2,cpkind=ulysses", "cp=2,tp=2,engine=fsdp2", "dp=2,cp=2,engine=zero3"),
    "qwen2": ("cp=4,cpkind=ulysses", "dp=2,cp=2,engine=fsdp2", "cp=2,tp=2,cpkind=ulysses"),
    "qwen3": ("cp=4", "dp=2,cp=2,engine=fsdp2,cpkind=ulysses", "cp=2,tp=2"),
    # A mixture of experts with its load-balancing loss on: counted over the whole sequences across the CP
    # group; experts whole, sharded by expert index over ep (DDP and FSDP2), and under TP2.
    "mixtral": ("cp=4,cpkind=ulysses", "dp=2,ep=2,cp=2", "dp=2,ep=2,cp=2,engine=fsdp2,cpkind=ulysses", "cp=2,tp=2",
                "dp=2,cp=2,engine=zero2"),
}


def test_each_rank_holds_one_chunk_from_each_end_and_the_gathered_order_inverts():
    assert [SequenceShard(2, rank).indices(8).tolist() for rank in (0, 1)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    gathered = torch.cat([SequenceShard(4, rank).indices(16) for rank in range(4)])
    assert torch.equal(gathered[natural_order(4, 16)], torch.arange(16))
    rows = torch.arange(16).reshape(2, 8)
    assert torch.equal(SequenceShard(2, 1).split(rows), rows[:, 2:6])
    with pytest.raises(ValueError, match=r"cp=4 is invalid for sequences of 20 tokens.*divisible by 8"):
        SequenceShard(4, 0).indices(20)


def test_documents_are_numbered_where_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4]]


def test_a_layout_with_cp_places_cp_ranks_between_dp_and_tp():
    layout = parse_layout("dp=2,cp=2,tp=2,cpkind=ulysses")
    assert (layout.world_size, layout.gradient_replicas, layout.cp_kind) == (8, 4, "ulysses")
    assert [(c.dp, c.cp, c.tp) for c in map(layout.coords, range(8))] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert layout.describe() == "DP2xCP2xTP2 (ddp, ulysses CP)"


@pytest.mark.parametrize("fields, message", [
    (dict(cp=2, pp=2), r"cp=2 is invalid with pp=2.*not built yet"),
    (dict(dp=2, ep=2, cp=2, data_parallel="zero2"), r"cp=2 with ep=2 is invalid with data_parallel='zero2'"),
    (dict(cp=2, cp_kind="tree"), r"cp_kind='tree' is invalid"),
    (dict(cp=0), r"cp=0 is invalid"),
])
def test_layouts_context_parallelism_cannot_run_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**fields)


def test_models_and_lengths_context_parallelism_cannot_split_are_refused_before_any_worker_starts(tmp_path):
    from transformers import AutoModelForCausalLM

    from baige_ray.models.gpt import GPTConfig
    from baige_ray.models.hf import HFModel
    from baige_ray.models.plugin import plugin_for
    from tests.hf_helpers import llama_config

    with pytest.raises(ValueError, match="needs a dense Hugging Face causal LM"):
        plugin_for(GPTConfig(seq_len=32, hidden=64, num_heads=4, num_layers=2)).check_layout(ParallelLayout(cp=2))
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"cp=4 is invalid for sequences of 36 tokens.*divisible by 8"):
        plugin_for(HFModel(tmp_path, seq_len=36)).check_layout(ParallelLayout(cp=4))
    with pytest.raises(ValueError, match=r"each rank's 2 attention heads \(of tp=2\) are split over cp"):
        plugin_for(HFModel(tmp_path, seq_len=32)).check_layout(ParallelLayout(cp=4, tp=2, cp_kind="ulysses"))


def _train():
    from baige_ray import TrainConfig

    return TrainConfig(num_steps=STEPS, global_batch_size=4, warmup_steps=2, seed=5)


def _init(rank: int, port: int, world_size: int) -> None:
    import os

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _train_layouts(rank: int, port: int, results, runs: dict[str, tuple[str, str, tuple[str, ...]]]) -> None:
    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from tests.hf_helpers import SEQ_LEN

    _init(rank, port, 4)
    for name, (model_dir, data_dir, layouts) in runs.items():
        for text in layouts:
            job = TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), train=_train(), data=TokenDataset.open(data_dir))
            engine = build_engine(job, parse_layout(text), rank)
            lengths = []
            stage = engine.stages[0] if hasattr(engine, "stages") else engine.module  # DeepSpeed's: one model
            stage.layers["0"].register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
            metrics = [engine.train_step(s) for s in range(STEPS)]
            results[(name, text, rank)] = {"losses": [m["loss"] for m in metrics], "lengths": sorted(set(lengths)),
                                           "sent": metrics[0]["context_parallel_bytes"]}
    dist.destroy_process_group()


def _replica_mean(results, name: str, text: str) -> list[float]:
    """Every rank reports its replica's share of the loss (the CP group's sum): their mean is the batch's."""
    per_rank = [results[(name, text, rank)]["losses"] for rank in range(4)]
    return [sum(step) / 4 for step in zip(*per_rank)]


def _packed_dataset(tiny, directory):
    """Short documents packed by the tokenizer's end-of-text, positions restarting at each."""
    from baige_ray.models.token_dataset import TokenDataset
    from tests.hf_helpers import SEQ_LEN

    words = (text.split() for text in (path.read_text() for path in tiny.text_files))
    pool = [word for text in words for word in text][:2000]
    documents = []
    for index in range(60):
        documents.append(directory / f"doc{index}.txt")
        start = (index * 37) % (len(pool) - 30)
        documents[-1].write_text(" ".join(pool[start : start + 3 + index % 11]))
    return TokenDataset.build(documents, tokenizer=tiny.tokenizer_dir, seq_len=SEQ_LEN, directory=directory / "data",
                              document_masking=True)


# The conformance matrix's published configs (models/hf/conformance.py), shrunk with every flag kept.
PUBLISHED = {"llama": "llama-3.2-1b.json", "qwen2": "qwen2.5-0.5b.json", "qwen3": "qwen3-0.6b.json",
             "mixtral": "mixtral-8x7b-v0.1.json"}


def _published_family(name: str):
    """A `build_tiny_hf` family: the published config shrunk; an MoE one with its load-balancing loss on."""
    from transformers import AutoConfig

    from baige_ray.models.hf.conformance import load_published, shrink_config
    from tests.hf_helpers import VOCAB_SIZE

    def family(**token_ids):
        config = shrink_config(load_published(PUBLISHED[name]), vocab_size=VOCAB_SIZE, **token_ids)
        if name == "mixtral":
            config.update(output_router_logits=True, router_aux_loss_coef=0.05)
        return AutoConfig.for_model(**config)

    return family


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny model of a family of PUBLISHED, built once per test process on first use."""
    from tests.hf_helpers import build_tiny_hf

    built = {}

    def build(name: str):
        if name not in built:
            built[name] = build_tiny_hf(tmp_path_factory.mktemp(name), family=_published_family(name))
        return built[name]

    return build


@pytest.mark.timeout(600)
# One family a test: the longest (Llama's four layouts) runs about 75 s on this machine, where Llama and Qwen2
# together ran 131 s and held one of the unit tier's two processes alone while the other had finished.
@pytest.mark.parametrize("names", [("llama",), ("qwen2",), ("qwen3",), ("mixtral",)])
def test_hf_families_train_with_context_parallelism_as_transformers_alone(tiny_model, names):
    import dataclasses
    import json

    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.planner.context_parallel import context_parallel_bytes_per_layer
    from baige_ray.planner.model_spec import ModelSpec
    from tests.hf_helpers import SEQ_LEN, plain_transformers_losses

    tiny_models = {name: tiny_model(name) for name in names}
    runs = {name: (str(tiny.model_dir), str(tiny.dataset_dir), LAYOUTS[name]) for name, tiny in tiny_models.items()}
    results = spawn_ranks(_train_layouts, 4, runs)

    references = {}  # by micro-batch: an MoE model's router loss is one per micro-batch (a replica's share)
    for name, tiny in tiny_models.items():
        spec = ModelSpec.from_hf_config(json.loads((tiny.model_dir / "config.json").read_text()), global_batch=4,
                                        seq_len=SEQ_LEN, dtype_bytes=4)
        for text in LAYOUTS[name]:
            layout = parse_layout(text)  # every rank sends what the planner's formula says, to the byte
            train = dataclasses.replace(_train(), micro_batch_size=4 // layout.dp)
            if (name, layout.dp) not in references:
                references[(name, layout.dp)] = plain_transformers_losses(
                    tiny.model_dir, TokenDataset.open(tiny.dataset_dir), train)
            reference = references[(name, layout.dp)]
            per_layer = context_parallel_bytes_per_layer(spec, cp=layout.cp, kind=layout.cp_kind, tp=layout.tp,
                                                         micro_batch=4 // layout.dp)
            assert {results[(name, text, rank)]["sent"] for rank in range(4)} == {per_layer * spec.num_layers}
            torch.testing.assert_close(_replica_mean(results, name, text), reference, rtol=1e-5, atol=0,
                                       msg=f"{name} {text}")
            # sequence parallelism splits a CP rank's tokens over tp (dense models; an MoE model's MLPs take them whole)
            expected_length = SEQ_LEN // (layout.cp * (layout.tp if name != "mixtral" else 1))
            assert results[(name, text, 0)]["lengths"] == [expected_length], (name, text)


@pytest.mark.timeout(600)
def test_packed_documents_keep_their_attention_inside_each_document_across_the_group(tiny_model, tmp_path):
    from baige_ray.engines.factory import build_engine
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from tests.hf_helpers import SEQ_LEN

    llama = tiny_model("llama")
    packed = _packed_dataset(llama, tmp_path)
    layouts = ("cp=4", "cp=4,cpkind=ulysses")
    results = spawn_ranks(_train_layouts, 4, {"llama packed": (str(llama.model_dir), str(packed.directory), layouts)})
    alone = build_engine(TrainJob(model=HFModel(llama.model_dir, seq_len=SEQ_LEN), train=_train(),
                                  data=TokenDataset.open(packed.directory)), ParallelLayout())
    reference = [alone.train_step(step)["loss"] for step in range(STEPS)]
    for text in layouts:
        torch.testing.assert_close(_replica_mean(results, "llama packed", text), reference, rtol=1e-5, atol=0, msg=text)
    restarts = packed.positions(range(packed.num_sequences), 0)[:, 1:] == 0
    assert restarts.any(dim=1).float().mean() > 0.5  # documents really do share most sequences


def test_a_cp_job_left_with_fewer_workers_than_a_replica_goes_on_at_a_smaller_cp(tmp_path):
    from transformers import AutoModelForCausalLM

    from baige_ray import TrainConfig
    from baige_ray.elastic.sizing import layout_for, valid_sizes
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from tests.hf_helpers import llama_config

    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(tmp_path)
    # 24 tokens split into 2 x cp chunks for cp 4, 3, 2 and 1; cp=3 does not divide cp=4's group
    job = TrainJob(model=HFModel(tmp_path, seq_len=24), train=TrainConfig(num_steps=1, global_batch_size=4))
    cp4 = ParallelLayout(cp=4)
    assert valid_sizes(job, cp4, 1, 8) == (1, 2, 4, 8)
    assert layout_for(cp4, 8, job) == ParallelLayout(dp=2, cp=4)
    assert layout_for(cp4, 2, job) == ParallelLayout(cp=2)  # a worker lost of four: CP2 on two of the three
    assert layout_for(cp4, 1, job) == ParallelLayout()
    # with two replicas of CP2, one worker lost leaves one replica at the same CP
    assert valid_sizes(job, ParallelLayout(dp=2, cp=2), 1, 4) == (1, 2, 4)
    with pytest.raises(ValueError, match="expected a multiple of tp x pp x cp = 4"):
        layout_for(cp4, 6, job)


def test_the_memory_check_prices_a_rank_s_share_of_the_sequence():
    """Llama 3 8B at 32K on eight devices, FSDP2 over all of them: the same model states whatever the CP
    degree, and activations that fall with it (CP4 keeps a quarter of DP8's per rank, plus the one layer's
    gathered keys and values)."""
    from baige_ray import TrainConfig
    from baige_ray.planner.fits import device_bytes, layout_shape
    from baige_ray.planner.memory import context_parallel_working_bytes
    from baige_ray.planner.model_spec import load_model_spec

    llama = load_model_spec("llama-3-8b", global_batch=8, seq_len=32768)
    train = TrainConfig(num_steps=1, global_batch_size=8, micro_batch_size=1, precision="bf16-mixed")

    def priced(text: str):
        layout = parse_layout(text)
        shape = layout_shape(layout, train, layout.layers_per_stage(llama.num_layers), compute_dtype_bytes=2)
        assert shape.world_size == 8
        return device_bytes(llama, shape)

    (dp8_states, dp8_activations), (cp4_states, cp4_activations) = priced("dp=8,engine=fsdp2"), priced(
        "dp=2,cp=4,engine=fsdp2")
    assert cp4_states == pytest.approx(dp8_states)
    working = context_parallel_working_bytes(llama, 1, 1, 4)
    assert cp4_activations - working == pytest.approx(dp8_activations / 4)


def test_a_layout_refused_for_device_memory_names_the_cp_degree_that_fits_the_same_workers(tmp_path):
    """Llama 3 8B's published config at 8,192 tokens on eight 48 GB devices: DP8 under FSDP2 keeps 59 GB of
    activations a device; trading replicas for CP ranks, DP4xCP2 and DP2xCP4 still do not fit, CP8 does."""
    import shutil

    import safetensors.torch
    import yaml

    from baige_ray import TrainConfig
    from baige_ray.api.errors import LayoutMemoryError
    from baige_ray.catalog import cluster_descriptor, published_model
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.runtime import memory_check
    from baige_ray.topology.descriptor import descriptor_from_dict
    from baige_ray.topology.graph import ResourceGraph

    shutil.copy(published_model("llama-3-8b"), tmp_path / "config.json")
    safetensors.torch.save_file({"unread": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # only priced
    train = TrainConfig(num_steps=1, global_batch_size=8, micro_batch_size=1, precision="bf16-mixed")
    job = TrainJob(model=HFModel(tmp_path, seq_len=8192), train=train)
    descriptor = yaml.safe_load(cluster_descriptor("sim-2x4").read_text())
    descriptor["node_types"]["sim-a100-node"]["chip"]["memory_gb"] = 48
    graph = ResourceGraph.from_descriptor(descriptor_from_dict(descriptor))
    with pytest.raises(LayoutMemoryError, match=r"DP8 \(fsdp2\) of .* needs 89.2 GB per device.*; with context "
                       r"parallelism it fits on the same 8 workers: CP8 \(fsdp2, ring CP\) needs 37.8 GB"):
        memory_check._check(job, memory_check._model_spec(job), graph, parse_layout("dp=8,engine=fsdp2"), None, 0)


def test_a_sequence_may_be_as_long_as_the_model_s_positions_reach_with_its_rope_scaling(tmp_path):
    """The published YaRN Llama 2 (4,096 positions x 16) takes 65,536 tokens, Qwen2.5's YaRN recipe (32,768 x 4)
    131,072; one token more is refused before any worker starts, with the numbers."""
    import json
    import shutil

    import safetensors.torch

    from baige_ray.catalog import published_model
    from baige_ray.models.hf import HFModel

    safetensors.torch.save_file({"unread": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    shutil.copy(published_model("yarn-llama-2-13b-64k"), tmp_path / "config.json")
    assert HFModel(tmp_path, seq_len=65536).max_positions == 65536
    config = json.loads(published_model("qwen2.5-0.5b").read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert HFModel(tmp_path, seq_len=131072).max_positions == 131072
    with pytest.raises(ValueError, match=r"seq_len=131073 is invalid: expected at most the model's 131072 positions"):
        HFModel(tmp_path, seq_len=131073)
