r"""MkDocs hook: turn the TeX that arithmatex marks into MathML at build time.

``pymdownx.arithmatex`` (generic mode) wraps inline math as
``<span class="arithmatex">\(...\)</span>`` and display math as
``<div class="arithmatex">\[...\]</div>``, in the Markdown pages and in the
docstrings that mkdocstrings renders. This hook replaces each with the MathML that
``latex2mathml`` produces, so the site needs no math renderer at view time (browsers render
MathML natively) and works offline. A formula that cannot be converted fails the build.
"""

import html
import re

from latex2mathml.converter import convert

_MATH = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[\(\[])(?P<tex>.*?)\\(?P<close>[\)\]])'
    r"\s*</(?P=tag)>",
    re.S,
)


_UNCONVERTED = re.compile(r"\\[A-Za-z]+")


def tex_to_mathml(tex: str, display: bool) -> str:
    """MathML for one formula; a ValueError for TeX that latex2mathml cannot convert."""
    try:
        mathml = convert(tex, display="block" if display else "inline")
    except Exception as error:  # latex2mathml raises its own exception classes
        raise ValueError(f"latex2mathml could not convert {tex!r}: {error!r}") from None
    # An unknown command comes back verbatim (<mi>\foo</mi>): a typo, or unsupported TeX.
    unknown = _UNCONVERTED.findall(mathml)
    if unknown or "merror" in mathml:
        raise ValueError(f"latex2mathml could not convert {tex!r}: unknown {unknown}")
    return mathml


def _replace(match: re.Match) -> str:
    tex = html.unescape(match.group("tex")).strip()
    display = match.group("open") == "["
    mathml = tex_to_mathml(tex, display)
    tag = "div" if display else "span"
    return f'<{tag} class="math {"math-display" if display else "math-inline"}">{mathml}</{tag}>'


def convert_page(content: str) -> str:
    return _MATH.sub(_replace, content)


def on_page_content(html_content, page, config, files):  # noqa: ARG001 (MkDocs hook API)
    try:
        return convert_page(html_content)
    except ValueError as error:
        raise ValueError(f"{page.file.src_path}: {error}") from None
