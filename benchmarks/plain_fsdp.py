"""A plain, hand-written FSDP2 training loop: the baseline `fsdp-kit train` is measured against.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_fsdp.py --model small --batch 4 --seq-len 128 --steps 30 --out plain.json

Same model (built from the same preset and seed), same data, same AdamW. `--layout layers` (the default) shards as
pytorch/examples distributed/FSDP2 does: `fully_shard` per decoder layer, then the root. `--layout accelerate` makes,
by hand, the units `fsdp-kit train` makes by default (accelerate's FSDP2 layout): the layers, then the embeddings alone,
a [norm, lm_head] tail kept whole after forward, and the root kept whole. Nothing from the kit runs inside the timed
loop: the kit only builds the model and draws the synthetic batches, so both sides train on the same numbers. After the
timed loop one more step is counted (all-gathers, with the kit's `comm_counter`) and tracked (peak memory, FSDPMemTracker).
"""
import argparse, json, os, statistics, sys, time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

from fsdp_kit.models import model_config, build_model, synthetic_tokens, rank_rows
from fsdp_kit.wrap import LAYOUTS  # the layouts' names; the units themselves are written out here, by hand


def units(net, layout:str="layers") -> list:
    "The FSDP units of `layout`, innermost first and the root last: ([(qualified name, module)], reshard_after_forward)."
    if net.get_output_embeddings().weight is net.get_input_embeddings().weight:
        raise SystemExit("plain_fsdp.py shards models with untied embeddings only (a tied pair must share one unit)")
    groups = [([(f"model.layers.{i}", layer)], True) for i, layer in enumerate(net.model.layers)]
    if layout == "layers": return groups + [([("", net)], True)]  # torch keeps the root's parameters after forward anyway
    return groups + [([("model.embed_tokens", net.model.embed_tokens)], True),
                     ([("model.norm", net.model.norm), ("lm_head", net.lm_head)], False),  # backward needs the tail at once
                     ([("", net)], False)]


def build(model:str="small", lr:float=3e-3, seed:int=0, bf16:bool=False, layout:str="layers"):
    "The model, sharded in the units of `layout` on this rank's device, and its AdamW."
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    net = build_model(model_config(model), seed=seed).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for group, reshard in units(net, layout):
        modules = [m for _, m in group]
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, mp_policy=mp)
    return net, torch.optim.AdamW(net.parameters(), lr=lr)


def step(net, optim, n:int, batch:int, seq_len:int, seed:int=0):
    "Training step `n`: this rank's rows of the global batch, forward, backward, AdamW; the loss (not synchronised)."
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = rank_rows(synthetic_tokens(net.config.vocab_size, batch * world, seq_len, n, seed), rank, world)
    tokens = tokens.to(next(net.parameters()).device)
    loss = net(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def counted_step(net, optim, n:int, batch:int, seq_len:int) -> dict:
    "One more step, untimed, with its all-gathers counted and its peak memory tracked by the kit's instruments."
    from fsdp_kit.measure import comm_counter, first_step_tracker
    counter, tracker = comm_counter(), first_step_tracker(net, optim)
    with counter, tracker: step(net, optim, n, batch, seq_len)
    count = lambda *names: sum(k for op, k in counter.get_comm_counts().items() if any(w in op.__name__ for w in names))
    return dict(all_gathers_per_step=count("allgather", "all_gather"), reduce_scatters_per_step=count("reduce_scatter"),
                peak_mib=tracker.peak_bytes()["total"] / 2**20)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small"); p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128); p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3); p.add_argument("--bf16", action="store_true")
    p.add_argument("--layout", default="layers", choices=list(LAYOUTS), help="layers: per decoder layer, then the root (default); "
                   "accelerate: the units fsdp-kit train makes by default")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    gpu = torch.cuda.is_available()
    if gpu: torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else: torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if gpu else "gloo")
    net, optim = build(a.model, a.lr, bf16=a.bf16, layout=a.layout)
    times, losses = [], []
    for n in range(a.steps):
        start = time.perf_counter()
        losses.append(step(net, optim, n, a.batch, a.seq_len))
        if gpu: torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    counted = counted_step(net, optim, a.steps, a.batch, a.seq_len)
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # after the timed loop: each step's loss averaged over the ranks, as fsdp-kit train reports it
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(dict(layout=a.layout, **counted,
                           step_seconds=statistics.median(times[1:]), step_times=times, losses=(losses / dist.get_world_size()).tolist(),
                           tokens_per_second=a.batch * dist.get_world_size() * a.seq_len / statistics.median(times[1:])), f)
    dist.barrier()  # leave together: a gloo rank that tears down while its peer still writes can abort it ("terminate called ...")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # leave without the interpreter's teardown: there, gloo's threads can still drop tensors after destroy_process_group and abort the
    # rank ("terminate called without an active exception", SIGABRT) once its result is written; seen in 1 of 18 runs of 3 tiny steps
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
