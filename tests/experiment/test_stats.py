"""The headline statistics (``opd_literate.experiment.stats``).
"""

from opd_literate.experiment import stats


def test_headline_counts_first_evaluation_at_target():
    results = {"teacher_accuracy": 1.0,
               "config": {"target_fraction": 0.9, "steps": 2, "batch_size": 10, "seeds": 1},
               "methods": {
                   "opd_full_vocab": {"samples": [0, 10, 20], "accuracy": [[0.1, 0.95, 0.99]],
                                      "reverse_kl": [[1, 0.1, 0.05]], "seconds": [[0, 1, 2]],
                                      "lr": 0.003},
                   "rl": {"samples": [0, 10, 20], "accuracy": [[0.1, 0.2, 0.3]],
                          "reverse_kl": [[1, 1, 1]], "seconds": [[0, 1, 2]], "lr": 0.001}}}
    table = stats.headline(results)
    assert table["opd_full_vocab"]["samples"]["mean"] == 10 and table["rl"]["samples"] is None
    text = stats.format_headline(results)
    assert "rl / opd_full_vocab: at least 2.0x [2.0, 2.0] (1 of 1 seeds never reach" in text
