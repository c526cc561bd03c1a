"""The kit's training step and the plain loop's, alternated step by step inside one job, so both see the same machine.

    torchrun --standalone --nproc-per-node 2 benchmarks/same_window.py --rounds 100 --out same_window.json

Separate runs on a shared machine see different moments of it (the speed of this 2-core VM drifts by tens of percent
within seconds), so their step times differ by more than anything the kit could add. Here each rank holds two copies of
the same model: one set up and stepped exactly as `fsdp-kit train` does (`wrap.apply_fsdp` with the default config over the kit's mesh,
`train.make_optimizer`, `train.train_loop` with the heartbeat, watchdog and loss log of `scale.StepWatch`, its first step
inside the memory tracker as `train.train_worker` runs it), one as `plain_fsdp.py` does, in the same units as the kit's
by default (`--layout accelerate`), so the ratio is the kit's own cost and not its layout's. Each round runs one step of each,
the order flipping every round; the kit's time includes everything it does after a step (heartbeat, loss log). The ratio is
the median over rounds of kit / plain.
"""
import argparse, dataclasses, json, os, statistics, sys, tempfile, time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import plain_fsdp
from fsdp_kit.models import model_config, build_model
from fsdp_kit.mesh import build_mesh, fsdp_mesh
from fsdp_kit.config import FSDPConfig
from fsdp_kit.train import TrainSpec, make_optimizer, train_loop
from fsdp_kit.wrap import apply_fsdp
from fsdp_kit.scale import StepWatch
from fsdp_kit.measure import first_step_tracker


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small"); p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128); p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--warmup", type=int, default=3, help="rounds run first and not timed")
    p.add_argument("--layout", default="accelerate", choices=list(plain_fsdp.LAYOUTS), help="the plain loop's units (default: the kit's)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["FSDP_KIT_RUN_DIR"] = tempfile.mkdtemp(prefix="fsdp_kit_bench_")  # where the heartbeat writes

    spec = TrainSpec(model=a.model, batch=a.batch, seq_len=a.seq_len, steps=a.warmup + a.rounds)
    kit, _ = apply_fsdp(build_model(model_config(spec.model), spec.seed), FSDPConfig(), fsdp_mesh(build_mesh()))
    kit_optim = make_optimizer(kit, spec)
    watch = StepWatch(timeout=120)
    after_step = watch.start(kit, 0)
    plain, plain_optim = plain_fsdp.build(a.model, spec.lr, spec.seed, layout=a.layout)
    tracker = first_step_tracker(kit, kit_optim[0])

    def kit_step(n):
        train_loop(kit, dataclasses.replace(spec, steps=n + 1), rank, world, optimizer=kit_optim, start_step=n, after_step=after_step,
                   first_step=tracker if n == 0 else None)

    def plain_step(n):
        plain_fsdp.step(plain, plain_optim, n, a.batch, a.seq_len, spec.seed)

    times = {"kit": [], "plain": []}
    for n in range(a.warmup + a.rounds):
        order = (("kit", kit_step), ("plain", plain_step)) if n % 2 == 0 else (("plain", plain_step), ("kit", kit_step))
        for side, fn in order:
            dist.barrier()  # both ranks start each timed step together
            start = time.perf_counter()
            fn(n)
            if n >= a.warmup: times[side].append(time.perf_counter() - start)
    watch.stop()
    if rank == 0:
        ratios = [k / p for k, p in zip(times["kit"], times["plain"])]
        json.dump(dict(rounds=a.rounds, layout=a.layout,
                       kit_step_seconds=statistics.median(times["kit"]), plain_step_seconds=statistics.median(times["plain"]),
                       ratio=statistics.median(ratios), ratios=ratios, kit_times=times["kit"], plain_times=times["plain"]),
                       open(a.out, "w"))
    dist.barrier()  # leave together: a gloo rank that tears down while its peer still writes can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
