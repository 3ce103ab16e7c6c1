"""docs/hooks/tables.py: identifiers in a table may break between their parts, never inside."""


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
