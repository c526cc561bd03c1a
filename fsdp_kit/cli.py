"""The `fsdp-kit` command line: the parser made from `commands.COMMANDS`, errors, exit codes.

    fsdp-kit env --json
    fsdp-kit mesh --nproc 4 --dp-replicate 2 --dp-shard 2 --json
    fsdp-kit train --nproc 2 --model tiny --steps 10 --check-parity --json out.json
    fsdp-kit train --nproc 2 --steps 20 --ckpt ckpt --save-every 5 --resume --json out.json
    fsdp-kit train --nproc 4 --dp-replicate 2 --dp-shard 2 --check-parity  # HSDP: 2 replicas, each sharded over 2
    fsdp-kit train --nnodes 2 --node-rank 0 --nproc 2 --rdzv-endpoint node0:29400 --steps 20  # --node-rank 1 on node1
    fsdp-kit train --nproc 2 --steps 20 --ckpt ckpt --save-every 2 --max-restarts 1 --inject-fault crash --fault-step 5
    fsdp-kit slurm --nodes 4 --gpus-per-node 8 --time 01:00:00 -- train --model small --steps 100 > job.sh
    fsdp-kit qlora --nproc 2 --model tiny --quant-storage bfloat16 --steps 10 --json out.json
    fsdp-kit cp-eval --nproc 2 --cp 2 --rotate alltoall --json out.json
    fsdp-kit plan --model llama-2-70b --gpus 2 --gpu-mem-gb 24 --method qlora --ac full --cpu-offload --json plan.json
    fsdp-kit plan --validate --nproc 2 --json validation.json
    fsdp-kit tour --out tour
"""
import argparse, os, re, signal, sys

from fsdp_kit.errors import KitError
from fsdp_kit.flags import field_docs
from fsdp_kit.commands import (COMMANDS, COMMON, LAUNCHES, OUTPUT_ERRNOS, READS, CheckFailed, OutputError,
                               check_json_dest, example_path, options, output_why, refuse_blank_lists, spec_flags)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows every option's default (off for a switch, none where unset), unless the help already
    says what the default does."""
    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is argparse.SUPPRESS or action.nargs == 0
            and action.default is None): return text
        if action.default is False: return f"{text} (default: off)"
        return f"{text} (default: none)" if action.default is None else f"{text} (default: %(default)s)"


EXIT_CODES = """exit status:
  0    all clear
  1    a check failed: a doctor FAIL (a WARN too with doctor --strict), or a rank that failed
  2    bad input: one line names the option as typed, the value and what is allowed
  74   the result could not be written (stdout or --json on a full disk, or past ulimit -f): one line says where and why
  130  interrupted (SIGINT, Ctrl-C); 143 SIGTERM; 129 SIGHUP: every process the command started is stopped first
  141  stdout closed by its reader (a pipe into head): the command stops without a traceback

progress (one line per finished unit of work) goes to stderr, results to stdout; --quiet silences progress."""


def parser() -> argparse.ArgumentParser:
    """The `fsdp-kit` argument parser: a subcommand per row of COMMANDS, its spec's flags made from
    the fields it reads (READS)."""
    from fsdp_kit import __version__
    p = argparse.ArgumentParser(prog="fsdp-kit",
                                description="Learn and measure PyTorch FSDP2 on real process groups.",
                                epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"fsdp-kit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help, launches, table in COMMANDS:
        s = sub.add_parser(name, help=help, description=help, formatter_class=_Help, epilog=EXIT_CODES)
        options(s, COMMON + LAUNCHES * launches)
        if name in READS: spec_flags(s, name)
        options(s, table)
        # after the options, to win over --timeout's own default: the doctor's twin runs the Trainer's whole stack
        s.set_defaults(fn=fn, **({"timeout": 300} if name == "doctor" else {}))
    return p


# a user's mistake names the spec's field; the command line shows the option the user typed instead
OPTION_NAMES = {"lora_r": "r", "lora_targets": "targets", "rotate_method": "rotate", "cp_size": "cp", "sp_size": "sp",
                "nprocs": "nproc", "dir": "ckpt", "lora": "lora-r",
                "seq_len": "seq-len", "reshard_after_forward": "reshard", "rdzv_timeout": "rdzv-timeout",
                "workflow": "run",
                "ce_chunks": "chunked-ce", "fsdp_config_file": "fsdp-config", "overwrite": "overwrite-ckpt"}


def option_message(error: KitError, sub: argparse.ArgumentParser, argv: list = ()) -> str:
    """The error's message with each `field=` of a spec written as the option of `sub` that sets it (`seq_len=` ->
    `--seq-len=`), in the spelling the user typed (`--seq=` for the old `--seq`). A value read from a file
    (`error.source`) keeps the file and its key."""
    if getattr(error, "source", None): return str(error)
    typed = {}  # dest -> the spelling in argv, old ones included
    for a in sub._actions:
        for opt in a.option_strings:
            if any(t == opt or t.startswith(opt + "=") for t in argv): typed.setdefault(a.dest, opt)
    # a hidden old spelling names nothing
    shown = [a for a in sub._actions
             if a.help != argparse.SUPPRESS and any(o.startswith("--") for o in a.option_strings)]
    options = {a.dest: typed.get(a.dest, next(o for o in a.option_strings if o.startswith("--"))) for a in shown}
    from fsdp_kit.config import FSDPConfig
    # an FSDP field not typed: the file's key
    options = {k: v for k, v in options.items() if k not in field_docs(FSDPConfig) or k in typed}
    aliases = {field: dest.replace("-", "_") for field, dest in OPTION_NAMES.items()}
    options |= {field: options[dest] for field, dest in aliases.items() if dest in options}
    # a positional, as its usage shows it (DIR)
    options |= {a.dest: a.metavar for a in sub._actions if not a.option_strings and a.metavar}
    # fsdp-kit ckpt DIR: the library calls it ckpt
    if "dir" in options and "ckpt" not in options: options["ckpt"] = options["dir"]
    # also the name of a key inside the user's YAML file: keep it as the file spells it
    options.pop("fsdp_config", None)
    text = re.sub(r"(?<![-\w.])(\w+)=", lambda m: f"{options[m.group(1)]}=" if m.group(1) in options else m.group(0),
                  str(error))
    # an option the library wrote out itself (`--seq-len=`), where the user typed another spelling of it
    for a in shown:
        for opt in a.option_strings:
            if typed.get(a.dest, opt) != opt: text = re.sub(rf"(?<![-\w]){re.escape(opt)}=", f"{typed[a.dest]}=", text)
    return text


EXIT_OUTPUT = 74  # sysexits.h's EX_IOERR: the result could not be written


class Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the command: unwind (stopping torchrun and its workers) and
    exit 128 + the signal number."""
    def __init__(self, signum): self.signum = signum


def _raise_interrupted(signum, frame): raise Interrupted(signum)


def _drop_stdout():
    """Point stdout at /dev/null, so that what is left in its buffer goes nowhere at the interpreter's exit (a
    closed pipe, a full disk)."""
    try: os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError): pass  # a stdout that is no file (io.UnsupportedOperation is a ValueError)


def main(argv=None):
    "Entry point of the `fsdp-kit` command."
    # the command's own process: it forks no ranks (upstream)
    if argv is None: os.environ["FSDP_KIT_COMMAND_PID"] = str(os.getpid())
    argv = sys.argv[1:] if argv is None else list(argv)
    # torchrun, as a launch starts it (fsdp_kit.launch.agent_command); not a command for users
    if argv[:1] == ["agent"]:
        from fsdp_kit.launch import agent_main
        return agent_main(argv[1:])
    if argv[:1] == ["worker"]:  # what torchrun runs in each rank of a launch; not a command for users
        from fsdp_kit.launch import worker_main
        try: worker_main(argv[1])
        except BaseException: sys.exit(1)  # the traceback is in the run folder; the launching process reports it
        return
    p = parser()
    args = p.parse_args(argv)
    sub = p._subparsers._group_actions[0].choices[args.command]
    from fsdp_kit.launch import WorkerError, CommandScope
    old = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C is the command's to answer, even where its parent ignored or blocked SIGINT (a service, a test runner)
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        check_json_dest(getattr(args, "json", None))
        refuse_blank_lists(args, args.command)
        for field in ("model", "fsdp_config"):
            if isinstance(getattr(args, field, None), str):
                setattr(args, field, example_path(field, getattr(args, field)))
        with CommandScope(): args.fn(args)
        sys.stdout.flush()  # a result stdout cannot take fails here, inside the command, not in the interpreter's exit
    except KitError as e:
        print(f"fsdp-kit {args.command}: error: {option_message(e, sub, argv)}", file=sys.stderr)
        sys.exit(2)
    except CheckFailed as e:
        print(f"fsdp-kit {args.command}: {e}", file=sys.stderr)
        sys.exit(1)
    except WorkerError as e:
        debug = getattr(args, "debug", False)
        print(f"fsdp-kit {args.command}: {e if debug else e.brief()}" + ("" if debug or not e.worker_traceback
                                                                         else "\n(--debug prints the whole trace)"),
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"fsdp-kit {args.command}: interrupted (SIGINT): the workers were stopped", file=sys.stderr)
        sys.exit(130)
    except Interrupted as e:
        print(f"fsdp-kit {args.command}: interrupted ({signal.Signals(e.signum).name}): the workers were stopped",
              file=sys.stderr)
        sys.exit(128 + e.signum)
    # stdout closed by its reader (`fsdp-kit train --json - | head`): the rest of the output is not wanted
    except BrokenPipeError:
        _drop_stdout()
        sys.exit(128 + signal.SIGPIPE)
    # the result could not be written: a full disk or `ulimit -f` under stdout or --json
    except (OutputError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in OUTPUT_ERRNOS: raise
        _drop_stdout()
        why = e if isinstance(e, OutputError) else (
            f"could not write {e.filename or 'the result to stdout'} ({output_why(e)})")
        print(f"fsdp-kit {args.command}: error: {why}", file=sys.stderr)
        sys.exit(EXIT_OUTPUT)
    finally:
        for sig, handler in old.items(): signal.signal(sig, handler)
