"The spec tree: each field name declared once across the `*Spec` classes and `FSDPConfig`; the sections every lab shares."
import ast, collections, json, math, os, subprocess, sys
import pytest
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent/"fsdp_kit"
# names declared in more than one spec class, each the same setting in each: the recipe labs' tree (RunSpec and its sections) and
# the flat specs of the labs that run upstream's entry point (EntrySpec: hf, doctor, the Trainer's CP evaluation; the PEFT guide's
# PeftSpec), which declare only the few settings they read instead of inheriting sections they would have to refuse
SAME_SETTING = {"model": "EntrySpec, RunSpec", "seed": "EntrySpec, RunSpec, PeftSpec", "batch": "RunSpec, HFRunSpec, CPTrainerSpec",
                "seq_len": "RunSpec, HFRunSpec, CPTrainerSpec", "steps": "RunSpec, HFRunSpec, DoctorSpec, PeftSpec",
                "lr": "StepSpec, HFRunSpec, PeftSpec", "mixed_precision": "FSDPConfig, DoctorSpec (a JSON's TrainingArguments bf16/fp16)",
                "quant_storage": "LoraSpec, DoctorSpec", "gradient_checkpointing": "StepSpec, DoctorSpec (the user's TrainingArguments)",
                "fsdp_config": "HFRunSpec, DoctorSpec (the user's file)", "out": "HFRunSpec, DoctorSpec (the output folder)",
                "check_parity": "TrainSpec, HFRunSpec"}


def declared_fields() -> dict:
    "Field name -> {module.Class} for every class named *Spec, and FSDPConfig, in fsdp_kit/*.py."
    out = collections.defaultdict(set)
    for path in sorted(PKG.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (node.name.endswith("Spec") or node.name == "FSDPConfig"):
                for s in node.body:
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id != "_":
                        out[s.target.id].add(f"{path.stem}.{node.name}")
    return out


def test_field_names_declared_once():
    "A name declared twice is one setting read by two families of labs (SAME_SETTING), never a second spelling of it."
    shared = {name: sorted(owners) for name, owners in declared_fields().items() if len(owners) > 1}
    assert set(shared) <= set(SAME_SETTING), {k: v for k, v in shared.items() if k not in SAME_SETTING}
    for name, owners in shared.items():
        assert {o.split(".")[1] for o in owners} <= set(SAME_SETTING[name].replace(",", " ").split()), (name, owners)


def test_ac_is_one_field_of_the_fsdp_config():
    from fsdp_kit.config import FSDPConfig, load_fsdp_config, EXAMPLES
    from fsdp_kit.ac import ac_policy
    cfg = load_fsdp_config(str(EXAMPLES / "fsdp_configs" / "transformers_fsdp_config.json"))
    assert (cfg.ac, cfg.activation_checkpointing, ac_policy(cfg)) == ("full", True, "full")
    assert (FSDPConfig().ac, FSDPConfig().activation_checkpointing) == ("none", False)
    assert "ac" in declared_fields() and declared_fields()["ac"] >= {"config.FSDPConfig"}


def test_train_spec_reads_the_shared_step_and_lora():
    from fsdp_kit.spec import StepSpec, LoraSpec
    from fsdp_kit.train import TrainSpec
    spec = TrainSpec(step=StepSpec(lr=1e-2, warmup=2), lora=LoraSpec(r=4)).check()
    assert (spec.step.lr, spec.step.warmup, spec.lora.r, spec.lora.targets) == (1e-2, 2, 4, "all-linear")
    assert not {"lr", "warmup", "lora_r", "ac"} & set(TrainSpec.__dataclass_fields__)


def test_plan_spec_embeds_the_fsdp_config():
    "PlanSpec has no FSDP field of its own: the planner reads the fsdp, step and lora sections; `asdict` records it, `from_dict` reads it."
    from dataclasses import asdict
    from fsdp_kit.plan import PlanSpec
    from fsdp_kit.config import FSDPConfig
    from fsdp_kit.spec import LoraSpec
    own = set(PlanSpec.__dataclass_fields__) - set(__import__("fsdp_kit.spec").spec.RunSpec.__dataclass_fields__)
    assert own == {"world_size", "fp8_all_gather", "compile", "loading"} and not own & set(FSDPConfig.__dataclass_fields__)
    fsdp = FSDPConfig(ac="full", reshard_after_forward=False)
    spec = PlanSpec("small", 2, batch=2, fsdp=fsdp, lora=LoraSpec(r=4, base_dtype="bf16")).check()
    assert (spec.config.ac, spec.config.reshard_after_forward, spec.lora.r, spec.method, spec.batch) == ("full", False, 4, "lora", 2)
    assert PlanSpec.from_dict(json.loads(json.dumps(asdict(spec)))) == spec


SITE = '''
import os
from fsdp_kit.config import FSDPConfig
_check = FSDPConfig.check
def counted(self):
    with open(os.environ["CHECK_COUNT_FILE"], "a") as f: f.write(f"{os.getpid()}\\n")
    return _check(self)
FSDPConfig.check = counted
'''


@pytest.fixture(scope="module")
def savers_run(tmp_path_factory):
    """One `fsdp-kit train --fsdp-config F` with pure bf16, chunked cross-entropy, the optimizer in backward and activations on the
    host, on 2 gloo ranks, every process of it (launcher, torchrun, ranks) counting its FSDPConfig.check calls: (process, result, pids)."""
    tmp_path = tmp_path_factory.mktemp("savers")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE)
    count, out = tmp_path / "checks.txt", tmp_path / "r.json"
    config = PKG / "examples" / "fsdp_configs" / "transformers_fsdp_config.json"
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, CHECK_COUNT_FILE=str(count))
    cmd = [sys.executable, "-m", "fsdp_kit", "train", "--nproc", "2", "--steps", "2", "--seq-len", "32", "--precision", "pure-bf16",
           "--chunked-ce", "4", "--optimizer-in-backward", "--offload-activations", "--fsdp-config", str(config), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), count.read_text().split()


@pytest.mark.timeout(240)
def test_train_runs_the_step_savers_the_planner_models(savers_run):
    "fsdp-kit train with pure bf16, chunked cross-entropy, the optimizer in backward and activations on the host, on 2 gloo ranks."
    proc, r, _ = savers_run
    assert len(r["losses"]) == 2 and all(math.isfinite(l) for l in r["losses"])
    assert r["step"] == dict(lr=3e-3, warmup=0, precision="pure-bf16", ce_chunks=4, optimizer_in_backward=True, offload_activations=True,
                             gradient_checkpointing=False)
    assert r["config"]["mixed_precision"] == "no"
    assert "step: pure-bf16, loss in 4 chunks, optimizer in backward, activations offloaded to host" in proc.stdout


def test_train_and_the_wrap_lab_share_one_step_function():
    "train.train_loop and wrap.run_config both call ac.train_step; neither computes a loss of its own."
    import inspect
    from fsdp_kit import train, wrap
    for fn in (train.train_loop, wrap.run_config):
        src = inspect.getsource(fn)
        assert "train_step(" in src and ".backward()" not in src and "labels=tokens" not in src, fn.__name__


@pytest.mark.timeout(240)
def test_a_train_run_checks_its_fsdp_config_once(savers_run):
    "One `fsdp-kit train --fsdp-config F`: FSDPConfig.check runs once, in the launching process; no worker checks again."
    pids = savers_run[2]
    assert len(pids) == 1, pids


def test_a_spec_read_back_from_json_is_the_same_spec():
    "from_dict rebuilds what asdict flattened, RunSpec's sections as their dataclasses (the doctor's twin reads its spec back this way)."
    import json
    from dataclasses import asdict
    from fsdp_kit.doctor import DoctorSpec
    from fsdp_kit.mesh import MeshSpec
    from fsdp_kit.qlora import QLoRASpec, nf4
    from fsdp_kit.spec import StepSpec, LoraSpec
    doctor = DoctorSpec(model="tests/doctor/qwen2-0.5b/config.json", fsdp_config="x.json", method="qlora", mixed_precision="bf16",
                        quant_storage="bfloat16", gradient_checkpointing=True)
    qlora = QLoRASpec(mesh=MeshSpec(dp_shard=2), lora=nf4("float16", r=4), step=StepSpec(lr=1e-2, warmup=2))
    for spec in (doctor, qlora):
        back = type(spec).from_dict(json.loads(json.dumps(asdict(spec))))
        assert back == spec, back
    back = QLoRASpec.from_dict(json.loads(json.dumps(asdict(qlora))))
    assert (type(back.mesh), type(back.step), type(back.lora)) == (MeshSpec, StepSpec, LoraSpec), back


MOVED = [  # a setting given to a spec where it no longer lives: (the spec, the keyword, a phrase of its KitError)
    ("train.TrainSpec", dict(mixed_precision="bf16"), "mixed_precision='bf16' is not a field of TrainSpec: it lives in the fsdp section, "
                                                      "as fsdp.mixed_precision: TrainSpec(fsdp=FSDPConfig(mixed_precision='bf16'))"),
    ("train.TrainSpec", dict(lr=1e-3), "lr=0.001 is not a field of TrainSpec: it lives in the step section, as step.lr"),
    ("train.TrainSpec", dict(dp_shard=2), "it lives in the mesh section, as mesh.dp_shard: TrainSpec(mesh=MeshSpec(dp_shard=2))"),
    ("qlora.QLoRASpec", dict(quant_storage="bfloat16"), "it lives in the lora section, as lora.quant_storage"),
    ("cp.CPSpec", dict(reshard_after_forward=False), "it lives in the fsdp section, as fsdp.reshard_after_forward"),
    ("plan.PlanSpec", dict(cpu_offload=True), "as fsdp.cpu_offload: PlanSpec(fsdp=FSDPConfig(cpu_offload=True))"),
    ("train.TrainSpec", dict(stepz=3), "stepz=3 is not a field of TrainSpec: its fields are model, seed, batch, seq_len, steps, mesh"),
]


@pytest.mark.parametrize("spec, given, phrase", MOVED, ids=[f"{s}-{next(iter(g))}" for s, g, _ in MOVED])
def test_a_moved_field_names_its_section(spec, given, phrase):
    "TrainSpec(mixed_precision=...) raised Python's own TypeError; now the kit's KitError names where the setting lives."
    import importlib
    from fsdp_kit.errors import KitError
    module, name = spec.split(".")
    cls = getattr(importlib.import_module(f"fsdp_kit.{module}"), name)
    with pytest.raises(KitError) as e: cls(**given)
    assert phrase in str(e.value)
