"""The Trainer / Accelerate path: both spellings of a config and back; the silent CPU fallback to DDP is reported."""
import json, subprocess, sys
import pytest
import yaml
from fsdp_kit.config import FSDPConfig, load_fsdp_config, from_accelerate
from fsdp_kit.errors import KitError
from fsdp_kit.hf import training_arguments, accelerate_yaml, from_training_arguments, fsdp_report, require_fsdp2, _same
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(240)
CONFIGS = sorted((ROOT / "examples" / "fsdp_configs").iterdir())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_round_trip_through_both_spellings(path):
    cfg = load_fsdp_config(path)
    assert _same(from_training_arguments(training_arguments(cfg)), cfg)
    assert _same(from_accelerate(yaml.safe_load(accelerate_yaml(cfg))), cfg)


def test_training_arguments_are_accepted_by_transformers(tmp_path):
    # in a subprocess: importing TrainingArguments imports peft and bitsandbytes, after which this process could not fork workers
    code = f"""
from transformers import TrainingArguments
from fsdp_kit.config import FSDPConfig
from fsdp_kit.hf import training_arguments, from_training_arguments, _same
cfg = FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000, reshard_after_forward=False, mixed_precision="bf16")
args = TrainingArguments(output_dir={str(tmp_path)!r}, use_cpu=True, report_to=[], **training_arguments(cfg))
assert args.fsdp_config["reshard_after_forward"] is False and args.fsdp_config["min_num_params"] == 1000 and args.bf16
assert _same(from_training_arguments(args), cfg)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.parametrize("cfg,message", [
    (FSDPConfig(reshard_after_forward=4), "reshard_after_forward=4 is not allowed: true or false for transformers and accelerate"),
    (FSDPConfig(auto_wrap_policy="PER_LINEAR"), "auto_wrap_policy='PER_LINEAR' is not allowed"),
])
def test_settings_upstream_cannot_spell_are_refused(cfg, message):
    with pytest.raises(KitError, match=message.replace("(", r"\(")): training_arguments(cfg)
    with pytest.raises(KitError, match=message.replace("(", r"\(")): accelerate_yaml(cfg)


def test_require_fsdp2_refuses_an_unsharded_model():
    from fsdp_kit.models import build_model, model_config
    model = build_model(model_config("tiny"))
    report = fsdp_report(model, "accelerator.prepare")
    assert not report["sharded"] and report["kind"] == "not wrapped" and report["local_parameters"] == report["parameters"]
    with pytest.raises(KitError, match="accelerator.prepare did NOT shard the model: it is LlamaForCausalLM"):
        require_fsdp2(model, "accelerator.prepare")


def test_cli_check_reports_the_cpu_fallback(cli, tmp_path):
    out = tmp_path / "hf.json"
    res = cli("hf", "--fsdp-config", ROOT / "examples" / "fsdp_configs" / "transformers_fsdp_config.json", "--check", "--json", out)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["training_arguments"]["fsdp"] is True and r["training_arguments"]["fsdp_config"]["version"] == 2
    check = r["check"]
    assert check["world_size"] == 2
    assert check["trainer"]["kind"] == "DistributedDataParallel" and not check["trainer"]["sharded"]
    assert not check["accelerate"]["sharded"]
    assert "did NOT shard the model" in check["trainer"]["verdict"] and "did NOT shard the model" in res.stdout
    assert check["kit"]["sharded"] and check["kit"]["local_parameters"] * 2 == check["kit"]["parameters"]


def test_cli_hf_bad_config(cli, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 2, "reshard_after_forward": 3}))
    res = cli("hf", "--fsdp-config", bad)
    assert res.returncode == 2 and "reshard_after_forward=3 is not allowed" in res.stderr and "Traceback" not in res.stderr
