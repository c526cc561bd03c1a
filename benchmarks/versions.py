"""The versions matrix: the kit's probes in a throwaway environment per combination of upstream releases.

    python benchmarks/versions.py --out fsdp_kit/examples/versions/matrix.json

For each combination (the newest release of every library; each older minor release of one library with the newest of
the others; each torch release of --torch with the newest of every library; the oldest set pyproject.toml allows) it makes
a virtual environment that sees this one's packages (torch, the kit) behind its own, installs the combination with pip (a
torch combination's torch too, which then shadows the base's), runs every probe of `fsdp_kit.versions.PROBES` in it, and
marks each probe PASS, DIFF (it ran, and measured other values than on the newest releases: which, and both values) or
FAIL (with its error's last line). The file is rewritten after each combination. A benchmark, not a test: about 35
minutes on 2 CPU cores for 10 combinations, and about 4 more per torch release (its CUDA build installed in under a minute).
"""
import argparse, sys, time
from pathlib import Path
import json, tempfile
from fsdp_kit.versions import (MATRIX, DEPTH, LIBS, PROBES, grid, minors, pypi_releases, supported_oldest, run_matrix, matrix_table, merge,
                               load_matrix, installed, release)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=MATRIX, help=f"the matrix JSON (default: {MATRIX})")
    p.add_argument("--only", default=None,
                   help="comma-separated combination names to run again (default: all), e.g. 'newest,accelerate 1.15.0'; "
                   "they replace those of the same name in --out, the others are kept")
    p.add_argument("--torch", default=None,
                   help="comma-separated torch releases to measure, each with the newest libraries and installed into its environment, "
                   "e.g. '2.14.1,2.12.1' (default: the torch releases --out already has, so that a run of other combinations keeps "
                   "them; '' for none); the base's own torch is the other combinations'")
    p.add_argument("--probes", default=None, help=f"comma-separated probes (default: all of {', '.join(x.name for x in PROBES)})")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="make the environments in DIR and keep them (default: a temporary folder, removed)")
    a = p.parse_args(argv)
    releases = {lib: minors(pypi_releases(lib), DEPTH[lib]) for lib in LIBS}
    stored = load_matrix(a.out) if a.out.exists() else dict(combos=[])
    torch = ([release(c["name"].removeprefix("torch ")) for c in stored["combos"] if c.get("varied") == "torch"] if a.torch is None
             else [t.strip() for t in a.torch.split(",") if t.strip()])
    torch = [t for t in torch if t != release(installed()["torch"])]  # the base's torch is the newest combination's
    everything = combos = grid(releases, supported_oldest(), torch)
    if a.only:
        combos = [c for c in combos if c["name"] in a.only.split(",")]
        if not combos or len(combos) < len(set(a.only.split(","))):
            sys.exit(f"--only={a.only!r} is not allowed: names from {[c['name'] for c in everything]}")
    probes = [x for x in PROBES if not a.probes or x.name in a.probes.split(",")]
    start, say = time.time(), lambda line: print(line, file=sys.stderr, flush=True)
    if a.only and a.out.exists():  # measure these again into a scratch file, then merge them into the stored matrix
        with tempfile.TemporaryDirectory() as tmp: new = run_matrix(combos, Path(tmp) / "part.json", probes, a.keep, say=say)
        matrix = merge(load_matrix(a.out), new, [c["name"] for c in everything])
        a.out.write_text(json.dumps(matrix, indent=1) + "\n")
    else: matrix = run_matrix(combos, a.out, probes, a.keep, say=say)
    print(matrix_table(matrix))
    print(f"{len(combos)} combinations, {len(probes)} probes each: {time.time() - start:.0f} s; wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
