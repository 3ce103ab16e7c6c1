"""``docs/hooks/commits.py``: full commit hashes shown short and linked."""


import commits  # a docs hook (tests/site/conftest.py)


def test_full_commit_hashes_read_short_and_link_to_their_repository():
    full = "b178a3cd56f58b2d502255daba591e92833930a7"
    page = (f"## verl (volcengine/verl)\n\nRead at `{full}`.\n\n| a | huggingface/trl | `{full}` |"
            f"\n\n```text\n`{full}`\n```\n")
    out = commits.link_commits(page).split("\n")
    assert out[2] == (f"Read at [`b178a3c`](https://github.com/volcengine/verl/commit/{full} "
                      f'"volcengine/verl@{full}").')
    assert f"(https://github.com/huggingface/trl/commit/{full}" in out[4]
    assert out[7] == f"`{full}`"  # code stays as written
    assert commits.link_commits(f"`{full}`") == f"`{full}`"  # no repository named: left alone
