"""The FSDP flag group: one group made from FSDPConfig's fields on every command that runs or plans the kit's recipe, old spellings kept
through one alias table, and a field a command cannot run refused by name."""
import json
from dataclasses import fields
from fsdp_kit.cli import ALIASES, FSDP_COMMANDS, FSDP_NOT_FLAGS, fsdp_given, parser
from fsdp_kit.config import FSDPConfig
from tests.badinput import Case, run_case


def _group(command: str) -> str:
    "The FSDP group of `fsdp-kit COMMAND --help` (parsed in this process)."
    code, out, _ = run_case(Case("help", [command, "--help"], 0, ""), ".")
    assert code == 0
    return out.split("\nFSDP:\n", 1)[1].split("\nexit status:", 1)[0] if "\nFSDP:\n" in out else ""


def test_the_five_commands_show_one_fsdp_group():
    """compare, qlora, cp-eval and plan print the same FSDP group, a flag per FSDPConfig setting; train's is made from the fields it
    reads (tests/test_flags.py); hf and doctor have none."""
    groups = {c: _group(c) for c in FSDP_COMMANDS if c != "train"}
    assert len(set(groups.values())) == 1, groups
    assert "--layout LAYOUT" in _group("train") and "--state-dict-type" not in _group("train")
    shown = groups["plan"]
    names = [f.name for f in fields(FSDPConfig) if f.name not in FSDP_NOT_FLAGS]
    assert len(names) == 10 and all(f"--{n.replace('_', '-')}" in shown for n in names)
    assert "--reshard RESHARD_AFTER_FORWARD" in shown and "--offload [CPU_OFFLOAD]" in shown and "(FSDPConfig's default: True)" in shown
    assert _group("hf") == "" and _group("doctor") == ""


def test_an_old_spelling_gives_the_same_spec(tmp_path):
    "--reshard, --offload and --policy read as --reshard-after-forward, --cpu-offload and --auto-wrap-policy."
    p = parser()
    old = p.parse_args(["compare", "--reshard", "false", "--offload", "--policy", "SIZE_BASED_WRAP"])
    new = p.parse_args(["compare", "--reshard-after-forward", "false", "--cpu-offload", "--auto-wrap-policy", "SIZE_BASED_WRAP"])
    assert [getattr(old, k) for k in ("reshard_after_forward", "cpu_offload", "auto_wrap_policy")] == \
        [getattr(new, k) for k in ("reshard_after_forward", "cpu_offload", "auto_wrap_policy")]
    assert {dest for dest, _ in ALIASES.values()} == {"reshard_after_forward", "cpu_offload", "auto_wrap_policy", "layout"}
    for command in ("train", "plan"):  # one name for the unit layout on both; plan's old switch kept
        assert p.parse_args([command, "--edges-in-root"]).layout == p.parse_args([command, "--layout", "layers"]).layout == "layers"
    plans = []
    for flags in (["--reshard", "false", "--offload"], ["--reshard-after-forward", "false", "--cpu-offload", "true"]):
        out = tmp_path / f"plan{len(plans)}.json"
        argv = ["plan", "--model", "llama-3-8b", "--gpus", "4", *flags, "--json", out]
        code, _, err = run_case(Case("plan-spelling", argv, 0, ""), tmp_path)
        assert code == 0, err
        plans.append(json.loads(out.read_text()))
    assert plans[0] == plans[1] and plans[0]["settings"]["reshard"] is False and plans[0]["settings"]["offload"] is True
    layouts = [run_case(Case("plan-layout", ["plan", "--model", "llama-3-8b", *flags], 0, ""), tmp_path)[1]
               for flags in (["--edges-in-root"], ["--layout", "layers"])]
    assert layouts[0] == layouts[1] and "embeddings and head in the root" in layouts[0]


def test_a_field_the_command_cannot_run_is_refused(tmp_path):
    "The flag is shown on every command; where a command cannot run it, one line names the flag, the value and the command (exit 2)."
    for argv, said in ((["plan", "--model", "tiny", "--auto-wrap-policy", "SIZE_BASED_WRAP"],
                        "--auto-wrap-policy='SIZE_BASED_WRAP' is not allowed with fsdp-kit plan"),
                       (["qlora", "--cpu-offload"], "--cpu-offload='true' is not allowed with fsdp-kit qlora"),
                       (["compare", "--ac", "full"], "--ac='full' is not allowed with fsdp-kit compare"),
                       (["train", "--min-num-params", "many"], "--min-num-params='many' is not allowed: a whole number")):
        code, _, err = run_case(Case("fsdp-refused", argv, 2, said), tmp_path)
        assert code == 2 and said in err and "Traceback" not in err, err
