"""The `fsdp-kit` command: thin argument parsing over the library; every subcommand can write `--json`.

    fsdp-kit env --json
    fsdp-kit mesh --nproc 4 --dp-replicate 2 --dp-shard 2 --json
    fsdp-kit train --nproc 2 --model tiny --steps 10 --check-parity --json out.json
    fsdp-kit train --nproc 2 --steps 20 --ckpt ckpt --save-every 5 --resume --json out.json
    fsdp-kit train --nproc 4 --dp-replicate 2 --dp-shard 2 --check-parity   # HSDP: 2 replicas, each sharded over 2 ranks
    fsdp-kit train --nnodes 2 --node-rank 0 --nproc 2 --rdzv-endpoint node0:29400 --steps 20   # and --node-rank 1 on node1
    fsdp-kit train --nproc 2 --steps 20 --ckpt ckpt --save-every 2 --max-restarts 1 --inject-fault crash --fault-rank 1 --fault-step 5
    fsdp-kit slurm --nodes 4 --gpus-per-node 8 --time 01:00:00 -- train --model small --steps 100 > job.sh
    fsdp-kit qlora --nproc 2 --model tiny --quant-storage bfloat16 --steps 10 --json out.json
    fsdp-kit cp-eval --nproc 2 --cp 2 --rotate alltoall --json out.json
    fsdp-kit plan --model llama-2-70b --gpus 2 --gpu-mem-gb 24 --method qlora --seq-len 2048 --grad-ckpt --offload --json plan.json
    fsdp-kit plan --validate --nproc 2 --json validation.json
    fsdp-kit tour --out tour
"""
import argparse, errno, json, math, os, re, signal, sys, tempfile
from contextlib import nullcontext
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

from fsdp_kit.errors import KitError, bad_value
from fsdp_kit.flags import add_flags, field_docs, flag_of, given, spec_from_flags
from fsdp_kit.spec import SECTIONS

FAULTS = ("crash", "hang")  # fsdp_kit.scale.FAULTS, repeated so building the parser imports nothing heavy


def dumps(data) -> str:
    "Indented JSON with short lists of numbers kept on one line."
    text = json.dumps(data, indent=2)
    return re.sub(r"\[\s*([-\d.e, \n]+?)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def check_json_dest(json_dest):
    "Refuse a --json path that cannot be written, before the run it would record starts."
    if json_dest not in (None, "-"): check_output_file("json", json_dest, "; --json alone prints to stdout")


def check_output_file(option: str, dest: str, alone: str = ""):
    """Refuse a path the command would write its result to, before any work: a folder, a link or device,
    or a place it cannot write."""
    path = Path(dest)
    if path.is_dir(): raise bad_value(option, dest, "a file path (this is a folder)")
    import stat
    try: mode = path.lstat().st_mode
    except OSError: mode = None  # not there yet: it will be a new regular file
    # a rename over it would replace the link, the device or the pipe itself
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        raise bad_value(option, dest, f"a regular file or a new path (this is {kind}{alone})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"): pass
    except OSError as e:
        import errno
        why = "A part of its folder path is a file" if e.errno in (errno.EEXIST,
                                                                   errno.ENOTDIR) else e.strerror or str(e)
        raise bad_value(option, dest, "a file path that can be written", why) from None


def check_out_dir(option: str, folder):
    """Refuse an output folder that cannot be made or written (under a file, read-only), before
    any work; nothing is created."""
    if folder is None: return
    path = Path(folder)
    if path.exists() and not path.is_dir(): raise bad_value(option, folder, "a folder path (this is a file)")
    here = next(p for p in (path, *path.parents) if p.exists())  # the nearest that exists ("." or "/" at worst)
    if here.exists() and not here.is_dir(): raise bad_value(option, folder, f"a folder path ({here} is a file)")
    try:
        with tempfile.NamedTemporaryFile(dir=here, prefix=".fsdp_kit_out.", suffix=".probe"): pass
    except OSError as e:
        raise bad_value(option, folder, "a folder that can be written", f"{here}: {e.strerror or e}") from None


def emit(data, json_dest, text: str = ""):
    "Write `data` as JSON to `json_dest` ('-' for stdout, None for none) and print `text` where it won't mix with JSON."
    if _rank() != 0: return  # under a user's torchrun every rank runs this command: rank 0 speaks for the job
    data = asdict(data) if is_dataclass(data) else data
    if json_dest == "-":
        if text: print(text, file=sys.stderr)
        print(dumps(data))
        return
    if text: print(text)
    if json_dest: _write_atomically(Path(json_dest), dumps(data))


def _write_atomically(path: Path, text: str):
    """Write `text` to `path` through a temporary file and a rename; if that fails, print it to
    stdout rather than lose it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        where = f"--json={str(path)!r}: could not write it ({_output_why(e)})"
        try: print(text, flush=True)
        except BrokenPipeError: raise
        except OSError as out: raise OutputError(f"{where}, nor print it to stdout ({_output_why(out)})") from None
        raise OutputError(f"{where}; the result was printed to stdout instead") from None
    print(f"wrote {path}")


class OutputError(Exception):
    "The command's result could not be written (stdout, or the --json file): a full disk, a file-size limit. Exit 74."


OUTPUT_ERRNOS = {errno.EFBIG: "the file-size limit, ulimit -f", errno.ENOSPC: "no space left on the disk",
                 errno.EDQUOT: "the disk quota", errno.EIO: "an I/O error"}


def _output_why(e: OSError) -> str:
    "Why a write failed, in words: the errno's text and what it means here."
    return f"{e.strerror or e}: {OUTPUT_ERRNOS[e.errno]}" if e.errno in OUTPUT_ERRNOS else str(e.strerror or e)


def _rank() -> int:
    return int(os.environ.get("RANK", 0)) if "TORCHELASTIC_RUN_ID" in os.environ else 0


def check_before_launch(fits: dict) -> dict:
    """Refuse, before launching, a model that cannot build (`check_model`: a preset needs no transformers import) and, for a config.json,
    whose check has imported transformers already, a step that would not fit this machine (`check_fits(**fits)`). Return what is left for
    the workers to check (`fits_then`): `fits` for a preset, None for a config.json."""
    from fsdp_kit.models import PRESETS, check_model
    check_model(fits["model"])
    if fits["model"] in PRESETS: return fits
    from fsdp_kit.plan import check_fits
    check_fits(**fits)


def fits_then(fits: dict, fn, *args):
    """A training worker: refuse a step that would not fit this machine's memory
    (`plan.check_fits`), then run `fn(*args)`."""
    # `fits` None: checked before launching. The check needs torch and transformers: the workers have imported them
    # anyway, the
    # launching process need not (6-7 s on 2 cores). It runs before the worker builds anything, so a refused step
    # allocates nothing.
    if fits is not None:
        from fsdp_kit.plan import check_fits
        check_fits(**fits)
    return fn(*args)


def example_path(field: str, value):
    """`value` as typed where it exists here; an `examples/...` path that does not, the packaged example of that name (`config.EXAMPLES`).
    A path found in neither is refused, saying where the packaged examples are."""
    if value is None or Path(value).exists() or ("/" not in str(value) and not str(value).endswith((".json", ".yaml", ".yml"))):
        return value
    from fsdp_kit.config import EXAMPLES
    parts = Path(value).parts
    if parts[:1] == ("examples",) and EXAMPLES.joinpath(*parts[1:]).exists():
        print(f"note: {value} is not in this folder: reading the packaged example {EXAMPLES.joinpath(*parts[1:])}",
              file=sys.stderr)
        return str(EXAMPLES.joinpath(*parts[1:]))
    raise bad_value(f"--{field.replace('_', '-')}", value, "an existing file",
                    f"It is not in {os.getcwd()}; the packaged examples are in {EXAMPLES} "
                    "(examples/configs/..., examples/fsdp_configs/..., examples/doctor/...: an "
                    "examples/... path finds them from any folder)")


def _cmd_env(a):
    from fsdp_kit.launch import environment
    env = environment()
    emit(env, a.json, "" if a.json else dumps(env))


def _cmd_mesh(a):
    from fsdp_kit.launch import launch
    from fsdp_kit.mesh import mesh_worker
    spec = command_spec("mesh", a).mesh.resolve(a.nproc)  # refuse bad sizes before launching
    layout = launch(mesh_worker, spec, nprocs=a.nproc, launcher="torchrun", timeout=a.timeout)
    emit(layout, a.json, layout.table())


def train_spec(a):
    """The TrainSpec `fsdp-kit train` runs: its flags laid over TrainSpec() (and --fsdp-config's file),
    checked for the world size."""
    from fsdp_kit.checkpoint import CheckpointSpec, refuse_other_runs
    spec = command_spec("train", a)
    if spec.lora is not None and spec.lora.r == 0: spec = replace(spec, lora=None)  # --lora-r 0: a full fine-tune
    ckpt = given(a, CheckpointSpec, CKPT_READS)
    if "dir" in ckpt:
        cfg = spec.config  # the config's format, unless --state-dict says
        state_dict = ckpt.get("state_dict") or (cfg.state_dict_type if a.fsdp_config else "sharded")
        if ckpt.get("state_dict") and a.fsdp_config and not cfg.state_dict_type.lower().startswith(ckpt["state_dict"].lower()):
            _override("--state-dict", ckpt["state_dict"], "state_dict_type", cfg.state_dict_type, a.fsdp_config)
        if not (ckpt.get("resume") or ckpt.get("overwrite")):
            refuse_other_runs(ckpt["dir"], "--resume", "--overwrite-ckpt")
        spec = replace(spec, ckpt=CheckpointSpec(**ckpt | dict(state_dict=state_dict)))
    elif needs := [k for k in ("resume", "save_every", "overwrite") if ckpt.get(k)]:
        raise KitError(f"{flag_of(needs[0])} needs --ckpt DIR: the folder checkpoints go to")
    return spec.checked(a.nnodes * a.nproc)  # once: launch does not check it again


def _cmd_train(a):
    from fsdp_kit.launch import launch
    from fsdp_kit.checkpoint import check_resume, lock_checkpoint_dir
    from fsdp_kit.scale import FaultSpec, scale_train_worker
    spec = train_spec(a)
    fits = check_before_launch(dict(model=spec.model, batch=spec.batch, seq_len=spec.seq_len, nproc=a.nproc,
                                    nnodes=a.nnodes,
                                    method="lora" if spec.lora else "full", lora_r=spec.lora.r if spec.lora else 8))
    fault = FaultSpec(a.inject_fault, a.fault_rank, a.fault_step).check(a.nnodes * a.nproc, spec.steps)
    # one run per checkpoint folder: a second is refused
    with lock_checkpoint_dir(spec.ckpt.dir) if spec.ckpt else nullcontext():
        if spec.ckpt and spec.ckpt.resume:
            folder, notes = check_resume(spec)  # refuse damaged checkpoints, or another run's, before launching
            for note in notes: print(f"  {note}", file=sys.stderr)
        result = launch(fits_then, fits, scale_train_worker, spec, fault, a.timeout, not a.quiet, nprocs=a.nproc,
                        launcher="torchrun",
                        timeout=a.timeout, nnodes=a.nnodes,
                        node_rank=a.node_rank, rdzv_endpoint=a.rdzv_endpoint, rdzv_id=a.rdzv_id,
                        max_restarts=a.max_restarts,
                        rdzv_timeout=a.rdzv_timeout if a.nnodes > 1 else None)
    s = result.scale
    text = f"{s['nodes']} node(s) x {s['ranks_per_node']} = " if s["nodes"] > 1 else ""
    for r in s["restarts"]:
        text += (f"restart {r['attempt'] + 1}: attempt {r['attempt']} ended after step "
                 f"{s['attempts'][r['attempt']]['last_step']} (rank "
                 f"{r['rank']} {r['kind']})\n")
    if s["attempt"]: text += f"the last attempt resumed from step {result.first_step}\n"
    mesh = spec.mesh.resolve(result.world_size)
    if mesh.dp_replicate > 1:
        text += (f"HSDP: {mesh.dp_replicate} replicas x {mesh.dp_shard} shards (parameters sharded over "
                 f"{mesh.dp_shard} ranks, gradients "
                 "all-reduced across replicas)\n")
    text += (f"{result.world_size} ranks, steps "
             f"{result.first_step + 1}-{result.first_step + len(result.losses)}, losses "
             + " ".join(f"{l:.3f}" for l in result.losses))
    if result.losses:
        from fsdp_kit.measure import busy_note
        t = result.timing
        spread = f" of {t['steps']}, min {t['min_s'] * 1e3:.1f}, max {t['max_s'] * 1e3:.1f}" if t else ""
        text += f"\nstep {result.step_seconds * 1e3:.1f} ms (median{spread}; warm-up excluded), {result.tokens_per_second:,.0f} tokens/s"
        note = busy_note([t])
        if note: text += "\n" + note
    if result.max_param_diff is not None:
        text += f"\nmax |sharded - one process| parameter difference: {result.max_param_diff:.2e}"
    c = result.config
    text += (f"\n{len(result.units)} FSDP units (the root included) by {c['auto_wrap_policy']}, "
             f"reshard_after_forward={c['reshard_after_forward']}, "
             f"mixed_precision={c['mixed_precision']}" + f", activation checkpointing {result.ac}" * (result.ac != "none")
             + ", CPU offload" * c["cpu_offload"])
    if result.peak_bytes: text += f"; first step's peak on rank 0: {result.peak_bytes['total'] / 2**20:.2f} MiB"
    st = result.step
    savers = [st["precision"] * (st["precision"] != "fp32"),
              f"loss in {st['ce_chunks']} chunks" * bool(st["ce_chunks"]),
              "optimizer in backward" * st["optimizer_in_backward"],
              "activations offloaded to host" * st["offload_activations"]]
    if any(savers): text += "\nstep: " + ", ".join(s for s in savers if s)
    if result.checkpoint:
        c = result.checkpoint
        if c["resumed_from"]:
            text += f"\nresumed from {c['resumed_from']['path']} (saved by {c['resumed_from']['world_size']} ranks)"
        text += f"\n{c['state_dict']} checkpoints saved at steps {c['saved_steps']}; latest: {c['latest']}" + "".join(
            f"\n  {n}" for n in c["notes"])
    if result.adapter:
        d = result.adapter
        text += (f"\nLoRA adapter: {d['tensors']} tensors, every rank's rows saved: {d['every_rank_share_saved']}, "
                 f"reloaded with peft: loss diff "
                 f"{d['reload_loss_diff']:.1e}" + (f", in {d['path']}" if d["path"] else ""))
    emit(asdict(result) | dict(mesh=asdict(mesh)), a.json, text)  # the mesh sizes it ran on, -1 filled in


def _say(line: str):
    "A note for the user: on stderr, beside the progress lines."
    print(line, file=sys.stderr)


def _override(flag: str, value, field: str, was, source: str):
    "Say that a flag replaced a field of the user's FSDP config file."
    if value != was: print(f"note: {flag} {value} overrides {field}={was!r} from {source}", file=sys.stderr)


def _cmd_hf(a):
    import time
    start = time.time()  # progress lines count from here
    if a.workflow: return _cmd_hf_run(a, start)
    if run_only := [n for n in HF_READS[""] if n != "model" and getattr(a, n) is not None]:
        raise KitError(f"{flag_of(run_only[0])} is read only with --run WORKFLOW: without it, hf shows "
                       f"the file as upstream reads it")
    from fsdp_kit.config import load_fsdp_config
    from fsdp_kit.hf import training_arguments, accelerate_config, accelerate_yaml, hf_worker
    from fsdp_kit.upstream import upstream_reading, FIELDS
    cfg = load_fsdp_config(a.fsdp_config)
    out = dict(source=a.fsdp_config, notes=cfg.notes, training_arguments=training_arguments(cfg),
               accelerate_config=accelerate_config(cfg, a.nproc), config={k: getattr(cfg, k) for k in FIELDS},
               upstream=upstream_reading(a.fsdp_config))
    up = out["upstream"]  # what the file's own entry point builds, beside what the kit runs
    from fsdp_kit.versions import versions_verdict
    # which releases built it, and what the versions matrix knows of them
    v = out["versions_verdict"] = versions_verdict()
    upstream_text = (f"{up['entry_point']} builds " + (f"FSDP{up['fsdp_version']}: " + ", ".join(f"{k}={up[k]!r}" for k in FIELDS)
                                                       if "refused" not in up else f"nothing: {up['refused']}")
                     + f"\n  (upstream {v['status']}: {v['reason']})"
                     + "\nthe kit runs FSDP2: " + ", ".join(f"{k}={v!r}" for k, v in out["config"].items()) + "\n")
    text = (f"{a.fsdp_config} as TrainingArguments:\n  TrainingArguments(" + ", ".join(
        f"{k}={v!r}" for k, v in out["training_arguments"].items())
            + ", ...)\nas an accelerate config (accelerate launch --config_file):\n" + "".join(
                f"  {l}\n" for l in accelerate_yaml(cfg, a.nproc).splitlines())
            + upstream_text + "".join(f"note: {n}\n" for n in cfg.notes))
    if a.check:
        from fsdp_kit.launch import launch
        out["check"] = launch(hf_worker, cfg, a.model or "tiny", None if a.quiet else start, nprocs=a.nproc,
                              launcher="torchrun", timeout=a.timeout)
        text += "\n".join(out["check"][k]["verdict"] for k in ("accelerate", "trainer", "kit"))
    emit(out, a.json, text.rstrip())


def check_upstream_can_run(path: str, workflow: str):
    """Read the file the upstream runner will read, in this process and before any launch: the kit's reading refuses what it cannot use
    (named with the file and its key), and a file its entry point refuses (`upstream_reading`) is refused here, not inside the workers;
    so is a file from which the Trainer would build FSDP1 (the trainer workflow checks FSDP2 on every rank; sft and qlora convert it)."""
    from fsdp_kit.config import load_fsdp_config
    from fsdp_kit.upstream import upstream_reading
    load_fsdp_config(path)
    up = upstream_reading(path)
    why = f"{up['entry_point']} refuses this file: {up['refused']}" if "refused" in up else None
    if workflow == "trainer" and up.get("fsdp_version") == 1:
        why = f"{up['entry_point']} builds FSDP1 from it (fsdp_version 1): the trainer workflow runs FSDP2; set \"version\": 2 in the file"
    if why:
        err = KitError(f"{path}: {why}")
        err.source = path
        raise err


def hf_run_spec(a):
    """The HFRunSpec `fsdp-kit hf --run WORKFLOW` runs: the workflow on --fsdp-config's file (trainer: with
    the kit's recipe beside it)."""
    spec = command_spec("hf", a, fsdp_file=None)
    return replace(spec, fsdp_config=a.fsdp_config, check_parity=spec.workflow == "trainer").check()


def _cmd_hf_run(a, start: float):
    """fsdp-kit hf --run WORKFLOW: one Hugging Face workflow on --nproc ranks (trainer, native: torchrun; sft,
    qlora: accelerate launch)."""
    from fsdp_kit.hf_run import run_workflow
    if a.check:
        raise KitError("--check and --run: pick one (--check compares accelerate, the Trainer and the "
                       "kit; --run runs one workflow)")
    check_out_dir("--out", a.out)
    spec = hf_run_spec(a)
    if spec.workflow != "native": check_upstream_can_run(spec.config_path(), spec.workflow)  # native never reads it
    r = run_workflow(spec, nproc=a.nproc, timeout=a.timeout, progress_from=None if a.quiet else start)
    text = (f"{r.workflow}: {'FSDP2 on every rank' if r.sharded else 'NOT sharded'} ({r.fsdp_units} FSDP units, "
            f"{r.param_type} parameters, "
            f"{r.world_size} ranks, {r.distributed_type}); MixedPrecisionPolicy {r.mixed_precision_policy}\n"
            f"losses {' '.join(f'{l:.4f}' for l in r.losses)}\nsaved {r.saved} -> loaded with "
            f"{r.loaded_with}: {r.load_check}")
    if r.parity:
        text += (f"\nthe kit's recipe on the same config and data: max loss difference "
                 f"{r.parity['max_loss_diff']:.1e}, "
                 f"{len(r.parity['units'])} units")
    if r.resume: text += f"\nresumed from {r.resume['checkpoint']}: max loss difference {r.resume['max_diff']:.1e}"
    text += "".join(f"\nnote: {n}" for n in r.notes) + f"\n{r.seconds} s"
    text += (f"\nthe run's files are in {spec.out}" if spec.out
             else "\nthe run's files were in a temporary folder, removed at exit (--out DIR keeps them)")
    emit(asdict(r), a.json, text)


def doctor_spec(a):
    "The DoctorSpec `fsdp-kit doctor` runs: the twin of --model with --fsdp-config, on --nproc ranks within --timeout."
    spec = command_spec("doctor", a, fsdp_file=None)
    return replace(spec, fsdp_config=a.fsdp_config, nproc=a.nproc, timeout=a.timeout)


def _cmd_doctor(a):
    "fsdp-kit doctor: the twin of --model run with --fsdp-config through the file's entry point, and the twelve checks."
    from fsdp_kit.doctor import doctor, report_text, exit_status
    check_out_dir("--out", a.out)
    spec = doctor_spec(a)
    import time
    r = doctor(spec, say=(lambda line: None) if a.quiet else lambda line: print(line, file=sys.stderr, flush=True),
               progress_from=time.time())
    emit(r, a.json, report_text(r) + (f"\nthe twin, its run and its log are in {spec.out}" if spec.out else ""))
    status = exit_status(r, a.strict)
    if status:
        raise CheckFailed(f"{'a check failed' if any(c['status'] == 'FAIL' for c in r['checks']) else 'a WARN under --strict'} (exit 1)")


def _cmd_slurm(a):
    from fsdp_kit.scale import slurm_script
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    script = slurm_script(a.nodes, a.gpus_per_node, args, a.partition, a.time, a.job_name)
    emit(dict(nodes=a.nodes, gpus_per_node=a.gpus_per_node, args=args, script=script), a.json,
         "" if a.json == "-" else script.rstrip("\n"))


def _cmd_ckpt(a):
    from fsdp_kit.checkpoint import list_checkpoints, to_full
    from pathlib import Path
    if not Path(a.dir).is_dir(): raise bad_value("DIR", a.dir, "an existing checkpoint folder (fsdp-kit ckpt DIR)")
    if a.out:
        from fsdp_kit.ranks import quiet_libraries
        quiet_libraries()  # no progress bars from save_pretrained
        out = to_full(a.dir, a.out)
        emit(dict(dir=a.dir, to_full=str(out), files=sorted(p.name for p in out.iterdir())), a.json,
             f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())) + " (AutoModelForCausalLM.from_pretrained reads it)")
        return
    step = Path(a.dir)
    # one step folder: that checkpoint alone, checked as in its parent's listing
    if step.name.startswith("step-") and step.name[5:].isdigit():
        found = [c for c in list_checkpoints(step.resolve().parent) if c["name"] == step.name]
    else: found = list_checkpoints(a.dir)
    rows = [f"{c['name']}{' (latest)' if c['latest'] else ''}: " + (f"complete, {c['state_dict']}, "
                                                                    f"{c['world_size']} ranks, {c['bytes']:,} "
                                                                    f"bytes, run {c['run'] or '?'}" if c["ok"]
            else "DAMAGED: " + "; ".join(c["problems"])) for c in found]
    emit(dict(dir=a.dir, checkpoints=found), a.json, "\n".join(rows) or f"no checkpoints in {a.dir}")


def compare_spec(a):
    "The CompareSpec `fsdp-kit compare` runs: --policies x --reshard, or the one config of --fsdp-config's file."
    from fsdp_kit.config import load_fsdp_config, to_reshard
    spec = command_spec("compare", a)
    if a.fsdp_config:  # that one config
        cfg = load_fsdp_config(a.fsdp_config)
        return replace(spec, fsdp=cfg, policies=[cfg.auto_wrap_policy], reshard=[cfg.reshard_after_forward])
    return replace(spec, reshard=[to_reshard("reshard", r) for r in spec.reshard])


def _cmd_compare(a):
    from fsdp_kit.launch import launch
    from fsdp_kit.wrap import check_spec, compare_worker, runs_table, plot_compare
    spec = compare_spec(a)
    fsdp_config = spec.fsdp if a.fsdp_config else None
    check_spec(spec, a.nproc)  # refuse bad configs before launching
    notes = []
    if fsdp_config:
        print(f"{a.fsdp_config}: " + "; ".join(f"{k}={v!r}" for k, v in vars(fsdp_config).items() if k not in ("notes", "source")),
              file=sys.stderr)
        import torch
        from fsdp_kit.wrap import lab_notes
        # the config's own notes stay as read
        notes = fsdp_config.notes + lab_notes(fsdp_config, torch.cuda.is_available())
        for note in notes: print(f"  {note}", file=sys.stderr)
    runs = launch(fits_then,
                  check_before_launch(dict(model=spec.model, batch=spec.batch, seq_len=spec.seq_len, nproc=a.nproc)),
                  compare_worker, spec, not a.quiet, nprocs=a.nproc, launcher="torchrun", timeout=a.timeout)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        plot_compare(runs).savefig(a.plot, dpi=100, bbox_inches="tight")
        print(f"wrote {a.plot}", file=sys.stderr if a.json == "-" else sys.stdout)
    emit(dict(model=spec.model, world_size=a.nproc, notes=notes, runs=[asdict(r) for r in runs]),
         a.json, runs_table(runs))


def _cmd_docs(a):
    from fsdp_kit.docs import docs
    manifest = docs(a.out, a.nbs, a.quarto)
    pages = manifest["pages"]
    text = f"built {len(pages)} pages with {manifest['builder']} into {a.out}/ (open {a.out}/index.html)"
    if manifest["builder"] == "nbconvert":
        text += f"; {sum(p['figures'] > 0 for p in pages)} pages carry figures"
    emit(manifest, a.json, text)


def qlora_spec(a):
    """The QLoRASpec `fsdp-kit qlora` runs: FSDP computes in --mixed-precision's dtype, else the 4-bit storage's,
    over --fsdp-config's file."""
    from fsdp_kit.config import PRECISION, load_fsdp_config
    from fsdp_kit.qlora import QLoRASpec, lora_fsdp_config
    spec = command_spec("qlora", a, fsdp_file=None)  # the file's config is laid under the storage's compute dtype below
    read = load_fsdp_config(a.fsdp_config) if a.fsdp_config else None
    mixed = spec.fsdp.mixed_precision if spec.fsdp is not None else None
    # FSDP's compute dtype: --mixed-precision's, else the storage's own (as QLoRASpec follows it when fsdp is None),
    # over the file's
    dtype = PRECISION[mixed] if mixed is not None else QLoRASpec(lora=spec.lora).param_dtype if read is not None else None
    cfg = lora_fsdp_config(dtype, read) if read is not None or mixed is not None else None
    spec = replace(spec, fsdp=cfg).check(a.nproc)
    if read is not None:
        _say(f"note: the QLoRA lab computes in param_dtype={spec.param_dtype} (the 4-bit storage dtype must match it); "
             f"it replaces mixed_precision={read.mixed_precision!r} from {a.fsdp_config}")
    return spec


def _cmd_qlora(a):
    from fsdp_kit.launch import launch
    from fsdp_kit.qlora import qlora_worker, weight_share
    spec = qlora_spec(a)
    fits = dict(model=spec.model, batch=spec.batch, seq_len=spec.seq_len, nproc=a.nproc, method="qlora",
                lora_r=spec.adapters.r)
    r = launch(fits_then, check_before_launch(fits), qlora_worker, spec, not a.quiet, nprocs=a.nproc,
               launcher="torchrun",
               timeout=a.timeout)
    mib = lambda key: " / ".join(f"{b / 2**20:.2f}" for b in r.peak_bytes[key])
    share = {key: weight_share(r.peak_by_category[key][0]) for key in ("bf16_lora", "qlora")}  # rank 0's
    text = (f"{r.world_size} ranks, 4-bit base in {r.quant_storage}, param_dtype {r.param_dtype}"
            + f", forward under autocast {r.autocast}" * (r.autocast != "no")
            + f", 4-bit matmuls in {r.compute_dtype}: losses " + " ".join(f"{l:.3f}" for l in r.losses)
            + f"\nsharded vs one process over {len(r.losses)} steps: max |loss diff| "
              f"{r.sharded_vs_unsharded_loss_diff:.1e}; "
            + f"trained {len(r.changed_parameters)} parameters, all LoRA: "
              f"{all('lora_' in n for n in r.changed_parameters)}"
            + f"\npeak MiB per rank: 4-bit base {mib('qlora')}, bf16 base {mib('bf16_lora')}; the base's "
              f"weights (sharded, gathered, "
            + f"all-gather buffer) are {share['bf16_lora']:.0%} of the bf16 peak and "
              f"{share['qlora']:.0%} of the 4-bit one"
            + (": activations, LoRA state and the rest dominate, so 4-bit saves little here (a "
               "wider model, e.g. --model "
               "examples/configs/llama-wide/config.json --batch 1 --seq-len 16, "
               "shows the base dominating)" if share["bf16_lora"] < 0.5
               else "")
            + f"\nadapter: {r.adapter['tensors']} tensors, every rank's share saved: "
              f"{r.adapter['every_rank_share_saved']}, "
            + f"reloaded loss diff {r.adapter['reload_loss_diff']:.1e}" + (f", saved in {r.adapter['path']}" if r.adapter["path"] else ""))
    emit(r, a.json, text)


def cp_eval_spec(a):
    """The CPSpec `fsdp-kit cp-eval` runs: one forward pass (steps=1); --mask none is full attention;
    --rows the old global batch."""
    spec = command_spec("cp-eval", a, fsdp_file=a.fsdp_config)
    spec = replace(spec, mask=None if spec.mask == "none" else spec.mask, batch=_cp_batch(a, spec))
    return spec.check(a.nproc)  # refuse bad sizes, lengths, masks and rotate methods before launching


def _cmd_cp_eval(a):
    from fsdp_kit.launch import launch
    from fsdp_kit.cp import cp_eval_worker
    spec = cp_eval_spec(a)
    r = launch(fits_then,
               check_before_launch(dict(model=spec.model, batch=spec.batch, seq_len=spec.seq_len, nproc=a.nproc)),
               cp_eval_worker, spec, not a.quiet, nprocs=a.nproc, launcher="torchrun", timeout=a.timeout)
    text = (f"{r.world_size} ranks, dp_shard={r.dp_shard} x cp={r.cp_size} ({r.rotate_method}), "
            f"{r.rows} x {r.seq_len} tokens, "
            f"{r.tokens} valid (per rank {r.tokens_per_rank})\neval_loss {r.eval_loss:.7f}, one process without CP "
            f"{r.eval_loss_reference:.7f}, "
            f"|diff| {r.loss_diff:.1e} (mean of the ranks' own means: {r.mean_of_rank_means:.7f})")
    if r.predictions_match_reference is not None:
        text += (f"\ngathered predictions equal the reference argmax: "
                 f"{r.predictions_match_reference} (max |logit diff| {r.max_logit_diff:.1e})")
    text += "\npeak MiB per rank: " + " / ".join(f"{b / 2**20:.2f}" for b in r.peak_bytes)
    emit(r, a.json, text)


def _cp_batch(a, spec) -> int:
    "--batch, or the old --rows (the global batch) turned into sequences per data-parallel rank."
    if a.rows is None: return spec.batch
    from fsdp_kit.cp import check_sizes
    dp_shard = check_sizes(a.nproc, spec.mesh.cp, spec.mesh.dp_shard, spec.sp).dp_shard
    if isinstance(a.rows, bool) or a.rows < 1 or a.rows % dp_shard:
        raise bad_value("rows", a.rows,
                        f"a whole number >= 1, a multiple of the data-parallel size dp_shard={dp_shard}",
                        "Or give --batch, sequences per data-parallel rank")
    print(f"note: --rows {a.rows} is the old spelling of --batch {a.rows // dp_shard} (sequences per "
          f"data-parallel rank, {dp_shard} of "
          "them)", file=sys.stderr)
    return a.rows // dp_shard


def _cmd_plan(a):
    from fsdp_kit import plan, plan_gpu, plan_validate
    if a.list_models:
        models = plan.list_models()
        emit(dict(models=models), a.json,
             "\n".join(f"{m['name']:<12}{m['parameters']:>16,}  {m['model_type']}, {m['layers']} "
                       f"layers, hidden {m['hidden_size']}"
                       for m in models))
        return
    if a.export_table:
        out = Path(a.export_table)
        check_output_file("export_table", a.export_table)  # before the planning, which takes minutes
        print(f"planning every setting of the docs planner's grid "
              f"({math.prod(len(v) for v in plan_gpu.PLANNER_GRID.values())} plans) ...",
              file=sys.stderr)
        table = plan_gpu.planner_table()
        out.write_text(json.dumps(table, separators=(",", ":")))
        print(f"wrote {out}: {len(table['plans'])} plans, {len(table['moments'])} peak moments", file=sys.stderr)
        return
    if a.validate:
        device, specs = plan_validate.validation_settings(a.nproc)  # the CUDA matrix where CUDA is available
        specs = [specs[i] for i in _settings(a.settings, len(specs))] if a.settings else specs
        if not a.quiet:
            print(f"running {len(specs)} settings on {device}, world sizes "
                  f"{sorted({s.world_size for s in specs})} ...", file=sys.stderr)
        result = plan_validate.validate(specs, launcher="torchrun", timeout=a.timeout, progress=not a.quiet)
        if a.plot:
            import matplotlib
            matplotlib.use("Agg")
            plan_validate.plot_validation(result).savefig(a.plot, dpi=100, bbox_inches="tight")
            print(f"wrote {a.plot}", file=sys.stderr)
        table = plan_validate.validation_table(result)
        emit(result, a.json,
             table + ("\n" + plan_validate.gpu_validation_table(result) if result["device"] == "cuda" else ""))
        return
    if not a.model: raise KitError("plan needs --model NAME|PATH (or --list-models, or --validate)")
    spec = plan_spec(a)
    if a.recommend:
        r = plan_gpu.recommend(spec, gpus=spec.world_size, gpu_mem_gb=a.gpu_mem_gb)
        emit(r, a.json, "\n".join(r["explanation"]) if isinstance(r["explanation"], list) else r["explanation"])
        return
    p = plan_gpu.plan_gpu(spec, gpu_mem_gb=a.gpu_mem_gb)
    # what the model assumes, in the text too
    emit(p, a.json, plan_gpu.plan_text(p) + "".join(f"\nnote: {n}" for n in p.notes))


RECOMMEND_SEARCHES = ("ac", "cpu_offload", "reshard_after_forward", "ce_chunks", "optimizer_in_backward",
                      "offload_activations")
RECOMMEND_IGNORES = ("fp8_all_gather", "compile", "layout")


def plan_spec(a):
    """The PlanSpec `fsdp-kit plan` predicts: its flags over `base_spec("plan")` (bf16 compute, one 2048-token sequence per GPU);
    --method gives the lora section (full: none, lora: a bf16 base, qlora: NF4), and --precision fp32 or pure-bf16 computes without
    mixed precision. A flag that would change nothing (a LoRA field with --method full, a setting --recommend searches) is refused."""
    from fsdp_kit.plan import METHODS
    if a.method not in METHODS: raise bad_value("method", a.method, "full, lora or qlora")
    lora = given(a, SECTIONS["lora"], PLAN_READS["lora"])
    if a.method == "full" and (extra := [k for k in ("r", "targets") if k in lora]):
        raise bad_value(extra[0], lora[extra[0]],
                        "only with --method lora or qlora, whose adapters it sets; --method full trains every "
                        "weight, so leave it out")
    for names, why in ((RECOMMEND_SEARCHES, "searches this setting itself"),
                       (RECOMMEND_IGNORES, "does not plan with it")):
        for name in names if a.recommend else ():
            value = getattr(a, name) if getattr(a,
                                                name) is not None else (getattr(a, f"old_{name}",
                                                                                None) or (None, None))[1]
            if value is not None: raise bad_value(name, value, f"left out with --recommend: --recommend {why}")
    spec = command_spec("plan", a)
    # --precision's compute dtype: none mixed
    mixed, words = spec.config.mixed_precision, {"fp32": "no", "pure-bf16": "no"}
    if a.precision in words:
        if a.mixed_precision is not None and mixed != "no":
            raise KitError(f"--mixed-precision={a.mixed_precision!r} is not allowed with "
                           f"--precision={a.precision!r}, which means "
                           "mixed_precision=no: pass one of them")
        if a.method != "full" and a.precision == "pure-bf16":
            raise KitError(f"--precision={a.precision!r} is not allowed with --method {a.method}: LoRA "
                           f"and QLoRA compute in bf16; "
                           "the frozen base's dtype is --base-dtype")
        spec = replace(spec, fsdp=replace(spec.config, mixed_precision="no"))
    base_dtype = lora.pop("base_dtype", None)
    if base_dtype not in (None, "bf16", "fp32"):
        raise bad_value("base_dtype", base_dtype, "bf16 or fp32 (None: fp32 for full, bf16 for a LoRA/QLoRA base)")
    if a.method == "full":  # a full fine-tune's weights in bf16 are pure bf16
        return replace(spec, lora=None,
                       step=replace(spec.step, precision="pure-bf16") if base_dtype == "bf16" else spec.step)
    adapters = METHODS[a.method]
    return replace(spec,
                   lora=replace(adapters, **lora,
                                **({"base_dtype": base_dtype} if base_dtype and a.method == "lora" else {})))


def _settings(text: str, count: int) -> list:
    "0-based indices of `--settings 1-3,7` (1-based, as the validation table numbers them) among `count` settings."
    out = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not (lo.isdigit() and (hi or lo).isdigit()) or not 1 <= int(lo) <= int(hi or lo) <= count:
            raise bad_value("settings", text, f"settings numbered 1 to {count} on this machine, as 1-3,7")
        out += range(int(lo) - 1, int(hi or lo))
    return sorted(set(out))


def _cmd_tour(a):
    from fsdp_kit.tour import tour
    tour(a.out, nproc=a.nproc, progress=not a.quiet)


def _nproc(text):
    "A whole number >= 1 (processes, nodes)."
    try: n = int(text)
    except ValueError: raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a whole number >= 1") from None
    if n < 1: raise argparse.ArgumentTypeError(f"{n} is not allowed: a whole number >= 1")
    return n


def _seconds(text):
    "A finite number of seconds > 0."
    try: x = float(text)
    except ValueError: x = math.nan
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a finite number of seconds > 0")
    return x


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows every option's default (off for a switch, none where unset), unless the help already
    says what the default does."""
    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is argparse.SUPPRESS or action.nargs == 0
            and action.default is None): return text
        if action.default is False: return f"{text} (default: off)"
        return f"{text} (default: none)" if action.default is None else f"{text} (default: %(default)s)"


EXIT_CODES = """exit status:
  0    all clear
  1    a check failed: a doctor FAIL (a WARN too with doctor --strict), or a rank that failed
  2    bad input: one line names the option as typed, the value and what is allowed
  74   the result could not be written (stdout or --json on a full disk, or past ulimit -f): one line says where and why
  130  interrupted (SIGINT, Ctrl-C); 143 SIGTERM; 129 SIGHUP: every process the command started is stopped first
  141  stdout closed by its reader (a pipe into head): the command stops without a traceback

progress (one line per finished unit of work) goes to stderr, results to stdout; --quiet silences progress."""


# comma lists, as are the FSDP group's list fields and compare's --reshard
LIST_OPTIONS = ("policies", "lora_targets", "targets", "settings", "reshard")


def refuse_blank_lists(a, command:str):
    """Refuse an empty or blank comma list, or one with an empty item, as typed: '' is a bad
    value, not an option left out."""
    from fsdp_kit.config import FSDPConfig
    lists = [*LIST_OPTIONS, *(name for name, (kind, _, _) in field_docs(FSDPConfig).items() if kind is list)]
    for dest in lists:
        value = getattr(a, dest, None)
        # an old spelling's value too
        value = (getattr(a, f"old_{dest}", None) or (None, None))[1] if value is None else value
        if isinstance(value, str) and any(not part.strip() for part in value.split(",")):
            raise bad_value(dest, value, "one or more values joined by commas, none of them empty")


# what each command reads of its spec (section -> fields; "" the spec's own), the spec it starts from, and its other
# options
FSDP_SETTINGS = ("reshard_after_forward", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params",
                 "cpu_offload",
                 "mixed_precision", "reduce_dtype", "ac", "state_dict_type", "cpu_ram_efficient_loading", "layout")
# train and cp-eval build their weights from a seed (no cpu_ram_efficient_loading to read) and write checkpoints as
# --state-dict says
# (train) or not at all (cp-eval); cp-eval shards with accelerate's layout
TRAIN_READS = {"": ("model", "steps", "batch", "seq_len", "seed", "check_parity"), "mesh": ("dp_replicate", "dp_shard"),
               # see RUN_FSDP
               "fsdp": tuple(f for f in FSDP_SETTINGS if f not in ("state_dict_type", "cpu_ram_efficient_loading")),
               "step": ("lr", "warmup", "precision", "ce_chunks", "optimizer_in_backward", "offload_activations"),
               "lora": ("r",)}
CKPT_READS = ("dir", "save_every", "state_dict", "resume", "overwrite", "keep")
GROUPS = {"": "run", "mesh": "mesh", "fsdp": "FSDP", "step": "step", "lora": "LoRA"}  # each section's group in --help
FSDP_FILE = ("--fsdp-config",
             dict(metavar="FILE", help="the FSDP config to run: a transformers fsdp_config .json or an accelerate "
                                   ".yaml; the FSDP flags given are laid over it (default: a "
                                   "unit per decoder layer, fp32)"))
TRAIN_OPTIONS = (
    FSDP_FILE,
    ("--nnodes", dict(type=_nproc, default=1, help="nodes of the job; run this command on each")),
    ("--node-rank", dict(type=int, default=0, help="this node's rank, 0 .. nnodes-1")),
    ("--rdzv-endpoint",
     dict(metavar="HOST:PORT", help="the c10d rendezvous (on the first node), needed with --nnodes > 1")),
    ("--rdzv-id", dict(default="fsdp_kit", help="a name every node of the job shares (e.g. $SLURM_JOB_ID)")),
    ("--rdzv-timeout",
     dict(type=_nproc, default=180, help="seconds this node waits at the rendezvous for the others before it fails")),
    ("--max-restarts",
     dict(type=int, default=0, help="times torchrun restarts the workers after a failure; they resume from --ckpt")),
    ("--inject-fault", dict(choices=FAULTS, help="make --fault-rank crash (SIGKILL) or hang after --fault-step, once")),
    ("--fault-rank", dict(type=int, default=1, help="the rank that fails")),
    ("--fault-step", dict(type=int, default=1, help="it fails after this step")))


MESH_READS = {"mesh": ("dp_replicate", "dp_shard", "cp")}
COMPARE_READS = {"": ("model", "batch", "seq_len", "policies", "reshard"), "fsdp": ("min_num_params",),
                 "step": ("gradient_checkpointing",)}
QLORA_READS = {"": ("model", "steps", "batch", "seq_len", "seed", "autocast", "load_in_8bit", "adapter_dir"),
               "step": ("lr", "warmup"), "lora": ("r", "quant_storage"), "fsdp": ("mixed_precision",)}
CP_READS = {"": ("model", "seq_len", "batch", "seed", "sp", "rotate", "mask", "gather"), "mesh": ("dp_shard", "cp"),
            "fsdp": tuple(f for f in FSDP_SETTINGS if f not in ("state_dict_type", "cpu_ram_efficient_loading",
                                                                "layout"))}
# the user's file: --fsdp-config
HF_READS = {"": ("workflow", "model", "steps", "batch", "seq_len", "lr", "seed", "out")}
DOCTOR_READS = {"": ("model", "method", "quant_storage", "mixed_precision", "dtype", "gradient_checkpointing",
                     "kbit_prepare", "steps",
                     # the user's file: --fsdp-config; nproc and timeout: the launch's options
                     "gpus", "gpu_mem_gb", "seed", "out")}
READS = {"train": TRAIN_READS, "mesh": MESH_READS, "compare": COMPARE_READS, "qlora": QLORA_READS, "cp-eval": CP_READS,
         "hf": HF_READS, "doctor": DOCTOR_READS}
PLAN_READS = {"": ("model", "world_size", "batch", "seq_len", "fp8_all_gather", "compile", "loading"), "mesh": ("cp",),
              "fsdp": ("reshard_after_forward", "cpu_offload", "mixed_precision", "reduce_dtype", "ac", "layout"),
              "step": ("precision", "ce_chunks", "optimizer_in_backward", "offload_activations"),
              "lora": ("r", "targets", "base_dtype")}
# the GPU planner models a unit per decoder layer: no wrap policy, no checkpoint format, no loading path
READS["plan"] = PLAN_READS
REQUIRED = {"doctor": ("model",)}  # fields a command cannot start without


def base_spec(command: str):
    "The spec `command` starts from, before its flags: its lab's spec with the command's own defaults."
    from fsdp_kit.train import TrainSpec
    from fsdp_kit.wrap import CompareSpec
    from fsdp_kit.qlora import QLoRASpec, nf4
    from fsdp_kit.cp import CPSpec
    from fsdp_kit.spec import RunSpec, StepSpec
    from fsdp_kit.mesh import MeshSpec
    from fsdp_kit.hf_run import HFRunSpec
    from fsdp_kit.doctor import DoctorSpec
    from fsdp_kit.plan import PlanSpec
    from fsdp_kit.config import FSDPConfig
    bases = {"train": TrainSpec, "mesh": RunSpec, "hf": lambda: HFRunSpec(workflow=None, batch=2, seq_len=32),
             "doctor": lambda: DoctorSpec(None, fsdp_config=None, steps=2),
             # 3 timed steps each
             "plan": lambda: PlanSpec(None, 8, batch=1, seq_len=2048, fsdp=FSDPConfig(mixed_precision="bf16")),
             "compare": lambda: CompareSpec("small", batch=2, steps=3),
             "qlora": lambda: QLoRASpec(lora=nf4(), step=StepSpec(lr=1e-2)),
             "cp-eval": lambda: CPSpec(seq_len=128, steps=1, mesh=MeshSpec(cp=2))}  # an evaluation is one forward pass
    return bases[command]()


def command_spec(command: str, a, fsdp_file: str = "file"):
    """`base_spec(command)` with the flags it reads laid over it (the FSDP section over `fsdp_file`,
    by default --fsdp-config's)."""
    fsdp_file = getattr(a, "fsdp_config", None) if fsdp_file == "file" else fsdp_file
    return spec_from_flags(a, base_spec(command), READS[command], SECTIONS, fsdp_file, say=_say)


FILE_HELP = "a transformers fsdp_config .json or an accelerate .yaml"
HF_OPTIONS = (("--fsdp-config", dict(required=True, metavar="FILE", help=FILE_HELP + " (required)")),
              ("--check",
               dict(action="store_true",
                    help="run accelerator.prepare, a Trainer and the kit on --nproc processes and report "
                                                         "what each did")))
DOCTOR_OPTIONS = (("--fsdp-config",
                   dict(required=True, metavar="FILE", help="your accelerate .yaml (run with accelerate launch) or "
                                         "transformers fsdp_config .json (run with TrainingArguments) (required)")),
                  ("--strict",
                   dict(action="store_true",
                        help="exit 1 on a WARN too, not only on a FAIL (for a CI job that gates on the doctor)")))
COMPARE_OPTIONS = (("--fsdp-config",
                    dict(metavar="FILE", help=f"run this config ({FILE_HELP}) instead of --policies x --reshard")),
                   ("--plot", dict(metavar="PNG", help="write the comparison plot here")))
QLORA_OPTIONS = (("--fsdp-config",
                  dict(metavar="FILE",
                       help=f"shard with this config ({FILE_HELP}); its mixed_precision gives way to the "
                                        "storage's param_dtype")),)
CP_OPTIONS = (("--fsdp-config", dict(metavar="FILE", help=f"shard the model with this config ({FILE_HELP})")),
              ("--rows",
               dict(type=int, default=None,
                    help="old spelling, kept for this release: sequences in the global batch, read as "
                              "--batch ROWS / dp_shard")))


PLAN_OPTIONS = (
    ("--gpu-mem-gb", dict(type=float, default=80, help="memory per GPU in GB")),
    ("--method",
     dict(default="full", help="full (every weight trains), lora (adapters on a bf16 base) or qlora (on an NF4 base)")),
    ("--recommend",
     dict(action="store_true",
          help="search reshard, checkpointing, offload, QLoRA, batch and GPU count; explain the choice")),
    ("--list-models", dict(action="store_true", help="list the model presets with exact parameter counts")),
    ("--validate",
     dict(action="store_true",
          help="run the validation matrix for real (world sizes up to --nproc) beside its predictions")),
    ("--settings",
     dict(metavar="LIST",
          help="with --validate: run only these settings of the matrix, numbered from 1 (1-3,7; default: all)")),
    ("--plot", dict(metavar="PNG", help="with --validate: write predicted vs measured per category here")),
    ("--export-table",
     dict(metavar="PATH",
          help="write every plan of the docs planner page's grid (plan_gpu.PLANNER_GRID) as JSON to PATH; "
                            "the page shows them without Python")))


def spec_flags(s, command: str):
    """The flag groups of what `command` reads of its spec (READS), each made from the fields'
    declarations (fsdp_kit.flags)."""
    base = base_spec(command)
    for section, names in READS[command].items():
        kind = type(base) if section == "" else SECTIONS[section]
        add_flags(s, GROUPS[section], kind, names, base if section == "" else getattr(base, section) or kind(),
                  REQUIRED.get(command, ()))
    if command == "train":
        from fsdp_kit.checkpoint import CheckpointSpec
        add_flags(s, "checkpoint", CheckpointSpec, CKPT_READS, None)


def options(s, table):
    """The command's options that are not fields of its spec (launch and output settings): one
    add_argument per row of `table`."""
    for flag, kw in table: s.add_argument(flag, **kw)


COMMON = (("--json",
           dict(nargs="?", const="-", metavar="PATH",
                help="write the result as JSON to PATH (stdout without PATH or with -)")),
          ("--quiet", dict(action="store_true", help="no progress lines on stderr (results and errors still print)")))
LAUNCHES = (("--nproc", dict(type=_nproc, default=2, help="processes to launch")),
            ("--timeout",
             dict(type=_seconds, default=120, help="seconds a collective or a step may wait before the run fails")),
            ("--debug",
             dict(action="store_true",
                  help="a failed or hung rank: print its whole traceback (default: its frames in the "
                                                       "kit's code and yours)")))
SLURM_OPTIONS = (("--nodes", dict(type=int, required=True, help="nodes to allocate")),
                 ("--gpus-per-node", dict(type=int, required=True, help="GPUs per node (one rank each)")),
                 ("--partition", dict(help="SLURM partition")), ("--time", dict(help="time limit, e.g. 01:00:00")),
                 ("--job-name", dict(default="fsdp-kit", help="#SBATCH --job-name")),
                 ("args",
                  dict(nargs=argparse.REMAINDER,
                       help="-- then the fsdp-kit command each node runs, e.g. -- train --steps 100")))
CKPT_OPTIONS = (("dir",
                 dict(metavar="DIR",
                      help="the checkpoint folder (--ckpt of fsdp-kit train), or one step-NNNNNN folder in it")),
                ("--to-full",
                 dict(dest="out", metavar="OUT",
                      help="convert the newest complete sharded checkpoint (or the step folder "
                                   "given) into OUT, a transformers folder from_pretrained reads")))
DOCS_OPTIONS = (("--out", dict(default="site", help="folder for the site")),
                ("--nbs", dict(help="the notebooks folder (default: nbs/ of this checkout)")),
                ("--quarto", dict(action=argparse.BooleanOptionalAction, default=None,
                                  help="force (or refuse) Quarto; default: use it where installed")))
# name, what it runs, its help, whether it launches processes, its options that are no fields of its spec (READS)
COMMANDS = (
    ("env", _cmd_env, "versions, device type, backend and GPU count", False, ()),
    ("mesh", _cmd_mesh, "build a device mesh on real processes and show which rank sits where", True, ()),
    ("train", _cmd_train,
     "a real FSDP2 training run (fully_shard per decoder layer, then the embeddings, the [norm, lm_head] tail and "
     "the root)", True, TRAIN_OPTIONS),
    ("slurm", _cmd_slurm,
     "print an sbatch script: one srun task per node, torchrun with the rendezvous on the first node", False,
     SLURM_OPTIONS),
    ("hf", _cmd_hf,
     "an FSDP config as TrainingArguments and as an accelerate YAML; --check runs both and says whether they sharded",
     True, HF_OPTIONS),
    ("doctor", _cmd_doctor,
     "run a small twin of your model with your FSDP config through its real entry point (accelerate launch or "
     "TrainingArguments) on --nproc CPU ranks, and check it for twelve silent failures: PASS, WARN or FAIL, "
     "each with its reason and fix",
     True, DOCTOR_OPTIONS),
    ("ckpt", _cmd_ckpt, "list the checkpoints in a folder and verify each against its manifest", False, CKPT_OPTIONS),
    ("compare", _cmd_compare,
     "measure memory and communication of wrap policies x reshard_after_forward on real processes", True,
     COMPARE_OPTIONS),
    ("qlora", _cmd_qlora,
     "LoRA on a 4-bit (bitsandbytes) base under FSDP2: packing, parity with one process, adapter, memory", True,
     QLORA_OPTIONS),
    ("cp-eval", _cmd_cp_eval,
     "evaluate under context parallelism (dp_shard x cp mesh, FSDP2 over dp_shard_cp) and compare with one "
     "process", True, CP_OPTIONS),
    ("plan", _cmd_plan,
     "predict per-GPU memory and communication of FSDP2 training; --validate checks the model against real runs here",
     True, PLAN_OPTIONS),
    ("tour", _cmd_tour, "run what the kit can show on this machine and write a report", True,
     (("--out", dict(default="tour", help="folder for the report")),)),
    ("docs", _cmd_docs, "build the docs site from the notebooks (Quarto where installed, else offline)", False,
     DOCS_OPTIONS))


def parser() -> argparse.ArgumentParser:
    """The `fsdp-kit` argument parser: a subcommand per row of COMMANDS, its spec's flags made from
    the fields it reads (READS)."""
    from fsdp_kit import __version__
    p = argparse.ArgumentParser(prog="fsdp-kit",
                                description="Learn and measure PyTorch FSDP2 on real process groups.",
                                epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"fsdp-kit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help, launches, table in COMMANDS:
        s = sub.add_parser(name, help=help, description=help, formatter_class=_Help, epilog=EXIT_CODES)
        # the doctor's twin runs the Trainer's whole stack
        s.set_defaults(fn=fn, **({"timeout": 300} if name == "doctor" else {}))
        options(s, COMMON + LAUNCHES * launches)
        if name in READS: spec_flags(s, name)
        options(s, table)
    return p


# a user's mistake names the spec's field; the command line shows the option the user typed instead
OPTION_NAMES = {"lora_r": "r", "lora_targets": "targets", "rotate_method": "rotate", "cp_size": "cp", "sp_size": "sp",
                "nprocs": "nproc", "dir": "ckpt", "lora": "lora-r",
                "seq_len": "seq-len", "reshard_after_forward": "reshard", "rdzv_timeout": "rdzv-timeout",
                "workflow": "run",
                "ce_chunks": "chunked-ce", "fsdp_config_file": "fsdp-config", "overwrite": "overwrite-ckpt"}


def option_message(error: KitError, sub: argparse.ArgumentParser, argv: list = ()) -> str:
    """The error's message with each `field=` of a spec written as the option of `sub` that sets it (`seq_len=` -> `--seq-len=`), in the
    spelling the user typed (`--seq=` for the old `--seq`). A value read from a file (`error.source`) keeps the file and its key."""
    if getattr(error, "source", None): return str(error)
    typed = {}  # dest -> the spelling in argv, old ones included
    for a in sub._actions:
        for opt in a.option_strings:
            if any(t == opt or t.startswith(opt + "=") for t in argv): typed.setdefault(a.dest, opt)
    # a hidden old spelling names nothing
    shown = [a for a in sub._actions if a.help != argparse.SUPPRESS and any(o.startswith("--") for o in a.option_strings)]
    options = {a.dest: typed.get(a.dest, next(o for o in a.option_strings if o.startswith("--"))) for a in shown}
    from fsdp_kit.config import FSDPConfig
    # an FSDP field not typed: the file's key
    options = {k: v for k, v in options.items() if k not in field_docs(FSDPConfig) or k in typed}
    aliases = {field: dest.replace("-", "_") for field, dest in OPTION_NAMES.items()}
    options |= {field: options[dest] for field, dest in aliases.items() if dest in options}
    # a positional, as its usage shows it (DIR)
    options |= {a.dest: a.metavar for a in sub._actions if not a.option_strings and a.metavar}
    # fsdp-kit ckpt DIR: the library calls it ckpt
    if "dir" in options and "ckpt" not in options: options["ckpt"] = options["dir"]
    # also the name of a key inside the user's YAML file: keep it as the file spells it
    options.pop("fsdp_config", None)
    text = re.sub(r"(?<![-\w.])(\w+)=", lambda m: f"{options[m.group(1)]}=" if m.group(1) in options else m.group(0),
                  str(error))
    # an option the library wrote out itself (`--seq-len=`), where the user typed another spelling of it
    for a in shown:
        for opt in a.option_strings:
            if typed.get(a.dest, opt) != opt: text = re.sub(rf"(?<![-\w]){re.escape(opt)}=", f"{typed[a.dest]}=", text)
    return text


EXIT_OUTPUT = 74  # sysexits.h's EX_IOERR: the result could not be written


class CheckFailed(Exception):
    "The command ran, and what it checked did not hold (a doctor FAIL, or a WARN under --strict): exit 1."


class Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the command: unwind (stopping torchrun and its workers) and
    exit 128 + the signal number."""
    def __init__(self, signum): self.signum = signum


def _raise_interrupted(signum, frame): raise Interrupted(signum)


def _drop_stdout():
    """Point stdout at /dev/null, so that what is left in its buffer goes nowhere at the interpreter's exit (a
    closed pipe, a full disk)."""
    try: os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError): pass  # a stdout that is no file (io.UnsupportedOperation is a ValueError)


def main(argv=None):
    "Entry point of the `fsdp-kit` command."
    # the command's own process: it forks no ranks (upstream)
    if argv is None: os.environ["FSDP_KIT_COMMAND_PID"] = str(os.getpid())
    argv = sys.argv[1:] if argv is None else list(argv)
    # torchrun, as a launch starts it (fsdp_kit.launch.agent_command); not a command for users
    if argv[:1] == ["agent"]:
        from fsdp_kit.launch import agent_main
        return agent_main(argv[1:])
    if argv[:1] == ["worker"]:  # what torchrun runs in each rank of a launch; not a command for users
        from fsdp_kit.launch import worker_main
        try: worker_main(argv[1])
        except BaseException: sys.exit(1)  # the traceback is in the run folder; the launching process reports it
        return
    p = parser()
    args = p.parse_args(argv)
    sub = p._subparsers._group_actions[0].choices[args.command]
    from fsdp_kit.launch import WorkerError, CommandScope
    old = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        check_json_dest(getattr(args, "json", None))
        refuse_blank_lists(args, args.command)
        for field in ("model", "fsdp_config"):
            if isinstance(getattr(args, field, None), str):
                setattr(args, field, example_path(field, getattr(args, field)))
        with CommandScope(): args.fn(args)
        sys.stdout.flush()  # a result stdout cannot take fails here, inside the command, not in the interpreter's exit
    except KitError as e:
        print(f"fsdp-kit {args.command}: error: {option_message(e, sub, argv)}", file=sys.stderr)
        sys.exit(2)
    except CheckFailed as e:
        print(f"fsdp-kit {args.command}: {e}", file=sys.stderr)
        sys.exit(1)
    except WorkerError as e:
        debug = getattr(args, "debug", False)
        print(f"fsdp-kit {args.command}: {e if debug else e.brief()}" + ("" if debug or not e.worker_traceback
                                                                         else "\n(--debug prints the whole trace)"),
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"fsdp-kit {args.command}: interrupted (SIGINT): the workers were stopped", file=sys.stderr)
        sys.exit(130)
    except Interrupted as e:
        print(f"fsdp-kit {args.command}: interrupted ({signal.Signals(e.signum).name}): the workers were stopped",
              file=sys.stderr)
        sys.exit(128 + e.signum)
    # stdout closed by its reader (`fsdp-kit train --json - | head`): the rest of the output is not wanted
    except BrokenPipeError:
        _drop_stdout()
        sys.exit(128 + signal.SIGPIPE)
    # the result could not be written: a full disk or `ulimit -f` under stdout or --json
    except (OutputError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in OUTPUT_ERRNOS: raise
        _drop_stdout()
        why = e if isinstance(e,
                              OutputError) else f"could not write {e.filename or 'the result to stdout'} ({_output_why(e)})"
        print(f"fsdp-kit {args.command}: error: {why}", file=sys.stderr)
        sys.exit(EXIT_OUTPUT)
    finally:
        for sig, handler in old.items(): signal.signal(sig, handler)
