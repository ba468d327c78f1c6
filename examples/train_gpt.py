"""Train the reference GPT on a simulated 2-node x 4-GPU cluster, serve it from the same pool, sample it.

Launch (what `make demo-gpt` runs):

    .venv/bin/python examples/train_gpt.py

Training runs as an elastic job on 8 workers. At --serve-at steps it lends half
of its devices to inference (training goes on with 4 replicas, same global
batch), serves the model from training's in-memory weights over HTTP on
127.0.0.1, answers a few prompts while training continues beside it, then takes
the devices back. At the end it samples from the final, checksum-verified
checkpoint. With RAY_ADDRESS set (after `ray start --head --num-gpus=8`), the
same script runs on that cluster instead of simulating one. Options: --steps,
--workers, --serve-at, --port, --cluster.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

import torch

import baige_ray as br
from baige_ray.models.corpus import stdlib_corpus
from baige_ray.models.gpt import generate
from baige_ray.serving import serve, shutdown

PROMPTS = ("def ", "import ", "class ")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="sim-2x4", help="a descriptor's name or YAML path")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--serve-at", type=int, default=150, help="step at which inference borrows devices")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--storage", type=Path, default=Path.home() / "baige_ray_results")
    args = parser.parse_args()
    if not 0 < args.serve_at < args.steps or args.workers % 2:
        parser.error("--serve-at must lie inside the run and --workers must be even (half are lent)")
    return args


MODEL = br.GPTConfig(seq_len=128, num_layers=4, num_heads=4, hidden=128)


def train_and_serve(args: argparse.Namespace) -> br.Result:
    train_config = br.TrainConfig(
        num_steps=args.steps, global_batch_size=32, learning_rate=3e-3, min_learning_rate=3e-4, warmup_steps=10
    )
    with br.open_cluster(args.cluster) as session:
        where = "simulated from " + str(args.cluster) if session.simulated else f"Ray at {session.address}"
        print(f"cluster: {where}; {args.workers} workers, {args.steps} steps")
        job = br.launch(
            MODEL,
            train=train_config,
            scaling=br.ScalingConfig(num_workers=args.workers),
            run=br.RunConfig(name="demo-gpt", storage_path=args.storage, show_progress=False),
            elastic=br.ElasticConfig(min_workers=args.workers // 2),
        )
        try:
            wait_for_step(job, args.serve_at)
            lend_and_serve(job, args)
            return job.wait()
        except BaseException:
            job.kill()
            raise


def wait_for_step(job: br.TrainingJob, step: int) -> None:
    last_print = 0.0
    while (status := job.status())["step"] < step:
        if status["state"] in ("failed", "finished"):
            raise RuntimeError(f"training ended early: {status['state']}")
        if status["num_workers"] and time.monotonic() - last_print > 15:
            print(f"  training: step {status['step']}/{status['num_steps']} on {status['num_workers']} workers, "
                  f"{status['steps_per_s']:.1f} steps/s")
            last_print = time.monotonic()
        time.sleep(0.5)


def lend_and_serve(job: br.TrainingJob, args: argparse.Namespace) -> None:
    half = args.workers // 2
    job.resize(half, reason="lend to inference")
    info = serve(job.latest_model_state(), model_config=MODEL, name="demo-gpt", port=args.port)
    print(f"lent {half} devices: training continues on {half}; serving at {info.url} from in-memory weights")
    try:
        for seed, prompt in enumerate(PROMPTS):
            reply = ask(info.url, prompt, seed)
            text = (prompt + reply["text"]).replace("\n", "\n    | ")
            print(f"  HTTP answer (weights of step {reply['step']}, training now at step {job.status()['step']}):"
                  f"\n    | {text}\n")
    finally:
        shutdown(info)
    training = job.resize(args.workers, reason="reclaim from inference")
    status = job.status()
    if training == args.workers:
        print(f"reclaimed: training back on {training} workers at step {status['step']}")
    else:  # new workers start in the background; the run may end first
        print(f"reclaim pending: training {status['state']} on {training} workers at step {status['step']}")


def ask(url: str, prompt: str, seed: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_new_tokens": 80, "temperature": 0.7, "seed": seed}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/generate", data=body), timeout=120) as response:
        return json.loads(response.read())


def report(result: br.Result) -> None:
    nodes = sorted({worker.node_id[:8] for worker in result.workers})
    print(f"{result.num_workers} workers on {len(nodes)} nodes ({', '.join(nodes)}); {result.elapsed_s:.0f}s total")
    first, last = result.metrics[0], result.metrics[-1]
    drop = 100 * (first.loss - last.loss) / first.loss
    print(f"loss: step {first.step} {first.loss:.3f} -> step {last.step} {last.loss:.3f} ({drop:.0f}% lower)")
    for metrics in result.metrics[:: max(1, len(result.metrics) // 6)]:
        print(f"  step {metrics.step:4d}  loss {metrics.loss:.3f}  {metrics.tokens_per_s:8,.0f} tokens/s")
    print(f"checkpoint: {result.checkpoint_path}")


def sample(result: br.Result) -> None:
    model = br.load_model(result.checkpoint_path)
    corpus = stdlib_corpus()
    generator = torch.Generator().manual_seed(0)
    print("samples:")
    for prompt in PROMPTS:
        tokens = generate(model, corpus.encode(prompt)[None, :], 120, temperature=0.7, generator=generator)
        text = corpus.decode(tokens[0]).replace("\n", "\n    | ")
        print(f"    | {text}\n")


def main() -> None:
    result = train_and_serve(parse_args())
    report(result)
    sample(result)


if __name__ == "__main__":
    main()
