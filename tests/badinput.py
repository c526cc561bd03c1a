"""The table-driven bad-input harness: each row is what a user typed, the exit code and a phrase the one-line message must hold.

A row runs `fsdp_kit.cli.main(argv)` in this process (no launch happens for input that is refused before launching), with
`{tmp}` in the arguments and in `files` replaced by a fresh folder. `files` maps a path under it to its contents (str or bytes;
a dict is written as JSON). Nothing may print a traceback."""
import io, json, os
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field


@dataclass
class Case:
    id:str # a short name for the row
    argv:list # what follows `fsdp-kit`
    code:int # the exit code expected
    phrase:str # a phrase the message must contain (case-sensitive)
    files:dict = field(default_factory=dict) # {path under {tmp}: contents} written before the run
    chmod:dict = field(default_factory=dict) # {path under {tmp}: mode} applied after writing
    fsize:int = None # bytes: run the command in a subprocess under this file-size limit (`ulimit -f`), its stdout a file in {tmp}


def write_files(tmp, files:dict, chmod:dict=None):
    for rel, content in files.items():
        p = tmp / rel.format(tmp=tmp)
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict) or isinstance(content, list): p.write_text(json.dumps(content))
        elif isinstance(content, bytes): p.write_bytes(content)
        elif content is None: p.mkdir(exist_ok=True)
        else: p.write_text(content)
    for rel, mode in (chmod or {}).items(): os.chmod(tmp / rel, mode)


def run_case(case:Case, tmp) -> tuple:
    "Run one row in this process (with `fsize`, in a subprocess): (exit code, stdout, stderr)."
    from fsdp_kit.cli import main
    write_files(tmp, case.files, case.chmod)
    argv = [str(a).format(tmp=tmp) for a in case.argv]
    if case.fsize is not None: return _run_limited(argv, case.fsize, tmp)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with redirect_stdout(out), redirect_stderr(err):
        try: main(argv)
        except SystemExit as e: code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def check_case(case:Case, tmp):
    "Assert the row's exit code and phrase, and that no traceback was printed."
    code, out, err = run_case(case, tmp)
    assert "Traceback" not in out + err, f"{case.id}: a traceback reached the user:\n{err[-2000:]}"
    assert code == case.code, f"{case.id}: exit {code}, expected {case.code}; stderr:\n{err[-2000:]}"
    phrase = case.phrase.replace("{tmp}", str(tmp))
    assert phrase in err, f"{case.id}: {phrase!r} not in the message:\n{err[-2000:]}"
    if case.fsize is not None: assert len(err.strip().splitlines()) == 1, f"{case.id}: more than one line:\n{err[-2000:]}"


def refused(argv:list, phrase:str, tmp, code:int=2):
    "Assert that `fsdp-kit ARGV`, run in this process, exits `code` with `phrase` in its one-line message and no traceback."
    check_case(Case(" ".join(map(str, argv))[:60], [str(a) for a in argv], code, phrase), tmp)


def _run_limited(argv:list, fsize:int, tmp) -> tuple:
    "`fsdp-kit ARGV` in a subprocess whose files may grow to `fsize` bytes, stdout redirected to {tmp}/stdout: (code, stdout, stderr)."
    import resource, subprocess, sys
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    with open(tmp / "stdout", "w") as out:
        res = subprocess.run([sys.executable, "-m", "fsdp_kit", *argv], stdout=out, stderr=subprocess.PIPE, text=True, timeout=120,
                             preexec_fn=limit)
    return res.returncode, (tmp / "stdout").read_text(), res.stderr


_APART = """
import json, sys
from pathlib import Path
from tests.badinput import Case, run_case
tmp, argvs = Path(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps([run_case(Case(str(i), argv, 0, ""), tmp) for i, argv in enumerate(argvs)]))
"""


def run_apart(argvs:list, tmp, timeout:float=240) -> list:
    """`fsdp-kit ARGV` for each ARGV in turn, as `run_case` runs it, in one fresh interpreter (one that may import peft and
    bitsandbytes, which this process must not): [(exit code, stdout, stderr)], one per ARGV. For commands that launch nothing."""
    import subprocess, sys
    from pathlib import Path
    res = subprocess.run([sys.executable, "-c", _APART, str(tmp), json.dumps([[str(a) for a in argv] for argv in argvs])],
                         capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    return [tuple(r) for r in json.loads(res.stdout.strip().splitlines()[-1])]
