"""`baige-ray calibrate [--cluster X.yaml] [--model M ...] [--json]`: measure the cluster the planner prices.

Connects to RAY_ADDRESS (a cluster from `ray start` / `ray up`), or starts the simulated cluster of
`--cluster`, runs the probes of runtime/calibrate.py in one worker actor per device, keeps the
result per graph fingerprint and shows it. Run again, it shows what it kept without measuring;
`--refresh` measures anew. `baige-ray plan` and `fit(layout="auto")` price with what it kept."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="measure compute, links and overlap for the planner")
    parser.add_argument("--cluster", default=None, help="a hardware descriptor's name (sim-2x4, ...) or YAML path: simulate it "
                                                        "when RAY_ADDRESS is not set; name the hardware when it is")
    parser.add_argument("--model", action="append", default=[],
                        help="model whose layer shapes to measure (repeatable): a shipped name (llama-3-8b, ...), a model "
                             "YAML or a Hugging Face config.json")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step, for a config.json")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence, for a config.json")
    parser.add_argument("--refresh", action="store_true", help="measure again even if a calibration is kept")
    parser.add_argument("--json", action="store_true", help="print the calibration as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from baige_ray.jobs.calibrate import CalibrationRequest, calibrate
    from baige_ray.planner.model_spec import load_model_spec
    from baige_ray.runtime.auto_plan import live_graph
    from baige_ray.runtime.calibration_store import cache_path
    from baige_ray.runtime.progress import StageProgress
    from baige_ray.topology.connect import open_cluster

    models = tuple(load_model_spec(path, global_batch=args.global_batch, seq_len=args.seq_len) for path in args.model)
    with open_cluster(args.cluster, log_to_driver=False) as session:
        graph = live_graph(session.descriptor)
        if graph.num_devices == 0:
            print("baige-ray calibrate: the cluster's resource graph has no accelerators: the node probes found "
                  "none (no NVML / sysfs devices) and no simulated node advertises a descriptor's resources. Run it "
                  "where the GPUs are, or on a cluster `open_cluster(DESCRIPTOR)` or `baige-ray calibrate --cluster "
                  "DESCRIPTOR` starts", file=sys.stderr)
            return 2
        with StageProgress("calibrate", enabled=not args.json) as progress:
            calibration = calibrate(graph, CalibrationRequest(models=models), refresh=args.refresh, progress=progress)
    if args.json:
        print(json.dumps(json.loads(calibration.to_json())))
    else:
        print(describe(calibration, str(cache_path(calibration.fingerprint))))
    return 0


def describe(calibration, path: str) -> str:
    from baige_ray.planner.calibration import zero_stage_of

    lines = [f"calibration {calibration.fingerprint} ({calibration.backend}), kept in {path}",
             f"  measured in {sum(calibration.seconds.values()):.1f} s: " + ", ".join(calibration.measured_terms()),
             "  where the time went: " + ", ".join(f"{phase} {seconds:.1f} s"
                                                   for phase, seconds in calibration.seconds.items())]
    for fit in sorted(calibration.links.values(), key=lambda f: f.tier):
        kinds = ", ".join(f"{kind} {k.latency_s * 1e6:.0f} us {k.bandwidth / 1e9:.2f} GB/s"
                          for kind, k in sorted(fit.kinds.items()))
        lines.append(f"  {fit.tier_name:<10} {kinds} (fit error {fit.rms_rel_error:.0%})")
    if calibration.overlap is not None:
        lines.append(f"  overlap    {calibration.overlap:.0%} of a background all-reduce hidden behind compute")
    if calibration.host_sharing is not None:
        lines.append(f"  sharing    a device computes {calibration.host_sharing:.2f}x faster while its host's others idle")
    if calibration.optimizer_s_per_param is not None:
        lines.append(f"  optimizer  {calibration.optimizer_s_per_param * 1e9:.2f} ns per parameter, step overhead "
                     f"{calibration.step_overhead_s * 1e3:.2f} ms")
    for chip in calibration.chips.values():
        for key, curve in sorted(chip.layer.items()):
            rates = ", ".join(f"{t} tok {r / 1e9:.1f}" for t, r in zip(curve.tokens, curve.flops_per_s))
            optimizer = chip.optimizer_s.get(key)
            extra = f"; optimizer {optimizer[0] * 1e3:.1f} ms per layer" if optimizer else ""
            lines.append(f"  {chip.chip} layer {key}: GFLOP/s {rates}{extra}")
        for key, cost in sorted(chip.sharding.items()):
            added = ", ".join(f"{t} tok {s * 1e3:.1f}" for t, s in zip(cost.tokens, cost.extra_s))
            stage = zero_stage_of(key)
            per = "micro-batch" if stage == 3 else "step"
            lines.append(f"  {chip.chip} ZeRO-{stage} {key}: ms added per layer and {per} {added}")
    return "\n".join(lines)
