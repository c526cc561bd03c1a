"""The docs site: built offline from the notebooks' stored outputs, checked in a real headless browser."""
import html, json, os, re, shutil, subprocess
import pytest
from fsdp_kit.docs import build_site, notebooks, page_name
from pathlib import Path
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    return out, build_site(out, ROOT / "nbs")


def _browser():
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if exe is None:
        if os.environ.get("FSDP_KIT_REQUIRE_BROWSER"):
            pytest.fail("FSDP_KIT_REQUIRE_BROWSER is set but no chromium is installed (apt-get install chromium)")
        pytest.skip("no chromium on this machine (CI installs Debian's chromium)")
    return exe


def _chrome(exe, tmp, *args):
    out = subprocess.run([exe, *CHROME_FLAGS, f"--user-data-dir={tmp}", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_page_per_notebook_and_figures(site):
    out, manifest = site
    pages = {p["page"]: p for p in manifest["pages"]}
    expected = [page_name(nb) for nb in notebooks(ROOT / "nbs")]
    assert expected[0] == "index.html" and set(expected) <= set(pages) and "api.html" in pages
    for name in pages:
        text = (out / name).read_text()
        assert "Traceback (most recent call last)" not in text, name
        # a page has no kernel: a note, then the default state
        assert "interactive(children=" not in text, f"{name} shows a widget's Python repr"
        assert re.search(r'<aside class="toc"><b>On this page</b><a ', text), f"{name}: its 'On this page' box is empty"
        assert all(f'href="{p}"' in text for p in expected), f"{name} lacks navigation"
    assert all(p["errors"] == 0 for p in pages.values())
    # a figure failed fsdp_kit.measure.check_figure (a legend over data, too wide, text too small)
    assert [p["page"] for p in pages.values() if p["figure_errors"]] == []
    with_figures = [p for p in pages.values() if p["figures"]]
    assert len(with_figures) >= 4, with_figures
    for p in with_figures:
        text = (out / p["page"]).read_text()
        assert text.count('src="data:image/png;base64,') == p["figures"]
        # every figure says what it is to a screen reader: its title, or its section's heading (never nbconvert's "No description")
        alts = re.findall(r'<img alt="([^"]*)"', text)
        assert len(alts) >= p["figures"] and all(a.startswith("Figure") for a in alts), (p["page"], alts[:3])


def test_headings_become_the_table_of_contents_and_api_has_docments(site):
    out, _ = site
    wrap = (out / "wrap.html").read_text()
    assert '<aside class="toc"><b>On this page</b><a class="l2" href="#Units">Units</a>' in wrap
    api = (out / "api.html").read_text()
    assert "launch(fn, *args, nprocs: int = 2" in api and "the function every rank runs" in api
    assert "reshard_after_forward" in api and "free gathered parameters after forward" in api
    # backticks render as code, as in the lessons
    assert "`" not in re.sub(r"<pre.*?</pre>", "", api, flags=re.S) and "<code>fully_shard</code>" in api


# One browser for every page: a harness page loads each page in an iframe (file:// pages may read each other's DOM under
# --allow-file-access-from-files) and writes what each page reported once loaded; starting Chromium once per page cost ~2 s each.
HARNESS = """<!doctype html><html><body><pre id="out"></pre><script>
const pages = PAGES, results = {};
let pending = pages.length;
for (const page of pages) {
  const frame = document.createElement('iframe');
  frame.addEventListener('load', () => {
    const doc = frame.contentDocument, body = doc && doc.body;
    results[page] = body ? {images: body.dataset.images ?? null, loaded: body.dataset.loadedImages ?? null,
                            traceback: doc.documentElement.outerHTML.includes('Traceback (most recent call last)'),
                            widget_repr: body.innerText.includes('interactive(children='),
                            figure_error: [...doc.querySelectorAll('.output_area')]
                                            .some(o => o.innerText.includes('FigureCheckError'))} : null;
    if (--pending === 0) document.getElementById('out').textContent = JSON.stringify(results);
  });
  frame.src = page;
  document.body.appendChild(frame);
}
</script></body></html>"""


def test_every_page_renders_in_chromium_with_its_figures(site, tmp_path):
    exe = _browser()
    out, manifest = site
    harness = out / "_every_page.html"
    harness.write_text(HARNESS.replace("PAGES", json.dumps([p["page"] for p in manifest["pages"]])))
    try:
        dom = _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--virtual-time-budget=20000", "--dump-dom",
                      harness.as_uri())
    finally: harness.unlink()
    found = re.search(r'<pre id="out">(.*)</pre>', dom)
    assert found and found.group(1), f"the pages did not all finish loading: {dom[-2000:]}"
    seen = json.loads(html.unescape(found.group(1)))
    assert sorted(seen) == sorted(p["page"] for p in manifest["pages"])
    for page in manifest["pages"]:
        r = seen[page["page"]]
        assert r and r["images"] is not None, f"{page['page']} did not finish loading"  # its load handler set the counts
        assert int(r["images"]) == int(r["loaded"]) == page["figures"], (page["page"], r)
        assert not r["traceback"] and not r["widget_repr"] and not r["figure_error"], (page["page"], r)


def test_screenshots_of_every_page(site, tmp_path):
    "Each page as headless Chromium draws it (what it holds is checked in the DOM above): a screenshot that is not blank."
    # One browser run draws every page, each in a 1400 x 1800 frame of a grid, and the grid is cut into one picture per page
    # (a browser per page cost ~1.3 s each).
    from PIL import Image
    exe = _browser()
    out, manifest = site
    shots = ROOT / "site-screenshots" if os.environ.get("CI") else tmp_path
    shots.mkdir(exist_ok=True)
    names = [p["page"] for p in manifest["pages"]]
    assert {"index.html", "wrap.html", "planner.html"} <= set(names)
    cols, (w, h) = 4, (1400, 1800)
    rows = -(-len(names) // cols)
    frames = "".join(f'<iframe src="{n}" '
                     f'style="position:absolute;left:{i % cols * w}px;top:{i // cols * h}px;width:{w}px;height:{h}px;border:0"></iframe>'
                     for i, n in enumerate(names))
    grid, png = out / "_grid.html", tmp_path / "grid.png"
    grid.write_text(f'<!doctype html><html><body style="margin:0">{frames}</body></html>')
    # every tile drawn
    try: _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--hide-scrollbars", "--force-gpu-mem-available-mb=8192",
                 f"--window-size={cols * w},{rows * h}", "--virtual-time-budget=20000", f"--screenshot={png}", grid.as_uri())
    finally: grid.unlink()
    whole = Image.open(png).convert("RGB")
    assert whole.size == (cols * w, rows * h)
    for i, name in enumerate(names):
        image = whole.crop((i % cols * w, i // cols * h, (i % cols + 1) * w, (i // cols + 1) * h))
        image.save(shots / name.replace(".html", ".png"), compress_level=1)
        colours = len(image.resize((280, 360)).getcolors(maxcolors=1 << 20))
        assert colours > 100, f"{name} looks blank ({colours} colours)"


def test_readme_commands_are_on_the_landing_page():
    readme = (ROOT / "README.md").read_text()
    commands = [l.strip() for block in re.findall(r"```sh\n(.*?)```", readme, re.S) for l in block.splitlines() if l.strip()]
    assert "pip install torch==2.13.0 -e . && fsdp-kit tour --out tour" in commands
    assert 'pip install torch==2.13.0 -e ".[dev]" && make test' in commands
    assert any(c.startswith("fsdp-kit docs --out") for c in commands)
    index = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"])
    missing = [c for c in commands if c not in index]
    assert missing == []


README_CHARACTERS, PARAGRAPH_CHARACTERS = 12_000, 600  # the front page stays a front page: the rest lives on the docs site


def paragraphs(markdown: str) -> list:
    "Each run of non-blank lines that are not table rows, headings or inside a code fence, joined."
    found, run, fenced = [], [], False
    for line in markdown.splitlines() + [""]:
        if line.startswith("```"): fenced = not fenced
        if fenced or line.startswith(("```", "#", "|")) or not line.strip():
            if run: found.append("\n".join(run))
            run = []
        else: run.append(line)
    return found


def test_readme_is_a_front_page():
    "At most 12,000 characters and no paragraph over 600; dated measurements, CI and guarantees live on the docs pages."
    readme = (ROOT / "README.md").read_text()
    longest = max(paragraphs(readme), key=len)
    assert len(readme) <= README_CHARACTERS, f"README.md has {len(readme):,} characters (at most {README_CHARACTERS:,})"
    assert len(longest) <= PARAGRAPH_CHARACTERS, f"a paragraph of {len(longest)} characters: {longest[:200]!r}"
    for page in ("nbs/command_line.ipynb", "nbs/benchmarks.ipynb", "nbs/03b_versions.ipynb"):
        assert f"]({page})" in readme and (ROOT / page).exists(), page
    sample = "# T\n\nline one\nline two\n\n| a | b |\n|---|---|\n\n```sh\nx\n\ny\n```\n- item\n\n## H\nlast"
    assert paragraphs(sample) == ["line one\nline two", "- item", "last"]


def test_moved_material_is_on_the_built_pages(site):
    "What left the README is on the offline site: guarantees, dated timings and CI, the version decisions."
    out, manifest = site
    assert "command_line.html" in {p["page"] for p in manifest["pages"]}
    text = lambda page: re.sub(r"<[^>]+>", "", (out / page).read_text())
    tool, bench, versions = text("command_line.html"), text("benchmarks.html"), text("versions.html")
    assert "Exit status" in tool and "--overwrite-ckpt" in tool and "janitor" in tool and "billion laughs" in tool
    assert "a clean .ci/run took 673 s and 743 s" in bench and "What each command costs" in bench and "2026-12-07" in bench
    assert "Which torch" in versions and "accelerate &gt;= 1.14" in versions and "torch 2.12.1 fails" in versions


def test_pages_follow_the_course(tmp_path):
    "The sidebar is the reading order: the landing page, the lessons by number then letter, then the unnumbered pages."
    names = ["benchmarks", "10_launch", "index", "9_x", "01a_models", "10b_errors", "01_train", "10a_ranks", "_private"]
    for n in names: (tmp_path / f"{n}.ipynb").write_text("{}")
    assert [p.stem for p in notebooks(tmp_path)] == ["index", "01_train", "01a_models", "9_x", "10_launch", "10a_ranks", "10b_errors",
                                                     "benchmarks"]
    assert page_name(Path("06_cp.ipynb")) == "cp.html" and page_name(Path("01a_models.ipynb")) == "models.html"
    order = [p.stem for p in notebooks(ROOT / "nbs")]
    assert order[:3] == ["index", "01_train", "01a_models"] and order.index("02_mesh") < order.index("10_launch")


def _table(text: str) -> list:
    "The notebook names in the first column of the notebooks table."
    return re.findall(r"^\| `(\w+)` \|", text.split("## The notebooks", 1)[1], re.M)


def test_readme_and_landing_page_list_every_notebook_in_course_order():
    index = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"])
    course = [p.stem for p in notebooks(ROOT / "nbs")]
    assert _table(index) == course
    assert _table((ROOT / "README.md").read_text()) == course


# The planner page, driven as a reader would: pick a setting, read the plan it shows.
PLANNER_HARNESS = """<!doctype html><html><body><pre id="out"></pre><script>
const settings = SETTINGS, frame = document.createElement('iframe');
frame.addEventListener('load', () => {
  const doc = frame.contentDocument, shown = [doc.getElementById('plan').textContent];
  for (const s of settings) {
    for (const [field, value] of Object.entries(s)) doc.getElementById(field).value = String(value);
    doc.getElementById('gpu_mem_gb').dispatchEvent(new Event('input', {bubbles: true}));
    shown.push(doc.getElementById('plan').textContent);
  }
  document.getElementById('out').textContent = JSON.stringify(shown);
});
frame.src = 'planner.html';
document.body.appendChild(frame);
</script></body></html>"""


def test_planner_page_changes_its_plan_as_the_python_planner_does(site, tmp_path):
    from fsdp_kit.plan_gpu import plan_gpu, grid_spec, plan_line
    exe = _browser()
    out, manifest = site
    assert "planner.html" in {p["page"] for p in manifest["pages"]}
    settings = [dict(model="llama-2-70b", method="qlora", gpus=2, batch=2, seq_len=2048, ac="full", gpu_mem_gb=24),
                dict(model="llama-3-8b", method="full", gpus=8, batch=2, seq_len=8192, ac="none", gpu_mem_gb=80),
                dict(model="mistral-7b", method="lora", gpus=1, batch=4, seq_len=4096, ac="full", gpu_mem_gb=48),
                dict(model="yi-34b", method="full", gpus=64, batch=1, seq_len=1024, ac="full", gpu_mem_gb=40),
                dict(model="qwen2-7b", method="qlora", gpus=4, batch=8, seq_len=2048, ac="none", gpu_mem_gb=24),
                dict(model="llama-2-13b", method="full", gpus=16, batch=1, seq_len=2048, ac="full", gpu_mem_gb=8)]
    harness = out / "_planner.html"
    harness.write_text(PLANNER_HARNESS.replace("SETTINGS", json.dumps(settings)))
    try:
        dom = _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--virtual-time-budget=10000", "--dump-dom",
                      harness.as_uri())
    finally: harness.unlink()
    found = re.search(r'<pre id="out">(.*)</pre>', dom)
    assert found and found.group(1), dom[-2000:]
    shown = json.loads(html.unescape(found.group(1)))
    expect = []
    # the page's default first
    for s in [dict(model="llama-3-8b", method="full", gpus=8, batch=1, seq_len=2048, ac="full", gpu_mem_gb=80)] + settings:
        spec = grid_spec(s)
        p = plan_gpu(spec, gpu_mem_gb=s["gpu_mem_gb"])
        expect.append(plan_line(p.per_gpu_peak_bytes, p.per_gpu_allocated_bytes, p.peak_moment, s["gpu_mem_gb"]))
    assert shown == expect
    assert len(set(shown)) == len(shown) and any("does NOT fit" in s for s in shown) and any(": fits" in s for s in shown)


# Figures: every one the docs show is checked as it is drawn (fsdp_kit.measure.check_figure), so that a legend over data,
# a figure wider than the page or text under 9 pt stops the notebook under nbval and leaves an error on its page.
def _figure(width=6, **legend):
    "Two crossing lines on a figure `width` inches wide, with a legend placed by `legend`."
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, 3), layout="constrained")
    ax = fig.subplots()
    x = [i / 20 for i in range(21)]
    ax.plot(x, x, label="rising"); ax.plot(x, [1 - v for v in x], "o", label="falling")
    ax.legend(**legend)
    return fig, ax


def test_check_figure_reports_a_legend_over_data():
    from fsdp_kit.measure import FigureCheckError, check_figure, figure_problems
    fig, _ = _figure(loc="center")
    problems = figure_problems(fig)
    assert len(problems) == 1 and "covers data" in problems[0], problems
    assert "line 'rising'" in problems[0] and "markers of 'falling'" in problems[0]
    with pytest.raises(FigureCheckError, match="covers data"):
        check_figure(fig)


def test_check_figure_passes_a_legend_beside_the_data():
    from fsdp_kit.measure import check_figure, figure_problems
    fig, _ = _figure(loc="upper left", bbox_to_anchor=(1.01, 1))
    assert figure_problems(fig) == []
    assert check_figure(fig) is fig
    fig, _ = _figure(loc="lower center")  # inside the axes, between the lines' ends: covers nothing
    assert figure_problems(fig) == []


def test_check_figure_reports_width_and_small_text():
    from fsdp_kit.measure import figure_problems
    fig, ax = _figure(width=21.6, loc="upper left", bbox_to_anchor=(1.01, 1))
    problems = figure_problems(fig)
    assert len(problems) == 1 and problems[0].startswith("21.6 inches wide (figsize 21.6"), problems
    fig, ax = _figure(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.tick_params(labelsize=7)
    problems = figure_problems(fig)
    assert len(problems) == 1 and problems[0].startswith("text under 9 pt: 7 pt ") and "8 pt ['falling', 'rising']" in problems[0], problems
    fig, _ = _figure(width=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # 8 inches, but the legend beside is drawn (and saved) with it
    fig.axes[0].legend(["a label long enough to carry the saved picture past the page's ten inches"] * 2, loc="upper left",
                       bbox_to_anchor=(1.01, 1))
    fig.set_layout_engine("none")
    assert "inches wide (figsize 8.0, as drawn 1" in figure_problems(fig)[0], figure_problems(fig)


def test_check_figure_sees_bars_points_other_axes_and_labels():
    from matplotlib.figure import Figure
    from fsdp_kit.measure import figure_problems
    fig = Figure(figsize=(8, 3))
    left, right = fig.subplots(1, 2)
    left.bar(range(3), [1, 2, 3], label="bars"); left.legend(loc="upper right")  # over the tallest bar
    right.scatter([0, 1], [0, 1], label="points"); right.legend(loc="upper right")  # over the point at (1, 1)
    problems = figure_problems(fig)
    assert any("patch 'bars'" in p for p in problems) and any("points of 'points'" in p for p in problems), problems
    fig = Figure(figsize=(8, 3))
    left, right = fig.subplots(1, 2)
    left.plot([0, 1], [0, 1], label="left line"); right.plot([0, 1], [0, 1], label="right line")
    left.legend(loc="center", bbox_to_anchor=(1.7, 0.5))  # outside its own axes, but over the middle of the other one's line
    assert any("left line" in p and "line 'right line'" in p for p in figure_problems(fig)), figure_problems(fig)
    fig, ax = _figure(loc="upper center", bbox_to_anchor=(0.5, -0.03))  # below the axes, over the tick labels
    ax.set_xlabel("progress")
    assert any("covers the labels" in p for p in figure_problems(fig)), figure_problems(fig)
    fig, ax = _figure(loc="lower center")
    ax.axvspan(0.3, 0.7, color="0.9", zorder=0, label="a phase")  # a band behind the data is not data
    ax.legend(loc="lower center")
    assert figure_problems(fig) == []


def test_kit_figures_pass_the_check_with_long_labels_and_big_meshes():
    "What the lessons do not show: long labels, a wide mesh, many configs."
    # each plotting function checks its own figure (plot_mesh: its caller), and a FigureCheckError fails this test.
    import numpy as np
    from types import SimpleNamespace
    from fsdp_kit.measure import CATEGORIES, check_figure, plot_categories, plot_timeline, wrap_label
    from fsdp_kit.mesh import MeshLayout, plot_mesh
    from fsdp_kit.train import TrainResult, plot_losses
    from fsdp_kit.cp import plot_attention_sweep
    from fsdp_kit.scale import plot_restart
    import matplotlib.pyplot as plt
    try:
        assert wrap_label("TRANSFORMER_BASED_WRAP, reshard_after_forward=False") == "TRANSFORMER_BASED_WRAP,\nreshard_after_forward=False"
        timeline = [("forward", 2**20 * (1 + i / 50)) for i in range(100)] + [("backward", 2**20 * (3 - i / 60))
                                                                              for i in range(100)] + [("optimizer", 2**20)] * 30
        plot_timeline({f"SIZE_BASED_WRAP, reshard_after_forward={r}, a long label a user chose": timeline for r in (True, False, 2)})
        peaks = {c: 2**20 for c in CATEGORIES.values()}
        plot_categories({f"config {i}": peaks for i in range(9)})
        for shape in ([2, 2], [8], [4, 16], [2, 2, 2]):
            grid = np.arange(int(np.prod(shape))).reshape(shape).tolist()
            groups = {f"axis{k}": [[0, 1]] * (int(np.prod(shape)) // 2) for k in range(len(shape))}
            # its callers check it
            check_figure(plot_mesh(MeshLayout([f"axis{k}" for k in range(len(shape))], shape, grid, groups, int(np.prod(shape)), "gloo")))
        plot_losses(TrainResult("tiny", 2, 125_248, [5.5, 5.2, 5.0], 0.1, 1e3, "gloo", reference_losses=[5.5, 5.2, 5.0]))
        points = [dict(cp=cp, seq_len=n, rotate=r, peak_bytes=n * n * 64 / cp, seconds=n * 1e-5) for cp in (1, 2, 4, 8)
                  for n in (256, 4096, 131072) for r in ("allgather", "alltoall")]
        plot_attention_sweep(points)
        attempts = [dict(attempt=0, steps=[1, 2, 3], losses=[5.5, 5.2, 5.1], last_step=3), dict(attempt=1)]
        restarted = SimpleNamespace(scale=dict(attempts=attempts, restarts=[dict(attempt=0, rank=1, kind="died")], attempt=1), first_step=2,
                                    losses=[5.1, 4.9, 4.8, 4.7], world_size=2)
        plot_restart(restarted, reference=[5.5, 5.2, 5.1, 4.9, 4.8, 4.7])
    finally:
        plt.close("all")


# Kit plotting functions that do not check their figure yet, and notebooks with a figure of their own that is not checked: issue #18,
# their owners add `check_figure(fig)`; take each one off these lists then.
# drawn in a foundation module, which may not import measure (tests/test_structure.py's layers): whoever calls it checks the figure
CHECKED_BY_CALLERS = {"mesh.plot_mesh"}


def _plot_functions() -> dict:
    "module.plot_x -> whether its body calls check_figure, for every plotting function of the package (read from the source)."
    import ast
    found = {}
    for path in sorted((ROOT / "fsdp_kit").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("plot_"):
                found[f"{path.stem}.{node.name}"] = "check_figure(" in ast.get_source_segment(text, node)
    return found


def test_every_figure_is_checked_as_it_is_drawn():
    functions = _plot_functions()
    assert {"measure.plot_timeline", "wrap.plot_compare", "train.plot_losses"} <= set(functions)
    assert [f for f, checked in functions.items() if not checked and f not in CHECKED_BY_CALLERS] == []
    callers = [p.stem for p in sorted((ROOT / "fsdp_kit").glob("*.py"))
               if p.stem not in ("_modidx", *(f.split(".")[0] for f in CHECKED_BY_CALLERS))
               and any(f"{f.split('.')[1]}(" in p.read_text() for f in CHECKED_BY_CALLERS) and "check_figure(" not in p.read_text()]
    assert callers == []
    checked = {f.split(".")[1] for f, ok in functions.items() if ok}
    unchecked = []
    for nb in notebooks(ROOT / "nbs"):
        for cell in json.loads(nb.read_text())["cells"]:
            source = "".join(cell["source"])
            if not any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])): continue
            calls = set(re.findall(r"\b(plot_\w+)\(", source))
            # a cell that makes its own figure checks it; one that only calls the kit's plotting functions is checked by them
            if "check_figure(" not in source and not (calls & checked and not re.search(r"subplots\(|plt\.figure\(", source)):
                unchecked.append(nb.stem)
    assert unchecked == []


# The planner page at a desktop's width and a phone's, in one browser run: two frames, each measured in the page. A line of text
# is the run of text boxes of one block element at one height; every line but a block's last must hold at least 20 characters
# (of that element's font), and no text may lie under the sidebar or the table of contents. The memory box refuses what is not a
# number of GB above 0. The same harness is drawn once more as a screenshot.
LAYOUT_HARNESS = """<!doctype html><html><body style="margin:0;white-space:nowrap;overflow:hidden">
<pre id="out" style="display:none"></pre><script>
const widths = [1400, 420], results = {}, ctx = document.createElement('canvas').getContext('2d');
function lines(doc, win) {
  const narrow = [], under = [];
  const side = [...doc.querySelectorAll('nav.side, aside.toc')].filter(e => win.getComputedStyle(e).display !== 'none')
                                                                .map(e => e.getBoundingClientRect());
  for (const block of doc.querySelectorAll('main h1, main h2, main p, main pre, main label, main li, main .pager')) {
    const style = win.getComputedStyle(block), rows = new Map();
    ctx.font = `${style.fontSize} ${style.fontFamily}`;
    const ch = ctx.measureText('abcdefghijklmnopqrstuvwxyz').width / 26;
    const walker = doc.createTreeWalker(block, NodeFilter.SHOW_TEXT);
    for (let n; (n = walker.nextNode());) {
      if (!n.textContent.trim()) continue;
      const range = doc.createRange(); range.selectNodeContents(n);
      for (const r of range.getClientRects()) {
        if (r.width === 0) continue;
        const key = Math.round(r.top), row = rows.get(key) || {left: r.left, right: r.right};
        rows.set(key, {left: Math.min(row.left, r.left), right: Math.max(row.right, r.right)});
        for (const s of side)
          if (r.left < s.right && r.right > s.left && r.top < s.bottom && r.bottom > s.top) under.push(n.textContent.trim().slice(0, 40));
      }
    }
    const sorted = [...rows.entries()].sort((a, b) => a[0] - b[0]);
    sorted.slice(0, -1).forEach(([top, row]) => { const chars = (row.right - row.left) / ch;
      if (chars < 20)
        narrow.push(`${block.tagName} '${block.textContent.trim().slice(0, 40)}' line at ${top}px: ${chars.toFixed(1)} characters`); });
  }
  return {narrow, under: [...new Set(under)], scroll: doc.documentElement.scrollWidth <= win.innerWidth + 1};
}
function memory(doc) {
  const box = doc.getElementById('gpu_mem_gb'), seen = {};
  for (const v of ['', '-5', '24']) {
    box.value = v; box.dispatchEvent(new Event('input', {bubbles: true})); seen[v] = doc.getElementById('plan').textContent; }
  return seen;
}
let left = widths.length;
for (const w of widths) {
  const frame = document.createElement('iframe');
  frame.style.cssText = `width:${w}px;height:900px;border:0;vertical-align:top`;
  frame.addEventListener('load', () => {
    const doc = frame.contentDocument, win = frame.contentWindow;
    results[w] = Object.assign(lines(doc, win), w === widths[0] ? {memory: memory(doc)} : {});
    if (--left === 0) document.getElementById('out').textContent = JSON.stringify(results);
  });
  frame.src = 'planner.html';
  document.body.appendChild(frame);
}
</script></body></html>"""


def test_planner_page_reads_at_1400_and_420_px_and_refuses_a_bad_memory(site, tmp_path):
    exe = _browser()
    out, _ = site
    harness = out / "_layout.html"
    harness.write_text(LAYOUT_HARNESS)
    png = tmp_path / "planner-1400-and-420.png"
    try:
        dom = _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--virtual-time-budget=10000", "--dump-dom",
                      harness.as_uri())
        _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--virtual-time-budget=10000", "--window-size=1830,900",
                f"--screenshot={png}", harness.as_uri())
    finally: harness.unlink()
    found = re.search(r'<pre id="out"[^>]*>(.*)</pre>', dom)
    assert found and found.group(1), dom[-2000:]
    r = json.loads(html.unescape(found.group(1)))
    for width in ("1400", "420"):
        assert r[width]["narrow"] == [], (width, r[width]["narrow"][:5])
        assert r[width]["under"] == [], (width, r[width]["under"][:5])
        assert r[width]["scroll"], f"the page scrolls sideways at {width} px"
    m = r["1400"]["memory"]
    assert "NaN" not in json.dumps(m) and m[""] == 'gpu_mem_gb="" is not allowed: the memory of one GPU in GB, a number above 0', m
    assert m["-5"].startswith('gpu_mem_gb="-5" is not allowed') and m["24"].startswith("per-GPU peak ") and " in 24 GB" in m["24"], m
    from PIL import Image
    shot = Image.open(png).convert("L")
    assert (shot.size == (1830, 900) and len(set(shot.crop((0, 0, 1400, 900)).getdata())) > 2
            and len(set(shot.crop((1400, 0, 1820, 900)).getdata())) > 2)
