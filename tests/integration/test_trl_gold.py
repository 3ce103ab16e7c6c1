"""TRL's installed ULD and GOLD hybrid loss (``trl.experimental.gold.gold_trainer.ULDLoss``)
on the cross-tokenizer toy's tensors, against ``opd_literate.teachers.cross_tokenizer``.

Every student sequence of the toy is one row of the batch (``trl_batch``); TRL's loss is the
mean over the rows, and its autograd gradient with respect to the student's logits must be
``logit_grads`` of the numpy losses. In float64, to 1e-12.
"""

import types

import numpy as np
import pytest

from opd_literate.teachers import cross_tokenizer as xt

# Deselected by the default run (pyproject's addopts); .ci/run runs them as their own step.
pytestmark = pytest.mark.trl

torch = pytest.importorskip("torch")
gold = pytest.importorskip("trl.experimental.gold.gold_trainer",
                           reason="TRL (with its experimental GOLD trainer) is not installed")


class _Vocab:
    """What ULDLoss reads of a tokenizer for the hybrid loss: ``get_vocab()``."""

    def __init__(self, vocab):
        self._vocab = {token: i for i, token in enumerate(list(vocab) + [xt.EOS])}

    def get_vocab(self):
        return dict(self._vocab)


def _config(**overrides):
    # GOLDConfig's ULD fields and defaults (trl/experimental/gold/gold_config.py), read here
    # from the installed class so that a changed default fails the test instead of hiding.
    fields = gold.GOLDConfig.__dataclass_fields__
    names = ["uld_crossentropy_weight", "uld_distillation_weight", "uld_student_temperature",
             "uld_teacher_temperature", "uld_skip_student_eos", "uld_skip_teacher_eos",
             "use_extended_uld", "uld_token_merge_strategy", "uld_use_hybrid_loss",
             "uld_hybrid_matched_weight", "uld_hybrid_unmatched_weight", "beta"]
    values = {name: fields[name].default for name in names}
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_the_defaults_this_module_assumes():
    config = _config()
    assert config.uld_token_merge_strategy == "observed" and config.use_extended_uld
    assert config.uld_skip_student_eos and config.uld_skip_teacher_eos
    assert config.uld_student_temperature == config.uld_teacher_temperature == 1.0
    assert config.uld_crossentropy_weight == 0.0 and config.uld_distillation_weight == 1.0
    assert config.beta == 0.5 and not config.uld_use_hybrid_loss



def test_the_gold_config_defaults_the_trainer_test_sets_aside():
    """The chapter: the trainer test sets ``use_uld_loss=True`` (default ``False``), calls the
    on-policy path directly (default ``lmbda=0.5``) and samples the student as it is (defaults
    ``temperature=0.9``, ``top_p=0.95``); a changed default fails here."""
    import pathlib

    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "teachers.md").read_text()
                    .split())
    for phrase in ("`use_uld_loss=True` (the default, `False`,", "the default `lmbda=0.5`",
                   "the defaults `temperature=0.9` and `top_p=0.95`"):
        assert phrase in page, phrase
    fields = gold.GOLDConfig.__dataclass_fields__
    defaults = {name: fields[name].default for name in ("use_uld_loss", "lmbda", "temperature",
                                                        "top_p")}
    assert defaults == {"use_uld_loss": False, "lmbda": 0.5, "temperature": 0.9, "top_p": 0.95}

CASES = [
    ("uld observed", {}, {}),
    ("uld bayesian", {"uld_token_merge_strategy": "bayesian"}, {"merge": "bayesian"}),
    ("uld positional", {"use_extended_uld": False}, {"extended": False}),
    ("hybrid beta 0.5", {"uld_use_hybrid_loss": True}, {"hybrid": True}),
    ("hybrid beta 1", {"uld_use_hybrid_loss": True, "beta": 1.0}, {"hybrid": True, "beta": 1.0}),
    ("hybrid beta 0", {"uld_use_hybrid_loss": True, "beta": 0.0}, {"hybrid": True, "beta": 0.0}),
    ("hybrid bayesian", {"uld_use_hybrid_loss": True, "uld_token_merge_strategy": "bayesian"},
     {"hybrid": True, "merge": "bayesian"}),
    ("hybrid fixed weights", {"uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.3,
                              "uld_hybrid_unmatched_weight": 2.0},
     {"hybrid": True, "matched_weight": 0.3, "unmatched_weight": 2.0}),
]


@pytest.mark.parametrize("kind", sorted(xt.KINDS))
@pytest.mark.parametrize("name, trl_options, ours", CASES, ids=[c[0] for c in CASES])
def test_trl_uld_loss_and_its_gradient_are_ours(kind, name, trl_options, ours):
    toy = xt.make_cross_toy(kind, T=3, seed=1)
    batch = {k: torch.from_numpy(v) for k, v in xt.trl_batch(toy).items()}
    student_logits = batch["student_logits"].clone().requires_grad_(True)
    loss_fn = gold.ULDLoss(_config(**trl_options),
                           student_tokenizer=_Vocab(toy["student"]["vocab"]),
                           teacher_tokenizer=_Vocab(toy["teacher"]["vocab"]))
    loss = loss_fn(student_logits=student_logits, teacher_logits=batch["teacher_logits"],
                   student_labels=batch["student_labels"],
                   teacher_labels=batch["teacher_labels"],
                   student_input_ids=batch["student_input_ids"],
                   teacher_input_ids=batch["teacher_input_ids"],
                   student_byte_offsets=batch["student_byte_offsets"],
                   teacher_byte_offsets=batch["teacher_byte_offsets"])
    loss.backward()
    losses = xt.uld_losses(toy, **ours)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(float(losses["loss"].mean()), abs=1e-12)
    np.testing.assert_allclose(student_logits.grad.numpy(), xt.logit_grads(toy, losses),
                               atol=1e-12)


def test_the_hybrid_matches_every_shared_token_string():
    # teacher_merges: a, b and <eos> are in both vocabularies, "ab" only in the teacher's;
    # the adaptive weight is 3 / 4.
    toy = xt.make_cross_toy("teacher_merges", T=2)
    loss_fn = gold.ULDLoss(_config(uld_use_hybrid_loss=True),
                           student_tokenizer=_Vocab(toy["student"]["vocab"]),
                           teacher_tokenizer=_Vocab(toy["teacher"]["vocab"]))
    assert sorted(loss_fn._vocab_mapping.items()) == [(0, 0), (1, 1), (3, 2)]


def test_the_chapter_counts_and_names_the_option_sets():
    import pathlib

    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "teachers.md").read_text()
                    .split())
    assert ("for eight option sets on each pair of tokenizers: ULD with either merge and with "
            "positional alignment, and the hybrid at $\\beta$ = 0, 0.5 and 1, with the bayesian "
            "merge and with fixed weights") in page
    assert [name for name, _, _ in CASES] == [
        "uld observed", "uld bayesian", "uld positional", "hybrid beta 0.5", "hybrid beta 1",
        "hybrid beta 0", "hybrid bayesian", "hybrid fixed weights"]
    assert len({kind for kind in xt.KINDS}) == 4
