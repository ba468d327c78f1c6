"""Fail points: a crash planned inside a step's phase kills the process there, with SIGKILL, and only there."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from baige_ray.elastic.faults import Fault, FaultKind, FaultPlan
from baige_ray.failpoints import BACKWARD, SAMPLING, arm_fail_point, disarm_fail_points, fail_point

# Generates twice with the built-in engine: unarmed, then with "sampling" armed (a rollout engine dying mid-batch).
SAMPLER = """
import torch
from baige_ray.failpoints import SAMPLING, arm_fail_point
from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import GPTDecoder
from baige_ray.serving.causal_lm_generation import SamplingParams
from baige_ray.serving.engine import ContinuousBatchingEngine, generate_all

torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=32, num_layers=1, num_heads=2, hidden=16)).eval()
def generate():
    engine = ContinuousBatchingEngine(GPTDecoder(model), eos_token_id=None)
    return generate_all(engine, [[1, 2, 3]] * 4, [SamplingParams(max_new_tokens=5, temperature=0.0)] * 4)
print("unarmed", sum(len(g.tokens) for g in generate()), flush=True)
arm_fail_point(SAMPLING)
print("armed", generate(), flush=True)
"""


def test_an_armed_sampling_point_kills_the_process_inside_its_first_decode_step():
    done = subprocess.run([sys.executable, "-c", SAMPLER], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.splitlines() == ["unarmed 20"]  # 4 rows x 5 tokens unarmed; the armed run never returned


def test_disarming_reports_the_points_never_reached():
    arm_fail_point(BACKWARD)
    fail_point(SAMPLING)  # not armed: passes
    assert disarm_fail_points() == [BACKWARD]
    assert disarm_fail_points() == []
    fail_point(BACKWARD)  # disarmed: passes


def test_a_crash_takes_a_known_place_and_only_a_steps_crash_has_one():
    assert FaultPlan().crash(rank=1, step=3, at="backward").faults == [Fault(FaultKind.CRASH, 1, 3, at="backward")]
    with pytest.raises(ValueError, match="Fault.at='forward'.*sampling, backward"):
        Fault(FaultKind.CRASH, 0, 1, at="forward")
    with pytest.raises(ValueError, match="Fault.at='sampling' is invalid for a hang fault"):
        Fault(FaultKind.HANG, 0, 1, at="sampling")
    with pytest.raises(ValueError, match="while regrouping"):
        Fault(FaultKind.CRASH, 0, 1, regrouping=True, at="backward")
    with pytest.raises(ValueError, match="fail point 'forward' is unknown"):
        arm_fail_point("forward")
