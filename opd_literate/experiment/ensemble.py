r"""Training many students as one: the ensemble's loss and its optimizer.

The students of one method (seeds times learning rates) are one
[opd_literate.experiment.tinylm.EnsembleLM][] whose weights carry a leading model dimension
``M``. Two pieces keep each model's training what it would be alone: the loss is the *sum* of
the models' own losses (so model ``m``'s gradient is that of its loss only), and
[opd_literate.experiment.ensemble.BatchedAdam][] is Adam with one learning rate per model.
This is speed work only: ``benchmarks/bench_experiment.py`` measures it against a loop of
models, and ``tests/experiment/test_batched_ensemble.py`` checks that it changes no weight.
"""

from __future__ import annotations

import torch

from . import tinylm as lm

__all__ = ["BatchedAdam", "sum_of_model_losses", "summed_cross_entropy"]


def sum_of_model_losses(batched, loss_fn, *tensors):
    """``loss_fn`` of one model's ``(B, ...)`` tensors; for the ``(M, B, ...)`` tensors of an
    ensemble (``batched``), the sum over models of each model's own loss (its own token-mean
    normaliser), so that model ``m``'s gradient is that of its loss alone."""
    if not batched:
        return loss_fn(*tensors)
    return sum(loss_fn(*(t[m] for t in tensors)) for m in range(tensors[0].shape[0]))


def summed_cross_entropy(ensemble, prompts, targets):
    r"""Each model's token-mean cross-entropy of ``targets`` (``(M, B, T)``), summed over models.

    $$
    \sum_m \frac{\sum_{b,t} \text{mask}_{m,b,t}\,(-\log p_m(y_{m,b,t}))}
    {\sum_{b,t} \text{mask}_{m,b,t}}
    $$
    """
    log_probs = torch.log_softmax(ensemble.logits(prompts, targets), -1)
    nll = -log_probs.gather(-1, targets[..., None])[..., 0]  # (M, B, T)
    mask = lm.answer_mask(targets)
    return ((nll * mask).sum((1, 2)) / mask.sum((1, 2))).sum()


class BatchedAdam:
    r"""Adam over an ensemble's stacked weights, with one learning rate per model.

    The update of each element is torch's Adam (no weight decay, no amsgrad):

    $$
    m \leftarrow \beta_1 m + (1 - \beta_1) g,\quad
    v \leftarrow \beta_2 v + (1 - \beta_2) g^2,\quad
    \theta \leftarrow \theta - \frac{\eta_m s_k}{1 - \beta_1^k}\,
    \frac{m}{\sqrt{v / (1 - \beta_2^k)} + \epsilon},
    $$

    with $\eta_m$ the learning rate of model $m$ (the leading index of every weight) and
    $s_k$ the warm-up factor of step $k$. Adam is per element, so each model is updated as
    ``torch.optim.Adam`` would update it alone.
    """

    def __init__(self, params, lrs, betas=(0.9, 0.999), eps=1e-8):
        self.params = list(params)
        # (M,), on the weights' device: the step multiplies them
        self.lrs = torch.as_tensor(lrs, dtype=torch.float32, device=self.params[0].device)
        self.betas, self.eps, self.k = betas, eps, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, scale=1.0):
        self.k += 1
        beta1, beta2 = self.betas
        correction1, correction2 = 1 - beta1 ** self.k, 1 - beta2 ** self.k
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denominator = (v.sqrt() / correction2 ** 0.5).add_(self.eps)
            step_size = (self.lrs * scale / correction1).view(-1, *[1] * (p.ndim - 1))
            p.sub_(step_size * m / denominator)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
