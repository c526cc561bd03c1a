("The versions matrix: its stored file, the grid, the environments, the doctor's verdict, and every version-dependent sentence of the "
 "lessons naming its version.")
import json, re
import pytest
from fsdp_kit.versions import (LIBS, PROBES, STATUS, CHANGES, grid, minors, supported_oldest, load_matrix, versions_verdict, make_env,
                               installed, change_of, differences)
from tests.conftest import ROOT

M = load_matrix()
NEWEST = M["combos"][0]["versions"]


def test_the_stored_matrix_has_ten_combinations_each_with_every_probe():
    assert len(M["combos"]) >= 10 and M["probes"] == [p.name for p in PROBES]
    assert M["runs"][0]["command"].startswith("versions.py") and len(M["runs"][0]["combos"]) == len(M["combos"]) and M["date"]
    assert M["runs"][0]["seconds"] < 45 * 60 and M["seconds"] < 45 * 60  # the whole grid in one run, and the stored combinations' time
    for c in M["combos"]:
        assert set(c["versions"]) == set(LIBS) and c["install_seconds"] >= 0
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
    py, seconds, error = make_env(tmp_path / "env", mine)  # nothing to download: every release is already in the base
    assert error is None and py.exists() and seconds < 120


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
