"""Train a small Llama-architecture Hugging Face model on a simulated 2-node x 4-GPU cluster, then serve it.

Launch:

    .venv/bin/python examples/train_llama.py

Nothing is downloaded: a byte-level BPE tokenizer is trained on local text (Python standard
library sources), a Llama config (RMSNorm, RoPE, grouped-query attention, SwiGLU) is saved as a
Hugging Face directory, and the text is tokenized into a packed, memory-mapped TokenDataset. The
model then trains as an elastic job (DP2 x TP2 on 4 workers by default), its final checkpoint is a
Hugging Face directory (`AutoModelForCausalLM.from_pretrained` loads it), and `serve()` hosts it on
127.0.0.1 with the OpenAI-compatible /v1/completions route. With RAY_ADDRESS set the same script runs
on that cluster (the work directory must then be on storage every node sees). Options: --steps,
--workers, --layout, --port, --workdir, --cluster.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

import baige_ray as br
from baige_ray.models.hf.tiny import make_llama_tiny
from baige_ray.parallel.layout import parse_layout
from baige_ray.serving import serve, shutdown

PROMPTS = ("def ", "import os\n", "class Parser")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="sim-2x4", help="a descriptor's name or YAML path")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--layout", default="dp=2,tp=2", help="'ddp', 'auto' or degrees, e.g. dp=2,tp=2")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workdir", type=Path, default=Path.home() / "baige_ray_results" / "llama-demo")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(f"tokenizer, model and dataset in {args.workdir} (trained and tokenized locally)")
    model, dataset = make_llama_tiny(args.workdir)
    print(f"model: {model.architecture}, {model.config['num_hidden_layers']} layers, hidden "
          f"{model.config['hidden_size']}, vocab {model.vocab_size}; data: {dataset.num_sequences} sequences of "
          f"{dataset.seq_len} tokens")
    train = br.TrainConfig(num_steps=args.steps, global_batch_size=16, learning_rate=3e-3, min_learning_rate=3e-4,
                           warmup_steps=10)
    with br.open_cluster(args.cluster):
        job = br.launch(model, data=dataset, train=train, scaling=br.ScalingConfig(num_workers=args.workers),
                        run=br.RunConfig(name="llama-demo", storage_path=args.workdir / "runs"),
                        elastic=br.ElasticConfig(num_spares=0), layout=parse_layout(args.layout))
        result = job.wait()
        first, last = result.metrics[0], result.metrics[-1]
        print(f"trained {result.layout} on {result.num_workers} workers in {result.elapsed_s:.0f}s: "
              f"loss {first.loss:.3f} -> {last.loss:.3f}")
        print(f"Hugging Face checkpoint: {result.checkpoint_path}")
        info = serve(result.checkpoint_path, name="llama-tiny", port=args.port)
        try:
            for prompt in PROMPTS:
                reply = complete(info.url, prompt)
                text = (prompt + reply["choices"][0]["text"]).replace("\n", "\n    | ")
                print(f"    | {text}\n    ({reply['usage']['completion_tokens']} tokens, "
                      f"{reply['choices'][0]['finish_reason']})")
        finally:
            shutdown(info)


def complete(url: str, prompt: str) -> dict:
    body = json.dumps({"model": "llama-tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0.7,
                       "seed": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    main()
