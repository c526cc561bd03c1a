"""Every setting of an FSDP config reaches `fully_shard` through `apply_fsdp`: a run's units and memory move as the setting says,
and `fsdp-kit train` runs the users' own config files."""
import json, os, re, subprocess, sys
from dataclasses import asdict
from pathlib import Path
import pytest
from tests.conftest import ROOT
from tests.helpers import train_each, fsdp_settings
from fsdp_kit.config import FSDPConfig, load_fsdp_config
from fsdp_kit.launch import launch
from fsdp_kit.models import build_model, model_config
from fsdp_kit.train import TrainSpec
from fsdp_kit.wrap import plan_units

pytestmark = pytest.mark.timeout(300)
EXAMPLES = sorted((ROOT / "examples" / "fsdp_configs").iterdir())


def test_apply_fsdp_is_the_only_call_of_fully_shard():
    calls = [f"{p.name}:{n}" for p in sorted((ROOT / "fsdp_kit").glob("*.py")) for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bfully_shard\(", line) and not line.lstrip().startswith(("#", '"'))]
    assert len(calls) == 1 and calls[0].startswith("wrap.py:"), calls


@pytest.fixture(scope="module")
def runs():
    "Two steps of tiny under each setting, on 2 ranks, in one launch."
    settings = dict(default=FSDPConfig(), no_wrap=FSDPConfig(auto_wrap_policy="NO_WRAP"),
                    size=FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=108_864),  # tiny's size_floor
                    checkpointing=FSDPConfig(ac="full"), offload=FSDPConfig(cpu_offload=True))
    specs = [TrainSpec(model="tiny", steps=2, seq_len=128, fsdp=c) for c in settings.values()]
    policies = ("selective-layer:2", "selective-op")  # the other policies (fsdp_kit.ac)
    specs += [TrainSpec(model="tiny", steps=2, seq_len=128, fsdp=FSDPConfig(ac=ac)) for ac in policies]
    return dict(zip([*settings, "layer2", "op"], launch(train_each, specs, nprocs=2)))


def test_units_are_what_the_policy_plans(runs):
    meta = build_model(model_config("tiny"), device="meta")
    for name, r in runs.items():
        assert r.units == [asdict(u)
                           for u in plan_units(meta, FSDPConfig(**{k: v for k, v in r.config.items() if k not in ("notes", "source")}))]
    # accelerate's carve-out: the embeddings, the tail (final norm, lm_head), the root
    edges = ["model.embed_tokens", "model.norm+lm_head", ""]
    assert [u["module"] for u in runs["default"].units] == ["model.layers.1", "model.layers.0"] + edges
    # the root holds the layers
    assert [u["module"] for u in runs["no_wrap"].units] == edges and runs["no_wrap"].units[-1]["parameters"] > 0
    assert [u["reshard_after_forward"] for u in runs["default"].units] == [True, True, True, False, False]
    assert runs["size"].units == runs["no_wrap"].units  # accelerate's FSDP2 size rule at tiny's size_floor selects nothing below the root


def test_memory_moves_as_each_setting_should(runs):
    peak = {name: r.peak_bytes for name, r in runs.items()}
    assert peak["no_wrap"]["total"] > peak["default"]["total"]  # every layer gathered at once
    assert peak["no_wrap"]["unsharded_params"] > peak["default"]["unsharded_params"]
    assert peak["checkpointing"]["activations"] < peak["default"]["activations"] / 2  # only layer inputs kept for backward
    # selective-op keeps half the matmuls
    assert peak["checkpointing"]["activations"] < peak["op"]["activations"] < peak["default"]["activations"]
    # layer 1 of 2 checkpointed
    assert peak["checkpointing"]["activations"] < peak["layer2"]["activations"] < peak["default"]["activations"]
    assert [runs[n].ac for n in ("default", "checkpointing", "layer2", "op")] == ["none", "full", "selective-layer:2", "selective-op"]
    assert runs["op"].losses == runs["layer2"].losses == runs["default"].losses  # recomputation changes no number
    # on a CPU-only machine host and device are one memory: CPUOffloadPolicy(pin_memory=False) copies, but moves nothing
    # (the state it holds is the same byte for byte; on a busy machine one more gathered unit, 65,792 bytes, can be in flight at the peak)
    state = ("sharded_params", "sharded_grads", "optimizer_state", "buffers", "activations")
    assert runs["offload"].config["cpu_offload"] and {k: peak["offload"][k] for k in state} == {k: peak["default"][k] for k in state}
    assert abs(peak["offload"]["total"] - peak["default"]["total"]) <= 0.02 * peak["default"]["total"]
    for r in runs.values(): assert r.losses[-1] < r.losses[0]


def test_every_field_reaches_fully_shard():
    "What each unit's FSDP state holds after apply_fsdp: offload policy, compute and reduce dtypes, reshard, checkpoint wrappers."
    default, custom = launch(fsdp_settings, [FSDPConfig(), FSDPConfig(cpu_offload=True, mixed_precision="bf16", reduce_dtype="fp32",
                                                                      ac="full", reshard_after_forward=False)],
                                                                      nprocs=2)
    # the root holds nothing: no parameter group
    units = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert [u["module"] for u in default] == units == [u["module"] for u in custom]
    assert {(u["offload"], u["param_dtype"], u["reduce_dtype"]) for u in default} == {("OffloadPolicy", "None", "None")}
    assert {(u["offload"], u["param_dtype"], u["reduce_dtype"])
            for u in custom} == {("CPUOffloadPolicy", "torch.bfloat16", "torch.float32")}
    assert ([u["cls"] for u in custom[1:3]] == ["FSDPCheckpointWrapper"] * 2
            and [u["cls"] for u in default[1:3]] == ["FSDPLlamaDecoderLayer"] * 2)
    # the tail keeps its weights
    assert all(u["reshard_to"] is None for u in custom) and [u["reshard_to"] for u in default] == [2, 2, 2, None, None]
    bf16 = launch(fsdp_settings, [FSDPConfig(mixed_precision="bf16")], nprocs=2)[0]
    assert {u["reduce_dtype"] for u in bf16} == {"torch.bfloat16"}  # accelerate's default: gradients reduced in the compute dtype


def test_reshard_to_smaller_groups_sits_between_true_and_false():
    "reshard_after_forward=2 on 4 ranks keeps a copy sharded over 2 ranks after forward: more than True frees, less than False keeps."
    specs = [TrainSpec(model="tiny", steps=1, seq_len=32, fsdp=FSDPConfig(reshard_after_forward=r)) for r in (True, 2, False)]
    true, two, false = (r.peak_bytes["total"] for r in launch(train_each, specs, nprocs=4))
    assert true < two < false, (true, two, false)


def _train_cli(config: Path, tmp_path) -> subprocess.Popen:
    args = ["train", "--nproc", 2, "--model", "tiny", "--steps", 3, "--fsdp-config", config, "--json", tmp_path / f"{config.stem}.json"]
    if not load_fsdp_config(config).mixed_precision != "no": args.append("--check-parity")
    return subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_train_runs_each_example_config_and_reports_it(tmp_path):
    procs = {p: _train_cli(p, tmp_path) for p in EXAMPLES}
    for path, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        r, cfg = json.loads((tmp_path / f"{path.stem}.json").read_text()), load_fsdp_config(path)
        assert {k: v for k, v in r["config"].items() if k != "notes"} == {k: v for k, v in asdict(cfg).items() if k != "notes"}
        # 2 layers, embeddings, tail, root
        assert r["units"][-1]["module"] == "" and len(r["units"]) == 5 and r["losses"][-1] < r["losses"][0]
        assert r["mesh"] == dict(dp_replicate=1, dp_shard=2, cp=1)  # the mesh it ran on, -1 filled in
        assert f"{len(r['units'])} FSDP units (the root included) by {cfg.auto_wrap_policy}" in out
        assert (r["timing"]["steps"] == 2
                and re.search(r"step [\d.]+ ms \(median of 2, min [\d.]+, max [\d.]+; warm-up excluded\)", out)), out
        if r["max_param_diff"] is not None: assert r["max_param_diff"] <= 1e-4


def test_flags_override_the_file_and_say_so(tmp_path):
    yaml = ROOT / "examples" / "fsdp_configs" / "accelerate_fsdp_lora.yaml"
    from tests.badinput import Case, check_case
    check_case(Case("parity-with-a-bf16-file", ["train", "--fsdp-config", yaml, "--check-parity"], 2, "--check-parity=True"), tmp_path)
    out = subprocess.run([sys.executable, "-m", "fsdp_kit", "train", "--steps", "2", "--fsdp-config", str(yaml), "--mixed-precision", "no",
                          "--check-parity", "--json", "-"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"note: --mixed-precision no overrides mixed_precision='bf16' from {yaml}" in out.stderr
    assert json.loads(out.stdout)["config"]["mixed_precision"] == "no"


def test_qlora_and_cp_eval_run_the_users_config(tmp_path):
    "The QLoRA and CP-eval commands shard with the user's file too (the QLoRA lab's compute dtype is the storage's, and says so)."
    configs = ROOT / "examples" / "fsdp_configs"
    from tests.conftest import left_behind, private_tmp
    tmps = [private_tmp(), private_tmp()]  # one TMPDIR per command, to find what each leaves behind
    run = lambda tmp, *args: subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, env=os.environ | {"TMPDIR": str(tmp)})
    cp = run(tmps[0], "cp-eval", "--nproc", 2, "--cp", 2, "--fsdp-config", configs / "transformers_fsdp_config.json",
             "--json", tmp_path / "cp.json", "--quiet")  # also cp-eval's --quiet case of test_cli_contract.test_long_labs_print_...
    qlora = run(tmps[1], "qlora", "--nproc", 2, "--steps", 3, "--fsdp-config", configs / "accelerate_fsdp_qlora.yaml", "--json",
                tmp_path / "q.json", "--adapter-dir", tmp_path / "adapter")
    outputs = []
    for proc in (cp, qlora):
        outputs.append(proc.communicate(timeout=240))
        assert proc.returncode == 0, outputs[-1][1][-3000:]
    (cp_out, cp_err), (out, err) = outputs
    assert not re.search(r"^part \d/", cp_out + cp_err, re.M) and cp_out.strip(), cp_err[-3000:]  # --quiet: no progress line
    # qlora's progress on stderr (test_cli_contract.test_long_labs_print_...'s qlora case, on this run): a line per part, none on stdout
    parts = re.findall(r"^part (\d)/5 (.+?): ([\d.]+) s elapsed, about (\d+) s left$", err, re.M)
    assert [int(p[0]) for p in parts] == [1, 2, 3, 4, 5] and parts[-1][3] == "0", err[-2000:]
    assert float(parts[0][2]) <= float(parts[-1][2]) and "part 1/5" not in out
    for tmp in tmps:  # 1 s after each ended: no temporary folder, no process
        assert not (left := left_behind(tmp)), left
    r = json.loads((tmp_path / "cp.json").read_text())
    assert r["config"]["ac"] == "full" and r["config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert len(r["units"]) == 5 and r["loss_diff"] < 1e-5
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["config"]["cpu_offload"] and q["config"]["mixed_precision"] == "bf16" and q["param_dtype"] == "bfloat16"
    assert q["losses"][-1] < q["losses"][0] and q["sharded_vs_unsharded_loss_diff"] < 3e-3
    assert q["adapter"]["path"] == str(tmp_path / "adapter") and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert "replaces mixed_precision='no' from" in err
