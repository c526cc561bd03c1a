"""`fsdp-kit doctor` on 2 CPU ranks, for real: for each of its twelve checks a config/model pair that makes it FAIL (or WARN) and one
that makes it PASS, each named with the upstream behaviour it reproduces; the command's JSON; hand-written config.json files of two
public architectures (Qwen2-0.5B, tied; Llama-2-7B, untied); --strict's exit 1 on the healthy run's WARN."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
from fsdp_kit.config import EXAMPLES
from fsdp_kit.doctor import DoctorSpec, doctor, CHECKS, STATUSES, exit_status
from fsdp_kit.versions import LIBS

HERE = Path(__file__).parent / "doctor"
# written by hand from the public checkpoints' files
QWEN, LLAMA = str(HERE / "qwen2-0.5b" / "config.json"), str(HERE / "llama-2-7b" / "config.json")
HEALTHY = str(EXAMPLES / "doctor" / "healthy.yaml")
pytestmark = pytest.mark.timeout(400)  # each run stops itself after DoctorSpec.timeout; a hang past that fails here


def by_name(r:dict) -> dict:
    "A doctor report's checks, each asserted whole (twelve, a known status, a reason): check name -> (status, reason)."
    assert len(r["checks"]) == len(CHECKS) == 12 and all(c["status"] in STATUSES and c["reason"] for c in r["checks"])
    return {c["name"]: (c["status"], c["reason"]) for c in r["checks"]}


def statuses(**kw) -> dict:
    "Run the doctor for real; check name -> (status, reason)."
    r = doctor(DoctorSpec(timeout=240, steps=1, **kw), say=lambda line: None)
    return by_name(r) | {"_twin": r["twin"]}


@pytest.fixture(scope="module")
def healthy_run():
    "Qwen2-0.5B's shape (tied embeddings) with an FSDP2 YAML under accelerate launch, run once through the command with --strict."
    args = ["doctor", "--model", QWEN, "--fsdp-config", HEALTHY, "--steps", "1", "--timeout", "240", "--strict", "--json", "-"]
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", *args], capture_output=True, text=True, timeout=380)
    assert res.stdout.startswith("{"), res.stderr[-3000:]
    return res, json.loads(res.stdout)


@pytest.fixture(scope="module")
def healthy(healthy_run):
    "The healthy run's checks: check name -> (status, reason), and its twin."
    r = healthy_run[1]
    return by_name(r) | {"_twin": r["twin"]}


def test_healthy_config_passes_every_check_it_can(healthy):
    passes = ["fsdp_version", "wrap", "tied_embeddings", "quant_storage", "frozen_base", "mixed_precision", "activation_checkpointing",
              "context_parallel", "saving", "keys", "ddp_fallback"]
    assert {k: healthy[k][0] for k in passes} == dict.fromkeys(passes, "PASS"), healthy
    # accelerate's tail unit for tied weights
    assert "tied: one weight, in one unit [lm_head, model.embed_tokens, model.norm]" in healthy["tied_embeddings"][1]
    assert "2 of 2 decoder layers" in healthy["wrap"][1] and "on 2 of 2 decoder layers" in healthy["activation_checkpointing"][1]
    # transformers 5's from_pretrained reads the checkpoint on every rank even with cpu_ram_efficient_loading (accelerate broadcasts only at
    # prepare), and converting Qwen2-0.5B's bf16 checkpoint to fp32 makes a copy on each
    assert healthy["loading"][0] == "WARN" and "2 of 2 ranks read the checkpoint" in healthy["loading"][1]
    assert "2 ranks hold a copy of their own: from_pretrained converts the bfloat16 checkpoint to float32" in healthy["loading"][1]
    # Qwen2-0.5B's 494 M parameters in float32, per rank
    assert "for your model that is 2.0 GB of host memory per rank" in healthy["loading"][1]


def test_the_twin_keeps_the_architecture_and_says_what_it_shrank(healthy):
    twin = healthy["_twin"]
    assert (twin["architecture"], twin["tied"]) == ("Qwen2", True)
    shrunk = {s["key"]: (s["user"], s["twin"]) for s in twin["shrunk"]}
    assert shrunk["hidden_size"] == (896, 64) and shrunk["num_hidden_layers"] == (24, 2) and shrunk["vocab_size"] == (151936, 256)
    # grouped-query attention stays grouped-query
    assert shrunk["num_key_value_heads"] == (2, 2) if "num_key_value_heads" in shrunk else True


def test_strict_fails_on_a_warn_only_report(healthy_run):
    "Qwen2-0.5B's bf16 checkpoint loaded in fp32: a loading WARN and no FAIL; exit 0, and 1 under --strict."
    res, r = healthy_run
    statuses_ = [c["status"] for c in r["checks"]]
    assert "FAIL" not in statuses_ and "WARN" in statuses_, res.stderr[-3000:]
    assert res.returncode == 1 and "a WARN under --strict (exit 1)" in res.stderr, res.stderr[-3000:]
    assert exit_status(r) == 0 and exit_status(r, strict=True) == 1


def test_checkpointing_twice_fails():
    "transformers' Trainer refuses FSDP's activation_checkpointing together with its own activation_checkpointing argument."
    s = statuses(model=QWEN, fsdp_config=HEALTHY, gradient_checkpointing=True, dtype="bfloat16")
    assert s["activation_checkpointing"][0] == "FAIL" and "can't both be set" in s["activation_checkpointing"][1]
    # loaded in the checkpoint's own dtype, transformers maps the safetensors file: every rank reads it, none copies it
    assert s["loading"][0] == "PASS" and "no rank copies the weights" in s["loading"][1]


def test_tied_embedding_in_its_own_unit_fails():
    "torch >= 2.13's fully_shard refuses a tied weight in two FSDP groups: wrapping the Embedding class splits embed_tokens from lm_head."
    s = statuses(model=QWEN, fsdp_config=str(HERE / "tied_embedding_wrapped.json"))
    assert s["tied_embeddings"][0] == "FAIL" and "shared with a parameter already managed by another FSDP group" in s["tied_embeddings"][1]


def test_ddp_fallback_fails():
    "accelerate launch with distributed_type MULTI_GPU runs DDP (MULTI_CPU here) and ignores the fsdp_config section."
    # run through the command: its JSON on stdout (checks, twin, versions), the report on stderr
    from tests.conftest import left_behind, private_tmp
    tmp = private_tmp()  # its own TMPDIR: the twin's folder and every process are gone 1 s after the end
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", "doctor", "--model", LLAMA, "--fsdp-config", str(HERE / "ddp.yaml"), "--json",
                          "-"],
                         capture_output=True, text=True, timeout=380, env=os.environ | {"TMPDIR": str(tmp)})
    assert res.returncode == 1 and "fsdp-kit doctor: a check failed (exit 1)" in res.stderr, res.stderr[-3000:]  # a FAIL gates a CI job
    assert not (left := left_behind(tmp)), left
    r = json.loads(res.stdout)
    assert (set(r) >= {"checks", "twin", "versions"}
            and set(r["versions"]) >= {"torch", "transformers", "accelerate", "peft", "bitsandbytes"})
    assert all(set(c) == {"name", "status", "reason", "fix"} for c in r["checks"])
    s = by_name(r)
    assert s["ddp_fallback"][0] == "FAIL" and s["ddp_fallback"][1].startswith("DistributedDataParallel")
    assert s["fsdp_version"][0] == "FAIL" and "does not run FSDP with this file" in s["fsdp_version"][1]
    assert "FAIL  ddp_fallback" in res.stderr and "3 FAIL" in res.stderr  # the report on stderr beside the JSON
    steps = [l.split(":")[0] for l in res.stderr.splitlines() if l.startswith("doctor ")]  # progress: a line per finished unit of work
    assert steps == ["doctor 1/3 the file read as its entry point reads it", "doctor 2/3 the twin's run", "doctor 3/3 the checks"], \
        res.stderr[-2000:]
    v = r["versions_verdict"]  # the installed releases against the stored versions matrix
    assert (v["status"] in ("PASS", "WARN", "FAIL") and v["installed"] == {k: r["versions"][k] for k in LIBS}
            and f"{v['status']:4}  versions" in res.stderr)


def test_keys_speak_of_the_entry_point_not_of_the_kit():
    "accelerate launch applies parallelism_config; the kit's own reader notes that its recipe does not, which is no finding of the doctor."
    from fsdp_kit.config import load_fsdp_config
    from fsdp_kit.doctor import check_keys
    notes = load_fsdp_config(str(EXAMPLES / "upstream_configs" / "accelerate_v2_parallelism.yaml")).notes
    assert any(n.startswith("parallelism_config: dp_replicate_size=1, dp_shard_size=2") and "not applied" in n for n in notes)
    assert check_keys(dict(notes=notes, upstream=dict(entry_point="accelerate launch"))).status == "PASS"
    ignored = notes + ["fsdp_sync_module_states=True is IGNORED under FSDP2"]
    assert check_keys(dict(notes=ignored, upstream={})).reason.startswith("1 key(s) do not do what they say: fsdp_sync_module_states")


def test_on_accelerate_1_14_the_fixes_name_the_release_that_cures_them(tmp_path):
    """accelerate 1.14 in a throwaway environment (the versions matrix's own `make_env`): the tied-embedding FAIL and the activation
    checkpointing WARN (a wrapper per child of a layer) name accelerate >= 1.15, not a config change the file already makes."""
    from fsdp_kit.versions import installed, make_env
    py, _, error, _ = make_env(tmp_path / "env", {k: installed()[k] for k in LIBS} | dict(accelerate="1.14.0"))
    assert error is None, error
    res = subprocess.run([str(py), "-m", "fsdp_kit", "doctor", "--model", QWEN, "--fsdp-config", HEALTHY, "--steps", "1", "--json", "-"],
                         capture_output=True, text=True, timeout=380)
    r = json.loads(res.stdout)
    assert r["versions"]["accelerate"] == "1.14.0"
    checks = {c["name"]: c for c in r["checks"]}
    tied, ac = checks["tied_embeddings"], checks["activation_checkpointing"]
    assert tied["status"] == "FAIL" and tied["fix"].startswith("upgrade accelerate to >= 1.15.0"), tied
    assert "transformer_layer_cls_to_wrap" not in tied["fix"]
    assert ac["status"] == "WARN" and ac["fix"].startswith("upgrade accelerate to >= 1.15.0"), ac
    assert "0 of 2 decoder layers are checkpointed whole, in 8 CheckpointWrapper(s)" in ac["reason"]


def test_loading_never_advises_what_is_already_on():
    """Every rank copies the weights in the checkpoint's own dtype: with cpu_ram_efficient_loading off the fix is to turn it on; with
    it on, never that key: on accelerate 1.14 and 1.15 the upgrade the versions matrix measured, on 1.16 a budget."""
    from fsdp_kit.doctor import check_loading
    mib = 2**20
    def loading(on, accelerate):
        ctx = dict(spec=DoctorSpec(model=QWEN, fsdp_config=HEALTHY), upstream=dict(cpu_ram_efficient_loading=on), user_bytes=4e9,
                   seen=dict(load=dict(read_checkpoint=[True, True], private_bytes=[8 * mib, 8 * mib], mapped_bytes=[0, 0])),
                   twin=dict(checkpoint_dtype="float32"), scale={}, versions=dict(accelerate=accelerate))
        return check_loading(ctx)
    off, on14, on16 = loading(False, "1.16.0"), loading(True, "1.14.0"), loading(True, "1.16.0")
    assert (off.status, off.fix) == ("WARN", "cpu_ram_efficient_loading: true")
    assert on14.status == "WARN" and "although cpu_ram_efficient_loading is on" in on14.reason
    assert on14.fix.startswith("upgrade accelerate to >= 1.16.0") and on16.fix == "budget host memory for one copy per rank"
