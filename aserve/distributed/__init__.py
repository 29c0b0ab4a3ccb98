"""Tensor parallelism over `torch.distributed`: who this rank is and the collectives layers call.

- `rendezvous.py` (standard library only, so the executor can import it without torch): where the
  ranks meet (`Rendezvous`: a free localhost port the executor picks, the backend, the timeout).
- `context.py`: `ParallelContext` (this rank, the group size, the process group), a frozen struct the
  runner hands to the loader and the loader to the layers (no module-level state), and
  `init_distributed` (one call per worker process, bounded by the rendezvous timeout).
- `collectives.py`: `all_reduce`, `all_gather_last_dim`, `all_reduce_min`: identity with one rank.
- `shm.py`: the same all-reduce / all-gather through shared memory for CPU ranks of one x86 machine
  (gloo's thread hand-offs cost more than the decode step's compute there).
- `context.shard_along`: this rank's slice of a checkpoint tensor (what `load_shard` narrows to).

Nothing here imports torch at package import time; import the submodules you need.
"""
