"""What the notebooks store and draw."""
# no machine paths or library warnings in stored outputs, and one colour per memory category in every figure.
import json, re
from types import SimpleNamespace
import pytest
from tests.conftest import ROOT

NOTEBOOKS = sorted((ROOT / "nbs").glob("*.ipynb"))
MACHINE_PATHS = re.compile(r"(?<![\w.])(/work/|/tmp/|/home/|/root/)")
ILLUSTRATIVE = ("/home/me/train_mine.py",)  # 10_launch's made-up user frame, built in the cell: a path of no machine
WARNING = re.compile(r"Warning|warnings\.warn|\[transformers\]|\[accelerate\]|site-packages|Failed to load")


def _outputs(nb):
    "(cell id, kind, text) of every stored output of the notebook at `nb`: streams by name, text data by MIME type."
    for cell in json.loads(nb.read_text())["cells"]:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream": yield cell["id"], out["name"], "".join(out["text"])
            for mime, data in (out.get("data") or {}).items():
                if mime.startswith("text/"): yield cell["id"], mime, "".join(data) if isinstance(data, list) else data
            if out["output_type"] == "error": yield cell["id"], "error", "\n".join(out.get("traceback", []))


def test_notebooks_are_found():
    assert len(NOTEBOOKS) >= 27 and all(nb.suffix == ".ipynb" for nb in NOTEBOOKS)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_stored_outputs_hold_no_machine_paths_and_no_warnings(nb):
    found = []
    for cid, kind, text in _outputs(nb):
        for path in ILLUSTRATIVE: text = text.replace(path, "")
        if m := MACHINE_PATHS.search(text): found.append(f"{cid} {kind}: ...{text[max(0, m.start() - 40):m.start() + 60]!r}")
        if kind == "stderr" and WARNING.search(text): found.append(f"{cid} stderr: {text[:120]!r}")
    assert found == [], f"{nb.name}:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    nb = tmp_path / "x.ipynb"
    cells = [dict(id="a", cell_type="code", outputs=[dict(output_type="stream", name="stdout", text=["saved to /tmp/x/y\n"])]),
             dict(id="b", cell_type="code",
                  outputs=[dict(output_type="stream", name="stderr", text=["/v/lib/site-packages/t.py:3: UserWarning: x\n"])])]
    nb.write_text(json.dumps(dict(cells=cells)))
    kinds = [(cid, kind) for cid, kind, text in _outputs(nb)]
    assert kinds == [("a", "stdout"), ("b", "stderr")]
    with pytest.raises(AssertionError, match="a stdout.*/tmp/x/y"): test_stored_outputs_hold_no_machine_paths_and_no_warnings(nb)


def _bar_colours(ax) -> dict:
    "Legend label -> face colour of each bar container of `ax`."
    from matplotlib.colors import to_hex
    return {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in ax.containers if c.patches}


def test_every_memory_figure_draws_a_category_in_its_one_colour():
    "plot_categories, 05_qlora's two panels and the planner's per-category scatter all take a category's colour from CATEGORY_COLOURS."
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex
    from fsdp_kit.measure import CATEGORIES, CATEGORY_COLOURS, category_colour, plot_categories
    from fsdp_kit.qlora import plot_memory, PARAMETER_CATEGORIES
    from fsdp_kit.plan_validate import plot_validation
    assert set(CATEGORIES.values()) <= set(CATEGORY_COLOURS) and len(set(CATEGORY_COLOURS.values())) == len(CATEGORY_COLOURS)  # distinct
    assert category_colour("no such category") == "#000000"
    peak = {c: (i + 1) * 2**20 for i, c in enumerate(CATEGORIES.values())} | dict(total=2**30)
    fig = plot_categories(dict(a=peak, b=peak))
    assert _bar_colours(fig.axes[0]) == {c: CATEGORY_COLOURS[c] for c in CATEGORIES.values()}
    plt.close(fig)
    result = SimpleNamespace(model="tiny", world_size=2, quant_storage="bfloat16",
                             peak_by_category=dict(bf16_lora=[peak, peak], qlora=[peak, peak]))
    fig = plot_memory(result)
    left, right = (_bar_colours(ax) for ax in fig.axes[:2])
    assert left == {c: CATEGORY_COLOURS[c] for c in CATEGORIES.values()} and right == {c: CATEGORY_COLOURS[c] for c in PARAMETER_CATEGORIES}
    plt.close(fig)
    run = dict(config=dict(world_size=2, label="x"), measured_bytes=2**20, predicted_bytes=2**20, peak_moment="loss backward",
               measured_by_category=dict(activations=2**20, all_gather_buffers=2**19),
               predicted_by_category=dict(activations=2**20, all_gather_buffers=2**19))
    fig = plot_validation(dict(runs=[run], max_abs_error=0.0))
    dots = {c.get_label(): to_hex(c.get_facecolor()[0]) for c in fig.axes[1].collections if c.get_label() in CATEGORY_COLOURS}
    assert dots == {c: CATEGORY_COLOURS[c] for c in ("activations", "all_gather_buffers")}
    plt.close(fig)
