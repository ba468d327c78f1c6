"""`deepspeed.initialize` without the seconds DeepSpeed spends compiling code our engines never run.

On every ZeRO initialize, DeepSpeed (0.19) imports its Muon optimizer, to add it to the optimizers
ZeRO supports and to ask whether the one at hand is Muon. Muon's module compiles its kernels when
imported (`torch.compile` at definition), which loads torch's inductor: about 5 s of CPU in every
worker process, 20-30 s of wall time when 8 workers share 2 cores, for an optimizer none of our
engines runs. Here that module is imported first with its compilation deferred to the kernels'
first call: the same functions, compiled when Muon really runs, free when it does not.

On CPU, DeepSpeed's communication backend also builds a C++ extension on its first start on a machine
(40-50 s of compiling, once per Python environment, while every worker of the node waits on its lock):
shared-memory kernels for `inference_all_reduce`, DeepSpeed's inference-time tensor parallelism. Training
never calls it (ZeRO's collectives are torch.distributed's), so the extension is marked unavailable
before the backend starts, through the table of compatible ops DeepSpeed keeps for that purpose.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def initialize(**kwargs: Any):
    """`deepspeed.initialize(**kwargs)`, with Muon's kernels compiled only if they run and without building
    the inference-only shared-memory all-reduce."""
    import deepspeed

    import_muon_lazily()
    skip_inference_all_reduce_build()
    number_parameters_from_zero()
    return deepspeed.initialize(**kwargs)


def number_parameters_from_zero() -> None:
    """Make the next engine number its ZeRO-3 parameters and modules from 0, as in a fresh process.
    DeepSpeed counts both per process (`Init.param_id`, and the default list of
    `DeepSpeedZeRoOffload._register_deepspeed_module`), and ZeRO-3 checks at its second step that every rank
    traced the same ids: a survivor of a failure, building its second engine, counted on from its first
    while its replacement, a new process, started at 0, and the check's broadcasts hung the step."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    (module_count,) = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    module_count[0] = 0


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon module (once per process) with `torch.compile` deferred to first call."""
    from deepspeed.runtime import compiler

    if MUON_MODULE in sys.modules or not hasattr(compiler, "compile"):
        return
    eager_compile = compiler.compile
    compiler.compile = lambda: _compile_on_first_call
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:
        pass  # a DeepSpeed without Muon: nothing to defer
    finally:
        compiler.compile = eager_compile


def skip_inference_all_reduce_build() -> None:
    """Mark DeepSpeed's shared-memory all-reduce extension (CPU accelerator only) as unavailable, so its
    backend starts without compiling it; a no-op where the accelerator has no such op."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def _compile_on_first_call(fn=None, **options: Any):
    """`torch.compile`'s decorator forms, compiling when the function is first called."""
    if fn is None:
        return functools.partial(_compile_on_first_call, **options)
    compiled = None

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return run
