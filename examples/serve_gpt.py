"""Train the reference GPT briefly, serve it over HTTP while training continues, and ask it for text.

Launch:

    .venv/bin/python examples/serve_gpt.py

On the simulated 2-node x 4-GPU cluster: training starts on 6 (fake) GPUs; after --warmup-steps the
model is served from training's in-memory weights (no checkpoint on disk) on one more GPU, a few
prompts are answered over HTTP at 127.0.0.1, then a device is lent from training to serving and
taken back, each new replica starting with training's newest weights. With --checkpoint DIR it
serves a checkpoint written by `fit` / `examples/train_gpt.py` instead, without training.
With RAY_ADDRESS set the same script runs on that cluster. Options: --port, --warmup-steps.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

import baige_ray as br
from baige_ray.api.elastic import ElasticConfig
from baige_ray.jobs.launch import launch
from baige_ray.serving import reload_weights, scale_replicas, serve, shutdown

PROMPTS = ("def ", "import ", "class ")
MODEL = br.GPTConfig(seq_len=128, num_layers=4, num_heads=4, hidden=128)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="sim-2x4", help="a descriptor's name or YAML path")
    parser.add_argument("--checkpoint", type=Path, default=None, help="serve this checkpoint instead of training")
    parser.add_argument("--warmup-steps", type=int, default=150, help="steps trained before serving starts")
    parser.add_argument("--port", type=int, default=8000)
    return parser.parse_args()


def ask(url: str, prompt: str, seed: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_new_tokens": 80, "temperature": 0.7, "seed": seed}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body), timeout=120) as response:
        return json.loads(response.read())


def show_answers(url: str, label: str) -> None:
    print(f"{label}:")
    for seed, prompt in enumerate(PROMPTS):
        reply = ask(url, prompt, seed)
        text = (prompt + reply["text"]).replace("\n", "\n    | ")
        print(f"  weights of step {reply['step']}, {reply['latency_s'] * 1000:.0f} ms:\n    | {text}\n")


def wait_for_step(job, step: int) -> dict:
    while (status := job.status())["step"] < step:
        if status["state"] in ("failed", "finished"):
            raise RuntimeError(f"training ended early: {status['state']}")
        time.sleep(1.0)
    return status


def serve_while_training(args: argparse.Namespace) -> None:
    job = launch(MODEL, train=br.TrainConfig(num_steps=100_000, global_batch_size=48, learning_rate=3e-3,
                                              min_learning_rate=3e-4, warmup_steps=10),
                 scaling=br.ScalingConfig(num_workers=6), run=br.RunConfig(name="serve-demo"),
                 elastic=ElasticConfig(min_workers=4, max_workers=6))
    status = wait_for_step(job, args.warmup_steps)
    print(f"training: step {status['step']} on {status['num_workers']} workers ({status['layout']})")
    info = serve(job.latest_model_state(), model_config=MODEL, name="gpt", port=args.port)
    print(f"serving at {info.url} (POST /generate, GET /health)")
    try:
        show_answers(info.url, "while training continues")
        trained = job.resize(4, reason="lend to inference")
        reload_weights(info, job.latest_model_state(), model_config=MODEL)
        scale_replicas(info, 3)
        print(f"lent 2 devices: training on {trained}, serving on 3 replicas with the newest weights")
        show_answers(info.url, "after lending")
        scale_replicas(info, 1)
        trained = job.resize(6, reason="reclaim from inference")
        print(f"reclaimed: training on {trained} workers at step {job.status()['step']}, serving on 1 replica")
    finally:
        shutdown(info)
        job.stop()


def serve_checkpoint(args: argparse.Namespace) -> None:
    info = serve(args.checkpoint, name="gpt", port=args.port)
    print(f"serving {args.checkpoint} at {info.url}")
    try:
        show_answers(info.url, "from the checkpoint")
    finally:
        shutdown(info)


def main() -> None:
    args = parse_args()
    with br.open_cluster(args.cluster):
        serve_checkpoint(args) if args.checkpoint else serve_while_training(args)


if __name__ == "__main__":
    main()
