r"""opd-literate: on-policy distillation and training-inference mismatch, as literate code.

Modules, from the bottom layer up; beside each, the third-party packages it imports (besides the
standard library and the package's own modules), so that a reader knows what a lifted module
drags along:

* ``opd_literate.toy``: the enumerable toy whose sampler and trainer disagree (imports: numpy).
* ``opd_literate.estimators``: the rollout-correction estimators with exact bias and variance
  (imports: numpy).
* ``opd_literate.opd_mismatch``: sampled-token OPD when the sampler is not the trainer
  (imports: numpy).
* ``opd_literate.opd``: the OPD losses (lab Tasks 1-3), the k1/k2/k3 estimators, forward KL,
  generalized JSD, discounted sampled-token OPD and the loss reductions (imports: torch).
* ``opd_literate.correction``: rollout correction on real ``(B, T)`` batches, the weights,
  rejection criteria and losses of the mismatch chapter as the frameworks apply them
  (imports: torch).
* ``opd_literate.large_vocab``: the full-vocabulary losses computed in chunks of tokens from
  hidden states and the LM head, never holding all the logits (imports: torch).
* ``opd_literate.topk``: top-k teachers, three approximations of the KL with their exact bias
  (imports: torch, matplotlib; matplotlib only to plot).
* ``opd_literate.tinylm``: a tiny LM for two-digit addition (imports: torch).
* ``opd_literate.run``: the OPD experiment (imports: torch, numpy, filelock, tqdm, matplotlib;
  numpy for the bootstrap intervals, the last two only when a progress bar or a plot is asked
  for).
* ``opd_literate.handout``: lab handouts and a grader, generated from this source
  (imports: nothing).
* ``opd_literate.copy``: ``opd-copy NAME`` prints a public function with every helper, constant
  and import it needs, to lift into course material (imports: nothing).

All of them share the argument checks of ``opd_literate._checks``, which loads torch only when
a torch tensor is checked: the numpy modules never load torch.
Importing the package runs nothing and imports no submodule.
"""

__version__ = "0.1.0"
