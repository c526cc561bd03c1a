"""`fsdp-kit doctor`'s other FAIL / PASS pairs on 2 CPU ranks (a second file, so pytest-xdist runs it beside test_doctor.py), the command's
JSON on the seeds' QLoRA YAML, and bad input refused in one line with exit 2."""
import json, subprocess, sys
import pytest
from tests.test_doctor import statuses, QWEN, LLAMA, HERE, THREE_FAILS, SEED_QLORA

pytestmark = pytest.mark.timeout(400)
QLORA_BF16 = str(HERE / "qlora_bf16.yaml")  # FSDP2, mixed_precision bf16, FULL_STATE_DICT


def test_seed_qlora_yaml_through_the_command():
    "The seeds' QLoRA YAML as it is: accelerate builds FSDP1 without fsdp_version; bitsandbytes' default uint8 storage is left out of FSDP by "
    "accelerate (replicated); Trainer.save_model writes nothing under SHARDED_STATE_DICT; keys FSDP2 does not use."
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", "doctor", "--model", "examples/configs/qwen2-tiny/config.json", "--fsdp-config",
                          SEED_QLORA, "--method", "qlora", "--json", "-"], capture_output=True, text=True, timeout=380)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)
    assert set(r) >= {"checks", "twin", "versions"} and set(r["versions"]) >= {"torch", "transformers", "accelerate", "peft", "bitsandbytes"}
    assert all(set(c) == {"name", "status", "reason", "fix"} for c in r["checks"]) and len(r["checks"]) == 12
    got = {c["name"]: c["status"] for c in r["checks"]}
    assert (got["fsdp_version"], got["quant_storage"], got["saving"], got["keys"]) == ("FAIL", "FAIL", "FAIL", "WARN"), got
    reasons = {c["name"]: c["reason"] for c in r["checks"]}
    assert "fsdp_version 1" in reasons["fsdp_version"] and "bnb_4bit_quant_storage=uint8" in reasons["quant_storage"]
    assert "wrote nothing" in reasons["saving"] and "FAIL" in res.stderr  # the report on stderr beside the JSON


def test_size_threshold_master_weights_cp_key():
    "SIZE_BASED_WRAP above every layer wraps no layer; a bf16 load without mixed precision trains bf16 weights; transformers never reads "
    "fsdp_config's cp_size; cpu_ram_efficient_loading off: every rank reads the checkpoint (Llama-2-7B's shape, untied)."
    s = statuses(model=LLAMA, fsdp_config=THREE_FAILS, dtype="bfloat16")
    assert (s["wrap"][0], s["mixed_precision"][0], s["context_parallel"][0], s["saving"][0]) == ("FAIL", "FAIL", "FAIL", "FAIL"), s
    assert "none of your model's decoder layers (202,383,360 parameters each)" in s["wrap"][1] and "bfloat16" in s["mixed_precision"][1]
    assert s["loading"][0] == "WARN" and "cpu_ram_efficient_loading off" in s["loading"][1] and "13.5 GB" in s["loading"][1]  # 6.74 B parameters in bf16, per rank
    assert "converts the float16 checkpoint to bfloat16" in s["loading"][1]
    assert s["tied_embeddings"][0] == "PASS" and s["tied_embeddings"][1].startswith("untied")


def test_kbit_prepare_upcasts_the_frozen_base():
    "peft's prepare_model_for_kbit_training casts every non-4-bit parameter to fp32, so bf16 storage no longer matches the rest of the base."
    s = statuses(model=LLAMA, fsdp_config=QLORA_BF16, method="qlora", quant_storage="bfloat16", kbit_prepare=True)
    assert s["frozen_base"][0] == "FAIL" and "upcast" in s["frozen_base"][1] and "bfloat16 to float32" in s["frozen_base"][1]
    assert s["quant_storage"][0] == "FAIL" and "float32" in s["quant_storage"][1]


def test_qlora_with_matching_storage_passes():
    "bf16 storage with a bf16 base: accelerate shards the packed weights and leaves them byte for byte; the adapter saved FULL loads."
    s = statuses(model=LLAMA, fsdp_config=QLORA_BF16, method="qlora", quant_storage="bfloat16")
    assert (s["quant_storage"][0], s["frozen_base"][0], s["saving"][0]) == ("PASS", "PASS", "PASS"), s
    assert "identical before and after fully_shard and after a step" in s["quant_storage"][1] and "PeftModel.from_pretrained" in s["saving"][1]
    assert s["mixed_precision"][0] == "WARN" and "reduce-scattered in bfloat16" in s["mixed_precision"][1]  # accelerate's bf16 policy reduces in bf16


@pytest.mark.parametrize("args,message", [
    (["--model", "tests/doctor/nope/config.json"], "--model='tests/doctor/nope/config.json' is not allowed"),
    (["--model", "MISSING"], "it lacks num_hidden_layers"),
    (["--model", "UNKNOWN"], "has no architecture 'nosucharch'"),
    (["--fsdp-config", "BROKEN"], "is not valid YAML"),
    (["--method", "big"], "--method='big' is not allowed: one of full, lora, qlora"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, args, message):
    (tmp_path / "missing.json").write_text('{"model_type": "qwen2", "hidden_size": 64}')
    (tmp_path / "unknown.json").write_text('{"model_type": "nosucharch", "hidden_size": 64}')
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    swap = {"MISSING": str(tmp_path / "missing.json"), "UNKNOWN": str(tmp_path / "unknown.json"), "BROKEN": str(tmp_path / "broken.yaml")}
    given = dict(zip(args[::2], [swap.get(v, v) for v in args[1::2]]))
    cmd = {"--model": QWEN, "--fsdp-config": str(HERE / "ddp.yaml")} | given
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", "doctor", *[x for kv in cmd.items() for x in kv]], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
