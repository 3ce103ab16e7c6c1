r"""The experiment: OPD against off-policy distillation and RL on a tiny language model.

``tinylm`` (the model, its data and its rollout) and ``run`` (the study and its command line,
``python -m opd_literate.experiment``). Importing this package imports neither.
"""
