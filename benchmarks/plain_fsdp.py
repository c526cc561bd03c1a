"""A plain, hand-written FSDP2 training loop: the baseline `fsdp-kit train` is measured against.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_fsdp.py --model small --batch 4 --seq-len 128 --steps 30 --out plain.json

Same model (built from the same preset and seed), same data, same AdamW, `fully_shard` per decoder layer then the root,
as in pytorch/examples distributed/FSDP2. Nothing from the kit runs inside the timed loop.
"""
import argparse, json, os, statistics, time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fsdp_kit.models import model_config, build_model, synthetic_tokens, rank_rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small"); p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128); p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3); p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(model_config(a.model), seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=a.lr)
    times, losses = [], []
    for step in range(a.steps):
        start = time.perf_counter()
        tokens = rank_rows(synthetic_tokens(model.config.vocab_size, a.batch * world, a.seq_len, step, 0), rank, world)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
        times.append(time.perf_counter() - start)
    if rank == 0:
        json.dump(dict(step_seconds=statistics.median(times[1:]), step_times=times, loss=losses[-1].item()), open(a.out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
