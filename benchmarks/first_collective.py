"""The smallest distributed job: bring up a process group, finish one all_reduce, exit.

    torchrun --standalone --nproc-per-node 2 benchmarks/first_collective.py OUT.json

Rank 0 writes the wall-clock time at which its first collective completed.
"""
import json, sys, time

import torch
import torch.distributed as dist


def first_collective():
    "One all_reduce on the default group; the time it completed."
    t = torch.ones(1)
    dist.all_reduce(t)
    return dict(done=time.time(), value=t.item())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    out = first_collective()
    if dist.get_rank() == 0:
        json.dump(out, open(sys.argv[1], "w"))
    dist.barrier()  # leave together: a gloo rank that tears down while its peer still writes can abort it
    dist.destroy_process_group()
