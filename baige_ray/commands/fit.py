"""`baige-ray fit`: train a Hugging Face model on local data, or the reference GPT, from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("fit", help="train a Hugging Face model (--model DIR --data FILES) or the reference GPT")
    parser.add_argument("--cluster", help="the cluster to simulate when RAY_ADDRESS is unset: a descriptor's name "
                                             "(sim-2x4, ...) or YAML path")
    parser.add_argument("--workers", type=int, default=2, help="number of worker actors")
    parser.add_argument(
        "--layout",
        default="ddp",
        help="'ddp', 'auto' (the planner decides), or degrees like dp=2,tp=2,pp=2,engine=fsdp2 "
        "(engine: ddp, fsdp2, zero1, zero2, zero3)",
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", type=Path, help="a local Hugging Face model directory (default: the reference GPT)")
    parser.add_argument("--data", nargs="+", help="text / JSON lines / Parquet files or globs to tokenize (with --model)")
    parser.add_argument("--data-dir", type=Path, help="where the tokenized dataset goes (default: STORAGE/NAME/data)")
    parser.add_argument("--layers", type=int, default=4, help="GPT only")
    parser.add_argument("--hidden", type=int, default=128, help="GPT only")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--name", default="cli-run")
    parser.add_argument("--storage", type=Path, default=Path.home() / "baige_ray_results")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import baige_ray as br
    from baige_ray.parallel.layout import parse_layout

    model, data = _model_and_data(args)
    train = br.TrainConfig(num_steps=args.steps, global_batch_size=args.global_batch, learning_rate=args.lr,
                           min_learning_rate=args.lr / 10)
    layout = parse_layout(args.layout)
    scaling = br.ScalingConfig(num_workers=args.workers)
    run = br.RunConfig(name=args.name, storage_path=args.storage)
    with br.open_cluster(args.cluster):
        result = br.fit(model, data=data, train=train, scaling=scaling, run=run, layout=layout)
    print(f"layout {result.layout} on {result.num_workers} workers")
    print(f"final loss {result.final_loss:.4f} after {args.steps} steps in {result.elapsed_s:.1f}s")
    print(f"checkpoint: {result.checkpoint_path}")
    return 0


def _model_and_data(args: argparse.Namespace):
    import baige_ray as br

    if args.model is None:
        if args.data:
            raise ValueError("--data is invalid without --model: the reference GPT trains on its own corpus")
        return br.GPTConfig(num_layers=args.layers, hidden=args.hidden, seq_len=args.seq_len), None
    if not args.data:
        raise ValueError("--model needs --data: the text to train it on")
    model = br.HFModel(args.model, seq_len=args.seq_len)
    directory = args.data_dir or args.storage / args.name / "data"
    tokenizer = model.tokenizer if model.tokenizer is not None else args.model
    return model, br.TokenDataset.build(args.data, tokenizer=tokenizer, seq_len=args.seq_len, directory=directory)
