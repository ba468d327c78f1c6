"""LoRA adapters through peft: only the adapter trains (and is snapshotted and exported), every layout
adapters run in trains as one process does, and the export is a PEFT adapter directory that
`peft.PeftModel.from_pretrained` loads and that scores, in transformers, the loss training reported (and
merged into the base, the logits peft gives)."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn_ranks

SEQ_LEN = 128
NUM_STEPS = 3


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from tests.hf_helpers import build_chat_data

    tiny, _, dataset = build_chat_data(tmp_path_factory.mktemp("lora"), count=32, seq_len=SEQ_LEN)
    return tiny.model_dir, dataset


def job(model_dir, dataset, micro_batch_size=None):
    from baige_ray import TrainConfig
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel

    train = TrainConfig(num_steps=NUM_STEPS + 1, global_batch_size=4, micro_batch_size=micro_batch_size,
                        learning_rate=1e-2, warmup_steps=0, seed=2)
    return TrainJob(model=HFModel(model_dir, seq_len=SEQ_LEN), train=train, data=dataset, adapter=lora())


def _two_ranks(rank: int, port: int, results, model_dir, dataset) -> None:
    import os

    from baige_ray.engines.factory import build_engine
    from baige_ray.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    layouts = {"dp2": ParallelLayout(dp=2), "fsdp2": ParallelLayout(dp=2, data_parallel="fsdp2"),
               "pp2": ParallelLayout(pp=2, num_microbatches=2), "zero2": ParallelLayout(dp=2, data_parallel="zero2")}
    for name, layout in layouts.items():
        engine = build_engine(job(model_dir, dataset), layout, rank)
        results[(name, rank)] = [engine.train_step(step)["loss"] for step in range(NUM_STEPS)]
    # ZeRO-3 partitions the frozen base too; its state (the adapter's alone) moves into a fresh engine, which
    # takes the last step as the first engine does
    zero3 = ParallelLayout(dp=2, data_parallel="zero3")
    engine = build_engine(job(model_dir, dataset), zero3, rank)
    losses = [engine.train_step(step)["loss"] for step in range(NUM_STEPS - 1)]
    state = [engine.export_state()]
    dist.broadcast_object_list(state, src=0)
    assert state[0]["model"] and all(".lora_" in name for name in state[0]["model"])
    moved = build_engine(job(model_dir, dataset), zero3, rank)
    moved.import_state(state[0])
    losses.append(moved.train_step(NUM_STEPS - 1)["loss"])
    assert losses[-1] == engine.train_step(NUM_STEPS - 1)["loss"]
    assert moved.train_step(NUM_STEPS)["loss"] == engine.train_step(NUM_STEPS)["loss"]  # the Adam moments moved too
    results[("zero3", rank)] = losses
    dist.destroy_process_group()


def test_only_the_adapter_trains_and_its_export_scores_the_reported_loss_in_peft(chat_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from baige_ray.engines.factory import build_engine
    from baige_ray.models.adapters import merge_adapter
    from baige_ray.parallel.layout import ParallelLayout

    model_dir, dataset = chat_data
    engine = build_engine(job(model_dir, dataset), ParallelLayout())
    frozen = {n: p.detach().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
    losses = [engine.train_step(step)["loss"] for step in range(NUM_STEPS)]
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in engine.module.named_parameters() if not p.requires_grad)
    state = engine.export_state()
    assert state["model"] and all(".lora_" in name for name in state["model"])
    assert state["optimizer"].keys() == state["model"].keys()

    weights = engine.export_weights()
    directory = engine.job.save_final(tmp_path / "final", weights, step=NUM_STEPS)
    reported = engine.train_step(NUM_STEPS)["loss"]  # computed with the exported weights, before its update
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, directory).eval()
    inputs, targets = dataset.batch(range(NUM_STEPS * 4, (NUM_STEPS + 1) * 4), seed=2)
    positions = dataset.positions(range(NUM_STEPS * 4, (NUM_STEPS + 1) * 4), seed=2)
    with torch.no_grad():
        logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    scored = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)
    assert float(scored) == pytest.approx(reported, rel=1e-5)

    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(directory, tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        merged_logits = merged(input_ids=inputs, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(merged_logits, logits, rtol=1e-4, atol=1e-5)


def test_adapters_train_as_one_process_with_accumulation_ddp_fsdp2_zero_and_pipeline_parallelism(chat_data):
    from baige_ray.engines.factory import build_engine
    from baige_ray.parallel.layout import ParallelLayout

    model_dir, dataset = chat_data
    engine = build_engine(job(model_dir, dataset), ParallelLayout())
    reference = [engine.train_step(step)["loss"] for step in range(NUM_STEPS)]
    accumulated = build_engine(job(model_dir, dataset, micro_batch_size=1), ParallelLayout())
    runs = {"accumulation 4": [accumulated.train_step(step)["loss"] for step in range(NUM_STEPS)]}
    ranks = spawn_ranks(_two_ranks, 2, model_dir, dataset)
    for data_parallel in ("dp2", "fsdp2", "zero2", "zero3"):
        runs[data_parallel] = [sum(pair) / 2 for pair in zip(ranks[(data_parallel, 0)], ranks[(data_parallel, 1)])]
    runs["pp2"] = ranks[("pp2", 1)]
    for name, losses in runs.items():
        assert losses == pytest.approx(reference, rel=1e-5), name


def test_layouts_and_configs_adapters_cannot_train_are_refused(chat_data):
    from peft import LoraConfig

    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.adapters import check_adapter_layout
    from baige_ray.parallel.layout import ParallelLayout

    model_dir, dataset = chat_data
    with pytest.raises(ValueError, match="TP2.*expected tp=1 and ep=1"):
        check_adapter_layout(ParallelLayout(tp=2))
    with pytest.raises(ValueError, match="expected a peft.LoraConfig"):
        TrainJob(model=job(model_dir, dataset).model, train=job(model_dir, dataset).train, adapter={"r": 4})
    from baige_ray.jobs.launch import launch

    with pytest.raises(ValueError, match="layout='auto' is invalid with adapter="):
        launch(job(model_dir, dataset).model, train=job(model_dir, dataset).train, layout="auto", adapter=lora())
    with pytest.raises(ValueError, match="LoraConfig.bias='all' is invalid"):
        TrainJob(model=job(model_dir, dataset).model, train=job(model_dir, dataset).train,
                 adapter=LoraConfig(r=4, target_modules=["q_proj"], bias="all"))
