"""Every `ray up` YAML in clusters/ passes Ray's own offline validation and keeps the cluster private.

`ray up` runs `prepare_config` (merge the provider's defaults, node types, setup commands) and then
`validate_config` (Ray's JSON schema plus its consistency checks) before it talks to any cloud; the
tests run exactly those two steps. Hardware descriptors (sim-2x4.yaml, ...) share the folder but have
no `provider:` key and are skipped.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from baige_ray.topology.descriptor import load_descriptor

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"
RAY_UP_FILES = sorted(p for p in CLUSTERS.glob("*.yaml") if "provider" in yaml.safe_load(p.read_text()))
DESCRIPTOR_FILES = sorted(set(CLUSTERS.glob("*.yaml")) - set(RAY_UP_FILES))
SECRET_PATTERNS = {
    "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    "AWS access key id": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
    "AWS secret key setting": r"(?i)aws_secret_access_key|aws_session_token",
    "Google API key": r"\bAIza[0-9A-Za-z_\-]{35}\b",
    "GitHub token": r"\bgh[pousr]_[A-Za-z0-9]{36,}\b",
    "password setting": r"(?i)\bpassword\s*[:=]",
    "token in a URL": r"https?://[^/\s:@]+:[^/\s@]+@",
}
RESOURCES_FLAG = re.compile(r"--resources='(\{[^']*\})'")
DASHBOARD_HOST_FLAG = re.compile(r"--dashboard-host[= ](\S+)")
ids = [p.name for p in RAY_UP_FILES]


def _prepared(path: Path) -> dict:
    return prepare_config(yaml.safe_load(path.read_text()))


def test_the_three_cluster_yamls_are_found_and_descriptors_are_not():
    assert {p.name for p in RAY_UP_FILES} >= {"aws-h100.yaml", "gcp-a100.yaml", "onprem.yaml"}
    assert "sim-2x4.yaml" in {p.name for p in DESCRIPTOR_FILES}


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_ray_validates_the_prepared_config(path):
    validate_config(_prepared(path))


def test_ray_validation_rejects_a_broken_config():
    # The check above can fail: a misspelled field breaks Ray's schema.
    broken = copy.deepcopy(yaml.safe_load((CLUSTERS / "aws-h100.yaml").read_text()))
    broken["max_worker"] = broken.pop("max_workers")
    with pytest.raises(Exception, match="max_worker"):
        validate_config(prepare_config(broken))


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_dashboard_and_serve_listen_on_private_addresses(path):
    config = _prepared(path)  # after Ray's defaults, whose own head command says --dashboard-host=0.0.0.0
    head = " ".join(config["head_start_ray_commands"])
    hosts = DASHBOARD_HOST_FLAG.findall(head)
    assert hosts, "the head must set --dashboard-host (Ray's default in the launcher is 0.0.0.0)"
    for host in hosts:
        address = ipaddress.ip_address(host)
        assert address.is_loopback or address.is_private, host
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = next(c for c in commands if "ray start" in c)
        assert "RAY_SERVE_DEFAULT_HTTP_HOST=127.0.0.1" in start


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_nothing_binds_or_opens_to_the_whole_internet(path):
    for value in _strings(_prepared(path)):
        assert "0.0.0.0" not in value and "::/0" not in value, value


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_cloud_nodes_get_no_public_address_and_no_launcher_made_security_group(path):
    config = _prepared(path)
    provider = config["provider"]
    if provider["type"] == "local":
        return
    assert provider.get("use_internal_ips") is True
    for name, node_type in config["available_node_types"].items():
        node_config = node_type["node_config"]
        if provider["type"] == "aws":
            # Without SecurityGroupIds Ray creates a group whose SSH rule is open to 0.0.0.0/0.
            assert node_config.get("SecurityGroupIds"), name
            assert node_config.get("SubnetIds"), name
        if provider["type"] == "gcp":
            interfaces = node_config.get("networkInterfaces")
            assert interfaces and all("accessConfigs" not in nic for nic in interfaces), name


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_no_secrets_in_the_file(path):
    text = path.read_text()
    for what, pattern in SECRET_PATTERNS.items():
        assert not re.search(pattern, text), f"{path.name} contains a {what}"
    auth = yaml.safe_load(text).get("auth", {})
    assert set(auth) <= {"ssh_user", "ssh_private_key"}
    if "ssh_private_key" in auth:  # a path to a key file, never the key
        assert auth["ssh_private_key"].startswith(("~/", "/")) and "\n" not in auth["ssh_private_key"]


def test_secret_patterns_catch_what_they_are_for():
    samples = ["-----BEGIN OPENSSH PRIVATE KEY-----", "AKIA" + "ABCDEFGHIJKLMNOP", "aws_secret_access_key: x",
               "password: hunter2", "https://user:tok@github.com/x.git"]
    for sample in samples:
        assert any(re.search(p, sample) for p in SECRET_PATTERNS.values()), sample


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_nodes_install_torch_then_baige_ray(path):
    commands = _prepared(path)["setup_commands"]
    torch = next(i for i, c in enumerate(commands) if "torch==2.13.0" in c)
    project = next(i for i, c in enumerate(commands) if "baige-ray" in c and "pip install" in c)
    assert torch < project


@pytest.mark.parametrize("path", RAY_UP_FILES, ids=ids)
def test_hardware_markers_name_a_descriptor_node_type_and_its_chip(path):
    node_types = {name: t for d in DESCRIPTOR_FILES for name, t in load_descriptor(d).node_types.items()}
    marker_sets = _marker_sets(_prepared(path))
    assert marker_sets, "no node advertises baige_type_* / baige_chip_*"
    for markers in marker_sets:
        assert not any(key.startswith("baige_node_") for key in markers), "node indexes cannot be static"
        (type_key,) = [k for k in markers if k.startswith("baige_type_")]
        node_type = node_types[type_key.removeprefix("baige_type_")]
        assert markers[type_key] == 1
        assert markers == {type_key: 1, f"baige_chip_{node_type.chip.model}": node_type.num_devices}


def _marker_sets(config: dict) -> list[dict[str, float]]:
    """baige_* resources of each --resources flag and of each node type; where both exist they agree."""
    flags = [json.loads(m) for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
             for m in RESOURCES_FLAG.findall(c)]
    flag_markers = [_baige(flag) for flag in flags]
    type_markers = [m for t in config["available_node_types"].values() if (m := _baige(t.get("resources", {})))]
    if flag_markers and type_markers:
        assert all(m in type_markers for m in flag_markers), "--resources disagrees with the node type resources"
    return flag_markers + type_markers


def _baige(resources: dict) -> dict[str, float]:
    return {key: value for key, value in resources.items() if key.startswith("baige_")}


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []
