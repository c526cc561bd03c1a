"""The command line is the spec written flat: every flag a command's --help shows in its spec groups is read (it changes the spec the
command runs), old spellings read as the new ones with a note, and a flag no field declares is not shown."""
import argparse
from dataclasses import asdict
import pytest
from fsdp_kit.cli import parser, train_spec, TRAIN_READS, CKPT_READS, GROUPS
from fsdp_kit.flags import flag_of

# a value other than the default for each flag of train's spec groups (None: the switch alone)
TRAIN_VALUES = {"--model": "small", "--steps": "3", "--batch": "2", "--seq-len": "32", "--seed": "1", "--check-parity": None,
                "--dp-replicate": "2", "--dp-shard": "2", "--reshard-after-forward": "false", "--auto-wrap-policy": "SIZE_BASED_WRAP",
                "--transformer-layer-cls-to-wrap": "LlamaDecoderLayer", "--min-num-params": "1000", "--cpu-offload": None,
                "--mixed-precision": "bf16", "--reduce-dtype": "fp32", "--ac": "full", "--cpu-ram-efficient-loading": None,
                "--layout": "layers", "--lr": "0.01", "--warmup": "2", "--precision": "pure-bf16", "--chunked-ce": "4",
                "--optimizer-in-backward": None, "--offload-activations": None, "--lora-r": "4",
                "--ckpt": "{tmp}/other", "--save-every": "2", "--state-dict": "full", "--resume": None, "--overwrite-ckpt": None,
                "--keep": "3"}


def _spec_flags(command: str) -> list:
    "The flags `fsdp-kit COMMAND --help` lists in its spec groups (run, mesh, FSDP, step, LoRA, checkpoint)."
    sub = parser()._subparsers._group_actions[0].choices[command]
    titles = {*GROUPS.values(), "checkpoint"}
    return [a.option_strings[0] for g in sub._action_groups if g.title in titles for a in g._group_actions
            if a.help != argparse.SUPPRESS]  # an old spelling is read, not shown


def _spec(argv: list, tmp_path) -> dict:
    return asdict(train_spec(parser().parse_args(["train", *[str(a).replace("{tmp}", str(tmp_path)) for a in argv]])))


def test_every_train_flag_changes_the_spec(tmp_path):
    shown = _spec_flags("train")
    reads = [flag_of(n) for names in TRAIN_READS.values() for n in names] + [flag_of(n) for n in CKPT_READS]
    assert sorted(shown) == sorted(reads) == sorted(TRAIN_VALUES), "each flag shown is a field train reads, and has a test value"
    ckpt = ["--ckpt", "{tmp}/ck"]
    for flag, value in TRAIN_VALUES.items():
        extra = ckpt if flag in ("--save-every", "--state-dict", "--resume", "--overwrite-ckpt", "--keep") else []
        given = [flag] + ([value] if value is not None else [])
        assert _spec(extra + given, tmp_path) != _spec(extra, tmp_path), f"{flag} did not change the spec train runs"


def test_a_refused_field_is_not_shown():
    "train writes checkpoints as --state-dict says: FSDPConfig.state_dict_type is not a train flag, so typing it is an unknown option."
    assert "--state-dict-type" not in _spec_flags("train")
    with pytest.raises(SystemExit):
        parser().parse_args(["train", "--state-dict-type", "FULL_STATE_DICT"])


def test_old_spellings_give_the_same_spec(tmp_path, capsys):
    old = _spec(["--reshard", "false", "--offload", "--policy", "SIZE_BASED_WRAP", "--edges-in-root", "--lora", "4",
                 "--precision", "bf16-fp32-reduce"], tmp_path)
    new = _spec(["--reshard-after-forward", "false", "--cpu-offload", "--auto-wrap-policy", "SIZE_BASED_WRAP", "--layout", "layers",
                 "--lora-r", "4", "--mixed-precision", "bf16", "--reduce-dtype", "fp32"], tmp_path)
    assert old == new
    err = capsys.readouterr().err
    for note in ("--reshard false is the old spelling of --reshard-after-forward false", "--lora 4 is the old spelling of --lora-r 4",
                 "--precision bf16-fp32-reduce is the old spelling of --mixed-precision bf16 --reduce-dtype fp32",
                 "--edges-in-root is the old spelling of --layout layers"):
        assert note in err, err
    assert _spec(["--precision", "mixed-bf16"], tmp_path)["fsdp"]["mixed_precision"] == "bf16"  # the spelling of two releases ago
