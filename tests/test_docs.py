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
        assert "interactive(children=" not in text, f"{name} shows a widget's Python repr"  # a page has no kernel: a note, then the default state
        assert re.search(r'<aside class="toc"><b>On this page</b><a ', text), f"{name}: its 'On this page' box is empty"
        assert all(f'href="{p}"' in text for p in expected), f"{name} lacks navigation"
    assert all(p["errors"] == 0 for p in pages.values())
    with_figures = [p for p in pages.values() if p["figures"]]
    assert len(with_figures) >= 4, with_figures
    for p in with_figures:
        assert (out / p["page"]).read_text().count('src="data:image/png;base64,') == p["figures"]


def test_headings_become_the_table_of_contents_and_api_has_docments(site):
    out, _ = site
    wrap = (out / "wrap.html").read_text()
    assert '<aside class="toc"><b>On this page</b><a class="l2" href="#Units">Units</a>' in wrap
    api = (out / "api.html").read_text()
    assert "launch(fn, *args, nprocs: int = 2" in api and "the function every rank runs" in api
    assert "reshard_after_forward" in api and "free gathered parameters after forward" in api
    assert "`" not in re.sub(r"<pre.*?</pre>", "", api, flags=re.S) and "<code>fully_shard</code>" in api  # backticks render as code, as in the lessons


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
                            widget_repr: body.innerText.includes('interactive(children=')} : null;
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
    try: dom = _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--virtual-time-budget=20000", "--dump-dom", harness.as_uri())
    finally: harness.unlink()
    found = re.search(r'<pre id="out">(.*)</pre>', dom)
    assert found and found.group(1), f"the pages did not all finish loading: {dom[-2000:]}"
    seen = json.loads(html.unescape(found.group(1)))
    assert sorted(seen) == sorted(p["page"] for p in manifest["pages"])
    for page in manifest["pages"]:
        r = seen[page["page"]]
        assert r and r["images"] is not None, f"{page['page']} did not finish loading"  # its load handler set the counts
        assert int(r["images"]) == int(r["loaded"]) == page["figures"], (page["page"], r)
        assert not r["traceback"] and not r["widget_repr"], (page["page"], r)


def test_screenshots_of_landing_and_a_lab_page(site, tmp_path):
    from PIL import Image
    exe = _browser()
    out, _ = site
    shots = ROOT / "site-screenshots" if os.environ.get("CI") else tmp_path
    shots.mkdir(exist_ok=True)
    for name in ("index.html", "wrap.html"):
        png = shots / name.replace(".html", ".png")
        _chrome(exe, tmp_path / "profile", "--window-size=1400,1800", f"--screenshot={png}", (out / name).as_uri())
        image = Image.open(png).convert("RGB")
        assert image.size == (1400, 1800)
        colours = len(image.resize((280, 360)).getcolors(maxcolors=1 << 20))
        assert colours > 100, f"{png.name} looks blank ({colours} colours)"


def test_readme_commands_are_on_the_landing_page():
    readme = (ROOT / "README.md").read_text()
    commands = [l.strip() for block in re.findall(r"```sh\n(.*?)```", readme, re.S) for l in block.splitlines() if l.strip()]
    assert "pip install torch==2.13.0 -e . && fsdp-kit tour --out tour" in commands
    assert 'pip install torch==2.13.0 -e ".[dev]" && make test' in commands
    assert any(c.startswith("fsdp-kit docs --out") for c in commands)
    index = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"])
    missing = [c for c in commands if c not in index]
    assert missing == []


def test_pages_follow_the_course(tmp_path):
    "The sidebar is the reading order: the landing page, the lessons by number then letter, then the unnumbered pages."
    names = ["benchmarks", "10_launch", "index", "9_x", "01a_models", "10b_errors", "01_train", "10a_ranks", "_private"]
    for n in names: (tmp_path / f"{n}.ipynb").write_text("{}")
    assert [p.stem for p in notebooks(tmp_path)] == ["index", "01_train", "01a_models", "9_x", "10_launch", "10a_ranks", "10b_errors", "benchmarks"]
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
    from fsdp_kit.plan_gpu import plan_gpu, plan_line
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
    try: dom = _chrome(exe, tmp_path / "profile", "--allow-file-access-from-files", "--virtual-time-budget=10000", "--dump-dom", harness.as_uri())
    finally: harness.unlink()
    found = re.search(r'<pre id="out">(.*)</pre>', dom)
    assert found and found.group(1), dom[-2000:]
    shown = json.loads(html.unescape(found.group(1)))
    expect = []
    for s in [dict(model="llama-3-8b", method="full", gpus=8, batch=1, seq_len=2048, ac="full", gpu_mem_gb=80)] + settings:  # the page's default first
        p = plan_gpu(s["model"], s["gpus"], s["gpu_mem_gb"], s["method"], batch=s["batch"], seq_len=s["seq_len"], ac=s["ac"])
        expect.append(plan_line(p.per_gpu_peak_bytes, p.per_gpu_allocated_bytes, p.peak_moment, s["gpu_mem_gb"]))
    assert shown == expect
    assert len(set(shown)) == len(shown) and any("does NOT fit" in s for s in shown) and any(": fits" in s for s in shown)
