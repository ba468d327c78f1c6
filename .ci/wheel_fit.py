"""A user's first job on a node that installed the wheel: a tiny Llama built the ordinary way with
transformers and tokenizers, trained by two workers for two steps on a simulated cluster found by name.

Run by .ci/check_wheel from a directory outside the repository, with the wheel's interpreter."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import baige_ray as br

work = Path("wheel-fit").resolve()
texts = []
for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:6]:  # some local text
    texts.append(work / "text" / (source.stem + ".txt"))
    texts[-1].parent.mkdir(parents=True, exist_ok=True)
    texts[-1].write_text(source.read_text(errors="replace"))

bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.train([str(path) for path in texts], trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"]))
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                                 eos_token="</s>")
config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "model")
tokenizer.save_pretrained(work / "model")

data = br.TokenDataset.build(texts, tokenizer=work / "model", seq_len=32, directory=work / "data")
with br.open_cluster("sim-2x4", log_to_driver=False):
    result = br.fit(br.HFModel(work / "model", seq_len=32), data=data,
                    train=br.TrainConfig(num_steps=2, global_batch_size=4),
                    scaling=br.ScalingConfig(num_workers=2),
                    run=br.RunConfig(name="wheel-fit", storage_path=work / "runs", show_progress=False))
assert result.num_workers == 2 and len(result.metrics) == 2 and math.isfinite(result.final_loss), result
print(f"wheel fit: 2 workers, 2 steps, final loss {result.final_loss:.4f}, checkpoint {result.checkpoint_path}")
