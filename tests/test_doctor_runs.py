"""`fsdp-kit doctor`'s other FAIL / PASS pairs on 2 CPU ranks (a second file, so pytest-xdist runs it beside test_doctor.py), and bad
input refused in one line with exit 2. The seeds' QLoRA YAML (fsdp_version 1, uint8 storage, a save that writes nothing, FSDP1 keys) is
run and asserted by nbs/12_doctor.ipynb and by the tour (tests/test_cli.py); the command's JSON by test_doctor.test_ddp_fallback_fails.
SIZE_BASED_WRAP above every layer, a bf16 load without mixed precision and the ignored cp_size key are 12_doctor's "Four FAILs" run;
SIZE_BASED_WRAP selecting model.layers (the crash, its cause, the fix the doctor ran, the progress lines) is 12_doctor's crash run."""
import pytest
from tests.test_doctor import statuses, QWEN, LLAMA, HERE


pytestmark = pytest.mark.timeout(400)
QLORA_BF16 = str(HERE / "qlora_bf16.yaml")  # FSDP2, mixed_precision bf16, FULL_STATE_DICT


def test_kbit_prepare_upcasts_the_frozen_base():
    "peft's prepare_model_for_kbit_training casts every non-4-bit parameter to fp32: bf16 storage no longer matches the rest."
    s = statuses(model=LLAMA, fsdp_config=QLORA_BF16, method="qlora", quant_storage="bfloat16", kbit_prepare=True)
    assert s["frozen_base"][0] == "FAIL" and "upcast" in s["frozen_base"][1] and "bfloat16 to float32" in s["frozen_base"][1]
    assert s["quant_storage"][0] == "FAIL" and "float32" in s["quant_storage"][1]


def test_qlora_with_matching_storage_passes():
    "bf16 storage with a bf16 base: accelerate shards the packed weights and leaves them byte for byte; the adapter saved FULL loads."
    s = statuses(model=LLAMA, fsdp_config=QLORA_BF16, method="qlora", quant_storage="bfloat16")
    assert (s["quant_storage"][0], s["frozen_base"][0], s["saving"][0]) == ("PASS", "PASS", "PASS"), s
    assert ("identical before and after fully_shard and after a step" in s["quant_storage"][1]
            and "PeftModel.from_pretrained" in s["saving"][1])
    # accelerate's bf16 policy reduces in bf16
    assert s["mixed_precision"][0] == "WARN" and "reduce-scattered in bfloat16" in s["mixed_precision"][1]


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
    # refused before the twin is launched: the command's main() in this process
    from tests.badinput import Case, run_case
    code, _, err = run_case(Case("doctor", ["doctor", *[x for kv in cmd.items() for x in kv]], 2, message), tmp_path)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
