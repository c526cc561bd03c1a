"One owner per concept: no `_name` crosses a module, no import cycle, no layer imports a higher one; pyflakes; line width."
import ast

import pytest
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent/"fsdp_kit"

# bottom up (../shared/DESIGN.md, "Owners"): a module may import its own layer or a lower one, never a higher one
LAYERS = [
    # foundations (upstream: what accelerate and transformers read), the run spec and the process-group helpers
    ("errors", "upstream", "config", "models", "mesh", "spec", "flags", "launch", "ranks"),
    ("measure", "ac", "wrap", "lora"),  # instruments, activation checkpointing, the sharding recipe, adapters
    ("train", "qlora", "cp", "checkpoint", "plan", "plan_validate", "plan_gpu", "build", "hf", "hf_run", "peft_guide", "cp_trainer", "moe",
     "versions", "doctor",
     "scale"),  # the labs
    ("seeds", "commands", "cli", "tour", "docs", "__main__"),  # the front
]
LAYER = {m: i for i, names in enumerate(LAYERS) for m in names}
# imports still to remove, each with where it goes; the last test fails once one is gone, so the entry goes too
PENDING = {}  # (module, dependency): why it is allowed for now

def _modules() -> dict:
    "Module name -> its parsed source, for every module of the package but nbdev's index."
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PKG.glob("*.py")) if p.stem not in ("__init__", "_modidx")}

def _imports(tree) -> list:
    "(imported fsdp_kit module, [names taken from it], line) for every import in `tree`, inside functions too."
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 1 and node.module: out.append((node.module.split(".")[0], names, node.lineno))
            elif node.level == 1: out += [(n, [], node.lineno) for n in names]  # from . import plan
            elif node.module == "fsdp_kit": out += [(n, [], node.lineno) for n in names]
            elif node.module and node.module.startswith("fsdp_kit."): out.append((node.module.split(".")[1], names, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], [], node.lineno) for a in node.names if a.name.startswith("fsdp_kit.")]
    return out

def _graph() -> dict:
    mods = _modules()
    return {m: {dep for dep, _, _ in _imports(t) if dep in mods and dep != m and (m, dep) not in PENDING} for m, t in mods.items()}

def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(LAYER))
    assert not missing, f"modules with no layer in tests/test_structure.py's LAYERS: {missing}"

def test_no_private_name_crosses_a_module():
    mods = _modules()
    bad = [f"fsdp_kit/{m}.py:{line} imports {n} from {dep}" for m, t in mods.items()
           for dep, names, line in _imports(t) if dep in mods and dep != m for n in names if n.startswith("_")]
    assert not bad, ("private names imported across modules (make them public in their owner, or move them to their only user):\n"
                     + "\n".join(bad))

def test_no_layer_imports_a_higher_one():
    mods = _modules()
    bad = [f"fsdp_kit/{m}.py:{line} (layer {LAYER[m]}) imports {dep} (layer {LAYER[dep]})"
           for m, t in mods.items() for dep, _, line in _imports(t) if dep in LAYER and m in LAYER and LAYER[dep] > LAYER[m]
           and (m, dep) not in PENDING]
    assert not bad, "a lower layer imports a higher one:\n" + "\n".join(bad)

def _cycle(graph:dict) -> list:
    "One import cycle as [a, b, ..., a], or []."
    state, stack = {}, []
    def visit(m):
        state[m] = "open"; stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == "open": return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)): return found
        state[m] = "done"; stack.pop()
        return []
    for m in sorted(graph):
        if m not in state and (found := visit(m)): return found
    return []

def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert not cycle, "import cycle among fsdp_kit modules (lazy imports count): " + " -> ".join(cycle)

def test_the_checks_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    from fsdp_kit.qlora import _x, y\n    from . import plan\nimport fsdp_kit.train\n")
    assert sorted(_imports(tree)) == [("plan", [], 3), ("qlora", ["_x", "y"], 2), ("train", [], 4)]

@pytest.mark.skipif(not PENDING, reason="PENDING is empty: no allowed import waits to be removed")
def test_pending_imports_are_still_there():
    mods = _modules()
    gone = [pair for pair in PENDING if pair[1] not in {dep for dep, _, _ in _imports(mods[pair[0]])}]
    assert not gone, f"fixed, remove from PENDING: {gone}"


def test_the_wheel_ships_every_example_file(tmp_path):
    "Notebooks and `fsdp-kit hf` read fsdp_kit/examples through the installed package (fsdp_kit.config.EXAMPLES)."
    # a wheel carries all of it.
    import shutil, subprocess, sys, zipfile
    src = tmp_path / "src"  # built from a copy: pip writes build/ and egg-info/ beside the sources
    shutil.copytree(PKG, src / "fsdp_kit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"): shutil.copy(PKG.parent / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"),
                          str(src)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    shipped = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist())
    examples = [str(p.relative_to(src)) for p in sorted((src / "fsdp_kit" / "examples").rglob("*")) if p.is_file()]
    assert len(examples) > 20 and [f for f in examples if f not in shipped] == []
    assert "fsdp_kit/examples/fsdp_configs/transformers_fsdp_config.json" in shipped and "fsdp_kit/examples/sft_lora.py" in shipped


OPTIONAL = {"pynvml": "GPU memory as NVML counts it, where it is installed (plan_validate)",
            "nbconvert": "fsdp-kit docs, with the dev extra (refused in one line without it)",
            "nbformat": "fsdp-kit docs (nbconvert's)", "pygments": "fsdp-kit docs (nbconvert's)"}


def test_every_import_is_installed_by_pip_install():
    "A third-party module the package imports comes from pyproject's dependencies or theirs: `pip install -e .` alone runs the kit."
    import ast, re, sys, tomllib
    import importlib.metadata as md
    mods = set()
    for path in PKG.glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import): mods |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module: mods.add(n.module.split(".")[0])
    name = lambda req: re.split(r"[<>=!~ ;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    direct = {name(d) for d in tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]["dependencies"]}
    theirs = {name(r) for d in direct for r in (md.requires(d) or []) if "extra ==" not in r}
    dists = md.packages_distributions()
    missing = {m: dists.get(m) for m in mods - set(sys.stdlib_module_names) - {"fsdp_kit"} - set(OPTIONAL)
               if not {name(d) for d in dists.get(m, [m])} & (direct | theirs)}
    assert missing == {}, missing


def _pyflakes(paths:list) -> tuple:
    "pyflakes over `paths`: (number of findings, their text)."
    import io
    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter
    out = io.StringIO()
    return checkRecursive([str(p) for p in paths], Reporter(out, out)), out.getvalue()

def test_pyflakes_finds_nothing():
    "An unused import, an undefined name or a redefinition in the package, the tests or the benchmarks fails the build."
    n, text = _pyflakes([PKG, PKG.parent/"tests", PKG.parent/"benchmarks"])
    assert n == 0, text

def test_pyflakes_check_can_fail(tmp_path):
    (tmp_path/"bad.py").write_text("import os\nprint(undefined_name)\n")
    n, text = _pyflakes([tmp_path])
    assert n == 2 and "'os' imported but unused" in text and "undefined name 'undefined_name'" in text


WIDTH = 140  # the tests and the benchmarks; the package keeps 120 (PACKAGE_WIDTH below, ../shared/STYLE.md)
LONG_LINES_ALLOWED = set()  # files still over the width while they are rewritten: must stay empty

def _python_files() -> list:
    "Every .py of the tests and the benchmarks (the package's own lines keep 120: `test_no_package_line_is_over_120_characters`)."
    root = PKG.parent
    return [p for d in (root/"tests", root/"benchmarks") for p in sorted(d.glob("*.py"))]

def _long_lines(paths:list, root:Path) -> list:
    "`file:line (n characters)` for every line of `paths` longer than WIDTH."
    return [f"{p.relative_to(root)}:{i} ({len(line)} characters)" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > WIDTH]

def test_no_line_is_over_140_characters():
    "Split calls at commas and strings by implicit concatenation; long explanations go to the notebook's prose."
    root = PKG.parent
    bad = [x for x in _long_lines(_python_files(), root) if x.split(":")[0] not in LONG_LINES_ALLOWED]
    assert not bad, f"{len(bad)} line(s) over {WIDTH} characters:\n" + "\n".join(bad)

def test_line_width_check_can_fail(tmp_path):
    (tmp_path/"wide.py").write_text("x = 1\n" + "y = '" + "a" * 140 + "'\n" + "z = '" + "b" * 134 + "'\n")
    assert _long_lines([tmp_path/"wide.py"], tmp_path) == ["wide.py:2 (146 characters)"]

@pytest.mark.skipif(not LONG_LINES_ALLOWED, reason="LONG_LINES_ALLOWED is empty: every file keeps the width")
def test_allowed_long_lines_are_still_there():
    root = PKG.parent
    for name in LONG_LINES_ALLOWED: assert (root/name).is_file(), f"{name} in LONG_LINES_ALLOWED does not exist"
    long_files = {x.split(":")[0] for x in _long_lines(_python_files(), root)}
    done = sorted(set(LONG_LINES_ALLOWED) - long_files)
    assert not done, f"no line over {WIDTH} characters any more, remove from LONG_LINES_ALLOWED: {done}"


# Lessons in nbdev's rhythm: an export cell holds one idea, each section shows a check, the package reads at 120 characters.
NBS = PKG.parent/"nbs"
EXPORTS = {"export", "exporti", "exports"}  # nbdev's directives that send a cell to the module
HIDDEN = {"hide", "exporti", "include: false", "echo: false", "eval: false"}  # a check in such a cell is not seen, or not run
CHECKS = {"test", "test_eq", "test_ne", "test_close", "test_fail", "test_is", "test_eq_type", "test_shuffled", "test_stdout",
          "test_warns", "test_fig_exists", "is_close", "ExceptionExpected"}  # fastcore.test's checks
CELL_MAX, CELL_MEAN = 60, 15  # non-blank lines of one export cell, and the mean over every export cell of every notebook
PACKAGE_WIDTH = 120  # ../shared/STYLE.md: lines stay under 120 characters
ALL_WIDTH = 130  # nbdev wraps `__all__`'s names at 120 characters, then writes `__all__ = ` in front of the first line
FRAGMENT = 25  # a string of at most this many characters alone on its line is a leftover of rewrapping

def _cells(nb:Path) -> list:
    "(cell type, directives, source lines) for every cell of `nb`; directives are the `#|` lines heading a code cell."
    import json
    out = []
    for cell in json.loads(nb.read_text())["cells"]:
        src = "".join(cell["source"]).splitlines()
        heads = []
        for line in src if cell["cell_type"] == "code" else []:
            if line.strip().startswith("#|"): heads.append(line.strip()[2:].strip())
            elif line.strip(): break
        out.append((cell["cell_type"], heads, src))
    return out

def _directive(head:str) -> str: return " ".join(head.replace(":", ": ").split())  # `echo:false` as `echo: false`

def _is_export(heads:list) -> bool: return any(h.split()[0] in EXPORTS for h in heads if h)

def _export_sizes(nb:Path) -> list:
    "Non-blank lines but the directives, for every export cell of `nb`."
    return [sum(1 for line in src if line.strip() and not line.strip().startswith("#|"))
            for kind, heads, src in _cells(nb) if kind == "code" and _is_export(heads)]

def _has_check(src:list) -> bool:
    "Whether code `src` asserts: an `assert` statement or a call to one of fastcore.test's checks."
    import re
    code = "\n".join(line for line in src if not line.lstrip().startswith(("!", "%")))
    try: tree = ast.parse(code)
    except SyntaxError: return bool(re.search(r"^\s*assert\b|\b(" + "|".join(CHECKS) + r")\(", code, re.M))
    name = lambda f: f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return any(isinstance(n, ast.Assert) or isinstance(n, ast.Call) and name(n.func) in CHECKS for n in ast.walk(tree))

def _unchecked_sections(nb:Path) -> list:
    "The `##` headings of `nb` whose section (up to the next `#` or `##` heading) has no visible check."
    sections, current = [], None  # [heading, checked]
    for kind, heads, src in _cells(nb):
        if kind == "markdown":
            for line in src:
                if line.startswith("## ") or line.startswith("# "):
                    current = [line[3:].strip(), False] if line.startswith("## ") else None
                    if current: sections.append(current)
        elif kind == "code" and current and not _is_export(heads) and not {_directive(h) for h in heads} & HIDDEN:
            current[1] = current[1] or _has_check(src)
    return [h for h, checked in sections if not checked]

def _lessons() -> list: return sorted(NBS.glob("[0-9][0-9]*.ipynb"))

def _package_files() -> list:
    "Every .py under fsdp_kit/ but _modidx.py, nbdev's index of names, which it writes with pprint at its own width."
    return [p for p in sorted(PKG.rglob("*.py")) if p.name != "_modidx.py" and "__pycache__" not in p.parts]

def _too_wide(paths:list, root:Path) -> list:
    "`file:line (n characters)` for every line over PACKAGE_WIDTH (ALL_WIDTH for the first line of `__all__`)."
    return [f"{p.relative_to(root)}:{i} ({len(line)} characters)" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > (ALL_WIDTH if line.startswith("__all__ = ") else PACKAGE_WIDTH)]

def _strings_and_others(text:str):
    "The significant tokens of `text`, an f-string as one STRING token (3.12 splits it), `__all__`'s names left out."
    import io, tokenize
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER}
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    depth, start, in_all, line_start = 0, None, False, True
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NEWLINE: in_all, line_start = False, True
        if tok.type in skip: continue
        if line_start and tok.string == "__all__": in_all = True  # nbdev wraps its names one or more to a line
        line_start = False
        if fstring_start is not None and tok.type == fstring_start:
            depth, start = depth + 1, start if depth else tok
        elif fstring_start is not None and tok.type == tokenize.FSTRING_END:
            depth -= 1
            if not depth and not in_all: yield tokenize.TokenInfo(tokenize.STRING, "", start.start, tok.end, "")
        elif not depth and not in_all: yield tok

def _fragments(paths:list, root:Path) -> list:
    "`file:line: text` for every string of at most FRAGMENT characters alone on its line (but brackets, commas, `+`)."
    import tokenize
    out = []
    for p in paths:
        text, by_line = p.read_text(), {}
        lines = text.splitlines()
        for tok in _strings_and_others(text):
            if tok.type == tokenize.OP and tok.string in "()[]{},+": continue
            for line in {tok.start[0], tok.end[0]}: by_line.setdefault(line, []).append(tok)
        for line, toks in sorted(by_line.items()):
            (tok, *more) = toks
            if more or tok.type != tokenize.STRING or tok.start[0] != tok.end[0]: continue
            literal = lines[line - 1][tok.start[1]:tok.end[1]]
            if len(literal) <= FRAGMENT: out.append(f"{p.relative_to(root)}:{line}: {literal}")
    return out

def test_export_cells_hold_one_idea():
    "nbdev's own export cells average 12 non-blank lines, fastcore's 8: split a long one at its definitions."
    sizes = {nb.name: _export_sizes(nb) for nb in sorted(NBS.glob("*.ipynb"))}
    big = [f"{name}: export cell {i} of {n} lines" for name, ns in sizes.items()
           for i, n in enumerate(ns, 1) if n > CELL_MAX]
    every = [n for ns in sizes.values() for n in ns]
    mean = sum(every) / len(every)
    assert not big and mean < CELL_MEAN, (f"mean {mean:.1f} lines per export cell (under {CELL_MEAN} wanted); "
                                          f"over {CELL_MAX}:\n" + "\n".join(big))

def test_every_section_shows_a_check():
    "A lesson asserts what it teaches where the reader sees it, not only in hidden cells or tests/."
    bad = [f"{nb.name}: ## {h}" for nb in _lessons() for h in _unchecked_sections(nb)]
    assert not bad, f"{len(bad)} section(s) with no visible assert or fastcore.test check:\n" + "\n".join(bad)

def test_no_package_line_is_over_120_characters():
    "Shorten the line; a module's docstring is its notebook's one-line description, which stays under 117 characters."
    bad = _too_wide(_package_files(), PKG.parent)
    assert not bad, f"{len(bad)} line(s) over {PACKAGE_WIDTH} characters:\n" + "\n".join(bad)

def test_no_orphan_string_fragment():
    "A sentence split into strings of a few words each reads worse than one longer line: join them."
    bad = _fragments(_package_files(), PKG.parent)
    assert not bad, f"{len(bad)} string fragment(s) alone on a line:\n" + "\n".join(bad)

def test_the_rhythm_checks_can_fail(tmp_path):
    import json
    code = lambda s: {"cell_type": "code", "source": s, "metadata": {}, "outputs": [], "execution_count": None}
    md = lambda s: {"cell_type": "markdown", "source": s, "metadata": {}}
    cells = [md("# T\n> d"), md("## Seen"), code("#| export\ndef f(): return 1\n\nassert f()"), code("test_eq(f(), 1)"),
             md("## Hidden"), code("#| hide\nassert f() == 1"), md("## Exported only"), code("#| export\nassert True"),
             md("## Said"), code("x = 1"), md("### Sub"), code("%time y = 2\nassert x + 1 == 2")]
    (tmp_path/"01_t.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert _export_sizes(tmp_path/"01_t.ipynb") == [2, 1]
    assert _unchecked_sections(tmp_path/"01_t.ipynb") == ["Hidden", "Exported only"]
    (tmp_path/"m.py").write_text('x = ("a long sentence that was "\n     "cut here"\n     "and here, "\n     "then")\n'
                                 'y = f("ok", "alone but long enough to be a real line of text")\nw = (f"{x}:g"\n     f"{y}")\n'
                                 + "__all__ = ['" + "a" * 116 + "',\n           'short_name']\n" + "z = '" + "b" * 115 + "'\n")
    assert [x.split(": ")[1] for x in _fragments([tmp_path/"m.py"], tmp_path)] == ['"cut here"', '"and here, "', '"then"', 'f"{y}"']
    assert _too_wide([tmp_path/"m.py"], tmp_path) == ["m.py:10 (121 characters)"]  # __all__'s 130 pass
