"""A state dict packed for Ray (parallel/packed_tensors.py): every dtype and shape comes back bitwise, the
bytes travel out of band (nothing but names and shapes in the pickle stream), views share the arrays and
copies do not."""

import pickle

import pytest
import torch

from baige_ray.parallel.packed_tensors import PackedTensors, pack_tensors, state_tensors


def mixed_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8),
        "norm.weight": torch.randn(8).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),  # 0-dim, as optimizer steps are
        "mask": torch.tensor([True, False, True]),
        "transposed": torch.randn(4, 6).t(),  # not contiguous: packed as a copy
        "empty": torch.zeros(0, 3, dtype=torch.float16),
    }


def test_every_dtype_and_shape_comes_back_bitwise_through_an_out_of_band_pickle():
    state = mixed_state()
    buffers = []
    stream = pickle.dumps(pack_tensors(state), protocol=5, buffer_callback=buffers.append)
    assert len(stream) < 2000 and len(buffers) == len(state)  # the bytes went out of band
    back = pickle.loads(stream, buffers=buffers)
    assert isinstance(back, PackedTensors) and list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    assert back.nbytes == sum(t.numel() * t.element_size() for t in state.values())


def test_views_share_the_arrays_and_copies_do_not():
    packed = pack_tensors({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    view, copy = packed.tensors(copy=False)["w"], packed["w"]
    packed.arrays["w"][:4] = 0  # the first float's 4 bytes
    assert view[0, 0] == 0 and copy[0, 0] == 0 and packed["w"][0, 1] == 1
    copy.add_(1)
    assert packed["w"][0, 1] == 1  # a copy is private


def test_a_mapping_loads_into_a_module_and_a_non_tensor_is_refused():
    module = torch.nn.Linear(3, 2)
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(pack_tensors(module.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values()))
    assert state_tensors({"w": module.weight}) == {"w": module.weight}
    with pytest.raises(TypeError, match=r"state\['n'\] is int"):
        pack_tensors({"n": 3})
