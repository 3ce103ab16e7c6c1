"""A configuration small enough to run the whole pipeline in well under a second: for the tests
of the plumbing (results, interruption, the cache, the workers), not of learning."""

import dataclasses

from opd_literate.experiment.config import DEFAULT

TINY = dataclasses.replace(
    DEFAULT, seeds=2, steps=2, batch_size=8, lrs=(1e-3,), eval_every=1, eval_prompts=16,
    val_prompts=8, teacher_hidden=8, teacher_layers=1, teacher_steps=2, teacher_batch=8,
    student_hidden=8, student_layers=1, student_pretrain_steps=1, student_pretrain_batch=8)
