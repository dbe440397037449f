"""Tensor parallelism on ``torch.distributed`` (NCCL on GPUs, gloo on the CPU).

- ``parallel_state``: the TP group and its two collectives (all-reduce, all-gather);
- ``layers``: the sharding plan (``TPLayout``, ``shard_spec``) and the parallel modules;
- ``worker``: one rank (its shard, its ``ModelRunner``, the per-step loop);
- ``executor``: ``TPExecutor``, rank 0's ``RunnerInterface`` that drives the workers.

See notebooks/11_tensor_parallel.ipynb.
"""
