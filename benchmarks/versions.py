"""The versions matrix: the kit's probes in a throwaway environment per combination of upstream releases.

    python benchmarks/versions.py --out fsdp_kit/examples/versions/matrix.json

For each combination (the newest release of every library; each older minor release of one library with the newest of
the others; the oldest set pyproject.toml allows) it makes a virtual environment that sees this one's packages (torch,
the kit) behind its own, installs the combination with pip, runs every probe of `fsdp_kit.versions.PROBES` in it, and
marks each probe PASS, DIFF (it ran, and measured other values than on the newest releases: which, and both values) or
FAIL (with its error's last line). The file is rewritten after each combination. A benchmark, not a test: about 35
minutes on 2 CPU cores for 10 combinations.
"""
import argparse, sys, time
from pathlib import Path
from fsdp_kit.versions import MATRIX, DEPTH, LIBS, PROBES, grid, minors, pypi_releases, supported_oldest, run_matrix, matrix_table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=MATRIX, help=f"the matrix JSON (default: {MATRIX})")
    p.add_argument("--only", default=None, help="comma-separated combination names to run (default: all), e.g. 'newest,accelerate 1.15.0'")
    p.add_argument("--probes", default=None, help=f"comma-separated probes (default: all of {', '.join(x.name for x in PROBES)})")
    p.add_argument("--keep", metavar="DIR", default=None, help="make the environments in DIR and keep them (default: a temporary folder, removed)")
    a = p.parse_args(argv)
    releases = {lib: minors(pypi_releases(lib), DEPTH[lib]) for lib in LIBS}
    combos = grid(releases, supported_oldest())
    if a.only: combos = [c for c in combos if c["name"] in a.only.split(",")] or sys.exit(f"--only={a.only!r}: no such combination in {[c['name'] for c in grid(releases, supported_oldest())]}")
    probes = [x for x in PROBES if not a.probes or x.name in a.probes.split(",")]
    start = time.time()
    matrix = run_matrix(combos, a.out, probes, a.keep, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(matrix_table(matrix))
    print(f"{len(combos)} combinations, {len(probes)} probes each: {time.time() - start:.0f} s; wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
