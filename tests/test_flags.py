"""The command line is the spec written flat: every flag a command's --help shows in its spec groups is read (it changes the spec the
command runs), old spellings read as the new ones with a note, and a flag for a field the command does not read is not shown."""
import argparse
from dataclasses import asdict
import pytest
from fsdp_kit.cli import parser
from fsdp_kit.commands import train_spec, command_spec, READS, CKPT_READS, GROUPS
from fsdp_kit.flags import flag_of

FSDP = {"--reshard-after-forward": "false", "--auto-wrap-policy": "SIZE_BASED_WRAP", "--transformer-layer-cls-to-wrap": "LlamaDecoderLayer",
        "--min-num-params": "1000", "--cpu-offload": None, "--mixed-precision": "bf16", "--reduce-dtype": "fp32", "--ac": "full",
        "--layout": "layers"}
RUN = {"--model": "small", "--steps": "3", "--batch": "2", "--seq-len": "32", "--seed": "1"}
# a value other than the command's default for each flag of its spec groups (None: the switch alone)
VALUES = {
    "train": RUN | FSDP | {"--check-parity": None, "--dp-replicate": "2", "--dp-shard": "2", "--lr": "0.01", "--warmup": "2",
                          "--precision": "pure-bf16", "--chunked-ce": "4", "--optimizer-in-backward": None, "--offload-activations": None,
                          "--lora-r": "4"},
    "mesh": {"--dp-replicate": "2", "--dp-shard": "2", "--cp": "2"},
    "compare": {"--model": "tiny", "--batch": "4", "--seq-len": "32", "--policies": "NO_WRAP", "--reshard": "true", "--min-num-params": "9",
                "--gradient-checkpointing": None},
    "qlora": RUN | {"--autocast": "bf16", "--load-in-8bit": None, "--adapter-dir": "a", "--lr": "0.1", "--warmup": "2", "--lora-r": "4",
                    "--quant-storage": "float32", "--mixed-precision": "bf16"},
    "cp-eval": {k: v for k, v in (RUN | FSDP).items() if k not in ("--steps", "--layout")}
               | {"--sp": "2", "--rotate": "alltoall", "--mask": "none", "--gather": "false", "--dp-shard": "1", "--cp": "4"}}
VALUES |= {"hf": {"--run": "sft", "--model": "small", "--steps": "3", "--batch": "4", "--seq-len": "64", "--lr": "0.01", "--seed": "1",
                  "--out": "o"},
           "doctor": {"--model": "other.json", "--method": "lora", "--quant-storage": "bfloat16", "--mixed-precision": "bf16",
                      "--dtype": "bfloat16", "--gradient-checkpointing": None, "--kbit-prepare": None, "--steps": "3", "--gpus": "8",
                      "--gpu-mem-gb": "80", "--seed": "1", "--out": "o"}}
VALUES["plan"] = {"--model": "tiny", "--gpus": "4", "--batch": "2", "--seq-len": "512", "--fp8-all-gather": None, "--compile": None,
                  "--loading": "whole-model", "--dp-replicate": "2", "--cp": "2", "--reshard-after-forward": "false", "--cpu-offload": None,
                  "--mixed-precision": "no", "--reduce-dtype": "fp32", "--ac": "full", "--layout": "layers", "--precision": "pure-bf16",
                  "--chunked-ce": "4", "--optimizer-in-backward": None, "--offload-activations": None, "--lora-r": "4",
                  "--lora-targets": "q_proj", "--base-dtype": "fp32"}
NEEDS = {"hf": ["--fsdp-config", "x.json"], "doctor": ["--model", "m.json", "--fsdp-config", "x.yaml"]}  # what the command requires
CKPT = {"--ckpt": "{tmp}/other", "--save-every": "2", "--state-dict": "full", "--resume": None, "--overwrite-ckpt": None, "--keep": "3"}


def spec_flags_shown(command: str) -> list:
    "The flags `fsdp-kit COMMAND --help` lists in its spec groups (run, mesh, FSDP, step, LoRA, checkpoint)."
    sub = parser()._subparsers._group_actions[0].choices[command]
    titles = {*GROUPS.values(), "checkpoint"}
    return [a.option_strings[0] for g in sub._action_groups if g.title in titles for a in g._group_actions
            if a.help != argparse.SUPPRESS]  # an old spelling is read, not shown


def _argv(command: str, flags: list, tmp_path) -> argparse.Namespace:
    return parser().parse_args([command, *NEEDS.get(command, []), *[str(f).replace("{tmp}", str(tmp_path)) for f in flags]])


@pytest.mark.parametrize("command", sorted(READS))
def test_every_flag_shown_changes_the_spec(command, tmp_path):
    shown = spec_flags_shown(command)
    reads = [flag_of(n) for names in READS[command].values() for n in names] + ([flag_of(n) for n in CKPT_READS] * (command == "train"))
    assert sorted(shown) == sorted(reads), "the flags shown are the fields the command reads"
    assert sorted(reads) == sorted(VALUES[command] | (CKPT if command == "train" else {})), "each flag has a test value"
    before = asdict(command_spec(command, _argv(command, [], tmp_path)))
    for flag, value in VALUES[command].items():
        after = asdict(command_spec(command, _argv(command, [flag] + ([value] if value is not None else []), tmp_path)))
        assert after != before, f"fsdp-kit {command} {flag} did not change the spec it runs"


def test_every_checkpoint_flag_changes_the_run(tmp_path):
    "train's checkpoint group: --ckpt sets the folder, each other flag changes the CheckpointSpec of a run that has one."
    spec = lambda flags: asdict(train_spec(_argv("train", flags, tmp_path)))
    assert spec(["--ckpt", "{tmp}/ck"])["ckpt"]["dir"] == str(tmp_path / "ck") and spec([])["ckpt"] is None
    for flag, value in CKPT.items():
        flags = ["--ckpt", "{tmp}/ck", flag] + ([value] if value is not None else [])
        if flag != "--ckpt": assert spec(flags) != spec(["--ckpt", "{tmp}/ck"]), f"{flag} did not change the checkpoint spec"


@pytest.mark.parametrize("command, flag", [("train", "--state-dict-type"), ("qlora", "--cpu-offload"), ("compare", "--ac"),
                                           ("cp-eval", "--state-dict-type"), ("mesh", "--model"), ("hf", "--cpu-offload"),
                                           ("doctor", "--lora-r")])
def test_a_field_the_command_does_not_read_is_not_shown(command, flag, capsys):
    "Typing it is an unknown option (exit 2), not a flag shown only to be refused."
    assert flag not in spec_flags_shown(command)
    with pytest.raises(SystemExit) as e: parser().parse_args([command, *NEEDS.get(command, []), flag, "x"])
    assert e.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_old_spellings_give_the_same_spec(tmp_path, capsys):
    spec = lambda command, flags: asdict(command_spec(command, _argv(command, flags, tmp_path)))
    old = spec("train", ["--reshard", "false", "--offload", "--policy", "SIZE_BASED_WRAP", "--edges-in-root", "--lora", "4",
                         "--precision", "bf16-fp32-reduce", "--seq", "32"])
    new = spec("train", ["--reshard-after-forward", "false", "--cpu-offload", "--auto-wrap-policy", "SIZE_BASED_WRAP", "--layout",
                         "layers", "--lora-r", "4", "--mixed-precision", "bf16", "--reduce-dtype", "fp32", "--seq-len", "32"])
    assert old == new
    assert spec("train", ["--precision", "mixed-bf16"])["fsdp"]["mixed_precision"] == "bf16"  # the spelling of two releases ago
    assert spec("qlora", ["--mixed-precision", "bfloat16"]) == spec("qlora", ["--mixed-precision", "bf16"])
    assert spec("cp-eval", ["--no-gather"]) == spec("cp-eval", ["--gather", "false"])
    assert spec("compare", ["--reshard-after-forward", "true"]) == spec("compare", ["--reshard", "true"])
    err = capsys.readouterr().err
    for note in ("--reshard false is the old spelling of --reshard-after-forward false", "--lora 4 is the old spelling of --lora-r 4",
                 "--precision bf16-fp32-reduce is the old spelling of --mixed-precision bf16 --reduce-dtype fp32",
                 "--edges-in-root is the old spelling of --layout layers", "--no-gather is the old spelling of --gather false",
                 "--mixed-precision bfloat16 is the old spelling of --mixed-precision bf16"):
        assert note in err, err


def test_each_setting_is_declared_once():
    """A spec field is a flag only through fsdp_kit.flags (made from its declaration): no command's own options table declares it
    again, and the package has few add_argument call sites left (one per table-reading loop)."""
    import re
    from pathlib import Path
    from fsdp_kit.commands import COMMANDS, COMMON, LAUNCHES, base_spec
    from fsdp_kit.flags import field_docs
    from fsdp_kit.spec import SECTIONS
    for name, _, _, _, table in COMMANDS:
        if name not in READS: continue
        base = base_spec(name)
        fields = set(field_docs(type(base))) | {f for kind in SECTIONS.values() for f in field_docs(kind)}
        spec_flags = {flag_of(f) for f in fields}
        given = {"--fsdp-config"} | ({"--nproc", "--timeout"} if name == "doctor" else set())  # the launch's, copied in
        twice = [flag for flag, _ in (*COMMON, *LAUNCHES, *table) if flag in spec_flags and flag not in given]
        assert not twice, f"fsdp-kit {name}: {twice} declared beside the spec field that makes them"
    pkg = Path(__file__).resolve().parent.parent / "fsdp_kit"
    calls = sum(len(re.findall(r"\.add_argument\(", p.read_text())) for p in pkg.glob("*.py"))
    assert calls <= 40, calls
    assert parser().parse_args(["doctor", *NEEDS["doctor"]]).timeout == 300  # the doctor's own default beside --timeout's


def test_every_other_option_is_read():
    "An option that is no field of the command's spec (launch, output, what to run) is read by the code that runs the command."
    import inspect
    import fsdp_kit.cli, fsdp_kit.commands
    from fsdp_kit.commands import COMMANDS, COMMON, LAUNCHES
    code = inspect.getsource(fsdp_kit.commands) + inspect.getsource(fsdp_kit.cli)
    for name, _, _, launches, table in COMMANDS:
        sub = parser()._subparsers._group_actions[0].choices[name]
        dests = {a.dest for a in sub._actions if a.option_strings and a.dest != "help"} - {"version"}
        for flag, kw in (*COMMON, *(LAUNCHES if launches else ()), *table):
            dest = kw.get("dest", flag.lstrip("-").replace("-", "_"))
            assert dest in dests or not flag.startswith("-"), (name, flag)
            assert f"a.{dest}" in code or f'"{dest}"' in code, f"fsdp-kit {name} {flag}: nothing reads a.{dest}"
