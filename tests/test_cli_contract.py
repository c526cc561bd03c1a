"""What the command promises a script or a CI job: `--version`, every default in `--help`, progress lines on stderr (one per finished unit
of work: a training step, a validated setting) apart from the results on stdout, `--quiet`, and `examples/...` paths from any folder."""
import argparse, re, subprocess, sys
import pytest
from fsdp_kit import __version__
from fsdp_kit.cli import parser, _Help
from fsdp_kit.config import EXAMPLES

pytestmark = pytest.mark.timeout(240)  # the runs below launch 1-2 ranks for a few seconds each; a hang fails here


def run(*args, cwd=None, timeout=200):
    return subprocess.run([sys.executable, "-m", "fsdp_kit", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_version_prints_the_package_version():
    res = run("--version", timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"fsdp-kit {__version__}", res


def test_every_help_shows_every_default():
    subs = parser()._subparsers._group_actions[0].choices
    helper = _Help("fsdp-kit")
    missing = [(name, a.option_strings[0]) for name, s in subs.items() for a in s._actions
               if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS and "default" not in helper._get_help_string(a)]
    assert missing == [], missing
    assert "exit status:" in subs["doctor"].format_help() and "1    a check failed" in subs["plan"].format_help()


@pytest.fixture(scope="module")
def typed_paths(tmp_path_factory):
    "train with a relative --ckpt and --json, its resume (quiet), and a quiet qlora with a relative --adapter-dir, run in a fresh folder."
    tmp = tmp_path_factory.mktemp("typed")
    runs = dict(train=run("train", "--steps", 2, "--seq-len", 16, "--ckpt", "runs/ck", "--json", "runs/train.json", cwd=tmp))
    runs["resume"] = run("train", "--steps", 3, "--seq-len", 16, "--ckpt", "runs/ck", "--resume", "--quiet", cwd=tmp)
    runs["qlora"] = run("qlora", "--steps", 1, "--seq-len", 16, "--adapter-dir", "runs/adapter", "--quiet", cwd=tmp)
    return tmp, runs


def test_train_prints_a_step_line_per_step_on_stderr_and_quiet_silences_them(typed_paths):
    res = typed_paths[1]["train"]  # its results go to runs/train.json and stdout
    assert res.returncode == 0, res.stderr[-2000:]
    steps = re.findall(r"^step (\d)/2: loss \d+\.\d{4}", res.stderr, re.M)
    assert steps == ["1", "2"] and "step 1/2" not in res.stdout, res.stderr
    quiet = typed_paths[1]["resume"]  # step 3 of 3, with --quiet
    assert quiet.returncode == 0 and not re.search(r"^step \d/", quiet.stderr + quiet.stdout, re.M), quiet.stderr
    assert "losses" in quiet.stdout, quiet.stdout


@pytest.fixture(scope="module")
def validate_1_7():
    "plan --validate on 1 rank, settings 1 and 7: one setting of the matrix, one held out."
    return run("plan", "--validate", "--nproc", 1, "--settings", "1,7")


def test_plan_validate_prints_a_line_per_setting_with_what_is_left(validate_1_7):
    res = validate_1_7
    assert res.returncode == 0, res.stderr[-2000:]
    lines = re.findall(r"^setting (\d)/2 (.+?): ([\d.]+) s elapsed, about (\d+) s left$", res.stderr, re.M)
    assert [l[0] for l in lines] == ["1", "2"] and lines[-1][3] == "0" and float(lines[0][2]) < float(lines[1][2]), res.stderr
    assert "2 settings, largest |error|" in res.stdout and "setting 1/2" not in res.stdout


PROGRESS = {  # each command's smallest run, and the units it counts
    "compare": (["compare", "--model", "tiny", "--policies", "TRANSFORMER_BASED_WRAP,NO_WRAP", "--reshard", "true"], "setting", 2),
    "cp-eval": (["cp-eval", "--seq-len", 16], "part", 3),
}


@pytest.mark.parametrize("name", PROGRESS)
def test_long_labs_print_a_line_per_unit_and_quiet_silences_them(name):
    "compare and cp-eval (14-80 s on 2 busy cores) print `unit n/N label: E s elapsed, about L s left` on stderr, as plan --validate does."
    # qlora's progress is checked on test_fsdp_config_runs' qlora run; the --quiet runs: compare's in test_wrap, cp-eval's in
    # test_fsdp_config_runs, qlora's in typed_paths (test_paths_are_printed_as_typed)
    args, unit, total = PROGRESS[name]
    res = run(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = re.findall(rf"^{unit} (\d)/{total} (.+?): ([\d.]+) s elapsed, about (\d+) s left$", res.stderr, re.M)
    assert [int(l[0]) for l in lines] == list(range(1, total + 1)) and lines[-1][3] == "0", res.stderr[-2000:]
    assert float(lines[0][2]) <= float(lines[-1][2]) and f"{unit} 1/{total}" not in res.stdout


def test_paths_are_printed_as_typed(typed_paths):
    "A relative --ckpt, --json and --adapter-dir stay relative in every line (latest was printed absolute beside 'wrote runs/...')."
    tmp_path, runs = typed_paths
    res = runs["train"]
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("latest: runs/ck/latest" in res.stdout and "wrote runs/train.json" in res.stdout
            and str(tmp_path) not in res.stdout + res.stderr), res.stdout
    import json
    assert json.loads((tmp_path / "runs" / "train.json").read_text())["checkpoint"]["latest"] == "runs/ck/latest"
    res = runs["resume"]
    assert (res.returncode == 0 and "resumed from runs/ck/step-000002" in res.stdout
            and str(tmp_path) not in res.stdout + res.stderr), res.stdout
    res = runs["qlora"]
    assert res.returncode == 0 and "saved in runs/adapter" in res.stdout and str(tmp_path) not in res.stdout + res.stderr, res.stdout
    assert not re.search(r"^part \d/", res.stderr + res.stdout, re.M), res.stderr[-2000:]  # --quiet: qlora prints no progress line


def test_plan_validate_reports_fitted_and_held_out_settings_apart(validate_1_7):
    "The matrix's settings (the planner was written on them) and held_out_matrix's (it never saw them) each get their largest error."
    res = validate_1_7  # on 1 rank: 6 matrix settings, then 1 held out
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"^fitted: 1 settings \(the tiny and small Llama settings .+\), largest \|error\| [\d.]+%", res.stdout,
                     re.M), res.stdout
    assert re.search(r"^held out: 1 settings \(Qwen2 and Mistral shapes.+never used to write it\), largest \|error\| [\d.]+%", res.stdout,
                     re.M), res.stdout
    assert "qwen2-tiny w1 full layer reshard fp32 s48" in res.stdout


def here(*args, tmp):
    "`fsdp-kit ARGS` in this process (the same main(); these commands launch nothing): (exit code, stdout, stderr)."
    from tests.badinput import Case, run_case
    return run_case(Case(" ".join(map(str, args))[:60], [str(a) for a in args], 0, ""), tmp)


@pytest.mark.parametrize("value", ["0", "1-99", "x"])
def test_a_bad_settings_list_is_refused_in_one_line(value, tmp_path):
    "Refused before any setting runs: in this process."
    code, _, err = here("plan", "--validate", "--nproc", 1, "--settings", value, tmp=tmp_path)
    assert code == 2 and f"--settings={value!r} is not allowed: settings numbered 1 to" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_examples_paths_work_from_another_folder(tmp_path, monkeypatch):
    "In this process, from another folder (its working folder is tmp_path): the packaged example is read, a missing one refused."
    monkeypatch.chdir(tmp_path)
    code, out, err = here("plan", "--model", "examples/configs/qwen2-tiny/config.json", "--gpus", 2, "--gpu-mem-gb", 24, tmp=tmp_path)
    assert code == 0 and "(119,360 parameters)" in out, err
    assert f"reading the packaged example {EXAMPLES / 'configs' / 'qwen2-tiny' / 'config.json'}" in err
    code, _, gone = here("plan", "--model", "examples/configs/nope/config.json", tmp=tmp_path)
    assert code == 2 and len(gone.strip().splitlines()) == 1 and "Traceback" not in gone, gone
    assert ("--model='examples/configs/nope/config.json' is not allowed" in gone
            and f"the packaged examples are in {EXAMPLES}" in gone)


def test_plan_prints_its_notes_in_the_text(tmp_path):
    "--compile is accepted and not modelled: the plan says so in the text output, not only in its JSON (in this process)."
    code, out, err = here("plan", "--model", "llama-3-8b", "--gpus", 8, "--compile", tmp=tmp_path)
    assert (code == 0 and "\nnote: torch.compile is not modelled" in out
            and "note: allocator overhead modelled" in out), err


def test_units_are_fsdp_units_with_the_root_and_policies_keep_their_config_names(typed_paths):
    "train's count is plan_units' (the root last, included)."
    # the tour's compare line names policies as the config does, not per-layer / per-Linear.
    from types import SimpleNamespace
    from fsdp_kit.config import FSDPConfig
    from fsdp_kit.models import build_model, model_config
    from fsdp_kit.tour import _compare_line
    from fsdp_kit.wrap import plan_units
    units = plan_units(build_model(model_config("tiny"), device="meta"), FSDPConfig())
    res = typed_paths[1]["resume"]  # a quiet train run (steps 3 of 3, resumed)
    assert res.returncode == 0 and units[-1].module == "", res.stderr[-2000:]
    assert f"\n{len(units)} FSDP units (the root included) by TRANSFORMER_BASED_WRAP" in res.stdout, res.stdout
    run_ = lambda policy, reshard: SimpleNamespace(policy=policy, reshard_after_forward=reshard, world_size=2, peak_bytes=dict(total=2**20),
                                                   collectives=dict(all_gather=dict(count=10)))
    line = _compare_line([run_(p, r) for p in ("TRANSFORMER_BASED_WRAP", "NO_WRAP", "PER_LINEAR") for r in (True, False)])
    assert "TRANSFORMER_BASED_WRAP 1.0 (reshard_after_forward=True)" in line and "PER_LINEAR 10" in line and "per-" not in line, line


def test_every_readme_command_parses_and_its_plans_exit_0(tmp_path):
    "Each `fsdp-kit` line of the README is accepted by the parser as written; the plans among them (no launch, seconds) run and exit 0."
    import shlex
    from tests.conftest import ROOT
    from tests.badinput import Case, run_case
    readme = (ROOT / "README.md").read_text()
    lines = [l.strip().rstrip("&").strip() for block in re.findall(r"```sh\n(.*?)```", readme, re.S) for l in block.splitlines()
             if l.strip().startswith("fsdp-kit ")]
    assert len(lines) >= 30, lines
    for line in lines:
        argv = shlex.split(line)[1:]
        try: parser().parse_args(argv)
        except SystemExit as e: raise AssertionError(f"the parser refuses a README command: {line}") from e
    plans = [l for l in lines if l.startswith("fsdp-kit plan ") and "--validate" not in l]
    for line in plans:  # in this process: the same main(), no launch
        code, out, err = run_case(Case(line[:40], shlex.split(line)[1:], 0, ""), tmp_path)
        assert code == 0 and "Traceback" not in err, (line, err[-1000:])
    assert len(plans) >= 5
