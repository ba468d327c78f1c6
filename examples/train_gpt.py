"""Train the reference GPT on a simulated 2-node x 4-GPU cluster, then sample from it.

Launch (what `make demo` runs):

    .venv/bin/python examples/train_gpt.py

With RAY_ADDRESS set (after `ray start --head --num-gpus=8`), the same script
trains on that cluster instead of simulating one. Options: --steps, --workers,
--cluster.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import baige_ray as br
from baige_ray.models.corpus import stdlib_corpus
from baige_ray.models.gpt import generate

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("def ", "import ", "class ")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", type=Path, default=REPO_ROOT / "clusters" / "sim-2x4.yaml")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--storage", type=Path, default=Path.home() / "baige_ray_results")
    return parser.parse_args()


def train(args: argparse.Namespace) -> br.Result:
    model = br.GPTConfig(seq_len=128, num_layers=4, num_heads=4, hidden=128)
    train_config = br.TrainConfig(
        num_steps=args.steps, global_batch_size=32, learning_rate=3e-3, min_learning_rate=3e-4, warmup_steps=10
    )
    with br.open_cluster(args.cluster) as session:
        where = "simulated from " + args.cluster.name if session.simulated else f"Ray at {session.address}"
        print(f"cluster: {where}; {args.workers} workers, {args.steps} steps")
        return br.fit(
            model,
            train=train_config,
            scaling=br.ScalingConfig(num_workers=args.workers),
            run=br.RunConfig(name="demo-gpt", storage_path=args.storage),
        )


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
    result = train(parse_args())
    report(result)
    sample(result)


if __name__ == "__main__":
    main()
