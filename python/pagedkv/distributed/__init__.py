"""Tensor parallelism on torch.distributed, the plumbing only: starting the ranks (`launch`), a rank's
membership in the group (`runtime`), the per-step broadcast (`step_channel`).

Rank 0 (the driver) owns the scheduler, the block manager and the sampler;
every rank owns its shard of the model and a paged KV cache of its KV heads.
Each step the driver broadcasts the batch metadata (`step_channel`), all
ranks run the same forward (the row-parallel layers all-reduce), and the
logits are gathered on the driver. What a rank runs is the engine's
(`pagedkv.engine.device_setup`, `pagedkv.engine.worker`): nothing here
imports pagedkv.engine.
"""

from pagedkv.distributed.runtime import TPRuntime, WorkerDiedError, torchrun_env

__all__ = ["TPRuntime", "WorkerDiedError", "torchrun_env"]
