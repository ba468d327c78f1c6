"""A real model size: Qwen2.5-0.5B's published config trained by `fit` on 2 workers against plain torchrun.

The model is built from `examples/models/qwen2.5-0.5b.json` (494M parameters, tied embeddings, 24
layers, hidden 896, 14 heads with 2 KV heads, vocabulary 151,936) with fresh weights, saved once with
`save_pretrained` under `--work-dir`; its data is a TokenDataset of standard-library text tokenized by a
BPE tokenizer trained here (the model's vocabulary stays the config's). Per layout (FSDP2, DeepSpeed
ZeRO-3; bf16 mixed precision by default), on the same 2 cores (or on a GPU host one worker per GPU,
`--workers` to choose, NCCL, memory read as the peak allocated on the device), one after the other:

- `torchrun`: bench/torchrun_sharded.py, the same model, wrapping, data and mathematics in a plain loop;
- `baige`: `fit(HFModel(dir), layout=ParallelLayout(dp=2, data_parallel=...))` on a local Ray.

Both start their processes with the same host allocator settings (`--host-allocator`, fit's default
"cached" unless told otherwise), so the ratio compares the frameworks, not glibc's treatment of freed memory.

Reported per layout, over `--rounds` rounds whose order alternates (ABBA, as the overhead bench does): the
median steady step time of each (the first `--warmup` steps of a run left out), and `vs_torchrun`, the
geometric mean of the rounds' ratios; each worker's peak resident memory against the planner's memory model for
that layout (`memory_error`, relative; read from a short run with glibc's own allocator, since the cached one
also holds freed blocks, reported beside it); and the memory model's verdict on DDP x2 for this host (the
check `fit` runs before any worker starts, planner/fits.py). The headline keys are the worst layout's.

Then, per layout in `--elastic-layouts` (FSDP2 by default), the model as an elastic job (`launch`) with
sharded snapshots in node shared memory, a sharded checkpoint every `--persist-every` steps, and one
worker SIGKILLed mid-step (bench/scale_faults.py): the snapshot stall as a fraction of the step
(`stall_frac`), the snapshots' bytes, detection and recovery time, steps redone (`steps_lost`), the loss
curve against fit's fault-free run, and the checkpoint's throughput, written by both ranks beside
training, against a plain sequential write of as many bytes to the same disk (`persist_vs_write`);
`--kill-step -1` runs without the kill. Last, fit's exported directory served by
`serve(..., engine="vllm")` against `vllm.LLM` (bench/scale_serve.py).

A headline key that a stage left unmeasured (skipped, or failed: its error is in the JSON) is null and
named in `unmeasured`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baige_ray.api.configs import HOST_ALLOCATORS
from baige_ray.bench.measure import report_stage, steady_median
from baige_ray.bench.scale_faults import measure_elastic
from baige_ray.bench.scale_serve import measure_vllm
from baige_ray.catalog import published_model
from baige_ray.engines.host_allocator import allocator_env_vars

if TYPE_CHECKING:
    from baige_ray.topology.graph import ResourceGraph

CONFIG = published_model("qwen2.5-0.5b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one round of 5 steps per system (1 warm-up)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=2)
    parser.add_argument("--layouts", default="fsdp2,zero3", help="comma-separated: fsdp2, zero3")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of torchrun and fit, alternating their order")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"])
    parser.add_argument("--elastic-layouts", default="fsdp2",
                        help="comma-separated layouts also run as an elastic job with a worker killed, e.g. fsdp2")
    parser.add_argument("--persist-every", type=int, default=3,
                        help="the elastic job persists a sharded checkpoint after every this many steps")
    parser.add_argument("--kill-step", type=int, default=4,
                        help="the step in whose middle a worker is killed (-1: none, snapshots only)")
    parser.add_argument("--no-serve", dest="serve", action="store_false",
                        help="skip serving fit's export with vLLM against vllm.LLM")
    parser.add_argument("--serve-tokens", type=int, default=32,
                        help="max_tokens of each request when fit's export is served with vLLM (scale_serve.py)")
    parser.add_argument("--serve-requests", type=int, default=3,
                        help="requests per stream at 1 and at 8 streams, served and with vllm.LLM")
    parser.add_argument("--workers", type=int, default=0,
                        help="workers of fit and processes of torchrun (0: one per GPU on a GPU host, else 2)")
    parser.add_argument("--host-allocator", default="cached", choices=HOST_ALLOCATORS,
                        help="the host allocator of fit's workers and of torchrun's ranks alike "
                             "(engines/host_allocator.py)")
    parser.add_argument("--memory-steps", type=int, default=4,
                        help="steps of one more fit run with glibc's own allocator, whose peak resident memory is "
                             "compared with the memory model (0: compare the timed runs' peak)")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "baige-bench-scale"))


def prepare(work_dir: Path, seq_len: int) -> tuple[Path, Path]:
    """(model directory, dataset directory), built once and reused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from baige_ray.models.hf.tiny import write_text_documents
    from baige_ray.models.token_dataset import METADATA_FILE, TokenDataset
    from baige_ray.models.tokenizer import train_bpe_tokenizer

    work_dir.mkdir(parents=True, exist_ok=True)
    files = sorted((work_dir / "text").glob("*.txt")) or write_text_documents(work_dir / "text", max_bytes=2 << 20)
    tokenizer_dir = work_dir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_bpe_tokenizer(files, tokenizer_dir, vocab_size=8192)
    model_dir = work_dir / "qwen2.5-0.5b"
    if not (model_dir / "config.json").is_file():
        config = AutoConfig.from_pretrained(CONFIG)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    data_dir = work_dir / f"data-{seq_len}"
    if not (data_dir / METADATA_FILE).is_file():
        TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=seq_len, directory=data_dir)
    return model_dir, data_dir


def on_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def this_host(workers: int) -> ResourceGraph:
    """This machine as one node: `workers` of its GPUs, or on a CPU host `workers` CPU devices that share
    its memory (the host is the device), as `launch` prices CPU workers on a one-machine cluster."""
    from baige_ray.topology.local_host import local_host_graph

    if not on_gpus():
        return local_host_graph(workers)
    import torch

    properties = torch.cuda.get_device_properties(0)
    return local_host_graph(workers, chip={"model": properties.name, "memory_gb": properties.total_memory / 1e9},
                            accelerator="cuda")


def _job(model_dir: Path, data_dir: Path, data_parallel: str, args):
    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.train_job import TrainJob
    from baige_ray.models.hf import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.parallel.layout import ParallelLayout

    dataset = TokenDataset.open(data_dir)
    train = TrainConfig(num_steps=args.steps, global_batch_size=args.global_batch_size, seed=0,
                        precision=args.precision)
    layout = ParallelLayout(dp=args.workers, data_parallel=data_parallel)
    model = HFModel(model_dir, seq_len=dataset.seq_len, tokenizer=model_dir.parent / "tokenizer")
    return TrainJob(model=model, train=train, data=dataset), layout


def memory_verdict(model_dir: Path, data_dir: Path, data_parallel: str, args,
                   snapshot_slots: int = 0) -> dict[str, Any]:
    """The memory model's bytes per worker for this layout, and its verdict on this host (fits.py): as
    `fit` runs it, or with `snapshot_slots` > 0 as an elastic job keeping that many snapshots."""
    from baige_ray.api.errors import LayoutMemoryError
    from baige_ray.planner.fits import WORKER_PROCESS_BYTES, check_fits, device_bytes, layout_shape
    from baige_ray.planner.replicas import host_copies
    from baige_ray.runtime.memory_check import STATE_DTYPE_BYTES

    job, layout = _job(model_dir, data_dir, data_parallel, args)
    spec = job.plugin.model_spec(global_batch=job.train.global_batch_size, dtype_bytes=STATE_DTYPE_BYTES)
    shape = layout_shape(layout, job.train, job.plugin.layers_per_stage(layout),
                         compute_dtype_bytes=job.train.compute_dtype_bytes)
    states, activations = device_bytes(spec, shape)
    copies = host_copies([0] * layout.world_size, ["0"] * layout.world_size, num_spares=0, replicate=False,
                         sharded=layout.snapshots_are_sharded, snapshot_slots=snapshot_slots)
    try:
        check_fits(spec, this_host(layout.world_size), shape, copies=copies)
        verdict = "fits"
    except LayoutMemoryError as refusal:
        verdict = str(refusal)
    # a GPU worker's allocated device memory is what it computes with; a CPU worker's resident memory
    # holds the process itself too
    process = 0 if on_gpus() else WORKER_PROCESS_BYTES
    return {"predicted_bytes": float((states + activations).max()) + process, "verdict": verdict}


def _torchrun(settings, out: Path, workers: int, host_allocator: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
               "-m", "baige_ray.bench.torchrun_sharded", "--settings", settings.to_json(), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **allocator_env_vars(host_allocator)}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if completed.returncode != 0:
        raise RuntimeError(f"torchrun baseline exited with {completed.returncode}\n{completed.stderr[-4000:]}")
    return json.loads(out.read_text())


def _baige(model_dir: Path, data_dir: Path, data_parallel: str, args, storage: Path) -> dict:
    from baige_ray.api.configs import RunConfig, ScalingConfig
    from baige_ray.jobs.fit import fit

    job, layout = _job(model_dir, data_dir, data_parallel, args)
    accelerator = "gpu" if on_gpus() else "cpu"
    result = fit(job.model, data=job.data, train=job.train,
                 scaling=ScalingConfig(num_workers=args.workers, accelerator=accelerator,
                                       host_allocator=args.host_allocator),
                 run=RunConfig(name=f"scale-{data_parallel}", storage_path=storage, show_progress=False), layout=layout)
    return {"step_times_s": [m.step_time_s for m in result.metrics], "losses": [m.loss for m in result.metrics],
            "peak_host_memory_bytes": max(m.peak_host_memory_gb for m in result.metrics) * 1e9,
            "peak_device_memory_bytes": max(m.peak_device_memory_gb for m in result.metrics) * 1e9,
            "export_dir": str(result.checkpoint_path) if result.checkpoint_path else None}


def _baige_in_fresh_ray(model_dir: Path, data_dir: Path, data_parallel: str, args, tmp: Path) -> dict:
    import ray

    ray.init(address="local", num_cpus=None if on_gpus() else 2, logging_level="WARNING", include_dashboard=False)
    try:
        return _baige(model_dir, data_dir, data_parallel, args, tmp)
    finally:
        ray.shutdown()


def measure_layout(data_parallel: str, model_dir: Path, data_dir: Path, args, tmp: Path) -> dict[str, Any]:
    """`args.rounds` rounds of torchrun and fit; odd rounds run fit first (ABBA), so a drift of the
    machine's speed that is linear over a pair of rounds weighs on both alike."""
    from baige_ray.bench.torchrun_sharded import ShardedSettings

    settings = ShardedSettings(model_dir=str(model_dir), dataset_dir=str(data_dir), seq_len=args.seq_len,
                               data_parallel=data_parallel, num_steps=args.steps,
                               global_batch_size=args.global_batch_size, precision=args.precision)
    rounds = []
    for index in range(args.rounds):
        systems = {"torchrun": lambda: _torchrun(settings, tmp / f"torchrun-{data_parallel}.json", args.workers,
                                                       args.host_allocator),
                   "baige": lambda: _baige_in_fresh_ray(model_dir, data_dir, data_parallel, args, tmp)}
        order = ["torchrun", "baige"] if index % 2 == 0 else ["baige", "torchrun"]
        rounds.append({name: systems[name]() for name in order})
    plain, baige = rounds[0]["torchrun"], rounds[0]["baige"]
    ratios = [steady_median(r["baige"]["step_times_s"], args.warmup)
              / steady_median(r["torchrun"]["step_times_s"], args.warmup) for r in rounds]
    predicted = memory_verdict(model_dir, data_dir, data_parallel, args)["predicted_bytes"]
    peak_key = "peak_device_memory_bytes" if on_gpus() else "peak_host_memory_bytes"
    baige_peak = max(r["baige"][peak_key] for r in rounds)
    # The cached allocator holds freed blocks too (given back under host memory pressure): the memory
    # model prices what is live, which a run with glibc's own allocator shows.
    live_peak = baige_peak
    if args.memory_steps > 0 and args.host_allocator != "system" and not on_gpus():
        system = argparse.Namespace(**{**vars(args), "steps": args.memory_steps, "host_allocator": "system"})
        live_peak = _baige_in_fresh_ray(model_dir, data_dir, data_parallel, system, tmp)[peak_key]
    return {
        "torchrun_step_s": round(steady_median([t for r in rounds for t in r["torchrun"]["step_times_s"][args.warmup:]], 0), 3),
        "baige_step_s": round(steady_median([t for r in rounds for t in r["baige"]["step_times_s"][args.warmup:]], 0), 3),
        "vs_torchrun": round(math.prod(ratios) ** (1 / len(ratios)), 4),
        "rounds": [round(ratio, 4) for ratio in ratios],
        "torchrun_losses": [round(x, 4) for x in plain["losses"]], "baige_losses": [round(x, 4) for x in baige["losses"]],
        "baige_peak_gb": round(baige_peak / 1e9, 3),
        "system_allocator_peak_gb": round(live_peak / 1e9, 3),
        "torchrun_peak_gb": round(max(max(r["torchrun"][peak_key]) for r in rounds) / 1e9, 3),
        "memory": "allocated on the GPU" if on_gpus() else "resident on the host",
        "predicted_gb": round(predicted / 1e9, 3),
        "memory_error": round(abs(live_peak - predicted) / predicted, 4),
        "export_dir": rounds[-1]["baige"]["export_dir"],  # fit's final Hugging Face directory
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.steps, args.warmup, args.rounds = 5, 1, 1
    args.kill_step = min(args.kill_step, args.steps - 2)  # a step to kill in and one after it (-1: none)
    args.workers = args.workers or (_gpu_count() if on_gpus() else 2)
    model_dir, data_dir = prepare(Path(args.work_dir), args.seq_len)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    # The elastic stage kills one worker of two on CPU slots (scale_faults.py)
    elastic_layouts = [name.strip() for name in args.elastic_layouts.split(",") if name.strip() and not on_gpus()]
    ddp = memory_verdict(model_dir, data_dir, "ddp", args)
    # What launch's memory check says before any actor starts, snapshots counted.
    elastic_verdicts = {f"{name} x{args.workers}, {slots} snapshot slot(s)": memory_verdict(model_dir, data_dir, name, args,
                                                                               snapshot_slots=slots)["verdict"]
                        for name in ("ddp", "fsdp2", "zero3") for slots in (2, 1)}
    serving = None
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for index, name in enumerate(layouts):
            report_stage(args, "fit against torchrun, layout by layout", index, len(layouts))
            results[name] = measure_layout(name, model_dir, data_dir, args, Path(tmp))
        for index, name in enumerate(elastic_layouts):
            report_stage(args, "elastic runs with a worker killed", index, len(elastic_layouts))
            reference = results[name]["baige_losses"] if name in results else []
            job, layout = _job(model_dir, data_dir, name, args)
            try:
                elastic = measure_elastic(job, layout, args, Path(tmp), reference)
            except Exception as error:  # the other stages' figures stand; this one says why it has none
                elastic = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            results.setdefault(name, {})["elastic"] = elastic
        exports = [r["export_dir"] for r in results.values() if r.get("export_dir")]
        if args.serve and exports:
            report_stage(args, "serving the export with vLLM", 0, 1)
            serving = measure_vllm(Path(exports[0]), args, Path(tmp))
    timed = [r for r in results.values() if "vs_torchrun" in r]
    elastic = [r["elastic"] for r in results.values() if "elastic" in r]
    headline = {
        "vs_torchrun": _worst(timed, "vs_torchrun"), "memory_error": _worst(timed, "memory_error"),
        "stall_frac": _worst(elastic, "stall_frac"), "steps_lost": _worst(elastic, "steps_lost"),
        "recovery_s": _worst(elastic, "recovery_s"), "detection_s": _worst(elastic, "detection_s"),
        "persist_vs_write": _least(elastic, "persist_vs_write"),
        "vllm_vs_direct": serving["vllm_vs_direct"] if serving else None,
    }
    return {
        "benchmark": "scale", "model": "qwen2.5-0.5b", "workers": args.workers,
        "device": _device_name(), "seq_len": args.seq_len,
        "global_batch_size": args.global_batch_size, "precision": args.precision, "steps": args.steps,
        "host_allocator": args.host_allocator,
        "layouts": results, "serving": serving,
        "ddp_predicted_gb": round(ddp["predicted_bytes"] / 1e9, 3), "ddp_verdict": ddp["verdict"],
        "elastic_verdicts": elastic_verdicts, **headline,
        "unmeasured": [key for key, value in headline.items() if value is None],
    }


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if on_gpus() else "cpu"


def _least(measured: list[dict], key: str):
    values = [m[key] for m in measured if m.get(key) is not None]
    return min(values) if values else None


def _worst(measured: list[dict], key: str):
    values = [m[key] for m in measured if m.get(key) is not None]
    return max(values) if values else None


def summarize(result: dict[str, Any]) -> str:
    lines = ["layout  torchrun_s  baige_s  vs_torchrun  peak_gb  predicted_gb  memory_error"]
    for name, r in ((n, r) for n, r in result["layouts"].items() if "vs_torchrun" in r):
        lines.append(f"{name:<7} {r['torchrun_step_s']:>10.2f} {r['baige_step_s']:>8.2f} {r['vs_torchrun']:>12.3f} "
                     f"{r['baige_peak_gb']:>8.2f} {r['predicted_gb']:>13.2f} {r['memory_error']:>13.3f}")
    lines.append(f"DDP x{result['workers']}: {result['ddp_predicted_gb']:.2f} GB per worker predicted; {result['ddp_verdict']}")
    for name, verdict in result["elastic_verdicts"].items():
        lines.append(f"launch {name}: {verdict}")
    for name, r in result["layouts"].items():
        if "elastic" in r and "error" in r["elastic"]:
            lines.append(f"{name} elastic: {r['elastic']['error']}")
        elif "elastic" in r:
            e = r["elastic"]
            lines.append(f"{name} elastic: stall {e['stall_frac']} of a step, snapshots {e['snapshot_host_gb']} GB, "
                         f"killed in step {e['killed_step']}: detected in {e['detection_s']} s, recovered in "
                         f"{e['recovery_s']} s, {e['steps_lost']} step(s) redone, loss max |diff| "
                         f"{e['loss_max_abs_diff']} vs fit")
            if e.get("persist_vs_write") is not None:
                lines.append(f"{name} persistence: {e['persisted_gb']} GB in {e['persist_s']} s by 2 ranks beside "
                             f"training ({e['persist_gbps']} GB/s) vs a plain write in {e['write_s']} s "
                             f"({e['write_gbps']} GB/s): {e['persist_vs_write']}x")
    if result["serving"]:
        v = result["serving"]
        lines.append(f"vLLM: serve() loads in {v['serve_load_s']} s, vllm.LLM in {v['direct_load_s']} s; tokens/s "
                     f"served {v['serve_tokens_per_s']} vs direct {v['direct_tokens_per_s']}: "
                     f"vllm_vs_direct {v['vllm_vs_direct']}")
    return "\n".join(lines)
