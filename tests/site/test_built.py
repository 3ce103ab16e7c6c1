"""What a build computes: the hooks run the generators whose files the built pages use."""

import pathlib
import re

import _built  # a docs hook (tests/site/conftest.py)
import generate  # a docs hook (tests/site/conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]

EXPLORABLE_PATTERNS = ("explore_*.html",)


def _pages():
    docs = ROOT / "docs"
    return [p.relative_to(docs).as_posix() for p in docs.rglob("*.md")
            if p.relative_to(docs).parts[0] not in {"generated", "source", "hooks"}]


def test_every_generated_file_a_page_uses_has_exactly_one_generator():
    used = _built.used_generated_files({"nav": _pages()})
    assert {"estimators_table.md", "experiment_accuracy.svg", "explore_mismatch.html"} <= used
    for name in sorted(used):
        makers = [generator.__name__ for generator, patterns in generate.GENERATORS
                  if _built.wanted({name}, patterns)]
        makers += ["explorables"] if _built.wanted({name}, EXPLORABLE_PATTERNS) else []
        assert len(makers) == 1, (name, makers)


def test_the_one_chapter_build_runs_only_the_opd_chapters_generators():
    config = {"nav": [{"On-policy distillation": "opd.md"}]}
    assert _built.nav_pages(config) == ["opd.md"]
    used = _built.used_generated_files(config)
    assert used == {"gradient_agreement.md", "k_estimators_table.md"}
    running = [generator.__name__ for generator, patterns in generate.GENERATORS
               if _built.wanted(used, patterns)]
    assert sorted(running) == ["_gradient_agreement", "_k_estimators"]
    assert not _built.wanted(used, EXPLORABLE_PATTERNS)


def test_without_a_navigation_every_generator_runs():
    assert _built.nav_pages({"nav": None}) is None
    assert _built.used_generated_files({"nav": None}) is None
    assert all(_built.wanted(None, patterns) for _, patterns in generate.GENERATORS)


def test_mkdocs_yml_lists_every_page_so_its_build_computes_everything():
    nav_block = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav_block, re.M))
    listed |= set(re.findall(r"^\s*-\s*([\w./-]+\.md)\s*$", nav_block, re.M))
    # pages built outside the navigation (not_in_nav), which use no generated file
    outside = set(re.findall(r"^  /([\w./-]+\.md)$", nav_block, re.M))
    assert outside == {"mutation.md"}
    assert not _built.used_generated_files({"nav": sorted(outside)})
    assert set(_pages()) <= listed | outside, sorted(set(_pages()) - listed - outside)


def test_a_name_no_generator_declares_is_refused():
    import pytest

    with pytest.raises(ValueError, match="generated/nothing.md is not declared"):
        generate._write("nothing.md", "")
    assert not (generate.OUT / "nothing.md").exists()
