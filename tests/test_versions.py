("The versions matrix: its stored file, the grid, the environments, the doctor's verdict, and every version-dependent sentence of the "
 "lessons naming its version.")
import json, re
import pytest
from fsdp_kit.versions import (LIBS, PROBES, STATUS, CHANGES, CHANGES_FILE, load_changes, grid, minors, supported_oldest, load_matrix,
                               versions_verdict, make_env, installed, change_of, differences, merge, matrix_table, findings,
                               plot_matrix, release, error_line, measured_on, _distance)
from tests.conftest import ROOT

M = load_matrix()
NEWEST = M["combos"][0]["versions"]


def test_the_stored_matrix_has_ten_combinations_each_with_every_probe():
    assert len(M["combos"]) >= 10 and M["probes"] == [p.name for p in PROBES]
    libraries = [c["name"] for c in M["combos"] if c["varied"] != "torch"]  # the first run measured the whole grid of libraries
    assert M["runs"][0]["command"].startswith("versions.py") and M["runs"][0]["combos"] == libraries and M["date"]
    assert {c["name"] for c in M["combos"]} <= {n for r in M["runs"] for n in r["combos"]}  # each stored row by a run it lists
    assert M["runs"][0]["seconds"] < 45 * 60 and M["seconds"] < 45 * 60  # the grid of libraries in one run, the stored combinations' time
    for c in M["combos"]:
        assert set(c["versions"]) == set(LIBS) and c["install_seconds"] >= 0 and c["torch"]  # each row the torch it ran on
        for name in M["probes"]:
            p = c["probes"][name]
            assert p["status"] in STATUS and p["seconds"] > 0
            assert ("values" in p) == (p["status"] != "FAIL") and (p["status"] != "FAIL" or p["reason"])
            assert (p["status"] == "DIFF") == bool(p.get("diff")), (c["name"], name)


def test_the_newest_combination_passes_every_probe_and_is_what_the_ranges_allow():
    assert all(p["status"] == "PASS" for p in M["combos"][0]["probes"].values())
    assert M["combos"][-1]["name"] == "oldest supported" and M["combos"][-1]["versions"] == supported_oldest()


def test_the_grid_varies_one_library_at_a_time():
    releases = dict(accelerate=["1.16.0", "1.15.0", "1.14.0"], transformers=["5.25.0", "5.24.0"], peft=["0.21.2"], trl=["1.16.0"],
                    bitsandbytes=["0.50.2"])
    oldest = dict(accelerate="1.14.0", transformers="5.24.0", peft="0.21.2", trl="1.16.0", bitsandbytes="0.50.2")
    combos = grid(releases, oldest)
    assert [c["name"] for c in combos] == ["newest", "accelerate 1.15.0", "accelerate 1.14.0", "transformers 5.24.0", "oldest supported"]
    assert all(sum(c["versions"][k] != combos[0]["versions"][k] for k in LIBS) == 1 for c in combos[1:-1])
    assert minors(["2.0.0", "1.9.1", "1.9.0", "2.0.0rc1"], 2) == ["2.0.0", "1.9.1"]


def test_every_change_is_measured_on_the_releases_it_names_and_explains_accelerate_1_15():
    diffs = [(combo, name, k) for combo in M["combos"] for name, p in combo["probes"].items() for k, _, _ in p.get("diff", [])]
    for ch in CHANGES:  # each entry of CHANGES is a difference the stored matrix measured, on a release it names as old
        assert any(change_of(k, name, combo["versions"]) is ch for combo, name, k in diffs), ch["what"]
    old = next(c for c in M["combos"] if c["name"] == "accelerate 1.15.0")
    unexplained = [(name, k) for c, name, k in diffs if c is old and k != "losses" and not change_of(k, name, old["versions"])]
    assert unexplained == []  # every 1.15 / 1.16 difference but the losses it causes has its entry, what and fix
    assert differences(dict(a=dict(x_mib=1.0, y=2)), dict(a=dict(x_mib=3.0, y=2))) == []


def test_changes_are_data_in_the_package_and_a_bad_entry_is_seen(tmp_path):
    "CHANGES is read from fsdp_kit/examples/versions/changes.json (shipped with the package), not written in the module."
    import inspect
    import fsdp_kit.versions as versions
    from fsdp_kit.config import EXAMPLES
    assert CHANGES_FILE == EXAMPLES / "versions" / "changes.json" and load_changes() == CHANGES and len(CHANGES) >= 7
    fields = {"lib", "old", "since", "key", "words", "what", "fix"}
    for c in json.loads(CHANGES_FILE.read_text()):
        assert fields <= set(c) <= fields | {"probe"} and c["lib"] in LIBS, c
        assert all(re.fullmatch(r"\d+\.\d+", v) for v in c["old"]) and c["what"] and c["fix"], c
    assert all(isinstance(c["old"], tuple) and isinstance(c["words"], tuple) for c in CHANGES)  # as the module once wrote them
    assert "dict(lib=" not in inspect.getsource(versions)
    other = tmp_path / "changes.json"
    other.write_text(json.dumps([dict(lib="peft", old=["0.20"], since="0.21.0", key="k", words=["w"], what="w", fix="f")]))
    assert load_changes(other) == [dict(lib="peft", old=("0.20",), since="0.21.0", key="k", words=("w",), what="w", fix="f")]


def test_a_failure_names_where_it_was_raised_from_its_package_on():
    tb = 'Traceback (most recent call last):\n  File "{}", line 7, in track\n    x\nAttributeError: no attribute\n'
    assert error_line(tb.format("/any/checkout/fsdp_kit/measure.py"), 1) == "AttributeError: no attribute (in fsdp_kit/measure.py:7, track)"
    assert error_line(tb.format("/v/lib/python3.11/site-packages/torch/a.py"), 1) == "AttributeError: no attribute (in torch/a.py:7, track)"
    kit = ("fsdp-kit train: rank 1 failed (then rank(s) 0 failed too): AttributeError: 'FSDPState' object has no attribute 'x'\n"
           "  /any/checkout/fsdp_kit/train.py:88 in train_loop\n  /any/checkout/fsdp_kit/measure.py:53 in hook\n"
           "(--debug prints the whole trace)\n")  # the kit's own report: the error, then its frames, innermost last
    assert error_line(kit, 1) == "AttributeError: 'FSDPState' object has no attribute 'x' (in fsdp_kit/measure.py:53, hook)"


def test_the_doctor_verdict_names_the_fix_for_a_release_with_a_known_diff():
    v = versions_verdict(dict(NEWEST, accelerate="1.15.0"), M)
    assert v["status"] == "WARN" and v["covered"] and v["combination"] == "accelerate 1.15.0"
    assert "upgrade accelerate to 1.16.0" in v["fix"] and any("output_dtype" in w for f in v["findings"] for w in f["changes"])
    assert versions_verdict(NEWEST, M)["status"] == "PASS"
    far = versions_verdict(dict(NEWEST, peft="0.19.0"), M)
    assert far["status"] == "WARN" and not far["covered"] and "nearest measured combination is 'peft 0.20.0'" in far["reason"]


@pytest.mark.timeout(180)
def test_an_environment_sees_the_base_behind_its_own_packages(tmp_path):
    mine = {k: v for k, v in installed().items() if k in LIBS}
    py, seconds, error, torch = make_env(tmp_path / "env", mine)  # nothing to download: every release is already in the base
    assert error is None and py.exists() and seconds < 120  # the base's torch, seen from the env (a wheel's metadata may drop +cu130)
    assert release(torch) == release(installed()["torch"]) and torch.startswith(installed()["torch"])


TORCH = ("torch 2.14.1", "torch 2.12.1")  # the torch releases the stored matrix measured besides the base's 2.13.0


def test_the_stored_matrix_measured_torch_releases_with_the_newest_libraries():
    rows = {c["name"]: c for c in M["combos"]}
    assert M["combos"][-1]["name"] == "oldest supported" and [c["name"] for c in M["combos"] if c["varied"] == "torch"] == list(TORCH)
    assert release(M["base"]["torch"]) == "2.13.0" and all(rows[c]["versions"] == NEWEST for c in TORCH)
    assert [release(rows[c]["torch"]) for c in TORCH] == ["2.14.1", "2.12.1"]  # the torch each environment imported, its own
    assert {release(c["torch"]) for c in M["combos"] if c["varied"] != "torch"} == {"2.13.0"}  # the others: the base's
    assert any(p["status"] == "FAIL" and "_cast_output_dtype" in p["reason"] for p in rows["torch 2.12.1"]["probes"].values())
    on_2141 = versions_verdict(dict(NEWEST, torch="2.14.1+cu130"), M)  # a local tag is no other release
    assert on_2141["covered"] and on_2141["combination"] == "torch 2.14.1" and on_2141["torch"] == "2.14.1"
    assert versions_verdict(dict(NEWEST, torch="2.13.0+cpu"), M)["combination"] == "newest"
    old = versions_verdict(dict(NEWEST, torch="2.12.1"), M)
    assert old["status"] == "FAIL" and old["combination"] == "torch 2.12.1" and "train FAIL" in old["reason"]
    assert "| torch 2.12.1 | 2.12.1" in matrix_table(M) and all(f["status"] for c in M["combos"] for f in findings(c, NEWEST))


def _row(name, torch=None, varied=None, versions=None, **statuses):
    probes = {p: dict(status=s, values=dict(x=1)) if s != "FAIL" else dict(status=s, reason="AttributeError: x") for p, s in
              (dict(a="PASS", b="PASS") | statuses).items()}
    return dict(name=name, versions=versions or SMALL, varied=varied, probes=probes, seconds=1) | (dict(torch=torch) if torch else {})


SMALL = dict(accelerate="1.16.0", transformers="5.25.0", peft="0.21.2", trl="1.16.0", bitsandbytes="0.50.2")
BASE = dict(torch="2.13.0+cpu")


def small_matrix():
    return dict(base=BASE, date="today", probes=["a", "b"], runs=[dict(command="versions.py")],
                combos=[_row("newest", "2.13.0+cpu"),
                        _row("accelerate 1.15.0", "2.13.0+cpu", "accelerate", dict(SMALL, accelerate="1.15.0")),
                        _row("torch 2.14.1", "2.14.1+cu130", "torch"), _row("torch 2.12.1", "2.12.1+cu130", "torch", b="FAIL")])


def test_the_grid_has_a_combination_per_torch_release_with_the_newest_libraries():
    releases = dict(accelerate=["1.16.0", "1.15.0"], transformers=["5.25.0"], peft=["0.21.2"], trl=["1.16.0"], bitsandbytes=["0.50.2"])
    combos = grid(releases, dict(SMALL, accelerate="1.15.0", peft="0.20.0"), ["2.14.1", "2.12.1"])
    assert [c["name"] for c in combos] == ["newest", "accelerate 1.15.0", "torch 2.14.1", "torch 2.12.1", "oldest supported"]
    assert [c.get("torch") for c in combos] == [None, None, "2.14.1", "2.12.1", None]  # None: the base's torch
    assert combos[2]["versions"] == combos[3]["versions"] == SMALL and combos[2]["varied"] == "torch"
    assert [c["name"] for c in grid(releases, SMALL)] == ["newest", "accelerate 1.15.0"]  # no torch releases: none


def test_merge_keeps_the_torch_rows_in_the_grids_order_and_stamps_each_row_with_its_torch():
    old = dict(base=BASE, probes=["a", "b"], runs=[dict(command="versions.py")],
               combos=[dict(_row("newest"), seconds=5), dict(_row("accelerate 1.15.0", versions=dict(SMALL, accelerate="1.15.0")),
                                                          seconds=5)])  # rows written before they recorded torch
    new = dict(base=BASE, probes=["a", "b"], runs=[dict(command="versions.py --only torch 2.12.1")],
               combos=[_row("torch 2.12.1", "2.12.1+cu130", "torch", b="FAIL")])
    m = merge(old, new, ["newest", "accelerate 1.15.0", "torch 2.14.1", "torch 2.12.1"])
    assert [(c["name"], c["torch"]) for c in m["combos"]] == [("newest", "2.13.0+cpu"), ("accelerate 1.15.0", "2.13.0+cpu"),
                                                              ("torch 2.12.1", "2.12.1+cu130")]
    assert m["combos"][2]["probes"]["b"]["status"] == "FAIL" and m["seconds"] == 11 and len(m["runs"]) == 2
    assert [c["name"] for c in merge(m, new, ["newest", "torch 2.12.1"])["combos"]] == ["newest", "torch 2.12.1"]  # grid's names only


def test_the_table_has_a_torch_column():
    lines = matrix_table(small_matrix()).splitlines()
    assert lines[0] == "| combination | torch | accelerate | transformers | peft | trl | bitsandbytes | a | b |"
    assert lines[1] == "|" + "---|" * 9
    assert lines[4] == "| torch 2.14.1 | 2.14.1+cu130 | 1.16.0 | 5.25.0 | 0.21.2 | 1.16.0 | 0.50.2 | PASS | PASS |"
    assert lines[5].endswith("| PASS | FAIL |") and lines[5].startswith("| torch 2.12.1 | 2.12.1+cu130 |")


def test_the_verdict_matches_a_combination_on_its_torch_release_too():
    m = small_matrix()
    v = versions_verdict(dict(SMALL, torch="2.14.1+cu130"), m)  # the local tag is ignored
    assert (v["status"], v["combination"], v["covered"], v["torch"], v["installed"]) == ("PASS", "torch 2.14.1", True, "2.14.1", SMALL)
    assert v["reason"] == ("torch 2.14.1, accelerate 1.16.0, transformers 5.25.0, peft 0.21.2, trl 1.16.0, bitsandbytes 0.50.2: "
                           "measured as 'torch 2.14.1' on today: every probe as on the newest releases")
    assert versions_verdict(dict(SMALL, torch="2.13.0"), m)["combination"] == "newest"
    assert versions_verdict(SMALL, m)["combination"] == "newest"  # no torch named: the base's
    old = versions_verdict(dict(SMALL, torch="2.12.1+cpu"), m)
    assert (old["status"], old["combination"], old["covered"]) == ("FAIL", "torch 2.12.1", True)
    assert old["findings"][0]["probe"] == "b" and old["findings"][0]["reason"] == "AttributeError: x"
    assert old["fix"] == "torch 2.13.0 or 2.14.1: no probe failed with it and these libraries"
    far = versions_verdict(dict(SMALL, torch="2.11.0"), m)  # not measured: the nearest torch release's row
    assert (far["status"], far["combination"], far["covered"]) == ("FAIL", "torch 2.12.1", False)
    assert "the nearest measured combination is 'torch 2.12.1' (torch 2.12.1)" in far["reason"]
    tie = versions_verdict(dict(SMALL, accelerate="1.15.0", torch="2.14.1"), m)  # one release off either way: the grid's first
    assert tie["combination"] == "accelerate 1.15.0" and not tie["covered"] and "(torch 2.13.0)" in tie["reason"]
    assert _distance(dict(SMALL, torch="2.14.1+cu130"), dict(SMALL, torch="2.12.1")) == (1, 2) and _distance(SMALL, SMALL) == (0, 0)
    runs = [dict(date="12-04", combos=["newest", "torch 2.14.1"]), dict(date="12-07", combos=["torch 2.14.1"])]
    assert [measured_on(c, dict(m, runs=runs)) for c in m["combos"]] == ["12-04", "today", "12-07", "today"]  # unlisted: the matrix's
    assert "measured as 'newest' on 12-04" in versions_verdict(SMALL, dict(m, runs=runs))["reason"]


def test_the_plot_has_a_row_per_combination_torch_rows_too():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plot_matrix(small_matrix())
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["newest", "accelerate 1.15.0", "torch 2.14.1", "torch 2.12.1"]
    plt.close(fig)


VERSION = re.compile(r"\b(accelerate|transformers|peft|trl|bitsandbytes)\s*(>=|<=|<|>|==|≥|≤)?\s*\d+\.\d+")


def sentences():
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                for s in re.split(r"(?<=[.;:!?])\s+(?=[A-Z`(])", "".join(cell["source"])): yield nb.name, s


def test_every_sentence_on_a_changed_behaviour_names_its_versions():
    changed = [c for c in CHANGES if any(change_of(k, name) is c for combo in M["combos"] for name, p in combo["probes"].items()
                                         for k, _, _ in p.get("diff", []))]
    assert changed
    bad = [(nb, s[:160]) for nb, s in sentences() for c in changed if any(w in s for w in c["words"]) and c["lib"] in s
           and not VERSION.search(s)]
    assert not bad, bad


# A release range a sentence states for a library: `accelerate <= 1.15`, `>= 1.16` (the library named last before it), `before 1.16`,
# `since 1.16`. The side it speaks of: `<=`, `<` and `before` the old behaviour, `>=`, `>` and `since` the new one.
RANGE = re.compile(r"(<=|>=|<|>|≤|≥|\bbefore\b|\bsince\b)\s*(\d+\.\d+)")
LIB = re.compile(r"\b(accelerate|transformers|peft|trl|bitsandbytes)\b")
minor = lambda v: tuple(int(x) for x in v.split(".")[:2])


def measured_sides(ch: dict, matrix: dict) -> tuple:
    """The minor releases of `ch`'s library the matrix measured with the old behaviour (a probe differs from the newest on a key `ch`
    explains at that release) and with the new one (no probe differs on a key of `ch`), on the rows that vary that library alone. A
    release that differs on the key for another entry's reason is on neither side."""
    base = matrix["combos"][0]["versions"]
    rows = [c for c in matrix["combos"] if all(c["versions"][k] == base[k] for k in LIBS if k != ch["lib"])]
    old, new = set(), set()
    for c in rows:
        keys = [(name, k) for name, p in c["probes"].items() for k, _, _ in p.get("diff", [])]
        if any(change_of(k, name, c["versions"]) is ch for name, k in keys): old.add(minor(c["versions"][ch["lib"]]))
        elif not any(change_of(k, name) is ch for name, k in keys): new.add(minor(c["versions"][ch["lib"]]))
    return old, new


def contradicted_ranges(sentence: str, ch: dict, old: set, new: set) -> list:
    "Each range `sentence` states for `ch`'s library that a measured release contradicts: (the range, the releases against it)."
    bad = []
    for m in RANGE.finditer(sentence):
        libs = LIB.findall(sentence[:m.start()])
        if not libs or libs[-1] != ch["lib"]: continue
        op, v = m.group(1), minor(m.group(2))
        inside = {"<=": lambda r: r <= v, "≤": lambda r: r <= v, "<": lambda r: r < v, "before": lambda r: r < v,
                  ">=": lambda r: r >= v, "≥": lambda r: r >= v, ">": lambda r: r > v, "since": lambda r: r >= v}[op]
        claims_old = op in ("<=", "≤", "<", "before")
        against = sorted(r for r in (new if claims_old else old) if inside(r))
        if against: bad.append((m.group(0), [".".join(map(str, r)) for r in against]))
    return bad


def lesson_ranges(matrix: dict):
    "(notebook, sentence, change, contradicted ranges) for every lesson sentence on a changed behaviour that states a release range."
    for ch in CHANGES:
        old, new = measured_sides(ch, matrix)
        if not old: continue
        for nb, s in sentences():
            if ch["lib"] in s and any(w in s for w in ch["words"]) and RANGE.search(s):
                yield nb, s, ch, contradicted_ranges(s, ch, old, new)


def test_each_change_carries_the_releases_the_matrix_measured():
    "No release an entry names as `old` was measured behaving like the newest, and every measured release from its `since` on was."
    for ch in CHANGES:
        old, new = measured_sides(ch, M)
        assert not ({minor(r) for r in ch["old"]} & new), (ch["key"], ch["old"], sorted(new))
        assert not any(r >= minor(ch["since"]) for r in old), (ch["key"], ch["since"], sorted(old))


def test_every_release_range_in_the_lessons_agrees_with_the_matrix():
    checked = list(lesson_ranges(M))
    assert len(checked) >= 3  # the lessons state ranges for several changes
    assert [(nb, s[:160], bad) for nb, s, _, bad in checked if bad] == []


def test_a_range_the_matrix_contradicts_is_caught():
    "A planted sentence that says `<= 1.15` for a behaviour the matrix measured on 1.15 and 1.14 but not 1.13 fails; its true range passes."
    ch = {"lib": "accelerate", "key": "k", "words": ["w"]}
    old, new = {(1, 14), (1, 15)}, {(1, 13), (1, 16)}
    assert contradicted_ranges("With w, accelerate <= 1.15 upcasts the model; >= 1.16 does not.", ch, old, new) == [("<= 1.15", ["1.13"])]
    assert contradicted_ranges("With w, accelerate 1.14 and 1.15 upcast the model; >= 1.16 does not.", ch, old, new) == []
    assert contradicted_ranges("With w, accelerate >= 1.14 keeps the model in bf16.", ch, old, new) == [(">= 1.14", ["1.14", "1.15"])]
    # a range of another library in the same sentence is not this change's
    assert contradicted_ranges("With w on torch >= 2.13, accelerate before 1.16 upcasts.", ch, old, new) == [("before 1.16", ["1.13"])]
    assert contradicted_ranges("transformers >= 5.0 with w", ch, old, new) == []
