"""A tensor-parallel worker (rank > 0): builds its device side like the driver, then runs the driver's steps.

It has no scheduler, block manager or sampler: each step arrives from the
driver as block ops plus a flat batch (`StepChannel.recv`), and the worker
runs the same copies and the same forward, taking part in its collectives.
It stops when the driver says so, or when the driver is gone (its
collectives fail). `pagedkv.distributed.launch` starts it with
`functools.partial(serve_steps, args)`.
"""

from __future__ import annotations

import torch

from pagedkv.config import EngineArgs
from pagedkv.distributed.runtime import TPRuntime
from pagedkv.engine.device_setup import build_device_side
from pagedkv.lora.request import LoRARequest


def serve_steps(args: EngineArgs, runtime: TPRuntime) -> int:
    """The device side (in the driver's order of collectives), then the step loop. Returns the steps run."""
    runner = build_device_side(args, runtime).runner
    steps = 0
    with torch.inference_mode():
        while (message := runtime.channel.recv()) is not None:
            if isinstance(message[1], LoRARequest):  # an adapter for a slot, before the step that uses it
                slot, request = message
                runner.lora.load_into_slot(slot, runner.lora.register(request))
                continue
            runner.run_batch(*message, checked=True)  # the driver checked it before sending
            steps += 1
    return steps
