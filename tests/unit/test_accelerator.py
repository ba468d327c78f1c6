from dataclasses import dataclass

import pytest

from baige_ray.accelerator import AcceleratorKind, detect_accelerator, spec_for


@dataclass
class FakeProbe:
    cuda: int = 0
    xpu: int = 0
    npu: int = 0

    def cuda_count(self) -> int:
        return self.cuda

    def xpu_count(self) -> int:
        return self.xpu

    def npu_count(self) -> int:
        return self.npu


@pytest.mark.parametrize(
    ("probe", "kind", "ray_resource", "device", "backend", "visible_env"),
    [
        (FakeProbe(cuda=8), AcceleratorKind.CUDA, "GPU", "cuda:0", "nccl", "CUDA_VISIBLE_DEVICES"),
        (FakeProbe(xpu=4), AcceleratorKind.XPU, "GPU", "xpu:0", "xccl", "ONEAPI_DEVICE_SELECTOR"),
        (FakeProbe(npu=8), AcceleratorKind.NPU, "NPU", "npu:0", "hccl", "ASCEND_RT_VISIBLE_DEVICES"),
        (FakeProbe(), AcceleratorKind.CPU, "CPU", "cpu", "gloo", None),
    ],
)
def test_detects_each_kind(probe, kind, ray_resource, device, backend, visible_env):
    spec = detect_accelerator(probe)
    assert spec.kind is kind
    assert spec.ray_resource == ray_resource
    assert spec.torch_device(0) == device
    assert spec.dist_backend == backend
    assert spec.visible_devices_env == visible_env


def test_workers_on_accelerators_also_reduce_host_tensors():
    """A loss or a count is a CPU tensor: NCCL alone refuses it, so gloo carries it beside NCCL."""
    assert spec_for("cuda").process_group_backend == "cpu:gloo,cuda:nccl"
    assert spec_for("npu").process_group_backend == "cpu:gloo,npu:hccl"
    assert spec_for("cpu").process_group_backend == "gloo"


def test_cuda_wins_when_several_kinds_are_visible():
    assert detect_accelerator(FakeProbe(cuda=1, xpu=1, npu=1)).kind is AcceleratorKind.CUDA


def test_this_machine_is_detected_without_a_fake():
    # CI has no accelerator; on a GPU box this still returns a valid spec.
    assert detect_accelerator().dist_backend in {"nccl", "xccl", "hccl", "gloo"}


def test_spec_for_rejects_unknown_kind():
    assert spec_for("npu").dist_backend == "hccl"
    with pytest.raises(ValueError, match="accelerator kind='tpu'"):
        spec_for("tpu")


def test_a_replica_computes_on_its_gpu_only_where_torch_sees_one():
    import torch

    from baige_ray.serving.deployment import replica_device

    assert replica_device([]) == torch.device("cpu")
    # Simulated GPUs (fake Ray resources) hand out ids on a host torch sees no GPU on.
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert replica_device([3]) == expected


def test_the_update_runs_one_fused_kernel_on_cuda_and_a_loop_elsewhere():
    import torch

    from baige_ray.api.configs import TrainConfig
    from baige_ray.engines.train_job import build_optimizer

    optimizer = build_optimizer(torch.nn.Linear(4, 4), TrainConfig(num_steps=1, global_batch_size=1))
    assert optimizer.defaults["foreach"] is False and not optimizer.defaults["fused"]
