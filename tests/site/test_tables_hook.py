"""docs/hooks/tables.py: identifiers in a table may break between their parts, never inside."""

import re

import pytest
import tables  # a docs hook (tests/site/conftest.py)


def test_separators_in_a_tables_code_become_break_opportunities():
    html = ("<table><tr><td><code>ppo_clip_bypass</code> and <code>a/b.py</code></td>"
            "<td><code>x &amp;&amp; y-1</code></td></tr></table>")
    assert tables.break_identifiers(html) == (
        "<table><tr><td><code>ppo_<wbr>clip_<wbr>bypass</code> and <code>a/<wbr>b.<wbr>py</code>"
        "</td><td><code>x &amp;&amp; y-<wbr>1</code></td></tr></table>")


def test_code_outside_tables_and_a_trailing_separator_stay():
    html = "<p><code>ppo_clip</code></p><table><tr><td><code>x_</code></td></tr></table>"
    assert tables.break_identifiers(html) == html


_TABLE = ('<table>\n<thead>\n<tr>\n<th>estimator</th>\n<th style="text-align: right;">'
          '<span class="arithmatex">\\(\\epsilon\\)</span></th>\n</tr>\n</thead>\n<tbody>\n'
          '<tr>\n<td><code>naive</code></td>\n<td style="text-align: right;">0.5</td>\n</tr>\n'
          '</tbody>\n</table>')


def test_every_body_cell_carries_its_columns_heading_and_its_own_content_whole():
    html = tables.label_cells("<p>x</p>" + _TABLE)
    label = '<span class="opd-cell-label" aria-hidden="true">'
    assert html.count(label) == 2
    assert (f'<td>{label}estimator</span><span class="opd-cell-value"><code>naive</code>'
            "</span></td>") in html
    assert (f'<td style="text-align: right;">{label}<span class="arithmatex">\\(\\epsilon\\)'
            '</span></span><span class="opd-cell-value">0.5</span></td>') in html
    # Read without the labels, the table is the one written.
    stripped = re.sub(r'<span class="opd-cell-label"[^>]*>.*?</span></span>|'
                      r'<span class="opd-cell-label"[^>]*>[^<]*</span>', "", html)
    assert re.sub(r'<span class="opd-cell-value">(.*?)</span></td>', r"\1</td>",
                  stripped) == "<p>x</p>" + _TABLE


def test_a_headings_anchor_is_not_copied_and_a_table_without_headings_stays():
    with_id = _TABLE.replace("<th>estimator</th>", '<th id="est">estimator</th>')
    html = tables.label_cells(with_id)
    assert html.count('id="est"') == 1
    bare = "<table><tbody><tr><td>1</td></tr></tbody></table>"
    assert tables.label_cells(bare) == bare


def test_a_row_with_another_number_of_cells_than_headings_is_an_error():
    broken = _TABLE.replace('<td style="text-align: right;">0.5</td>\n', "")
    with pytest.raises(ValueError, match="1 cells under 2 headings"):
        tables.label_cells(broken)
