"""ResourceGraph build time and peak memory at 1,000 / 16,384 / 100,000 devices.

Each size is built in a fresh Python process, so its peak RSS is that build's
alone (a shared process would report the largest size's peak for every row).
The graph is the H100 rail-optimized descriptor with its node count set to
reach the size. `peak_rss_mb` is the process peak right after the build;
`baseline_rss_mb` is the process after imports (the baige_ray package pulls in
torch and Ray), so `build_rss_delta_mb` is what the graph itself costs. Queries
(slowest link of the whole cluster, 1M random device pairs) run after that.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from baige_ray.catalog import cluster_descriptor
from baige_ray.topology.groups import slowest_link

SIZES = (1_000, 16_384, 100_000)
DESCRIPTOR = cluster_descriptor("h100-rail-2048")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="device counts to build")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results = [_measure_in_subprocess(size) for size in args.sizes]
    return {"results": results}


def summarize(result: dict[str, Any]) -> str:
    lines = ["devices   build_s  peak_rss_mb  build_delta_mb  slowest_link_s  1M_pairs_s"]
    for row in result["results"]:
        lines.append(f"{row['devices']:>7}  {row['build_s']:>8.4f}  {row['peak_rss_mb']:>11.1f}  "
                     f"{row['build_rss_delta_mb']:>14.1f}  {row['slowest_link_s']:>14.4f}  {row['pair_queries_s']:>10.4f}")
    return "\n".join(lines)


def _measure_in_subprocess(devices: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "baige_ray.bench.topo", "--child", str(devices)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"topo bench child for {devices} devices failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(devices: int) -> dict[str, Any]:
    import resource
    import time

    import numpy as np
    import yaml

    from baige_ray.topology.descriptor import descriptor_from_dict
    from baige_ray.topology.graph import ResourceGraph

    raw = yaml.safe_load(DESCRIPTOR.read_text())
    per_node = next(iter(raw["node_types"].values()))["num_devices"]
    raw["nodes"][0]["count"] = -(-devices // per_node)
    descriptor = descriptor_from_dict(raw)
    baseline = _rss_mb(resource)
    start = time.perf_counter()
    graph = ResourceGraph.from_descriptor(descriptor)
    build_s = time.perf_counter() - start
    build_peak = _rss_mb(resource)
    start = time.perf_counter()
    slowest_link(graph, graph.device_ids)
    slowest_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, graph.num_devices, size=(2, 1_000_000))
    start = time.perf_counter()
    graph.tier_between(a, b)
    graph.bandwidth_between(a, b)
    pairs_s = time.perf_counter() - start
    return {"devices": graph.num_devices, "build_s": round(build_s, 5), "peak_rss_mb": round(build_peak, 1),
            "baseline_rss_mb": round(baseline, 1), "build_rss_delta_mb": round(build_peak - baseline, 1),
            "slowest_link_s": round(slowest_s, 5), "pair_queries_s": round(pairs_s, 5), "pair_queries": 1_000_000,
            "query_peak_rss_mb": round(_rss_mb(resource), 1)}


def _rss_mb(resource) -> float:
    # ru_maxrss is in KiB on Linux: the process's peak resident set so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", type=int, required=True)
    print(json.dumps(_child(parser.parse_args().child)))
