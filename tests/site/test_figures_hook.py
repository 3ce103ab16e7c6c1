"""docs/hooks/figures.py: each figure of a page in a numbered <figure> with its caption."""

import re

import figures  # a docs hook (tests/site/conftest.py)
import pytest

PAGE = ('<p>Text.</p>\n<p><a class="glightbox" href="a.svg"><img alt="First &amp; best" '
        'src="a.svg"></a></p>\n<p>More <img alt="inline" src="i.svg"> text.</p>\n'
        '<div class="explorable" markdown="0" data-caption="Moving one">\n<script></script>\n'
        '<div style="h"><div id="x"></div><script>var s = "</p>";</script></div>\n</div>\n'
        '<p><img alt="Third." src="c.svg"></p>')


def test_figures_are_numbered_in_order_with_their_captions():
    out = figures.number_figures(PAGE)
    captions = re.findall(r"<figcaption><strong>Figure (\d+)\.</strong> (.*?)</figcaption>", out)
    assert captions == [("1", "First &amp; best."),
                        ("2", "Moving one. <em>(hover for the values)</em>"), ("3", "Third.")]
    with_slider = figures.number_figures(PAGE.replace('var s = "</p>";', 'var s = {"sliders": 1};'))
    assert "Moving one. <em>(move its slider)</em>" in with_slider
    assert re.findall(r'<figure id="(figure-\d+)"', out) == ["figure-1", "figure-2", "figure-3"]
    assert "More <img alt=\"inline\" src=\"i.svg\"> text." in out  # an image in prose stays
    # the explorable whole inside its figure, its nested divs closed before the caption
    explorable = out.split('<figure id="figure-2" class="numbered">', 1)[1].split("<figcaption>")[0]
    assert explorable.count("<div") == explorable.count("</div>") == 3


def test_an_explorable_never_closed_is_refused():
    with pytest.raises(ValueError, match="never closed"):
        figures.number_figures('<div class="explorable" markdown="0" data-caption="x"><div>')


def test_a_reference_by_name_becomes_the_figures_number_wherever_it_stands():
    page = ('<p>See <a href="#fig-c">Figure</a> and <a href="#fig-x">Figure</a>.</p>\n' + PAGE)
    out = figures.number_figures(page)
    assert ('See <a href="#figure-3">Figure 3</a> and <a href="#figure-2">Figure 2</a>.'
            in out)  # c.svg is the third figure, the explorable with <div id="x"> the second
    assert "#fig-" not in out


def test_a_reference_to_a_figure_not_on_the_page_fails_the_build():
    with pytest.raises(ValueError, match=r"a reference to figure 'gone', which is not on this "
                                         r"page \(its figures: \['a', 'c', 'x'\]\)"):
        figures.number_figures('<p><a href="#fig-gone">Figure</a></p>' + PAGE)


def test_every_figure_of_a_chapter_is_referred_to_by_name_from_its_text():
    """Each chapter names each of its figures ([Figure](#fig-NAME)); the build turns the names
    into numbers, and fails on a name that is not a figure of the page."""
    import pathlib

    docs = pathlib.Path(__file__).parents[2] / "docs"
    for page in sorted(docs.glob("*.md")):
        text = page.read_text()
        names = set(re.findall(r"!\[[^\]]*\]\((?:[^)]*/)?([\w-]+)\.svg\)", text))
        names |= {stem.replace("_", "-") for stem in
                  re.findall(r'--8<-- "generated/(explore_\w+)\.html"', text)}
        referred = set(re.findall(r"\[Figure\]\(#fig-([\w-]+)\)", text))
        assert names == referred, (page.name, sorted(names ^ referred))
