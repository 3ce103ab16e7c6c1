r"""The experiment: OPD against off-policy distillation and RL on a tiny language model.

``tinylm`` (the model, its data and its rollout), ``config`` (the configurations), ``ensemble``
and ``train`` (one method's loss, update and loop), ``run`` (the study: teacher, students,
every method), ``stats`` and ``plots`` (what the results say), ``cli`` (``python -m
opd_literate.experiment``); ``_cache`` and ``_workers`` hold the file and process handling.
Importing this package imports none of them.
"""
