"""`fsdp-kit tour`: run what the kit can show on this machine, on its defaults, and write a report.

Each lab adds a step here; every step calls the same library functions the notebooks and tests call. The steps that run
on `nproc` ranks (train, compare, qlora, cp_eval, checkpoint, hf_trainer) run one after another inside a single
`torchrun` launch (`labs_worker`): starting fresh interpreters that import torch and transformers costs several seconds
a launch. Rank 0 prints each shared step's one-line result as that step ends, so the terminal shows progress while the
launch runs. Every step's lines are progress, on stderr (a worker's stdout reaches the command's stderr through the
launch); the ten results, one line each, are printed on stdout at the end.
"""
import json, time
from dataclasses import asdict
from pathlib import Path


def _train_line(r) -> str:
    return (f"tiny Llama ({r.n_params:,} params) on {r.world_size} ranks: loss "
            f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}, "
            f"max parameter difference vs one process {r.max_param_diff:.1e}")


def _compare_line(runs) -> str:
    per_linear = next(r for r in runs if r.policy == "PER_LINEAR" and r.reshard_after_forward is True)
    peak = {(r.policy, r.reshard_after_forward): r.peak_bytes["total"] / 2**20 for r in runs}
    return (f"small Llama on {runs[0].world_size} ranks, peak MiB per rank: TRANSFORMER_BASED_WRAP "
            f"{peak[('TRANSFORMER_BASED_WRAP', True)]:.1f} "
            f"(reshard_after_forward=True) / {peak[('TRANSFORMER_BASED_WRAP', False)]:.1f} (False), NO_WRAP "
            f"{peak[('NO_WRAP', True)]:.1f}; "
            f"all-gathers per step TRANSFORMER_BASED_WRAP {runs[0].collectives['all_gather']['count']}, PER_LINEAR "
            f"{per_linear.collectives['all_gather']['count']}")


def _qlora_line(r) -> str:
    from fsdp_kit.qlora import weight_share
    mib = lambda key: max(r.peak_bytes[key]) / 2**20
    return (f"LoRA on a 4-bit tiny Llama (bfloat16 storage) on {r.world_size} ranks: loss "
            f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}, "
            f"max loss diff vs one process over {len(r.losses)} steps "
            f"{r.sharded_vs_unsharded_loss_diff:.1e}, peak MiB per rank 4-bit "
            f"{mib('qlora'):.2f} vs bf16 base "
            f"{mib('bf16_lora'):.2f} (the base's weights are "
            f"{weight_share(r.peak_by_category['bf16_lora'][0]):.0%} of the bf16 peak: "
            f"activations and the rest dominate this model, so 4-bit saves little; 05_qlora's llama-wide "
            f"shows the base dominating), "
            f"adapter reload diff {r.adapter['reload_loss_diff']:.1e}")


def _cp_eval_line(r) -> str:
    return (f"context-parallel eval, cp={r.cp_size} ({r.rotate_method}), {r.tokens} valid tokens: "
            f"eval_loss {r.eval_loss:.6f} vs one "
            f"process without CP {r.eval_loss_reference:.6f} (|diff| {r.loss_diff:.1e}); gathered predictions equal: "
            f"{r.predictions_match_reference}")


def _checkpoint_line(runs) -> str:
    straight, first, second = runs
    return (f"sharded checkpoint at step 3, resumed to step 6 from step {second.first_step}: "
            f"losses bit-identical to one "
            f"6-step run: {first.losses + second.losses == straight.losses}")


def _hf_trainer_line(r) -> str:
    from fsdp_kit.hf_run import param_groups
    return (f"unmodified Trainer on transformers_fsdp_config.json (accelerate's FSDP branch opened on CPU): "
            f"FSDP2 on {r.world_size} ranks, "
            f"{len(param_groups(r.units))} units holding weights, loss {r.losses[0]:.3f} -> "
            f"{r.losses[-1]:.3f}; saved FULL -> " "from_pretrained diff "
            f"{r.load_check['max_weight_diff']:.1e}; SHARDED checkpoint resumed, diff "
            f"{r.resume['max_diff']:.1e}; the kit's recipe on the " "same "
            f"file: the same units {param_groups(r.units) == param_groups(r.parity['units'])}, loss diff "
            f"{r.parity['max_loss_diff']:.1e}")


SUMMARY = dict(train=_train_line, compare=_compare_line, qlora=_qlora_line, cp_eval=_cp_eval_line,
               checkpoint=_checkpoint_line,
               hf_trainer=_hf_trainer_line)  # the one-line result of each shared step
_SHARED = tuple(SUMMARY)  # the steps `labs_worker` runs, in this order


def labs_worker(ckpt_folder: str, first: int, total: int, progress: bool = True) -> dict:
    "Run the shared steps in this process group, in order."
    # {step: (result, seconds)}. Rank 0 prints each step as it starts and its result as it ends.
    import torch.distributed as dist
    from fsdp_kit.train import TrainSpec, train_worker
    from fsdp_kit.spec import StepSpec
    from fsdp_kit.wrap import CompareSpec, compare_worker
    from fsdp_kit.qlora import QLoRASpec, qlora_worker
    from fsdp_kit.cp import CPSpec, cp_eval_worker
    from fsdp_kit.mesh import MeshSpec
    from fsdp_kit.checkpoint import CheckpointSpec
    from fsdp_kit.hf_run import HFRunSpec, trainer_worker
    run = lambda steps, ckpt=None: train_worker(TrainSpec(model="tiny", steps=steps, step=StepSpec(warmup=2),
                                                          ckpt=ckpt))
    # last: it opens accelerate's CPU gate
    work = dict(train=lambda: train_worker(TrainSpec(model="tiny", steps=10, check_parity=True)),
                compare=lambda: compare_worker(CompareSpec("small", batch=2, steps=3)),
                qlora=lambda: qlora_worker(QLoRASpec(model="tiny", steps=5, step=StepSpec(lr=1e-2))),
                cp_eval=lambda: cp_eval_worker(CPSpec(mesh=MeshSpec(cp=2), seq_len=128, steps=1, rotate="alltoall")),
                checkpoint=lambda: (run(6), run(3, CheckpointSpec(ckpt_folder)),
                                    run(6, CheckpointSpec(ckpt_folder, resume=True))),
                hf_trainer=lambda: trainer_worker(HFRunSpec(workflow="trainer", steps=4, batch=2, seq_len=32,
                                                            out=f"{ckpt_folder}/hf_trainer")))
    out = {}
    for i, name in enumerate(_SHARED, first):
        # a worker's stdout: the command's stderr
        if progress and dist.get_rank() == 0: print(f"[{i}/{total}] {name} ...", flush=True)
        start = time.time()
        out[name] = (work[name](), time.time() - start)
        if progress and dist.get_rank() == 0: print(f"      {SUMMARY[name](out[name][0])}", flush=True)
    return out


def _steps(nproc: int, progress: bool = True):
    "The tour's steps: (title, function returning (json-able data, figure or None, summary line))."
    from fsdp_kit.launch import environment, launch
    from fsdp_kit.mesh import MeshSpec, mesh_worker, plot_mesh
    from fsdp_kit.train import plot_losses

    def env():
        e = environment()
        return e, None, f"{e['device_type']} / {e['backend']}, torch {e['versions']['torch']}, {e['gpu_count']} GPU(s)"

    def mesh():
        layout = launch(mesh_worker, MeshSpec(dp_replicate=2, dp_shard=2), nprocs=4, launcher="torchrun")
        return asdict(layout), plot_mesh(layout), f"2 x 2 HSDP mesh on 4 processes: grid {layout.grid}"

    shared = {}
    def ran(name):
        "The result of a shared step, launching `labs_worker` once for all of them."
        if not shared:
            import tempfile, shutil
            folder = tempfile.mkdtemp(prefix="fsdp_kit_tour_ckpt_")
            try: shared.update(launch(labs_worker, folder, 3, len(steps), progress, nprocs=nproc, launcher="torchrun"))
            finally: shutil.rmtree(folder, ignore_errors=True)
        return shared[name][0]

    def train():
        r = ran("train")
        return asdict(r), plot_losses(r), _train_line(r)

    def compare():
        from fsdp_kit.wrap import plot_compare
        runs = ran("compare")
        return dict(runs=[asdict(r) for r in runs]), plot_compare(runs), _compare_line(runs)

    def qlora():
        from fsdp_kit.qlora import plot_qlora_losses
        r = ran("qlora")
        return asdict(r), plot_qlora_losses(r), _qlora_line(r)

    def cp_eval():
        r = ran("cp_eval")
        return asdict(r), None, _cp_eval_line(r)

    def checkpoint():
        straight, first, second = runs = ran("checkpoint")
        same = first.losses + second.losses == straight.losses
        return dict(straight=straight.losses, first=first.losses, resumed=second.losses,
                    bit_identical=same), None, _checkpoint_line(runs)

    def hf_trainer():
        r = ran("hf_trainer")
        return asdict(r), None, _hf_trainer_line(r)

    def doctor():
        import shutil
        from fsdp_kit.config import EXAMPLES
        from fsdp_kit.doctor import DoctorSpec, doctor as run_doctor, STATUSES
        r = run_doctor(DoctorSpec(model=str(EXAMPLES / "configs" / "qwen2-tiny" / "config.json"),
                                  fsdp_config=str(EXAMPLES / "fsdp_configs" / "accelerate_fsdp_qlora.yaml"),
                                  method="qlora", nproc=max(nproc, 2), steps=2), say=lambda line: None)
        shutil.rmtree(r.pop("folder"), ignore_errors=True)
        counts = ", ".join(f"{n} {'not reached' if s == 'SKIP' else s}" for s in STATUSES
                           if (n := sum(c["status"] == s for c in r["checks"])) or s != "SKIP")
        fails = [c["name"] for c in r["checks"] if c["status"] == "FAIL"]
        return r, None, (f"the seeds' QLoRA YAML on a Qwen2 twin (accelerate launch, 2 ranks): {counts}; "
                         f"FAIL: {', '.join(fails)}")

    def plan():
        from dataclasses import replace
        from fsdp_kit.config import FSDPConfig
        from fsdp_kit.plan import PlanSpec, BASE, QLORA
        from fsdp_kit.plan_validate import validate, plot_validation
        from fsdp_kit.plan_gpu import plan_gpu
        base = replace(BASE, world_size=nproc)  # small on nproc ranks, 2 x 64 tokens per rank, one step
        r = validate([base, replace(base, fsdp=FSDPConfig(mixed_precision="bf16")),
                      replace(base, model="tiny", lora=QLORA)])
        big = PlanSpec("llama-2-70b", 2, batch=1, seq_len=2048, lora=QLORA,
                       # QLoRA, checkpointing, offload
                       fsdp=FSDPConfig(mixed_precision="bf16", ac="full", cpu_offload=True))
        big = plan_gpu(big, gpu_mem_gb=24)
        line = (f"planner vs measured, {len(r['runs'])} settings on {nproc} ranks: largest |error| "
                f"{r['max_abs_error'] * 100:.1f}%, "
                f"communication exact: {r['comm_exact']}; llama-2-70b QLoRA on 2 x 24 GB with offload: "
                f"{big.per_gpu_peak_bytes / 1e9:.1f} GB per GPU predicted, fits: {big.fits}")
        return dict(validation=r, llama_2_70b_qlora=asdict(big)), plot_validation(r), line

    steps = [("environment", env), ("mesh", mesh), ("train", train), ("compare", compare), ("qlora", qlora),
            ("cp_eval", cp_eval), ("checkpoint", checkpoint), ("hf_trainer", hf_trainer), ("doctor", doctor),
             ("plan", plan)]
    return steps, shared


def tour(out: str = "tour", nproc: int = 2, progress: bool = True) -> dict:
    "Run every step, writing OUT/<step>.json, OUT/<step>.png, OUT/report.json and OUT/summary.md."
    # progress on stderr, the results on stdout.
    import sys
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from fsdp_kit.measure import check_figure
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (steps, shared), report, lines = _steps(nproc, progress), {}, ["# fsdp_kit tour", ""]
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    for i, (name, run) in enumerate(steps, 1):
        if name not in _SHARED: say(f"[{i}/{len(steps)}] {name} ...")
        start = time.time()
        data, fig, line = run()
        (out / f"{name}.json").write_text(json.dumps(data, indent=2))
        if fig is not None:
            check_figure(fig)  # readable at the docs' width, no legend over data (fsdp_kit.measure)
            fig.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
            plt.close(fig)
        # a shared step: its own time inside the launch
        seconds = shared[name][1] if name in shared else time.time() - start
        report[name] = dict(data=data, seconds=round(seconds, 2), figure=f"{name}.png" if fig else None)
        lines.append(f"- **{name}** ({seconds:.1f} s): {line}" + (f" ![{name}]({name}.png)" if fig else ""))
        report[name]["line"] = line
        if name not in _SHARED: say(f"      {line}")  # a shared step's line was printed as it ended, by its worker
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    for i, (name, r) in enumerate(report.items(), 1):
        print(f"[{i}/{len(report)}] {name} ({r['seconds']:.1f} s): {r['line']}")
    print(f"wrote {out}/summary.md, report.json and {sum(1 for r in report.values() if r['figure'])} figures")
    return report
