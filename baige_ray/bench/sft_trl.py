"""bench sft's peer: TRL's SFTTrainer in a process of its own, or in two under torchrun (DDP over gloo).

The parent hands a spec file over: the model directory, the rows (each of baige-ray's sequences of every
step, in order: tokens, labels -100 where baige-ray trains nothing, the lengths of the conversations
packed in it) and the step settings. The trainer takes the rows in that order (its sampler sequential;
under torchrun accelerate gives process i the micro-batches i, i + 2, ..., so each optimizer step still
trains the step's sequences). Rank 0 writes the losses, each step's time (from one step's end to the
next's) and its peak resident memory as JSON.

    python -m baige_ray.bench.sft_trl SPEC.json            # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m baige_ray.bench.sft_trl SPEC.json
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BETAS = (0.9, 0.95)  # baige-ray's AdamW (engines/train_job.py build_optimizer)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_trl(work: Path, model_dir: Path, rows: list[dict], settings: dict[str, Any], *, processes: int,
            adapter: bool, timeout_s: float = 1800) -> dict[str, Any]:
    """TRL's run on `rows` in `processes` fresh processes: {"losses", "step_times", "peak_memory_gb"}.
    `settings`: steps, global_batch_size, micro_batch_size, learning_rate, lora_rank."""
    name = f"trl-{'lora' if adapter else 'full'}-{processes}"
    spec = {"model_dir": str(model_dir), "rows": rows, "settings": settings, "adapter": adapter,
            "processes": processes, "output_dir": str(work / name), "result": str(work / f"{name}.json")}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "baige_ray.bench.sft_trl", str(spec_path)]
    if processes > 1:
        command[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m",
                        "baige_ray.bench.sft_trl"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"TRL ({name}) failed with exit code {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(Path(spec["result"]).read_text())


def train(spec: dict[str, Any]) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    settings, processes = spec["settings"], spec["processes"]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.config.use_cache = False  # training: with a cache transformers ignores packed positions
    micro = settings["micro_batch_size"]
    config = SFTConfig(output_dir=spec["output_dir"], max_steps=settings["steps"], per_device_train_batch_size=micro,
                       gradient_accumulation_steps=settings["global_batch_size"] // (micro * processes),
                       learning_rate=settings["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
                       weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1], max_grad_norm=1.0,
                       padding_free=True, max_length=None, logging_steps=1, save_strategy="no", report_to=[],
                       dataloader_num_workers=0, seed=0, use_cpu=True, disable_tqdm=True,
                       ddp_backend="gloo" if processes > 1 else None,
                       # fp32 and no recomputation, as baige-ray trains here (TRL's defaults are bf16 autocast and
                       # gradient checkpointing: 20x slower on this CPU, and not the same arithmetic)
                       bf16=False, gradient_checkpointing=False)
    lora = (LoraConfig(r=settings["lora_rank"], lora_alpha=2 * settings["lora_rank"], lora_dropout=0.0,
                       target_modules=LORA_TARGETS) if spec["adapter"] else None)
    clock = step_clock()
    trainer = sequential_sft_trainer()(model=model, args=config, train_dataset=Dataset.from_list(spec["rows"]),
                                       processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
                                       peft_config=lora, callbacks=[clock])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
        Path(spec["result"]).write_text(json.dumps({"losses": losses, "step_times": clock.step_times,
                                                    "peak_memory_gb": peak_gb}))


def sequential_sft_trainer():
    """SFTTrainer taking the rows in the order given: they are baige-ray's steps already, in its order."""
    import torch
    from trl import SFTTrainer

    class SequentialSFTTrainer(SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return SequentialSFTTrainer


def step_clock():
    """A TrainerCallback that times each optimizer step, from one step's end to the next's."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.step_times, self._last = [], time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.step_times:
                self._last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_times.append(now - self._last)
            self._last = now

    return StepClock()


if __name__ == "__main__":
    train(json.loads(Path(sys.argv[1]).read_text()))
