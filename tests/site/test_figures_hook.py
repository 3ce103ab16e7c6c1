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
