"""Worker functions for the tests: module-level, so torchrun-launched ranks can import them."""
import os, time


def rank_info():
    import torch, torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dict(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend(), rank_sum=t.item(),
                env={k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, pid=os.getpid())


def started_with():
    "What this rank's process held before its function ran: forked or not, the agent's PRELOAD modules, and how many ranks lead a session."
    import multiprocessing, sys, torch, torch.distributed as dist
    from fsdp_kit.launch import PRELOAD
    leaders = torch.tensor([float(os.getsid(0) == os.getpid())])
    dist.all_reduce(leaders)  # every rank in a session of its own, as torchrun's subprocess workers are (the scheduler's autogroup)
    return dict(forked=multiprocessing.parent_process() is not None, preloaded=[m for m in PRELOAD if m in sys.modules],
                session_leaders=int(leaders.item()))


def started_with_and_rank_info():
    "started_with() (before anything else runs here), then rank_info() under 'info': two checks from one launch."
    return started_with() | dict(info=rank_info())


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


def train_each(specs):
    "train_worker for each spec in turn on this process group: rank 0's results (many settings, one launch)."
    from fsdp_kit.train import train_worker
    return [train_worker(s) for s in specs]


def fsdp_settings(configs):
    "For each config, shard tiny with apply_fsdp and read back what each unit's FSDP state holds."
    # policies, dtypes, reshard mesh, wrapper class
    return [_fsdp_settings(cfg) for cfg in configs]


def _fsdp_settings(cfg):
    from fsdp_kit.mesh import build_mesh, fsdp_mesh
    from fsdp_kit.models import build_model, model_config
    from fsdp_kit.wrap import apply_fsdp
    model, units = apply_fsdp(build_model(model_config("tiny")), cfg, fsdp_mesh(build_mesh()))
    out = []
    for name, m in model.named_modules():
        get = getattr(m, "_get_fsdp_state", None)
        group = get()._fsdp_param_group if get else None
        if group is None: continue
        post = group.post_forward_mesh_info
        out.append(dict(module=name, cls=type(m).__name__, offload=type(group.offload_policy).__name__,
                        param_dtype=str(group.mp_policy.param_dtype), reduce_dtype=str(group.mp_policy.reduce_dtype),
                        reshard_to=None if post is None else post.mesh.size(-1)))
    return out


def qlora_each(specs):
    "qlora_worker for each spec in turn on this process group: rank 0's results (torchrun only: peft and bitsandbytes are imported)."
    from fsdp_kit.qlora import qlora_worker
    return [qlora_worker(s) for s in specs]


def all_reduce_forever(started: str):
    "Every rank all-reduces in a loop until it is stopped; rank 0 writes the file `started` once the loop runs."
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0: open(started, "w").close()
    while True:
        dist.all_reduce(t)
        time.sleep(0.01)
