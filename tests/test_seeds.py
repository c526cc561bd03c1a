"""The seed coverage table (nbs/13_seeds.ipynb, fsdp_kit.seeds): every lesson and section it names exists, every row with a marker
points at a code cell of its section that holds the marker and a stored output, and every partial or mentioned row says what was
measured, where."""
import json, re
from pathlib import Path
import pytest
from fsdp_kit.errors import KitError
from fsdp_kit.seeds import COVERAGE, SEEDS, MEASURED, NOT_RUN, check_row, check_evidence, item

NBS = Path(__file__).resolve().parent.parent / "nbs"
# runs and partial rows, and the mentioned ones that name a marker
MARKED = [r for r in COVERAGE if r["marker"] and not r["status"].startswith("pending")]


def sections(notebook: str) -> set:
    "The ## and ### headings of a lesson, without the hashes."
    cells = json.loads((NBS / f"{notebook}.ipynb").read_text())["cells"]
    return {l.lstrip("#").strip() for c in cells if c["cell_type"] == "markdown"
            for l in "".join(c["source"]).splitlines() if re.match(r"^#{2,3} ", l)}


def test_every_row_is_well_formed():
    for row in COVERAGE: check_row(row)
    assert {r["seed"] for r in COVERAGE} == set(SEEDS)
    assert len({(r["seed"], r["item"]) for r in COVERAGE}) == len(COVERAGE), "an item listed twice"


@pytest.mark.parametrize("row", [r for r in COVERAGE if not r["status"].startswith("pending")], ids=lambda r: r["item"][:50])
def test_every_lesson_and_section_named_exists(row):
    assert (NBS / f"{row['notebook']}.ipynb").exists(), f"no lesson {row['notebook']} for {row['item']!r}"
    assert row["section"] in sections(row["notebook"]), f"{row['notebook']} has no section {row['section']!r} (renamed?)"


def test_every_runs_and_partial_row_has_a_marker():
    assert all(r["marker"] for r in COVERAGE if r["status"] in ("runs", "partial"))
    assert {r["status"] for r in MARKED} >= {"runs", "partial"}


@pytest.mark.parametrize("row", MARKED, ids=lambda r: f"{r['status']}: {r['item'][:50]}")
def test_every_marked_row_points_at_a_cell_that_ran(row):
    "The row's section has a code cell that contains its marker and has a stored output (check_evidence refuses it otherwise)."
    assert check_evidence(row, NBS)


def test_a_planted_row_whose_section_does_not_run_it_fails():
    "04a's 'Collectives and their bytes' defines the counters (cells without output); the run is in another section."
    planted = item("transformers", "feature", "the picture", "04a_measure", "Collectives and their bytes",
                   marker="tiny_collective_timeline")
    with pytest.raises(KitError) as refused: check_evidence(planted, NBS)
    assert str(refused.value) == ("marker='tiny_collective_timeline' is not allowed: no code cell of 04a_measure, section "
                                  "'Collectives and their bytes' contains it (item 'the picture')")
    with pytest.raises(KitError, match=r"marker='comm_counter' .* 04a_measure, section 'Collectives and their bytes' that contain it "
                                       r"have no stored output \(item 'the picture'\)"):
        check_evidence(planted | dict(marker="comm_counter"), NBS)  # an export cell: the marker is there, no output
    with pytest.raises(KitError, match="no code cell of 04a_measure, section 'No such section'"):
        check_evidence(planted | dict(section="No such section"), NBS)
    assert check_evidence(planted | dict(section="One step's collectives, beside the seed's picture"), NBS)  # where it runs


def test_a_marked_cell_counts_only_inside_its_section_and_with_an_output(tmp_path):
    "A lesson made here: the marker in a cell without output, and in a cell with one under the next heading of the same level."
    def cell(kind, text, outputs=None):
        return dict(cell_type=kind, source=[text], metadata={}) | ({} if kind == "markdown" else dict(outputs=outputs or []))
    ran = [dict(output_type="stream", name="stdout", text=["4 calls\n"])]
    cells = [cell("markdown", "## Counting"), cell("markdown", "### Inside"), cell("code", "count_calls()", ran),
             cell("markdown", "## Defining\n```\n## not a heading, in a fence\n```"), cell("code", "def run_it(): ..."),
             cell("markdown", "## Running"), cell("code", "run_it()", ran)]
    (tmp_path / "99_lab.ipynb").write_text(json.dumps(dict(cells=cells)))
    row = item("peft", "tip", "a tip", "99_lab", "Defining", marker="run_it")
    with pytest.raises(KitError, match=r"the 1 code cell\(s\) of 99_lab, section 'Defining' that contain it have no stored output"):
        check_evidence(row, tmp_path)
    assert len(check_evidence(row | dict(section="Running"), tmp_path)) == 1
    assert len(check_evidence(row | dict(section="Counting", marker="count_calls"), tmp_path)) == 1  # a ### subsection is inside its ##


def test_partial_and_mentioned_rows_give_a_measured_reason():
    "A partial row says where it was measured and what is not run; a mentioned row where its reason was measured."
    partial = [r for r in COVERAGE if r["status"] == "partial"]
    mentioned = [r for r in COVERAGE if r["status"] == "mentioned"]
    assert partial and mentioned
    assert all(MEASURED.search(r["reason"]) for r in partial + mentioned)
    assert all(NOT_RUN.search(r["reason"]) for r in partial)
    assert all(r["reason"] is None for r in COVERAGE if r["status"] == "runs")
    with pytest.raises(KitError, match="a measured reason for a partial item"):
        check_row(item("peft", "caveat", "x", "05a_lora", "y", "partial", "merging works", "merge_worker"))
    with pytest.raises(KitError, match="says what is not run"):
        check_row(item("peft", "caveat", "x", "05a_lora", "y", "partial", "merging works (measured in 05a)", "merge_worker"))
    with pytest.raises(KitError, match="marker=None is not allowed"):
        check_row(item("peft", "caveat", "x", "05a_lora", "y", "partial", "merged, not run on FSDP1 (measured in 05a)"))


def test_a_pending_item_loses_its_mark_once_its_section_exists():
    done = [f"{r['notebook']}: {r['section']}" for r in COVERAGE if r["status"].startswith("pending")
            and (NBS / f"{r['notebook']}.ipynb").exists() and r["section"] in sections(r["notebook"])]
    assert done == [], "these sections exist now: set the items' status to runs (or point them to the section's real name)"


def test_the_table_is_data_the_package_ships(tmp_path):
    "COVERAGE is read from fsdp_kit/examples/seeds/coverage.json; a bad row in such a file is refused, naming the field."
    from fsdp_kit.config import EXAMPLES
    from fsdp_kit.seeds import COVERAGE_FILE, load_coverage
    assert COVERAGE_FILE == EXAMPLES / "seeds" / "coverage.json" and load_coverage(COVERAGE_FILE) == COVERAGE
    bad = tmp_path / "coverage.json"
    bad.write_text(json.dumps([dict(seed="peft", kind="tip", item="x", notebook="05a_lora", section="y", status="mentioned")]))
    with pytest.raises(KitError, match="reason=None is not allowed: a measured reason"): load_coverage(bad)
    bad.write_text(json.dumps([dict(seed="peft", kind="tip", item="x", notebook="05a_lora", section="y")]))
    with pytest.raises(KitError, match="marker=None is not allowed"): load_coverage(bad)
