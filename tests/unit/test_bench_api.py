"""`bench api`'s pure parts: its requests cover the serving table's fields, answers are reduced the same
from a whole response and from its stream, and a comparison names what differs."""

from __future__ import annotations

import argparse

import pytest

from baige_ray.bench import api
from baige_ray.bench.api_cases import CHAT, COMPLETIONS, SEEDED, api_cases, compare, read_answer, read_stream
from baige_ray.serving.openai_api import COMPLETION_FIELDS, UNIMPLEMENTED
from baige_ray.serving.openai_chat import CHAT_FIELDS

# Fields no case sends: what the route does with them is refusal (tested by the serving tests), or
# structured output, which the built-in engine answers with a 400 (tests/ray/test_vllm_serving.py).
NOT_SENT = {field for field, _ in UNIMPLEMENTED} | {"structured_outputs", "response_format", "tools", "tool_choice",
                                                   "model"}


def test_the_cases_send_every_field_each_route_takes():
    cases = api_cases([5, 6, 7, 8, 9, 10])
    for route, fields in ((COMPLETIONS, COMPLETION_FIELDS), (CHAT, CHAT_FIELDS)):
        sent = {key for case in cases if case.route == route for key in case.body}
        assert set(fields) - NOT_SENT - sent == set(), route
    assert {case.kind for case in cases} == {"greedy", SEEDED}
    assert len({case.name for case in cases}) == len(cases)


def completion(text, finish="length", logprobs=None, index=0, usage=(3, 2)):
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    return {"choices": [choice], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                           "total_tokens": sum(usage)}}


def test_a_stream_and_a_whole_answer_reduce_to_the_same_answer():
    logprobs = {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0], "top_logprobs": [{"a": -0.5}, {"b": -1.0}]}
    whole = read_answer(200, completion("ab", logprobs=logprobs))
    chunks = [{"choices": [{"index": 0, "text": "a", "finish_reason": None,
                            "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}]}}]},
              {"choices": [{"index": 0, "text": "b", "finish_reason": "length",
                            "logprobs": {"tokens": ["b"], "token_logprobs": [-1.0], "top_logprobs": [{"b": -1.0}]}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
    assert compare(whole, read_stream(200, chunks), logprob_tolerance=0.0) == []
    chat_chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None}]},
                   {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]}]
    chat = read_answer(200, {"choices": [{"index": 0, "message": {"content": "ab"}, "finish_reason": "stop"}]})
    assert compare(chat, read_stream(200, chat_chunks), logprob_tolerance=0.0) == []


def test_a_comparison_names_the_text_the_finish_the_usage_and_log_probabilities_beyond_the_tolerance():
    logprobs = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5, "c": -2.0}]}
    reference = read_answer(200, completion("a", logprobs=logprobs))
    close = {**logprobs, "token_logprobs": [-0.5 + 5e-5]}
    assert compare(reference, read_answer(200, completion("a", logprobs=close)), logprob_tolerance=1e-4) == []
    far = {**logprobs, "top_logprobs": [{"a": -0.5, "c": -2.01}]}
    (problem,) = compare(reference, read_answer(200, completion("a", logprobs=far)), logprob_tolerance=1e-4)
    assert "differ by 1.00e-02" in problem
    other = read_answer(200, completion("b", finish="stop", logprobs=logprobs, usage=(3, 1)))
    problems = compare(reference, other, logprob_tolerance=1e-4)
    assert any("text 'b'" in p for p in problems) and any("finish_reason 'stop'" in p for p in problems)
    assert any(p.startswith("usage") for p in problems)
    assert compare(reference, read_answer(400, {"error": {"message": "too long"}}), logprob_tolerance=1)[0].startswith(
        "status 400 where the reference answered 200 (too long)")
    assert compare(read_answer(400, "bad"), read_answer(400, {"message": "also bad"}), logprob_tolerance=0) == []


def test_sampled_answers_need_only_agree_in_shape_with_the_reference():
    reference = read_answer(200, completion("xy", usage=(3, 2)))
    assert api._shape_problems(reference, read_answer(200, completion("zz", usage=(3, 2)))) == []
    assert api._shape_problems(reference, read_answer(200, completion("zz", usage=(4, 2)))) != []


@pytest.mark.parametrize("options, message", [({"max_tokens": 100}, "--max-tokens=100 is invalid"),
                                              ({"streams": [8, 0]}, r"--streams=\[8, 0\] is invalid"),
                                              ({"client_prompts": 0}, "--client-prompts=0 is invalid"),
                                              ({"rounds": 0}, "--rounds=0 is invalid")])
def test_options_out_of_range_are_refused_before_anything_starts(options, message):
    defaults = {"max_tokens": 16, "streams": [1, 8, 32], "client_prompts": 16, "start_timeout_s": 1.0, "work_dir": None,
                "rounds": 3}
    with pytest.raises(ValueError, match=message):
        api.run(argparse.Namespace(**{**defaults, **options}))


def test_the_client_summary_counts_every_backends_requests():
    runs = {"openai": {"num_prompts": 16, "completed": 16, "failed": 0},
            "openai-chat": {"num_prompts": 16, "completed": 16, "failed": 0}}
    summary = api.summarize_client({"vllm serve": runs, "serve(engine='builtin')": runs})
    assert summary["vllm_bench_serve_all_completed"]
    assert summary["vllm_bench_serve"]["serve(engine='builtin')"] == {"openai": "16 of 16", "openai-chat": "16 of 16"}
    failed = {**runs, "openai-chat": {"num_prompts": 16, "error": "exit 1"}}
    assert not api.summarize_client({"vllm serve": runs, "serve(engine='vllm')": failed})["vllm_bench_serve_all_completed"]


class ScriptedClient:
    """Answers each run with the rate its server has in the round it is in; records the order of the runs."""

    prompts = 4

    def __init__(self, rates: dict[str, list[float]]):
        self.rates, self.calls = rates, []

    def run(self, url, name, backend, prompts, streams):
        round_index = sum(1 for call in self.calls if call[0] == url and call[1] == streams)
        self.calls.append((url, streams, prompts))
        rate = self.rates[url][round_index]
        return {"num_prompts": prompts, "completed": prompts, "output_tokens_per_s": rate, "ttft_p50_ms": 1.0}


def test_throughput_rounds_reverse_the_servers_order_and_the_ratio_is_the_rounds_geometric_mean():
    from baige_ray.bench import api_throughput

    client = ScriptedClient({"peer": [100.0, 200.0], "ours": [50.0, 400.0], "proxy": [25.0, 100.0]})
    servers = {api_throughput.PEER: "peer", api.DIRECT: "ours", api.PROXIED: "proxy"}
    results = api_throughput.measure_rounds(client, servers, (8,), rounds=2)
    assert [call[0] for call in client.calls] == ["peer", "ours", "proxy", "proxy", "ours", "peer"]
    assert {call[2] for call in client.calls} == {4 * 4}  # the client's prompts per two streams
    summary = api.summarize_throughput(results)
    assert summary["throughput_ratio_by_streams"] == {"8": pytest.approx(1.0)}  # sqrt(0.5 * 2)
    assert summary["throughput_ratio_via_proxy_by_streams"] == {"8": pytest.approx((0.25 * 0.5) ** 0.5, abs=1e-3)}
    assert summary["vllm_http_throughput_ratio"] == pytest.approx(1.0)  # 8 streams alone measured: it is the lower
    assert summary["throughput_rounds"]["vllm serve"]["8"]["output_tokens_per_s"] == [100.0, 200.0]


def test_a_failed_run_leaves_its_round_out_of_the_ratio():
    from baige_ray.bench import api_throughput

    results = {api_throughput.PEER: {32: [{"output_tokens_per_s": 100.0}, {"error": "exit 1"}]},
               api.DIRECT: {32: [{"output_tokens_per_s": 90.0}, {"output_tokens_per_s": 10.0}]}}
    assert api_throughput.ratio_by_streams(results, api.DIRECT) == {32: pytest.approx(0.9)}
    assert api_throughput.headline({1: 0.1, 8: 0.95, 32: 0.92}) == 0.92 and api_throughput.headline({1: 0.5}) is None