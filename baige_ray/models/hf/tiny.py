"""A small Llama-architecture model made on this machine: a tokenizer trained on local text, a config, a dataset.

For the demo and `baige-ray bench overhead --model llama-tiny`: nothing is downloaded. The text is a
few hundred KB of the Python standard library's sources, copied as plain-text documents.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from baige_ray.models.corpus import stdlib_source_files

LLAMA_TINY = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False}


def write_text_documents(directory: Path, *, max_bytes: int = 512 * 1024) -> list[Path]:
    """Standard-library sources as .txt documents (one per file) until `max_bytes`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for source in stdlib_source_files():
        target = directory / (str(source.relative_to(root)).replace("/", "__") + ".txt")
        text = source.read_text(errors="replace")
        target.write_text(text)
        files.append(target)
        total += len(text)
        if total >= max_bytes:
            break
    return files


def make_llama_tiny(directory: Path, *, seq_len: int = 128, vocab_size: int = 1024, seed: int = 0,
                    text_bytes: int = 512 * 1024, shape: dict | None = None, name: str = "llama-tiny"):
    """(HFModel, TokenDataset): a saved tiny Llama with its own tokenizer, and its training data.
    `shape` overrides LLAMA_TINY's LlamaConfig sizes (the model is then saved under `name`)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from baige_ray.models.hf.model import HFModel
    from baige_ray.models.token_dataset import TokenDataset
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer

    directory = Path(directory)
    files = write_text_documents(directory / "text", max_bytes=text_bytes)
    tokenizer_dir = train_bpe_tokenizer(files, directory / "tokenizer", vocab_size=vocab_size)
    tokenizer = load_tokenizer(tokenizer_dir)
    model_dir = directory / name
    if not (model_dir / "config.json").is_file():
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, **{**LLAMA_TINY, **(shape or {})})
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    dataset = TokenDataset.build(files, tokenizer=tokenizer_dir, seq_len=seq_len, directory=directory / "data")
    return HFModel(model_dir, seq_len=seq_len), dataset
