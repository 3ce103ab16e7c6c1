r"""The experiment's configuration: one frozen dataclass, and its three variants.

As CleanRL's ``Args`` and nanoGPT's ``GPTConfig``: every setting is a field with its meaning
under it, and a variant is ``dataclasses.replace(DEFAULT, ...)``. ``results.json`` stores the
configuration it ran as [opd_literate.experiment.config.ExperimentConfig.as_dict][].
"""

from __future__ import annotations

import dataclasses

__all__ = ["METHODS", "ExperimentConfig", "DEFAULT", "QUICK", "LONG", "eval_steps"]

METHODS = ("opd_sampled", "opd_full_vocab", "sft", "rl")
"""The four training methods, in the order every table shows them."""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One run of the study: the data, the teacher, the students, and how they are trained."""

    seed: int = 0
    """The run's random seed: the data split, the teacher, and every stream of every method."""
    seeds: int = 5
    """Weak students per method and learning rate, each from its own initial weights."""
    steps: int = 1800
    """Updates per method and learning rate."""
    batch_size: int = 64
    """Student samples per update, for every method (RL: ``batch_size / group`` prompts)."""
    group: int = 4
    """RL's samples per prompt, whose mean reward is the baseline."""
    lrs: tuple = (1e-3, 3e-3)
    """The common learning-rate grid; each method is reported at its best on validation."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warm-up."""
    eval_every: int = 25
    """Steps between evaluations up to ``eval_dense_until``."""
    eval_dense_until: int = 300
    """The last step of the dense evaluations, where the fast methods reach the target."""
    eval_every_late: int = 100
    """Steps between evaluations after ``eval_dense_until``."""
    val_prompts: int = 500
    """Held-out prompts that choose each method's learning rate (and nothing else)."""
    eval_prompts: int = 500
    """Held-out prompts of every reported number, disjoint from the validation prompts."""
    held_out: int = 2000
    """Operand pairs never trained on; the validation and test prompts are drawn from them."""
    pretrain_lr: float = 3e-3
    """Adam's learning rate for the teacher's and the weak students' supervised training."""
    teacher_hidden: int = 256
    """The teacher's width."""
    teacher_layers: int = 2
    """The teacher's hidden layers."""
    teacher_steps: int = 400
    """The teacher's supervised steps."""
    teacher_batch: int = 256
    """The teacher's batch size."""
    teacher_label_smoothing: float = 0.1
    """The label smoothing of the teacher's cross-entropy, which keeps its distribution soft."""
    student_hidden: int = 128
    """The students' width."""
    student_layers: int = 2
    """The students' hidden layers."""
    student_pretrain_steps: int = 250
    """The supervised steps that make each student weak but not hopeless."""
    student_pretrain_batch: int = 64
    """The batch size of the students' supervised steps."""
    target_fraction: float = 0.9
    """The target: this fraction of the teacher's accuracy."""
    digits: int = 2
    """Digits of each operand (``"ab+cd="``); ``LONG`` has three."""

    def as_dict(self):
        """The configuration as ``results.json`` records it: the fields in order, ``lrs`` a list.

        ``digits`` is left out at its default of 2: the field came after the committed
        two-digit runs and their teacher caches, whose records and keys have none.

        Examples
        --------
        >>> record = QUICK.as_dict()
        >>> record["lrs"], "digits" in record, LONG.as_dict()["digits"]
        ([0.001], False, 3)
        """
        record = dataclasses.asdict(self)
        record["lrs"] = list(self.lrs)
        if self.digits == 2:
            del record["digits"]
        return record

    def stream_seed(self, seed_index, purpose):
        """The generator seed of one use (``purpose``) for seed ``seed_index`` of this run.

        Examples
        --------
        >>> DEFAULT.stream_seed(1, 2), dataclasses.replace(DEFAULT, seed=1).stream_seed(0, 2)
        (1011, 1000005)
        """
        return 1_000_003 * self.seed + 1009 * seed_index + purpose


DEFAULT = ExperimentConfig()
"""The default experiment (about 115 s on 2 CPU cores, two worker processes, with the teacher
cached; the first run also trains the teacher).

Each method is trained for every seed at every learning rate in ``lrs`` (``seeds`` times
``len(lrs)`` students, trained together as one batched model) and reported at the learning
rate that does best on the validation prompts: a common grid, so that no method is compared
at a step size that suits only the others, and a choice made on prompts the results are not
reported on. The site's figures come from the committed results of this configuration.
"""
QUICK = dataclasses.replace(DEFAULT, seeds=3, steps=200, lrs=(1e-3,), eval_every=25,
                            val_prompts=300, eval_prompts=300, teacher_steps=250)
"""``--quick``: the same pipeline, smaller, for the tests and smoke checks (about 11 s on
2 CPU cores with the teacher cached, 16 s the first time); full-vocabulary OPD reaches its
target on every seed."""


LONG = dataclasses.replace(DEFAULT, digits=3, steps=1200, teacher_steps=1200,
                           student_pretrain_steps=600)
"""``--long``: the second regime, longer answers. Three-digit operands (``"abc+def="``, answers
of up to 5 tokens), where a wrong early digit leaves the student further from anything the
teacher showed it; the teacher and the students are trained longer to reach comparable
starting points, and the budget is 1,200 steps of 64 samples."""


def eval_steps(config):
    """The steps after which the students are evaluated (step 0, before any update, too):
    every ``eval_every`` steps up to ``eval_dense_until``, where the fast methods reach the
    target and the resolution matters, then every ``eval_every_late``, and the last step.

    Examples
    --------
    >>> eval_steps(ExperimentConfig(steps=10, eval_every=2, eval_dense_until=4,
    ...                             eval_every_late=5))
    [0, 2, 4, 5, 10]
    """
    return [k for k in range(config.steps + 1)
            if (k <= config.eval_dense_until and k % config.eval_every == 0)
            or k % config.eval_every_late == 0 or k == config.steps]
