"""What calibration times as a model's layer: the model's own blocks, built without the rest of it."""

from __future__ import annotations

import pytest
import torch

from baige_ray.jobs.calibrate import CalibrationRequest
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.hf import HFModel
from baige_ray.models.plugin import plugin_for
from tests.hf_helpers import llama_config, qwen2_tied_config

GPT = GPTConfig(vocab_size=512, seq_len=16, num_layers=4, num_heads=4, hidden=64)
LLAMA = HFModel.from_config(llama_config(), seq_len=16)
QWEN2_TIED = HFModel.from_config(qwen2_tied_config(), seq_len=16)  # QKV biases, a head tied to the embedding


@pytest.mark.parametrize("config", [GPT, LLAMA, QWEN2_TIED], ids=["gpt", "llama", "qwen2-tied"])
def test_probe_layers_are_the_models_own_blocks_and_nothing_else(config):
    plugin = plugin_for(config)
    stage = plugin.build_probe_layers(2, torch.device("cpu"))
    blocks = plugin.stage_blocks(stage)
    assert len(blocks) == 2
    block_params = sum(p.numel() for block in blocks for p in block.parameters())
    assert sum(p.numel() for p in stage.parameters()) == block_params  # no embedding, head or final norm
    full = plugin.build_model()
    assert block_params == 2 * sum(p.numel() for p in plugin.stage_blocks(
        plugin.build_stage(full, 0, 1, is_first=False, is_last=False))[0].parameters())
    hidden = torch.randn(2, 16, plugin.model_spec(global_batch=2, dtype_bytes=4).hidden, requires_grad=True)
    out = stage(hidden)
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in stage.parameters())


def test_probe_layers_never_exceed_the_models_depth():
    plugin = plugin_for(GPT)
    assert len(plugin.stage_blocks(plugin.build_probe_layers(9, torch.device("cpu")))) == GPT.num_layers


def test_a_calibration_request_refuses_configs_of_models_it_does_not_measure():
    spec = plugin_for(GPT).model_spec(global_batch=2, dtype_bytes=4)
    assert CalibrationRequest(models=(spec,), model_configs={spec.name: GPT}).model_configs[spec.name] is GPT
    with pytest.raises(ValueError, match=r"CalibrationRequest.model_configs=\['other'\]"):
        CalibrationRequest(models=(spec,), model_configs={"other": GPT})


LIBRARIES_SCRIPT = """
import sys
from baige_ray.models.hf import HFModel
from baige_ray.runtime.calibration_probes import library_probe
from tests.hf_helpers import llama_config

modeling = "transformers.models.llama.modeling_llama"
library_probe([], tensor_parallel=False, deepspeed=False, device="cpu")
assert "torch._dynamo" in sys.modules and "deepspeed" not in sys.modules and modeling not in sys.modules
assert library_probe([HFModel.from_config(llama_config(), seq_len=16)], tensor_parallel=True, deepspeed=True,
                     device="cpu") > 0
assert {"torch.distributed.tensor.parallel", "deepspeed", modeling} <= set(sys.modules)
import gc
assert gc.get_freeze_count() > 100_000  # the imports' objects: a full collection no longer scans them
"""


def test_the_library_probe_imports_what_the_later_probes_use_and_nothing_else():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", LIBRARIES_SCRIPT], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
