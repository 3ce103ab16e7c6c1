"""The (B, T) batches the torch forms of the rollout corrections are tested on: a toy's
enumerated responses, and random batches of log-probabilities with a length each."""

import numpy as np
import torch

from opd_literate.mismatch.toy import response_mask


def as_batch(toy):
    """The toy as a float64 (M, T) batch of all its responses: ``(trainer, sampler, mask)``."""
    return (torch.from_numpy(np.array(toy["logp_train"])),
            torch.from_numpy(np.array(toy["logp_sampler"])),
            torch.from_numpy(response_mask(toy)))


def random_batch(seed, B=64, T=7, scale=0.15):
    """``(trainer, sampler, mask, advantages)``, float64: trainer log-probabilities in
    ``[log 0.02, log 0.99]``, the sampler's off by Gaussian noise of ``scale`` (at most
    ``-1e-3``), a random length in ``[1, T]`` per response, one advantage per response."""
    g = torch.Generator().manual_seed(seed)
    trainer = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.97 + 0.02)
    sampler = (trainer - scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(
        max=-1e-3)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return trainer, sampler, mask, advantages
