"""Supervised fine-tuning on conversations against TRL's SFTTrainer, fully and with a LoRA adapter.

Made here: a Llama (`--hidden-size`, `--num-layers`) with a tokenizer trained on local text that holds
Llama 3's chat tokens and a Llama 3 template with generation markers (the form TRL's `assistant_only_loss`
needs), and `--conversations` conversations of one to four exchanges, replies of 2 to 80 words.
`ConversationDataset` renders them, trains the replies only and packs them by best-fit decreasing.

* baige-ray: `fit` with one worker (both cores) and with two, fully and with `peft.LoraConfig(r=16)` on
  every attention and MLP projection; then `launch` of the LoRA job on two workers, one of them SIGKILLed
  in its backward (fail point "backward"): `steps_lost`.
* TRL: `SFTTrainer` in a fresh process, and in two under torchrun (DDP over gloo, one thread each as
  baige-ray's two workers), on the same model directory and the very sequences of each step, in the same order (its sampler made sequential, the rows handed over tokenized, with the same trained
  tokens as labels and the same document lengths: `padding_free`, so its attention stays in each
  conversation too), the same optimizer (AdamW, betas 0.9 / 0.95, no weight decay), constant learning
  rate, clipping at 1.0, gradient accumulation and precision (fp32, no gradient checkpointing: TRL's
  defaults are bf16 autocast and recomputation, which baige-ray's run does not do); its loss is normalised by the step's trained tokens
  (`num_items_in_batch`), as baige-ray's. The losses of every step are compared.

Trained tokens per second are over the steps after the first (each system's own step clock: StepMetrics'
`step_time_s`, TRL's time between `on_step_end` callbacks). Peak memory is the peak resident memory of
baige-ray's worker and of TRL's (first) process (bench/sft_trl.py).
`adapter_to_serving_s`: a LoRA job gated after two steps serves its adapter from memory (`serve(adapters=...)`);
after two more steps, the seconds `reload_adapter` takes to put its newer adapter into the running replica
(copied from the job's memory, swapped between two decode steps), which TRL, writing a checkpoint for a
server to load, has no counterpart for.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from baige_ray.bench.measure import free_port, report_stage

CHAT_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template, with TRL's generation markers around each reply and its end-of-turn token.
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
WORDS = ("add subtract numbers list sum product first last each value result total count order sort reverse "
         "print return answer because therefore then when while until every none some many few").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smaller model, 5 steps")
    parser.add_argument("--no-peer", action="store_true", help="leave TRL out")
    parser.add_argument("--work-dir", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.steps, args.hidden_size, args.num_layers, args.conversations = 5, 128, 2, 200
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-sft-"))
    model_dir = make_chat_model(work, args.hidden_size, args.num_layers)
    data = build_conversations(work, model_dir, args)
    runs: dict[str, dict] = {}
    stages = ["baige-ray full, 1 worker", "baige-ray full, 2 workers", "baige-ray LoRA, 1 worker",
              "baige-ray LoRA, 2 workers", "baige-ray LoRA, 2 workers, one SIGKILLed",
              "a training job's newer adapter into serving", "TRL full, 1 process", "TRL full, 2 processes",
              "TRL LoRA, 1 process", "TRL LoRA, 2 processes"]
    for index, (name, workers, adapter) in enumerate((("full_1", 1, False), ("full_2", 2, False),
                                                      ("lora_1", 1, True), ("lora_2", 2, True))):
        report_stage(args, stages[index], index, len(stages))
        runs[name] = baige_run(args, model_dir, data, work, name, workers, adapter)
    report_stage(args, stages[4], 4, len(stages))
    steps_lost = baige_fault_run(args, model_dir, data, work)
    report_stage(args, stages[5], 5, len(stages))
    swap_s = adapter_to_serving_seconds(args, model_dir, data, work)
    if not args.no_peer:
        peers = (("trl_full", False, 1), ("trl_full_2", False, 2), ("trl_lora", True, 1), ("trl_lora_2", True, 2))
        for index, (name, adapter, processes) in enumerate(peers, start=6):
            report_stage(args, stages[index], index, len(stages))
            runs[name] = trl_run(args, model_dir, data, work, adapter, processes)
    return summary(runs, data, steps_lost, swap_s)


def make_chat_model(work: Path, hidden: int, layers: int) -> Path:
    """A fresh Llama whose directory holds a tokenizer trained here, with Llama 3's chat tokens and template."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from baige_ray.models.hf.tiny import write_text_documents
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer

    files = write_text_documents(work / "text", max_bytes=256 * 1024)
    tokenizer = load_tokenizer(train_bpe_tokenizer(files, work / "tokenizer", vocab_size=1024))
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tokenizer.chat_template = MARKED_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=hidden // 32,
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model_dir = work / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def build_conversations(work: Path, model_dir: Path, args: argparse.Namespace):
    from baige_ray.models.conversation_dataset import ConversationDataset

    rng = random.Random(0)
    path = work / "conversations.jsonl"
    with path.open("w") as rows:
        for _ in range(args.conversations):
            messages = []
            for _ in range(rng.randint(1, 4)):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 20)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 80)))})
            rows.write(json.dumps({"messages": messages}) + "\n")
    return ConversationDataset.build(path, tokenizer=model_dir, seq_len=args.seq_len, directory=work / "data",
                                     overwrite=True)


def train_config(args: argparse.Namespace):
    from baige_ray.api.configs import TrainConfig

    return TrainConfig(num_steps=args.steps, global_batch_size=args.global_batch_size,
                       micro_batch_size=args.micro_batch_size, learning_rate=args.learning_rate,
                       min_learning_rate=args.learning_rate, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)


def lora_config(args: argparse.Namespace):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def step_trained_tokens(data, args: argparse.Namespace) -> list[int]:
    batch = args.global_batch_size
    return [data.trained_tokens(range(step * batch, (step + 1) * batch), 0) for step in range(args.steps)]


def baige_run(args, model_dir: Path, data, work: Path, name: str, workers: int, adapter: bool) -> dict[str, Any]:
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.fit import fit
    from baige_ray.models.hf import HFModel

    result = fit(HFModel(model_dir, seq_len=args.seq_len), data=data, train=train_config(args),
                 scaling=ScalingConfig(num_workers=workers, accelerator="cpu", cpus_per_worker=2 / workers),
                 run=RunConfig(name=f"bench-sft-{name}", storage_path=work / "runs", show_progress=False),
                 adapter=lora_config(args) if adapter else None)
    return _figures([m.loss for m in result.metrics], [m.step_time_s for m in result.metrics],
                    step_trained_tokens(data, args), max(m.peak_host_memory_gb for m in result.metrics))


def baige_fault_run(args, model_dir: Path, data, work: Path) -> int:
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.api.elastic import ElasticConfig
    from baige_ray.elastic.faults import FaultPlan
    from baige_ray.jobs.launch import launch
    from baige_ray.models.hf import HFModel

    crash_step = max(1, args.steps // 2)
    job = launch(HFModel(model_dir, seq_len=args.seq_len), data=data, train=train_config(args),
                 adapter=lora_config(args),
                 scaling=ScalingConfig(num_workers=2, accelerator="cpu", cpus_per_worker=0.5),
                 run=RunConfig(name="bench-sft-fault", storage_path=work / "runs", show_progress=False),
                 elastic=ElasticConfig(num_spares=1), faults=FaultPlan().crash(rank=1, step=crash_step, at="backward"))
    result = job.wait()
    if len(result.recoveries) != 1 or [m.step for m in result.metrics] != list(range(args.steps)):
        raise RuntimeError(f"expected every step and one recovery, saw {result.recoveries}")
    return int(result.recoveries[0]["lost_steps"])


def adapter_to_serving_seconds(args, model_dir: Path, data, work: Path) -> float:
    """Seconds from `reload_adapter` to a running replica serving a LoRA job's newer adapter."""
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.launch import launch
    from baige_ray.models.hf import HFModel
    from baige_ray.serving import reload_adapter, serve, shutdown

    job = launch(HFModel(model_dir, seq_len=args.seq_len), data=data, train=train_config(args), adapter=lora_config(args),
                 scaling=ScalingConfig(num_workers=1, accelerator="cpu", cpus_per_worker=1),
                 run=RunConfig(name="bench-sft-serving", storage_path=work / "runs", show_progress=False),
                 steps_allowed=2)
    info = None
    try:
        job.wait_for_snapshot(2, timeout_s=300)
        info = serve(model_dir, name="bench-sft", port=free_port(), adapters={"sft": job})
        job.allow_steps(4)
        job.wait_for_snapshot(4, timeout_s=300)
        began = time.perf_counter()
        reload_adapter(info, "sft", job)
        return round(time.perf_counter() - began, 3)
    finally:
        job.kill()
        if info is not None:
            shutdown(info)


def trl_run(args, model_dir: Path, data, work: Path, adapter: bool, processes: int) -> dict[str, Any]:
    """SFTTrainer on the sequences baige-ray trains, step by step in its order, in `processes` fresh processes."""
    from baige_ray.bench.sft_trl import run_trl

    settings = dict(steps=args.steps, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                    learning_rate=args.learning_rate, lora_rank=args.lora_rank)
    done = run_trl(work, model_dir, trl_rows(data, args), settings, processes=processes, adapter=adapter)
    return _figures(done["losses"], done["step_times"], step_trained_tokens(data, args), done["peak_memory_gb"])


def trl_rows(data, args: argparse.Namespace) -> list[dict]:
    """Each of baige-ray's sequences of every step, in order, as SFTTrainer takes tokenized rows: the tokens
    (seq_len + 1: transformers shifts the labels itself), labels -100 where baige-ray trains nothing, and
    the lengths of the conversations packed in it (padding one of its own)."""
    import numpy as np

    from baige_ray.models.conversation_dataset import POSITIONS_FILE, TOKENS_FILE, TRAINED_FILE

    rows = []
    count = args.steps * args.global_batch_size
    for sequence in data.sequence_ids(range(count), 0):
        tokens = data.stored(TOKENS_FILE)[sequence].astype(np.int64)
        trained = data.stored(TRAINED_FILE)[sequence].astype(bool)
        positions = data.stored(POSITIONS_FILE)[sequence]
        starts = list(np.flatnonzero(positions == 0)) + [len(tokens)]
        rows.append({"input_ids": tokens.tolist(), "labels": np.where(trained, tokens, -100).tolist(),
                     "seq_lengths": [int(b - a) for a, b in zip(starts, starts[1:])]})
    return rows


def _figures(losses: list[float], step_times: list[float], trained: list[int], peak_gb: float | None) -> dict[str, Any]:
    steady = slice(1, None)  # the first step builds what later ones reuse
    tokens_per_s = sum(trained[steady]) / sum(step_times[steady]) if len(step_times) > 1 else None
    return {"losses": [round(loss, 5) for loss in losses], "step_time_s": [round(t, 3) for t in step_times],
            "trained_tokens_per_s": round(tokens_per_s, 1) if tokens_per_s else None,
            "peak_memory_gb": None if peak_gb is None else round(peak_gb, 3)}


def summary(runs: dict[str, dict], data, steps_lost: int, adapter_to_serving_s: float | None) -> dict[str, Any]:
    result: dict[str, Any] = {"padding_fraction": round(data.padding_fraction, 4), "steps_lost": steps_lost,
                              "adapter_to_serving_s": adapter_to_serving_s,
                              "lora_peak_memory_vs_full": round(runs["lora_1"]["peak_memory_gb"]
                                                                / runs["full_1"]["peak_memory_gb"], 3)}
    if "trl_full" in runs:
        result["full_tokens_per_s_vs_trl"] = _ratio(runs["full_1"], runs["trl_full"])
        result["lora_tokens_per_s_vs_trl"] = _ratio(runs["lora_1"], runs["trl_lora"])
        if "trl_full_2" in runs:  # two workers against TRL in two processes (torchrun, DDP)
            result["full_2_tokens_per_s_vs_trl"] = _ratio(runs["full_2"], runs["trl_full_2"])
            result["lora_2_tokens_per_s_vs_trl"] = _ratio(runs["lora_2"], runs["trl_lora_2"])
        result["loss_max_rel_diff_vs_trl"] = max(_max_rel_diff(runs["full_1"]["losses"], runs["trl_full"]["losses"]),
                                                 _max_rel_diff(runs["lora_1"]["losses"], runs["trl_lora"]["losses"]))
    result["runs"] = runs
    return result


def _ratio(ours: dict, peer: dict) -> float | None:
    if not ours["trained_tokens_per_s"] or not peer["trained_tokens_per_s"]:
        return None
    return round(ours["trained_tokens_per_s"] / peer["trained_tokens_per_s"], 3)


def _max_rel_diff(ours: list[float], peer: list[float]) -> float:
    if len(ours) != len(peer):
        raise RuntimeError(f"{len(ours)} losses against TRL's {len(peer)}")
    return round(max(abs(a - b) / abs(b) for a, b in zip(ours, peer)), 6)


def summarize(result: dict[str, Any]) -> str:
    lines = ["run        trained tok/s   peak GB   first -> last loss"]
    for name, row in result["runs"].items():
        peak = "-" if row["peak_memory_gb"] is None else f"{row['peak_memory_gb']:.2f}"
        lines.append(f"{name:<10} {row['trained_tokens_per_s'] or 0:>13.0f} {peak:>9}   "
                     f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}")
    for key in ("full_tokens_per_s_vs_trl", "lora_tokens_per_s_vs_trl", "full_2_tokens_per_s_vs_trl",
                "lora_2_tokens_per_s_vs_trl", "loss_max_rel_diff_vs_trl",
                "lora_peak_memory_vs_full", "steps_lost", "padding_fraction", "adapter_to_serving_s"):
        if key in result:
            lines.append(f"{key}: {result[key]}")
    return "\n".join(lines)
