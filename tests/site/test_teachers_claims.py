"""The teachers chapter's sentences on the explorable figure (docs/teachers.md, "How the bias
grows with the difference"), read back against the library at the figure's own settings
(docs/hooks/explorables.py)."""

import pathlib
import re

import explorables  # a docs hook (tests/site/conftest.py)
import numpy as np

from opd_literate.experiment.quantized import rank_correlation
from opd_literate.teachers import cross_tokenizer as xt
from tests.helpers.committed import assert_matches_committed


def test_the_chapters_sentences_on_the_bias_against_the_retokenized_share():
    """docs/teachers.md, "How the bias grows with the difference", against retokenization_sweep
    at the explorable's settings (docs/hooks/explorables.py)."""
    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "teachers.md").read_text()
                    .split())
    n = r"([−-]?[0-9.]+)"

    def numbers(pattern):
        found = re.search(pattern.replace("N", n), page)
        assert found, f"the sentence {pattern!r} is not on the page"
        return [float(x.replace("−", "-")) for x in found.groups()]

    kinds = ("teacher_merges", "student_merges", "non_refining")
    sweep = {kind: xt.retokenization_sweep(kind, explorables.RETOKENIZATION_SEEDS,
                                           scale=explorables.RETOKENIZATION_SCALE)
             for kind in ("identical",) + kinds}
    projection, uld = "projection (NeMo-RL P-KL, reverse)", "ULD (TRL's ULD options)"

    def errors(kind, label, key):
        return [r["bias"][label][key] for r in sweep[kind]]

    def shares(kind):
        return [r["share"] for r in sweep[kind]]

    why = "three decimals on the page"
    low, high = numbers(r"from N to N on `teacher_merges` over 40 draws")
    assert_matches_committed([min(shares("teacher_merges"))], [low], rtol=0, atol=5e-4,
                             why="three decimals on the page")
    assert_matches_committed([max(shares("teacher_merges"))], [high], rtol=0, atol=5e-3,
                             why="two decimals on the page")
    assert len(explorables.RETOKENIZATION_SEEDS) == 40 and explorables.RETOKENIZATION_SCALE == 1.5
    stated = numbers(r"has a rank correlation with the share of N, N and N on `teacher_merges`, "
                     r"`student_merges` and `non_refining`, and its median, N, N and N, is the "
                     r"least of the five losses on each pair")
    total = [rank_correlation(shares(k), errors(k, projection, "total_rel_norm")) for k in kinds]
    medians = [float(np.median(errors(k, projection, "total_rel_norm"))) for k in kinds]
    assert_matches_committed(total + medians, stated, rtol=0, atol=5e-4, why=why)
    for kind in kinds:
        assert min((float(np.median(errors(kind, label, "total_rel_norm"))), label)
                   for label, _, _ in xt.TABLE_METHODS)[1] == projection, kind
    low, high, c_low, c_high = numbers(r"its median error is between N and N on the three pairs, "
                                       r"whatever the share \(rank correlations from N to N\)")
    uld_medians = [float(np.median(errors(k, uld, "total_rel_norm"))) for k in kinds]
    uld_total = [rank_correlation(shares(k), errors(k, uld, "total_rel_norm")) for k in kinds]
    assert_matches_committed([min(uld_medians), max(uld_medians), min(uld_total),
                              max(uld_total)], [low, high, c_low, c_high], rtol=0, atol=5e-4,
                             why=why)
    low, high, c_low, c_high, same = numbers(
        r"in the pathwise gradient the projection's median error is N to N on the three pairs, "
        r"with no trend in the share \(rank correlations from N to N\), as on `identical`, where "
        r"it is N:")
    path = [float(np.median(errors(k, projection, "rel_norm"))) for k in kinds]
    path_rank = [rank_correlation(shares(k), errors(k, projection, "rel_norm")) for k in kinds]
    identical = float(np.median(errors("identical", projection, "rel_norm")))
    assert_matches_committed([min(path), max(path), min(path_rank), max(path_rank), identical],
                             [low, high, c_low, c_high, same], rtol=0, atol=5e-4, why=why)
    assert all(abs(c) < 0.3 for c in path_rank)  # "no trend"
