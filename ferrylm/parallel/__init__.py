"""Tensor, expert and pipeline parallelism over torch.distributed (docs/parallel.md).

`group.py`: the tensor-parallel group a sharded layer computes in (and the collectives it needs);
`dist.py`: one process's place in the world (process groups, the control channel, start-up syncs);
`launch.py`: spawning the worker processes (or joining torchrun's) and the worker loop;
`executor.py`: rank 0's runner, which ships each step to the workers and watches them.
"""
