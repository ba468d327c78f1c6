"""DeepSpeed's Muon module is imported without compiling its kernels (which loads torch's inductor, ~5 s a
worker), a deferred kernel is compiled on its first call with the options it was declared with, and the
communication backend starts without building its inference-only shared-memory extension (40-50 s)."""

from __future__ import annotations

import subprocess
import sys

import torch

from baige_ray.engines import deepspeed_init


def test_muon_import_loads_no_inductor():
    script = ("import sys\n"
              "from baige_ray.engines.deepspeed_init import MUON_MODULE, import_muon_lazily\n"
              "import_muon_lazily()\n"
              "from deepspeed.runtime.zero.utils import is_zero_supported_optimizer\n"
              "assert MUON_MODULE in sys.modules\n"
              "print(sorted(m for m in sys.modules if m.startswith('torch._inductor.compile_fx')))\n")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip().splitlines()[-1] == "[]"


def test_deferred_kernel_compiles_on_first_call_only(monkeypatch):
    compiled = []

    def fake_compile(fn, **options):
        compiled.append(options)
        return lambda *args: fn(*args) + 1

    monkeypatch.setattr(torch, "compile", fake_compile)
    bare = deepspeed_init._compile_on_first_call(lambda x: x * 2)
    with_options = deepspeed_init._compile_on_first_call(mode="max-autotune")(lambda x: x * 3)
    assert compiled == []
    assert bare(2) == 5 and bare(3) == 7
    assert with_options(1) == 4
    assert compiled == [{}, {"mode": "max-autotune"}]


def test_the_backend_starts_without_building_the_shared_memory_extension():
    from deepspeed.comm.torch import build_shm_op

    deepspeed_init.skip_inference_all_reduce_build()
    assert build_shm_op() is None
