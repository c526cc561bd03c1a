"""`fsdp-kit doctor`'s other FAIL / PASS pairs on 2 CPU ranks (a second file, so pytest-xdist runs it beside test_doctor.py), and bad
input refused in one line with exit 2. The seeds' QLoRA YAML (fsdp_version 1, uint8 storage, a save that writes nothing, FSDP1 keys) is
run and asserted by nbs/12_doctor.ipynb and by the tour (tests/test_cli.py); the command's JSON by test_doctor.test_ddp_fallback_fails.
SIZE_BASED_WRAP above every layer, a bf16 load without mixed precision and the ignored cp_size key are 12_doctor's "Four FAILs" run."""
import json, subprocess, sys
import pytest
from tests.test_doctor import statuses, by_name, QWEN, LLAMA, HERE

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
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", "doctor", *[x for kv in cmd.items() for x in kv]], capture_output=True,
                         text=True, timeout=120)
    assert (res.returncode == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1
            and "Traceback" not in res.stderr), res.stderr


def doctor_cli(*args):
    return subprocess.run([sys.executable, "-m", "fsdp_kit", "doctor", *map(str, args), "--json", "-"], capture_output=True, text=True,
                          timeout=380)


def test_size_policy_crash_is_a_wrap_fail_with_its_cause_and_the_fix_it_ran(tmp_path):
    "accelerate's FSDP2 size policy selects model.layers (a ModuleList) when it holds more than min_num_params: fully_shard raises."
    config = tmp_path / "size.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n"
                      "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 100000\n  fsdp_state_dict_type: FULL_STATE_DICT\n")
    res = doctor_cli("--model", QWEN, "--fsdp-config", config)
    assert res.returncode == 1 and "a check failed (exit 1)" in res.stderr, res.stderr[-3000:]
    r = json.loads(res.stdout)
    s = by_name(r)
    wrap = next(c for c in r["checks"] if c["name"] == "wrap")
    assert (s["wrap"][0] == "FAIL" and r["stopped_by"] == "wrap"
            and "fully_shard does not support containers that do not implement forward" in wrap["reason"])
    assert ("accelerate's FSDP2 size policy" in wrap["reason"]
            and "model.layers (ModuleList, 357,897,216 parameters in your model)" in wrap["reason"])
    assert (r["fix_run"]["ok"] and wrap["fix"].startswith("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP")
            and "the doctor ran the twin with it" in wrap["fix"])
    unreached = ["tied_embeddings", "mixed_precision", "activation_checkpointing", "saving", "ddp_fallback"]
    assert [k for k, (st, _) in s.items() if st == "SKIP"] == unreached and [k for k, (st, _) in s.items() if st == "FAIL"] == ["wrap"]
    assert f"not reached, the run stopped here: {', '.join(unreached)}" in res.stderr and "1 FAIL, 5 not reached" in res.stderr
    assert any(n.startswith("min_num_params 100,000 -> ") for n in r["twin"]["notes"])  # scaled, so the twin's units are Qwen2-0.5B's
    steps = [l.split(":")[0] for l in res.stderr.splitlines() if l.startswith("doctor ")]  # a unit more once the run stops: the fix's run
    assert steps == ["doctor 1/3 the file read as its entry point reads it", "doctor 2/4 the twin's run",
                     "doctor 3/4 the twin's run with the fix",
                     "doctor 4/4 the checks"], res.stderr[-2000:]
