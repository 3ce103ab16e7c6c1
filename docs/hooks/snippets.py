"""MkDocs hook: each function of a copy-ready module shows its copy-ready snippet.

The API page of such a module is the single line ``::: opd_literate.MODULE``. This hook expands
it, before mkdocstrings renders it, into the module (its docstring, constants and classes), then
each public function as its own ``:::`` entry followed by a collapsed block holding the output of
``opd-copy MODULE.FUNCTION`` (``opd_literate.course.lift.snippet``), computed from the current
source on every build. The estimators page shows ``REGISTRY`` as a table built from the registry
itself instead of the literal that defines it.
"""

from __future__ import annotations

import ast
import textwrap

from mkdocs.exceptions import PluginError

from opd_literate.course import lift

PAGES = {f"api/{module.split('.')[-1]}.md": module for module in lift.COPY_READY_MODULES}
INDENT = " " * 4
# Plain text, not "python": Pygments' spans on some 20,000 lines of snippets made the build
# about 25 s slower (search indexing parses them all); the entry's source above is highlighted.
LANGUAGE = "text"


def on_pre_build(config) -> None:
    lift._parse.cache_clear()  # mkdocs serve: read the source again after an edit


def _members(module: str):
    """Public top-level names that mkdocstrings shows (a docstring), in source order:
    (functions, everything else)."""
    body = ast.parse(lift._module_path(module).read_text(encoding="utf-8")).body
    exported = next((ast.literal_eval(node.value) for node in body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)),
                    ())
    functions, others = [], []
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.ImportFrom) and node.level and node.module == "_numerics":
            # A shared constant re-exported under its public name (``opd.REDUCTIONS``): shown
            # with the docstring of its one home, ``_numerics``.
            others += [a.asname or a.name for a in node.names
                       if (a.asname or a.name) in exported and (a.asname or a.name).isupper()]
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names, documented = [node.name], ast.get_docstring(node) is not None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            documented = (isinstance(following, ast.Expr)
                          and isinstance(following.value, ast.Constant)
                          and isinstance(following.value.value, str))
        else:
            continue
        for name in names:
            if name.startswith("_") or not documented:
                continue
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            (functions if is_function else others).append(name)
    return functions, others


def _directive(path: str, **options) -> str:
    lines = [f"::: {path}"]
    if options:
        lines.append(INDENT + "options:")
        for key, value in options.items():
            lines.append(INDENT * 2 + f"{key}: {value}")
    return "\n".join(lines)


def _snippet_block(module: str, function: str) -> str:
    code = lift.snippet(f"{module}.{function}")
    needed, _, examples = code.partition(lift._EXAMPLES_BANNER)
    needed_lines = len(needed.rstrip().splitlines())
    title = f"Copy this function ({needed_lines} lines with its imports and helpers"
    if examples:
        title += f"; {len(examples.strip().splitlines())} more that its examples use"
    title += ")"
    fence = "````"
    return "\n".join([
        f'??? example "{title}"',
        "",
        INDENT + f"`opd-copy {module}.{function}` prints the same code: it runs alone, with "
        "numpy and torch only, and its doctests pass.",
        "",
        INDENT + fence + LANGUAGE,
        textwrap.indent(code.rstrip("\n"), INDENT, lambda line: True).replace(
            "\n" + INDENT + "\n", "\n\n"),
        INDENT + fence,
    ])


def registry_table() -> str:
    """``REGISTRY`` as a Markdown table (name, thresholds and defaults, source, unbiased, level)."""
    from opd_literate.mismatch.estimators import REGISTRY

    rows = ["| name | thresholds and defaults | source | unbiased | level |",
            "| --- | --- | --- | --- | --- |"]
    for name, spec in REGISTRY.items():
        defaults = ", ".join(f"`{key}={value:.6g}`" for key, value in spec.defaults.items())
        link = f"[`{name}`][opd_literate.mismatch.estimators.{spec.fn.__name__}]"
        rows.append(f"| {link} | {defaults or 'none'} | {spec.source} | "
                    f"{'yes' if spec.unbiased else 'no'} | {spec.reference} |")
    return "\n".join(rows)


REGISTRY_INTRO = (
    "Built from `REGISTRY` at each docs build. *Level* is the spec's `reference`: the "
    "uncorrected weight a token is compared with to count it as truncated or masked (`one`, "
    "the token ratio, the sequence ratio, or the geometric mean of the token ratios); "
    "*unbiased* is the spec's `unbiased` field."
)


def on_page_markdown(markdown: str, page, config, files) -> str:
    module = PAGES.get(page.file.src_uri)
    if module is None:
        return markdown
    directive = f"::: opd_literate.{module}"
    lines = markdown.splitlines()
    if lines.count(directive) != 1:
        raise PluginError(f"{page.file.src_uri}: expected the line {directive!r} once")
    functions, others = _members(module)
    has_registry = module == "mismatch.estimators" and "REGISTRY" in others
    others = [name for name in others if not (has_registry and name == "REGISTRY")]
    parts = [_directive(f"opd_literate.{module}",
                        members=f"[{', '.join(others)}]" if others else "false")]
    member = {"heading_level": 2, "show_root_full_path": "false"}
    if has_registry:
        parts.append(_directive(f"opd_literate.{module}.REGISTRY", **member,
                                show_attribute_values="false"))
        parts.append(REGISTRY_INTRO + "\n\n" + registry_table())
    for function in functions:
        parts.append(_directive(f"opd_literate.{module}.{function}", **member))
        parts.append(_snippet_block(module, function))
    index = lines.index(directive)
    lines[index:index + 1] = ["\n\n".join(parts)]
    return "\n".join(lines) + "\n"
