"The seed coverage table (nbs/13_seeds.ipynb, fsdp_kit.seeds): every lesson and section it names exists, so a renamed section fails here."
import json, re
from pathlib import Path
import pytest
from fsdp_kit.seeds import COVERAGE, SEEDS, check_row

NBS = Path(__file__).resolve().parent.parent / "nbs"


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


def test_a_pending_item_loses_its_mark_once_its_section_exists():
    done = [f"{r['notebook']}: {r['section']}" for r in COVERAGE if r["status"].startswith("pending")
            and (NBS / f"{r['notebook']}.ipynb").exists() and r["section"] in sections(r["notebook"])]
    assert done == [], "these sections exist now: set the items' status to runs (or point them to the section's real name)"


def test_mentioned_items_give_a_reason():
    mentioned = [r for r in COVERAGE if r["status"] == "mentioned"]
    assert mentioned and all(r["reason"] and "measured" in r["reason"] for r in mentioned)


def test_the_table_is_data_the_package_ships(tmp_path):
    "COVERAGE is read from fsdp_kit/examples/seeds/coverage.json; a bad row in such a file is refused, naming the field."
    from fsdp_kit.config import EXAMPLES
    from fsdp_kit.errors import KitError
    from fsdp_kit.seeds import COVERAGE_FILE, load_coverage
    assert COVERAGE_FILE == EXAMPLES / "seeds" / "coverage.json" and load_coverage(COVERAGE_FILE) == COVERAGE
    bad = tmp_path / "coverage.json"
    bad.write_text(json.dumps([dict(seed="peft", kind="tip", item="x", notebook="05a_lora", section="y", status="mentioned")]))
    with pytest.raises(KitError, match="reason=None is not allowed: a measured reason"): load_coverage(bad)
