"""bench scale's serving part without Ray or vLLM: the summary's ratios. The measurement itself (serve and
vllm.LLM on a tiny Qwen2, about 50 s) is run by hand, not here."""

import pytest

from baige_ray.bench.scale_serve import EngineSettings, Load, summary


def test_the_ratio_is_served_over_direct_tokens_per_s_at_the_most_streams():
    def level(tokens_per_s):
        return {"tokens_per_s": tokens_per_s}

    served = {"load_s": 40.0, "levels": {"1": level(9.0), "8": level(30.0)}}
    direct = {"load_s": 25.0, "levels": {"1": level(10.0), "8": level(40.0)}}
    settings = EngineSettings(model="m", dtype="float32", max_model_len=128, max_num_seqs=32, kv_cache_gib=1)
    result = summary(served, direct, Load(), settings)
    assert result["vllm_vs_direct"] == 0.75
    assert result["vllm_vs_direct_by_streams"] == {"1": 0.9, "8": 0.75}
    assert (result["serve_load_s"], result["direct_load_s"]) == (40.0, 25.0)
    assert result["engine"]["dtype"] == "float32" and result["load"]["streams"] == (1, 8)
    assert summary(served, {**direct, "levels": {"1": level(0.0), "8": level(0.0)}}, Load(), settings)["vllm_vs_direct"] is None
    with pytest.raises(KeyError):  # a level the direct run did not measure is an error, not a silent gap
        summary(served, {**direct, "levels": {"1": level(10.0)}}, Load(), settings)
