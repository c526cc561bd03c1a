"""Checkpoints: resume bit-identical (sharded and full), from_pretrained, SIGKILL mid-save, damage, LoRA. Resuming a 2-rank
checkpoint on another world size is asserted by the checkpoint lesson (nbs/07_checkpoint.ipynb, "resumed a 2-rank checkpoint")."""
import json, os, shutil, signal, subprocess, sys, time
from pathlib import Path
import pytest
from tests.conftest import ROOT
from tests.badinput import refused

pytestmark = pytest.mark.timeout(300)
TRAIN = ("train", "--nproc", 2, "--model", "tiny", "--warmup", 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "One uninterrupted 20-step run, and for each format 10 steps with checkpoints then a resume to 20: one launch, the runs in turn."
    from dataclasses import asdict
    from fsdp_kit.checkpoint import CheckpointSpec
    from fsdp_kit.launch import launch
    from fsdp_kit.train import TrainSpec
    from fsdp_kit.spec import StepSpec
    from tests.helpers import train_each
    tmp = tmp_path_factory.mktemp("ckpt")
    spec = lambda steps, ckpt=None: TrainSpec(model="tiny", step=StepSpec(warmup=3), steps=steps, ckpt=ckpt)
    specs = [spec(20)]
    for kind in ("sharded", "full"):
        specs += [spec(10, CheckpointSpec(str(tmp / kind), save_every=5, state_dict=kind)),
                  spec(20, CheckpointSpec(str(tmp / kind), save_every=5, state_dict=kind, resume=True))]
    results = [json.loads(json.dumps(asdict(r))) for r in launch(train_each, specs, nprocs=2, timeout=240)]
    return dict(tmp=tmp, straight=results[0], sharded=results[1:3], full=results[3:5])


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_resume_is_bit_identical(runs, kind):
    first, second = runs[kind]
    assert first["first_step"] == 0 and second["first_step"] == 10
    assert first["checkpoint"]["saved_steps"] == [5, 10] and second["checkpoint"]["saved_steps"] == [15, 20]
    assert second["checkpoint"]["resumed_from"]["step"] == 10
    assert first["losses"] + second["losses"] == runs["straight"]["losses"]  # equal, not close


def test_full_checkpoint_loads_with_from_pretrained(runs):
    import torch
    from transformers import AutoModelForCausalLM
    from fsdp_kit.models import synthetic_tokens
    latest = runs["tmp"] / "full" / "latest"
    assert os.readlink(latest) == "step-000020"
    assert {"config.json", "model.safetensors", "optimizer.pt", "manifest.json"} <= set(os.listdir(latest))
    model = AutoModelForCausalLM.from_pretrained(latest)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == runs["straight"]["n_params"]
    with torch.no_grad():
        loss = model(input_ids=synthetic_tokens(256, 8, 64, step=19), labels=synthetic_tokens(256, 8, 64, step=19)).loss.item()
    assert loss < runs["straight"]["losses"][19]  # trained weights: lower than the loss before step 20's update


def test_sharded_checkpoint_converts_to_full(runs, tmp_path):
    "fsdp-kit ckpt DIR --to-full OUT."
    # the sharded run's weights, whole, equal the full run's bit for bit (the two runs trained alike); from_pretrained reads them.
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from tests.badinput import Case, check_case, run_case
    out = tmp_path / "exported"
    code, _, err = run_case(Case("to-full", ["ckpt", runs["tmp"] / "sharded", "--to-full", out], 0, ""), tmp_path)
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]  # no optimizer, no manifest
    exported, full = load_file(out / "model.safetensors"), load_file(runs["tmp"] / "full" / "latest" / "model.safetensors")
    assert sorted(exported) == sorted(full) and all(torch.equal(exported[k], full[k]) for k in full)
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters()) == runs["straight"]["n_params"]
    check_case(Case("to-full-again", ["ckpt", runs["tmp"] / "sharded", "--to-full", out], 2, "--to-full="), tmp_path)
    check_case(Case("to-full-of-a-full", ["ckpt", runs["tmp"] / "full", "--to-full", tmp_path / "x"], 2, "this one is full already"),
               tmp_path)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".tmp-*"))


def _tree(pid):
    import psutil
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def _kill_mid_save(args, ck, deadline=120):
    "Start `fsdp-kit train ARGS`, wait until a save is in progress (a .tmp- folder), SIGKILL every process of it; return the killed steps."
    import psutil
    # every process dies here, the command's janitor too: its temporary folder stays there, not in the session's
    own_tmp = Path(ck).parent / "tmpdir"
    own_tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=os.environ | {"TMPDIR": str(own_tmp)})
    start = time.monotonic()
    try:
        while True:
            assert proc.poll() is None, "the run ended before a save could be interrupted"
            assert time.monotonic() - start < deadline, "no save started"
            tmp = list(Path(ck).glob(".tmp-step-*"))
            if tmp and list(Path(ck).glob("step-*")):
                procs = _tree(proc.pid)
                for p in procs:
                    try: p.send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess: pass
                proc.wait(10)
                gone, alive = psutil.wait_procs(procs, timeout=10)
                assert not alive, f"left behind: {alive}"
                return int(tmp[0].name.split("-")[-1]), tmp[0].exists()  # the step being saved; still unpublished?
            time.sleep(0.001)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)


def test_sigkill_while_saving_three_times(cli, runs, tmp_path):
    from fsdp_kit.checkpoint import find_checkpoint, verify
    ck = tmp_path / "killed"
    args = [*TRAIN, "--steps", 20, "--ckpt", ck, "--save-every", 1]
    mid_save, attempts = 0, 0
    while mid_save < 3:
        attempts += 1
        assert attempts <= 6, "could not kill the run during a save"
        killed_at, unpublished = _kill_mid_save(args + (["--resume"] if attempts > 1 else []), ck)
        folder, notes = find_checkpoint(ck)
        assert folder is not None and verify(folder) == []
        assert verify(ck / os.readlink(ck / "latest")) == []  # `latest` names a complete checkpoint
        last = int(folder.name.split("-")[-1])
        if unpublished:  # killed mid-save: that save never became a checkpoint, the one before it is intact
            mid_save += 1
            assert last == killed_at - 1, (last, killed_at)
    out = tmp_path / "final.json"
    res = cli(*args, "--resume", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["first_step"] == last and r["checkpoint"]["resumed_from"]["step"] == last
    assert r["losses"] == runs["straight"]["losses"][last:]  # the interrupted run ends exactly where the uninterrupted one did
    assert not list(ck.glob(".tmp-*"))


def test_damaged_checkpoint_is_skipped_then_refused(cli, runs, tmp_path):
    ck = tmp_path / "damaged"
    shutil.copytree(runs["tmp"] / "full", ck, symlinks=True)
    weights = ck / "step-000020" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    from tests.badinput import Case, run_case
    code, listing, _ = run_case(Case("ckpt-listing", ["ckpt", ck], 0, ""), tmp_path)
    assert code == 0 and "step-000020 (latest): DAMAGED: model.safetensors has 1,000 bytes" in listing
    out = tmp_path / "resumed.json"
    res = cli(*TRAIN, "--steps", 20, "--ckpt", ck, "--state-dict", "full", "--resume", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipped step-000020: model.safetensors has 1,000 bytes" in res.stderr
    r = json.loads(out.read_text())
    assert r["first_step"] == 15 and r["losses"] == runs["straight"]["losses"][15:]
    for folder in ck.glob("step-*"): (folder / "trainer_state.pt").write_bytes(b"x")
    code, _, err = run_case(Case("damaged-everywhere", [*TRAIN, "--steps", 20, "--ckpt", ck, "--resume"], 2, ""), tmp_path)
    assert code == 2 and "Traceback" not in err
    assert "no complete checkpoint in" in err and "trainer_state.pt has 1 bytes" in err


def test_lora_adapter_saved_whole_and_reloads(cli, tmp_path):
    out = tmp_path / "lora.json"
    res = cli("train", "--nproc", 2, "--model", "tiny", "--steps", 6, "--lr", "1e-2", "--lora", 8, "--ckpt", tmp_path / "ck", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    a = r["adapter"]
    assert r["losses"][-1] < r["losses"][0]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(a["files"]) and a["tensors"] == 28
    assert a["every_rank_share_saved"] and a["reload_loss_diff"] < 1e-5 and a["disabled_vs_base_diff"] < 1e-5
    # reload here too, in a process that never saw the run (a subprocess: importing peft here would stop later tests from forking)
    code = ("import torch; from peft import PeftModel; from fsdp_kit.models import build_model, model_config, synthetic_tokens\n"
            f"model = PeftModel.from_pretrained(build_model(model_config('tiny'), 0), {a['path']!r})\n"
            "tokens = synthetic_tokens(256, 4, 64, step=10_000)\n"
            "with torch.no_grad(): print(model(input_ids=tokens, labels=tokens).loss.item())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert abs(float(res.stdout.split()[-1]) - a["sharded_loss"]) < 1e-5
    assert os.path.isdir(tmp_path / "ck" / "latest" / "adapter")


@pytest.mark.parametrize("args,message", [
    (("--ckpt", "X", "--state-dict", "local"), "--state-dict='local' is not allowed: sharded or full"),
    (("--resume",), "--resume needs --ckpt DIR"),
    (("--ckpt", "X", "--save-every", -1), "--save-every=-1 is not allowed: a whole number >= 0"),
    (("--ckpt", "pyproject.toml"), "is not allowed: a folder (this is a file)"),
    (("--lora", 4, "--check-parity"), "--check-parity=True is not allowed: a full fine-tune from step 0"),
])
def test_bad_checkpoint_options(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # relative folders (X) are made here; pyproject.toml is a file here too
    (tmp_path / "pyproject.toml").write_text("")
    refused(["train", "--nproc", 2, *args], message, tmp_path)


def test_resume_refuses_another_models_checkpoint(runs, tmp_path):
    from tests.conftest import EXAMPLES
    from tests.badinput import run_case, Case
    code, _, err = run_case(Case("other-model", ["train", "--nproc", "2", "--model", str(EXAMPLES / "qwen2-tiny" / "config.json"),
                                                 "--ckpt", str(runs["tmp"] / "sharded"), "--resume"], 2, ""), tmp_path)
    assert code == 2 and "Traceback" not in err
    assert "model=" in err and "as the checkpoint" in err and "'tiny'" in err
