r"""opd-literate: on-policy distillation and training-inference mismatch, as literate code.

Modules (each readable on its own, importing only numpy, torch and the package's small
helpers):

* ``opd_literate.opd``: the OPD losses (lab Tasks 1-3), the k1/k2/k3 estimators, forward KL,
  generalized JSD, discounted sampled-token OPD and the loss reductions.
* ``opd_literate.toy``: the enumerable toy whose sampler and trainer disagree.
* ``opd_literate.estimators``: the rollout-correction estimators with exact bias and variance.
* ``opd_literate.opd_mismatch``: sampled-token OPD when the sampler is not the trainer.
* ``opd_literate.tinylm`` and ``opd_literate.run``: a tiny LM and the OPD experiment.
* ``opd_literate.handout``: lab handouts and a grader, generated from this source.

Importing the package runs nothing and imports no submodule.
"""

__version__ = "0.1.0"
