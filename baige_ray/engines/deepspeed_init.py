"""`deepspeed.initialize` without the seconds DeepSpeed spends compiling an optimizer nobody uses.

On every ZeRO initialize, DeepSpeed (0.19) imports its Muon optimizer, to add it to the optimizers
ZeRO supports and to ask whether the one at hand is Muon. Muon's module compiles its kernels when
imported (`torch.compile` at definition), which loads torch's inductor: about 5 s of CPU in every
worker process, 20-30 s of wall time when 8 workers share 2 cores, for an optimizer none of our
engines runs. Here that module is imported first with its compilation deferred to the kernels'
first call: the same functions, compiled when Muon really runs, free when it does not.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def initialize(**kwargs: Any):
    """`deepspeed.initialize(**kwargs)`, with Muon's kernels compiled only if they run."""
    import deepspeed

    import_muon_lazily()
    return deepspeed.initialize(**kwargs)


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
