"""`fsdp-kit docs --out DIR`: the notebooks as a browsable site.

Where Quarto is installed, this is nbdev's own site (`nbdev-docs`). Where it is not (Quarto has no PyPI or Debian
package), the same notebooks are rendered with nbconvert from their stored outputs: one page per notebook, a
sidebar linking them in order, each page's headings as its table of contents, and an API reference of the
exported functions with their signatures and parameter comments (docments).
"""
import html, importlib, inspect, json, re, shutil, subprocess
from pathlib import Path

from fsdp_kit.errors import KitError

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
HIDDEN = re.compile(r"^#\|\s*(hide|exporti?\s+.*hide)\b")
DIRECTIVE = re.compile(r"^\s*(#\|.*|# NBVAL_\w+)\s*$")


def find_nbs(start: Path = None) -> Path:
    "The notebooks folder: `nbs/` next to the nearest pyproject.toml with [tool.nbdev], or beside the package."
    for folder in [Path(start or Path.cwd()).resolve(), *Path(start or Path.cwd()).resolve().parents]:
        project = folder / "pyproject.toml"
        if project.exists() and "[tool.nbdev]" in project.read_text() and (folder / "nbs").is_dir():
            return folder / "nbs"
    beside = Path(__file__).resolve().parents[1] / "nbs"
    if beside.is_dir():
        return beside
    raise KitError("no nbs/ folder found: run `fsdp-kit docs` inside a checkout of fsdp_kit "
                   "(the notebooks are the docs' source)")


def page_name(notebook: Path) -> str:
    """nbdev's page name: `10_launch.ipynb` -> `launch.html`, `01a_models.ipynb` -> `models.html`,
    `index.ipynb` -> `index.html`."""
    return re.sub(r"^\d+[a-z]?_", "", notebook.stem) + ".html"


def course_key(notebook: Path) -> tuple:
    "Where a notebook sits in the course."
    # the landing page, then the lessons by number and letter (`01_train`, `01a_models`, `02_mesh`, ...), then the
    # unnumbered pages (the benchmark report) by name.
    m = re.match(r"^(\d+)([a-z]?)_", notebook.stem)
    if notebook.stem == "index": return (0, 0, "", notebook.name)
    return (1, int(m.group(1)), m.group(2), notebook.name) if m else (2, 0, "", notebook.name)


def notebooks(nbs: Path) -> list:
    "The site's notebooks in sidebar order, the course's reading order (`course_key`)."
    return sorted((p for p in nbs.glob("*.ipynb") if not p.name.startswith("_")), key=course_key)


def _clean(nb):
    "Drop hidden cells and directive lines."
    # a widget becomes a one-line note (its `interactive(children=...)` repr means nothing on a page).
    keep = []
    for cell in nb.cells:
        lines = cell.source.splitlines()
        if cell.cell_type == "code" and any(HIDDEN.match(l) for l in lines):
            continue
        if cell.cell_type == "code":
            cell.source = "\n".join(l for l in lines if not DIRECTIVE.match(l)).strip("\n")
            if not cell.source:
                continue
            for out in cell.get("outputs", []):
                # a page has no kernel: say so instead of the widget's Python repr;
                # the lesson shows its default state next
                if WIDGET_MIME in out.get("data", {}):
                    out["data"] = {"text/plain": "[an interactive widget: run the notebook to use it; its "
                                                 "default state is shown below]"}
        keep.append(cell)
    nb.cells = keep
    return nb


def _title(nb, fallback: str) -> str:
    "The notebook's first level-1 heading."
    for cell in nb.cells:
        m = re.search(r"^#\s+(.+)$", cell.source, re.M) if cell.cell_type == "markdown" else None
        if m:
            return m.group(1).replace("`", "").strip()
    return fallback


def figure_alts(nb, page_title: str) -> list:
    """Alt text for each figure of `nb`, in order: the figure's title where its output carries one, else
    the heading of its section."""
    alts, heading = [], page_title
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            found = re.findall(r"^#{1,4}\s+(.+)$", cell.source, re.M)
            if found: heading = found[-1].replace("`", "").strip()
            continue
        for out in cell.get("outputs", []):
            if "image/png" not in out.get("data", {}): continue
            title = out.get("metadata", {}).get("title") or ""
            alts.append(f"Figure: {title}" if title else f"Figure of the section '{heading}' ({page_title})")
    return alts


def render_notebook(path: Path) -> dict:
    """One notebook as an HTML fragment with its title, table of contents and counts of figures,
    errors and failed figures."""
    # a failed figure is one `measure.check_figure` refused
    import nbformat
    from nbconvert import HTMLExporter
    nb = nbformat.read(path, as_version=4)
    errors = sum(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    # a legend over data, too wide, text too small
    figure_errors = sum(o.get("ename") == "FigureCheckError" for c in nb.cells for o in c.get("outputs", []))
    figures = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])
                  if not any(HIDDEN.match(l) for l in c.source.splitlines()))
    nb = _clean(nb)
    # the template passes every code cell's pygments HTML through bleach (`clean_html`), which leaves it unchanged
    # (pygments escapes the source) and took most of the rendering time: skipped; markdown and HTML outputs are not
    # sanitized either way
    body, _ = HTMLExporter(template_name="basic", filters={"clean_html": lambda html: html}).from_notebook_node(nb)
    body = re.sub(r'<div class="prompt[^"]*">.*?</div>', "", body, flags=re.S)  # no In [ ]: prompts
    # nbconvert writes "No description has been provided for this image" on each
    alts = iter(figure_alts(nb, _title(nb, path.stem)))
    body = re.sub(r'alt="No description has been provided for this image"',
                  lambda m: f'alt="{html.escape(next(alts, "a figure"))}"', body)
    toc = [(int(level), anchor, re.sub("<[^>]+>", "", text))
           for level, anchor, text in re.findall(r'<h([23]) id="([^"]+)">(.*?)<a class="anchor-link"', body)]
    return dict(title=_title(nb, path.stem), body=body, toc=toc, figures=figures, errors=errors,
                figure_errors=figure_errors, page=page_name(path), source=path.name)


def _signature_comments(obj) -> dict:
    "Parameter -> its trailing comment in the source (nbdev's docments style), for functions and dataclasses."
    try:
        lines = inspect.getsource(obj).splitlines()
    except (OSError, TypeError):
        return {}
    found = {}
    for line in lines[:60]:
        m = re.match(r"^\s*(?:def \w+\()?\s*\**(\w+)\s*(?::[^#=]+)?(?:=[^#]*)?,?"
                     r"\s*(?:\)\s*(?:->[^#]*)?:?)?\s*#\s*(.+)$", line)
        if m and m.group(1) not in ("return", "if", "for", "else"):
            found.setdefault(m.group(1), m.group(2).strip())
    return found


def exported_modules(nbs: Path) -> list:
    "The modules the notebooks export (their `#| default_exp`), in the notebooks' order."
    found = []
    for nb in notebooks(nbs):
        m = re.search(r"#\|\s*default_exp\s+([\w.]+)", nb.read_text())
        if m: found.append(m.group(1))
    return found


def _code(text: str) -> str:
    "Escape `text` for HTML and render its `backticked` spans as code, as markdown would."
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def api_reference(modules: list) -> str:
    "HTML for every exported name of the kit's modules: signature, docstring, parameter comments."
    parts = []
    for name in modules:
        try:
            mod = importlib.import_module(f"fsdp_kit.{name}")
        except ImportError:
            continue
        summary = mod.__doc__.splitlines()[0] if mod.__doc__ else ""
        parts.append(f'<h2 id="{name}">fsdp_kit.{name}</h2><p>{_code(summary)}</p>')
        for attr in getattr(mod, "__all__", []):
            obj = getattr(mod, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "()"
            rows = "".join(f"<tr><td><code>{html.escape(k)}</code></td><td>{_code(v)}</td></tr>"
                           for k, v in _signature_comments(obj).items())
            table = f'<table class="params">{rows}</table>' if rows else ""
            parts.append(f'<div class="api"><h3 id="{name}.{attr}"><code>{attr}{html.escape(sig)}</code></h3>'
                         f"<p>{_code(inspect.getdoc(obj) or '')}</p>{table}</div>")
    return "\n".join(parts)


CSS = """
body { margin: 0; font: 15px/1.55 -apple-system, 'Segoe UI', Roboto, sans-serif; color: #1d2330; }
nav.side { position: fixed; top: 0; left: 0; bottom: 0; width: 230px; overflow-y: auto; background: #f4f6fa;
           border-right: 1px solid #dde3ee; padding: 16px; box-sizing: border-box; }
nav.side a { display: block; color: #23395b; text-decoration: none; padding: 3px 6px; border-radius: 4px;
             font-size: 14px; }
nav.side a.here { background: #dbe6f7; font-weight: 600; }
nav.side .brand { font-weight: 700; font-size: 17px; margin-bottom: 10px; }
main { margin-left: 250px; margin-right: 250px; padding: 10px 28px 60px; max-width: 980px; }
aside.toc { position: fixed; top: 0; right: 0; width: 230px; padding: 16px; font-size: 13px; box-sizing: border-box; }
aside.toc a { display: block; color: #4a5a75; text-decoration: none; padding: 2px 0; }
aside.toc a.l3 { padding-left: 12px; }
pre { background: #f7f8fa; padding: 8px 10px; overflow-x: auto; border-radius: 4px; font-size: 13px; }
.output_area pre, .jp-OutputArea pre { background: none; border-left: 2px solid #f0a57a; border-radius: 0; }
img { max-width: 100%; }
table { border-collapse: collapse; } td, th { border: 1px solid #dde3ee; padding: 3px 8px; }
.pager { display: flex; justify-content: space-between; margin-top: 40px; border-top: 1px solid #dde3ee;
         padding-top: 10px; }
.anchor-link { display: none; }
.api { border-top: 1px solid #eef1f6; padding-top: 4px; }
#planner label { display: inline-block; margin: 0 10px 6px 0; }
input:invalid { outline: 2px solid #c0392b; }
@media (max-width: 1250px) { aside.toc { display: none; } main { margin-right: 0; } }
@media (max-width: 760px) {  /* a phone: the sidebar becomes a block above the text, the text takes the whole width */
  nav.side { position: static; width: auto; max-height: 40vh; border-right: none; border-bottom: 1px solid #dde3ee; }
  main { margin: 0; padding: 10px 14px 40px; max-width: none; }
  pre { white-space: pre-wrap; word-break: break-word; }
}
"""

# Counts the figures that really decoded, so a browser test can read them back from the rendered page.
IMAGE_CHECK = """<script>window.addEventListener('load', () => {
  const imgs = [...document.querySelectorAll('main img')];
  document.body.dataset.images = imgs.length;
  document.body.dataset.loadedImages = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
});</script>"""


PLANNER_JS = """
const T = JSON.parse(document.getElementById('table').textContent), axes = Object.keys(T.grid);
// the plan of the chosen setting: its row-major index over the grid's axes, as planner_table wrote them
function show() {
  let i = 0;
  for (const a of axes) i = i * T.grid[a].length + T.grid[a].map(String).indexOf(document.getElementById(a).value);
  const box = document.getElementById('gpu_mem_gb'), text = box.value.trim(), mem = Number(text);
  const out = document.getElementById('plan');
  // an empty box, -5 or 'abc': say what is allowed, never NaN GB
  if (text === '' || !Number.isFinite(mem) || mem <= 0) {
    box.setCustomValidity('a number of GB above 0');
    out.textContent = `gpu_mem_gb=${JSON.stringify(box.value)} is not allowed: `
      + 'the memory of one GPU in GB, a number above 0';
    return;
  }
  box.setCustomValidity('');
  const p = T.plans[i];
  if (typeof p === 'string') { out.textContent = p; return; }  // the planner's own one-line refusal
  const [peak, allocated, moment] = p, gb = (b) => (b / T.gb).toFixed(2);
  const fits = peak <= mem * T.gb ? 'fits' : 'does NOT fit';
  out.textContent = `per-GPU peak ${gb(peak)} GB at '${T.moments[moment]}': ${fits} in ${mem} GB `
    + `(allocated ${gb(allocated)} GB)`;
}
document.getElementById('planner').addEventListener('input', show);
show();
"""

# the lesson's widget starts here too
DEFAULTS = dict(model="llama-3-8b", method="full", gpus=8, batch=1, seq_len=2048, ac="full")


def planner_page() -> dict:
    "The planner without a kernel: the stored table of plans and a form that looks the chosen setting up in it."
    # the table is what `fsdp-kit plan --export-table` writes
    from fsdp_kit.config import EXAMPLES
    stored = (EXAMPLES / "plan" / "planner_table.json").read_text()
    table = json.loads(stored)
    option = lambda a, v: f'<option{" selected" if v == DEFAULTS.get(a) else ""}>{html.escape(str(v))}</option>'
    fields = "".join(f'<label>{a} <select id="{a}">' + "".join(option(a, v) for v in vals)
                     + "</select></label> " for a, vals in table["grid"].items())
    fields += ('<label>gpu_mem_gb <input id="gpu_mem_gb" type="number" '
               'value="80" min="0.001" step="any" required></label>')
    body = ("<h1>The planner, without a kernel</h1><p>Per-GPU memory of one FSDP2 training step, as "
            f"<code>fsdp_kit.plan_gpu.plan_gpu</code> predicts it, for {len(table['plans']):,} settings planned "
            "ahead (<code>fsdp-kit plan --export-table</code>); change a field and the plan changes. "
            "The lesson <a href=\"plan_gpu.html\">plan_gpu</a> explains each term; the command and the notebook "
            "plan any other setting.</p>"
            f'<h2 id="settings">The setting</h2><form id="planner">{fields}</form>'
            '<h2 id="the-plan">The plan</h2><pre id="plan"></pre>'
            f'<script type="application/json" id="table">{stored}</script><script>{PLANNER_JS}</script>')
    return dict(title="Planner (no kernel)", body=body,
                toc=[(2, "settings", "The setting"), (2, "the-plan", "The plan")],
                figures=0, errors=0, figure_errors=0, page="planner.html", source=None)


def _page(page: dict, pages: list) -> str:
    "A whole HTML page: sidebar, content, table of contents, previous / next."
    from pygments.formatters import HtmlFormatter
    links = "".join(f'<a href="{p["page"]}" class="{"here" if p["page"] == page["page"] else ""}">'
                    f'{html.escape(p["title"])}</a>' for p in pages)
    toc = "".join(f'<a class="l{level}" href="#{anchor}">{html.escape(html.unescape(text))}</a>'
                  for level, anchor, text in page.get("toc", []))
    i = [p["page"] for p in pages].index(page["page"])
    before, after = pages[i - 1] if i > 0 else None, pages[i + 1] if i + 1 < len(pages) else None
    prev = f'<a href="{before["page"]}">&larr; {html.escape(before["title"])}</a>' if before else "<span></span>"
    nxt = f'<a href="{after["page"]}">{html.escape(after["title"])} &rarr;</a>' if after else "<span></span>"
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<title>{html.escape(page["title"])} | fsdp_kit</title>'
            f'<style>{CSS}{HtmlFormatter().get_style_defs(".highlight")}</style></head><body>'
            f'<nav class="side"><div class="brand">fsdp_kit</div>{links}</nav>'
            f'<aside class="toc"><b>On this page</b>{toc}</aside>'
            f'<main>{page["body"]}<div class="pager">{prev}{nxt}</div></main>{IMAGE_CHECK}</body></html>')


def build_site(out: str, nbs: str = None) -> dict:
    "Render every notebook and the API reference into `out`; return the manifest (pages, figures, errors)."
    try:
        importlib.import_module("nbconvert")
    except ImportError:
        raise KitError("fsdp-kit docs needs nbconvert: pip install -e '.[dev]'") from None
    nbs, out = (Path(nbs) if nbs else find_nbs()), Path(out)
    if not nbs.is_dir(): raise KitError(f"nbs={str(nbs)!r} is not a folder of notebooks")
    out.mkdir(parents=True, exist_ok=True)
    pages = [render_notebook(p) for p in notebooks(nbs)]
    pages.append(planner_page())
    modules = exported_modules(nbs)
    pages.append(dict(title="API reference", body="<h1>API reference</h1>" + api_reference(modules),
                      toc=[(2, m, f"fsdp_kit.{m}") for m in modules],
                      figures=0, errors=0, figure_errors=0, page="api.html", source=None))
    for page in pages:
        (out / page["page"]).write_text(_page(page, pages))
    keys = ("page", "title", "figures", "errors", "figure_errors", "source")
    manifest = dict(builder="nbconvert", pages=[{k: p[k] for k in keys} for p in pages])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def build_with_quarto(out: str) -> dict:
    "nbdev's own site through Quarto (`nbdev-docs`), copied to `out`."
    root = find_nbs().parent
    subprocess.run(["nbdev-docs"], cwd=root, check=True)
    shutil.copytree(root / "_docs", out, dirs_exist_ok=True)
    return dict(builder="quarto", pages=[{"page": p.name} for p in Path(out).glob("*.html")])


def docs(out: str = "site", nbs: str = None, quarto: bool = None) -> dict:
    "Build the docs site into `out`: with Quarto where it is installed, else offline with nbconvert."
    use_quarto = shutil.which("quarto") is not None if quarto is None else quarto
    if use_quarto and not shutil.which("quarto"):
        raise KitError("quarto=True but no `quarto` on PATH: install Quarto (https://quarto.org) or "
                       "build offline without --quarto")
    import importlib.util
    if not use_quarto and importlib.util.find_spec("nbconvert") is None:
        raise KitError("the offline build renders the notebooks with nbconvert, which is not installed: "
                       "pip install -e '.[dev]' (the dev extra) or pip install nbconvert")
    return build_with_quarto(out) if use_quarto else build_site(out, nbs)
