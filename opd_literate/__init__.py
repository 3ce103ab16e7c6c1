r"""opd-literate: on-policy distillation and training-inference mismatch, as literate code.

One package a chapter of the site, and the numpy and torch forms of an idea side by side in
it. Beside each module, the third-party packages it imports (besides the standard library and
the package's own modules), so that a reader knows what a lifted module drags along:

* ``opd_literate.opd``: the OPD losses (lab Tasks 1-3), the k1/k2/k3 estimators, forward KL,
  generalized JSD, discounted sampled-token OPD and the loss reductions (imports: torch).
* ``opd_literate.mismatch``: the training-inference mismatch chapter.

  * ``opd_literate.mismatch.toy``: the enumerable toys whose sampler and trainer disagree
    (imports: numpy).
  * ``opd_literate.mismatch.estimators``: the rollout-correction estimators with exact bias
    and variance, on the toys (imports: numpy).
  * ``opd_literate.mismatch.opd_mismatch``: sampled-token OPD when the sampler is not the
    trainer (imports: numpy).
  * ``opd_literate.mismatch.correction``: the same weights, rejection criteria and losses on
    real ``(B, T)`` batches, as the frameworks apply them (imports: torch).
  * ``opd_literate.mismatch.engine``: the inference engine's sampler on the toys: temperature,
    min-p, top-k, top-p, and which log-probs it reports (imports: numpy).
  * ``opd_literate.mismatch.task_rewards``: OPD with task rewards, the mixtures' exact bias
    against the mixing weight (imports: numpy).
  * ``opd_literate.mismatch.groups``: GRPO and RLOO group baselines when a rejection masks
    part of a group, their exact bias and variance over every group (imports: numpy).

* ``opd_literate.large_vocab``: the large-vocabulary chapter.

  * ``opd_literate.large_vocab.chunked``: the full-vocabulary losses computed in chunks of
    tokens from hidden states and the LM head, never holding all the logits (imports: torch).
  * ``opd_literate.large_vocab.topk``: top-k teachers, three approximations of the KL with
    their exact bias (imports: torch; its figure through ``_figures``).
  * ``opd_literate.large_vocab.clamps``: verl's top-k forward KL with its clamps, its
    diagnostics, and how often the clamp discards a position's gradient (imports: torch).
  * ``opd_literate.large_vocab.supports``: which support: the teacher's top-k, the student's,
    their union, TRL's top-1 paths and Tinker's REINFORCE reverse KL, built chunk by chunk,
    with their exact bias and bounds (imports: torch; its figure through ``_figures``).

* ``opd_literate.teachers``: the teachers chapter.

  * ``opd_literate.teachers.cross_tokenizer``: distillation across tokenizers on an enumerable
    toy: the exact string-level reverse KL and its gradient, TRL's ULD and GOLD losses and
    NeMo-RL's projection, each with its exact bias (imports: numpy).
  * ``opd_literate.teachers.many_teachers``: several teachers on enumerable prompts: routing
    by source, a mixture of teachers, a weighted sum of KLs, their exact gradients and the
    bias of misrouting (imports: numpy).
  * ``opd_literate.teachers.teacher_targets``: the same objectives' per-token teacher targets on
    a trainer's ``(B, T)`` batch (imports: torch).

* ``opd_literate.experiment``: the experiment chapter.

  * ``opd_literate.experiment.tinylm``: a tiny LM for two-digit addition (imports: torch).
  * ``opd_literate.experiment.exact``: every answer of tinylm enumerated, and exact sums over a
    model's own answers (imports: torch).
  * ``opd_literate.experiment.quantized``: the students run as quantized (int8, int4) and
    low-precision (bf16, fp16) samplers, the mismatch they create, and every estimator's exact
    bias and variance on tinylm's enumerated answers (imports: numpy, torch).
  * ``opd_literate.experiment.mismatch_training``: RL and sampled-token OPD trained with those
    samplers, with and without verl's corrections (imports: torch).
  * ``opd_literate.experiment.config``: the frozen configuration dataclass, ``DEFAULT``,
    ``QUICK`` and ``LONG`` (imports: nothing).
  * ``opd_literate.experiment.ensemble``: many students trained as one: the summed loss and
    Adam with one learning rate per model (imports: torch).
  * ``opd_literate.experiment.train``: one method's loss, update and training loop (imports:
    torch).
  * ``opd_literate.experiment.run``: the study, OPD against off-policy distillation and RL:
    the teacher, the weak students, every method, the gradient agreement (imports: torch).
  * ``opd_literate.experiment._cache``: the teacher cache's verified, atomic, locked file
    (imports: torch, filelock).
  * ``opd_literate.experiment._workers``: the worker processes, the progress bar and the
    signals that stop them (imports: torch, tqdm; tqdm only when a progress bar is asked for).
  * ``opd_literate.experiment.stats``: bootstrap intervals, the headline and the ratios, from a
    results dictionary (imports: numpy).
  * ``opd_literate.experiment.plots``: the experiment's figures (imports: matplotlib; imported
    only when a plot is asked for).
  * ``opd_literate.experiment.cli``: ``python -m opd_literate.experiment``
    (``opd-experiment``), the command line (imports: nothing).

* ``opd_literate.course``: the course tools.

  * ``opd_literate.course.markers``: the solution markers, and the student text without the
    solutions (imports: nothing).
  * ``opd_literate.course.labs``: the labs, and the student's folder (modules with TODO stubs,
    tests, a README, or a notebook nbgrader accepts) rendered from this source; the lab tests as
    package data (imports: nothing).
  * ``opd_literate.course.grade``: the grader, task by task: the student's functions run in
    the sandbox, the verdict is computed in the grader's process (imports: numpy).
  * ``opd_literate.course.cases``: the grading cases, one per lab test and task: the calls the
    sandbox makes and the judge of what comes back (imports: numpy, torch).
  * ``opd_literate.course._runner``: the grading runner, a program the grader copies into the
    sandbox and runs there (imports: numpy, torch; never this package).
  * ``opd_literate.course.sandbox``: the operating-system sandbox the grader runs student
    code in: bubblewrap, resource limits, capped output (imports: nothing).
  * ``opd_literate.course.cli``: ``python -m opd_literate.course`` (``opd-handout``) writes or
    grades labs (imports: nothing).
  * ``opd_literate.course.gradescope``: a lab's Gradescope autograder zip, and the program
    that grades one submission inside it (imports: nothing).
  * ``opd_literate.course.handouts``: a lab written to a folder in any of its formats (files,
    notebook, Gradescope, nbgrader), and replaced only where this tool wrote it (imports:
    nothing).
  * ``opd_literate.course.lift``: ``opd-copy NAME`` prints a public function with every
    helper, constant and import it needs, to lift into course material (imports: nothing).

* ``opd_literate._figures``: the one style of every static figure, at the site's column width,
  as SVG (imports: matplotlib; only when a figure is drawn).
* ``opd_literate._files``: files written whole (a new file renamed over the old), for the
  teacher cache, the experiment's records and the grader's reports (imports: nothing).

All of them share the argument checks and numerics of ``opd_literate._numerics``, which loads
torch only when a torch tensor is checked: the numpy modules never load torch.
Importing the package, or one of its chapter packages, runs nothing and imports no submodule.
"""

__version__ = "0.1.0"
