"""nbval over notebooks that `nbdev-clean` keeps: their stored outputs stay, their execution counts are nulled.

nbval treats a cell with outputs but no execution count as an error ("Unrun reference cell has outputs").
The stored outputs are real outputs of a run (the docs site shows them), so give such cells a count back
before nbval looks at them; which outputs are compared is still decided by `# NBVAL_CHECK_OUTPUT`.
"""


# `make nbval` runs two notebooks at a time, each whole in one kernel (--dist loadscope), in the order collected
# (--no-loadscope-reorder: xdist would otherwise start the notebooks with the most cells first). The longest notebooks first, as
# measured on 2 cores, so that the two workers end together; the rest follow in name order.
LONGEST_FIRST = ("12_doctor", "08c_plan_build", "09a_hf_run", "07_checkpoint", "04c_ac", "04_wrap", "05_qlora", "03b_versions",
                 "05b_peft", "11_scale", "10_launch", "08a_plan_validate", "04b_reshard", "05a_lora", "09_hf", "08_plan", "09b_moe",
                 "03a_upstream", "06_cp")


def pytest_collection_modifyitems(items):
    rank = lambda item: LONGEST_FIRST.index(item.path.stem) if item.path.stem in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # a stable sort: a notebook's cells keep their order
    for i, item in enumerate(items, 1):
        cell = getattr(item, "cell", None)
        if cell is not None and cell.get("outputs") and cell.get("execution_count") is None:
            cell["execution_count"] = i
