"""docs/hooks/solutions.py: the solution markers leave the code a reader sees, and a numbered
listing keeps each line's own number."""

import re

import pytest
import solutions  # a docs hook (tests/site/conftest.py)

NUMBERED = ('<table class="highlighttable"><tbody><tr><td class="linenos"><div class="linenodiv">'
            '<pre><span></span><span class="normal">10</span>\n<span class="normal">11</span>\n'
            '<span class="normal">12</span>\n<span class="normal">13</span></pre></div></td>'
            '<td class="code"><div><pre><span></span><code><span class="k">def</span> f():\n'
            '    <span class="c1">### BEGIN SOLUTION Task 1: hint</span>\n'
            '    <span class="k">return</span> <span class="mi">1</span>  '
            '<span class="c1"># why</span>\n'
            '<span class="w">    </span><span class="c1">### END SOLUTION</span>\n'
            '</code></pre></div></td></tr></tbody></table>')


def _columns(html):
    numbers, code = re.findall(r"<pre[^>]*>(.*?)</pre>", html, re.S)
    return re.findall(r'"normal">(\d+)<', numbers), code


def test_a_numbered_listing_loses_the_marker_lines_and_their_numbers():
    numbers, code = _columns(solutions.hide_solution_markers(NUMBERED))
    assert numbers == ["10", "12"]
    assert "SOLUTION" not in code and '<span class="c1"># why</span>' in code
    assert code.count("\n") == 2  # def, return (and the closing line of the block)


def test_a_plain_block_loses_them_only_where_every_block_is_asked_for():
    block = ('<div class="highlight"><pre><span></span><code>x = 1\n'
             '    <span class="c1">### BEGIN SOLUTION Task 2: h</span>\ny = 2\n</code></pre></div>')
    assert solutions.hide_solution_markers(block) == block  # a copy block keeps them
    assert "SOLUTION" not in solutions.hide_solution_markers(block, every_block=True)


@pytest.mark.parametrize("text", ["# ### BEGIN SOLUTION is how a lab marks it",
                                  "x = '### BEGIN SOLUTION'"])
def test_a_line_that_only_mentions_a_marker_stays(text):
    line = f'<span class="c1">{text}</span>' if text.startswith("#") else text
    block = f"<pre><code>{line}\n</code></pre>"
    assert solutions.hide_solution_markers(block, every_block=True) == block
