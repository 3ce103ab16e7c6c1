"""Inputs and float64 references shared by the OPD chapter's test modules: random logits from a
seeded generator, per-token log-probabilities, a full mask, and the KL written out by hand."""

import torch

D = torch.float64


def _logits(B=2, T=3, V=4, seed=0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g, dtype=D).to(dtype)


def _logp(B=2, T=3, seed=0):
    return torch.log_softmax(_logits(B, T, 4, seed), -1)[..., 0]


ONES = torch.ones(2, 3)


def _softmax_logs(z):
    z = z.to(D)
    return z - torch.logsumexp(z, -1, keepdim=True)


def _kl(log_a, log_b):
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _grad_of(fn, z):
    z = z.detach().clone().requires_grad_(True)
    fn(z).backward()
    return z.grad
