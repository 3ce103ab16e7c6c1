r"""Chapter "Teachers": distillation when the teacher is not one model of the student's kind.

Two questions the per-token losses of [opd_literate.opd][] do not ask: what the student should
match when the teacher writes with another tokenizer
(``opd_literate.teachers.cross_tokenizer``: the string-level reverse KL on an enumerable toy,
TRL's ULD and GOLD losses and NeMo-RL's projection, each with its exact bias), and what it
should match when there are several teachers (``opd_literate.teachers.many_teachers``: routing
by source, a mixture of teachers and a weighted sum of KLs on enumerable prompts, their exact
gradients, what verl and slime compute, and the bias of sending a prompt to the wrong teacher;
``opd_literate.teachers.teacher_targets``, their per-token targets on a torch batch).

Importing this package runs nothing and imports none of its modules.
"""
