"""What a vLLM engine serving LoRA adapters is built for (serving/vllm_adapters.py): the smallest rank vLLM
takes that holds every adapter the application starts with, and a later adapter of a larger rank refused
with the rank the engine has. Serving through vLLM itself: tests/ray/test_vllm_serving.py."""

import json

import pytest

from baige_ray.serving.vllm_adapters import LoRASlots, VLLMAdapters, lora_slots


def adapter_dir(root, name: str, r: int, rank_pattern: dict | None = None):
    directory = root / name
    directory.mkdir()
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": rank_pattern or {}}))
    return str(directory)


def test_the_engine_is_built_for_the_largest_rank_rounded_up_to_one_vllm_takes(tmp_path):
    small, wide = adapter_dir(tmp_path, "small", 4), adapter_dir(tmp_path, "wide", 8, {"q_proj": 24})
    assert lora_slots({"small": small}) == LoRASlots(max_rank=16, max_loras=2)
    assert lora_slots({"small": small, "wide": wide}) == LoRASlots(max_rank=32, max_loras=4)
    assert lora_slots({"small": small}).engine_args() == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2}
    with pytest.raises(ValueError, match="largest LoRA rank is 512"):
        lora_slots({"huge": adapter_dir(tmp_path, "huge", 1024)})
    with pytest.raises(ValueError, match="LoRASlots.max_rank=12"):
        LoRASlots(max_rank=12, max_loras=1)


def test_a_directory_adapter_is_read_where_it_lies_and_a_larger_rank_is_refused(tmp_path):
    served = VLLMAdapters(LoRASlots(max_rank=16, max_loras=2))
    small = adapter_dir(tmp_path, "small", 4)
    first = served.prepare("tuned", small)
    served.add("tuned", first)
    again = served.prepare("tuned", small)
    served.add("tuned", again)
    assert (first.lora_path, again.lora_path) == (small, small) and first.lora_int_id != again.lora_int_id
    assert served.request_for("tuned") == again
    with pytest.raises(ValueError, match="rank 32: this vLLM engine was built for ranks up to 16"):
        served.prepare("wide", adapter_dir(tmp_path, "wide", 32))
    with pytest.raises(ValueError, match="'other' is not served"):
        served.request_for("other")
    served.close()
