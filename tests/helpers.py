"""Worker functions for the tests: module-level, so torchrun-launched ranks can import them."""
import os, time


def rank_info():
    import torch, torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dict(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend(), rank_sum=t.item(),
                env={k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, pid=os.getpid())


def fails_on_rank(bad_rank=1):
    import torch.distributed as dist
    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} ran out of data")
    dist.barrier()


def hangs_on_rank_0():
    import torch, torch.distributed as dist
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(120)


def exits_on_rank(bad_rank=1):
    "Rank `bad_rank` leaves with exit status 0 without returning (os._exit); the others wait for it in a barrier."
    import torch.distributed as dist
    if dist.get_rank() == bad_rank:
        os._exit(0)
    dist.barrier()
