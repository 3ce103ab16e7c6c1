r"""tinylm: a tiny autoregressive language model for two-digit addition, sized for a CPU.

**The task.** A prompt is ``"ab+cd="`` with two zero-padded two-digit numbers; the answer is
the decimal digits of the sum, most significant first, then ``<eos>``: ``"07+05="`` ->
``"12<eos>"``, ``"99+99="`` -> ``"198<eos>"``. Answers have 2 to 4 tokens, so
``MAX_ANSWER = 4`` positions hold any answer with its ``<eos>``. Writing the most significant
digit first is the hard order: the first digit depends on a carry that has not been written
yet, and every later digit is predicted *given the digits already written*. A model that gets
the first digit wrong is then in a state it has never seen during supervised training (a
prefix that is not the start of the correct sum), and its later tokens are unreliable: the
compounding error that on-policy distillation addresses. With ``digits=3`` (the experiment's
second regime) the prompt is ``"abc+def="`` and answers have up to ``digits + 2 = 5`` tokens;
the constants ``PROMPT_LEN`` and ``MAX_ANSWER`` describe the two-digit default.

**The model.** A next-token MLP over a fixed window: the 6 prompt tokens and the at most 3
answer tokens already written (``<pad>`` where there are none), each embedded, plus an
embedding of the answer position, concatenated and passed through an MLP to $V = 14$ logits.
It is autoregressive (each answer token conditions on the previous ones) and small enough
that a rollout of 64 answers by the experiment's student (sampling, then the teacher-forced
pass with gradient) takes about 2 ms on one CPU thread (2.15 ms, the fastest of 200, on the
project's 2-core machine; ``benchmarks/bench_experiment.py`` prints it).
[opd_literate.experiment.tinylm.EnsembleLM][] runs many such students as one model. The teacher is a
wider, well-trained copy; the student is narrower and briefly trained.

**What the OPD functions take.** [opd_literate.experiment.tinylm.rollout][] samples answers and
returns exactly the inputs of [opd_literate.opd.reverse_kl_rewards][],
[opd_literate.opd.opd_pg_loss][] and [opd_literate.opd.full_vocab_reverse_kl][]: tokens
``(B, T)``, the student's log-probs ``(B, T)`` with gradient, its logits ``(B, T, V)`` with
gradient, and the mask ``(B, T)`` (1 up to and including ``<eos>``, 0 after).
[opd_literate.experiment.tinylm.score][] is the teacher pass over the student's tokens, without
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..opd import full_vocab_reverse_kl

__all__ = [
    "VOCAB",
    "PAD",
    "EOS",
    "PLUS",
    "EQUALS",
    "V",
    "PROMPT_LEN",
    "MAX_ANSWER",
    "encode",
    "decode",
    "make_prompts",
    "answer_tokens",
    "answer_mask",
    "TinyLM",
    "EnsembleLM",
    "Rollout",
    "rollout",
    "sample_tokens",
    "score",
    "token_logp",
    "greedy_accuracy",
    "reverse_kl_on_own_samples",
    "supervised_loss",
]

VOCAB = [str(d) for d in range(10)] + ["+", "=", "<eos>", "<pad>"]
"""Tokens: the ten digits, then "+", "=", "<eos>", "<pad>"."""
PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13
V = len(VOCAB)
PROMPT_LEN = 6
"""The prompt ``ab+cd=`` has six tokens."""
MAX_ANSWER = 4
"""Answer positions: up to three digits and <eos>."""


def encode(text):
    """Token ids of a string of digits, ``+``, ``=``, ``<eos>`` and ``<pad>``.

    Examples
    --------
    >>> encode("07+05=12<eos>")
    [0, 7, 10, 0, 5, 11, 1, 2, 12]
    >>> decode(encode("99+99=198<eos>")) == "99+99=198<eos>"
    True
    """
    ids, i = [], 0
    while i < len(text):
        for special, token_id in (("<eos>", EOS), ("<pad>", PAD)):
            if text.startswith(special, i):
                ids.append(token_id)
                i += len(special)
                break
        else:
            char = text[i]
            if char not in VOCAB:
                raise ValueError(f"cannot encode {char!r} at position {i} of {text!r}")
            ids.append(VOCAB.index(char))
            i += 1
    return ids


def decode(ids):
    """The string of a sequence of token ids (``<pad>`` included)."""
    return "".join(VOCAB[int(i)] for i in ids)


def make_prompts(pairs, digits=2):
    """``(..., 2 digits + 2)`` prompt tokens for a ``(..., 2)`` tensor of operands with at most
    ``digits`` digits (zero-padded): ``"ab+cd="`` for two digits, ``"abc+def="`` for three.

    Examples
    --------
    >>> decode(make_prompts(torch.tensor([[7, 5]]))[0])
    '07+05='
    >>> decode(make_prompts(torch.tensor([[7, 105]]), digits=3)[0])
    '007+105='
    """
    a, b = pairs[..., 0], pairs[..., 1]

    def written(x):  # the digits of x, most significant first: (..., digits)
        return torch.stack([(x // 10 ** k) % 10 for k in range(digits - 1, -1, -1)], dim=-1)

    return torch.cat([written(a), torch.full_like(a, PLUS)[..., None], written(b),
                      torch.full_like(a, EQUALS)[..., None]], dim=-1)


def answer_tokens(pairs, digits=2):
    """``(..., digits + 2)`` correct answers: the digits of a + b, ``<eos>``, then ``<pad>``.

    Examples
    --------
    >>> [decode(row) for row in answer_tokens(torch.tensor([[7, 5], [99, 99], [0, 3]]))]
    ['12<eos><pad>', '198<eos>', '3<eos><pad><pad>']
    >>> decode(answer_tokens(torch.tensor([[999, 999]]), digits=3)[0])
    '1998<eos>'
    """
    total = pairs[..., 0] + pairs[..., 1]  # (...) in [0, 2 * 10^digits - 2]
    # number of digits of the sum: 1 + [total >= 10] + [total >= 100] + ...
    n = 1 + sum((total >= 10 ** k).long() for k in range(1, digits + 1))
    columns = []
    for j in range(digits + 2):  # answer position j
        # position j < n holds the digit of 10^(n - 1 - j); position n holds <eos>
        power = torch.pow(10, (n - 1 - j).clamp_min(0))
        digit = (total // power) % 10
        columns.append(torch.where(j < n, digit, torch.where(j == n, EOS, PAD)))
    return torch.stack(columns, dim=-1)


def answer_mask(tokens):
    r"""1 up to and including the first ``<eos>``, 0 after it (float, ``(..., T)``).

    An answer without ``<eos>`` in its ``MAX_ANSWER`` tokens is kept whole (it was cut off).

    Examples
    --------
    >>> answer_mask(torch.tensor([encode("12<eos><pad>"), encode("3<eos>7<eos>")])).tolist()
    [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    """
    is_eos = tokens == EOS
    # eos seen strictly before position t: the cumulative count, shifted right by one
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return (eos_before == 0).float()


class TinyLM(nn.Module):
    """Next-token MLP over (prompt, answer so far, position).

    Parameters
    ----------
    hidden : int
        Width of each hidden layer.
    layers : int
        Number of hidden layers.
    embed : int
        Token embedding size.
    digits : int
        Operand digits of the task: 2 (the experiment's default, answers of up to
        ``MAX_ANSWER = 4`` tokens) or more (answers of up to ``digits + 2`` tokens).
    """

    def __init__(self, hidden=64, layers=1, embed=16, digits=2):
        super().__init__()
        self.digits, self.max_answer = digits, digits + 2
        self.token_embedding = nn.Embedding(V, embed)
        self.position_embedding = nn.Embedding(self.max_answer, embed)
        # the prompt (2 digits + 2 tokens), the answer so far, and the position
        width = (2 * digits + 2 + self.max_answer - 1 + 1) * embed
        blocks = []
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.mlp = nn.Sequential(*blocks, nn.Linear(width, V))

    @staticmethod
    def context_at(prompts, answers, t):
        """The context of answer position ``t``, ``(..., 9)``: the prompt, ``answers[..., :t]``
        (the tokens already written), then ``<pad>``. Any leading dimensions (``(B,)``, or
        ``(M, B)`` for an [opd_literate.experiment.tinylm.EnsembleLM][])."""
        T = answers.shape[-1]  # the answer positions, MAX_ANSWER for two-digit operands
        padding = torch.full((*prompts.shape[:-1], T - 1 - t), PAD, dtype=torch.long,
                             device=prompts.device)
        return torch.cat([prompts, answers[..., :t], padding], dim=-1)

    def window(self, prompts, answers):
        """Contexts for every answer position: ``(..., T, 9)`` token ids (teacher forcing)."""
        return torch.stack([self.context_at(prompts, answers, t)
                            for t in range(answers.shape[-1])], dim=-2)

    def forward(self, context, position):
        """Logits ``(..., V)`` for contexts ``(..., 9)`` at answer positions ``(...)``."""
        slots = self.token_embedding(context).flatten(-2)  # (..., 9 * embed)
        features = torch.cat([slots, self.position_embedding(position)], dim=-1)
        return self.mlp(features)

    def logits(self, prompts, answers):
        """Teacher-forced logits ``(..., T, V)`` of every answer position, in one batched call."""
        T = answers.shape[-1]
        positions = torch.arange(T, device=prompts.device).expand(*prompts.shape[:-1], T)
        return self(self.window(prompts, answers), positions)


class EnsembleLM(TinyLM):
    r"""``M`` independent TinyLMs of one shape, stored as stacked weights and run as one model.

    Every weight has a leading model dimension: embeddings ``(M, V, E)``, each linear layer a
    matrix ``(M, in, out)`` and a bias ``(M, out)``. A forward pass takes contexts
    ``(M, ..., 9)``, one batch per model, and computes every layer of every model with one
    batched matrix product,

    $$
    h^{(m)}_{\ell+1} = \mathrm{GELU}\big(h^{(m)}_\ell W^{(m)}_\ell + b^{(m)}_\ell\big),
    \qquad m = 1, \dots, M,
    $$

    so the ``M`` models cost one call per layer instead of ``M``. No weight is shared: the
    gradient of $\sum_m \mathcal{L}_m$ with respect to model $m$'s weights is the gradient of
    $\mathcal{L}_m$ alone, and a per-element optimizer such as Adam trains each model exactly
    as it would alone. [opd_literate.experiment.tinylm.sample_tokens][],
    [opd_literate.experiment.tinylm.rollout][] and ``logits`` take ``(M, B, 6)`` prompts and return
    ``(M, B, ...)`` tensors.

    Parameters
    ----------
    models : int
        ``M``, the number of models.
    hidden, layers, embed : int
        As for [opd_literate.experiment.tinylm.TinyLM][].

    Examples
    --------
    Two TinyLMs stacked give, model by model, the logits each gives alone:

    >>> torch.manual_seed(0) is not None
    True
    >>> a, b = TinyLM(8, 1), TinyLM(8, 1)
    >>> ensemble = EnsembleLM.from_models([a, b])
    >>> prompts = make_prompts(torch.tensor([[1, 2], [40, 50]]))
    >>> answers = answer_tokens(torch.tensor([[1, 2], [40, 50]]))
    >>> stacked = ensemble.logits(torch.stack([prompts, prompts]), torch.stack([answers] * 2))
    >>> stacked.shape
    torch.Size([2, 2, 4, 14])
    >>> torch.allclose(stacked[1], b.logits(prompts, answers), atol=1e-6)
    True
    """

    def __init__(self, models, hidden=64, layers=1, embed=16, digits=2):
        nn.Module.__init__(self)
        self.models, self.embed = models, embed
        self.digits, self.max_answer = digits, digits + 2
        # The parameters are made on the CPU and moved by .to(device), like TinyLM's nn.Embedding
        # and nn.Linear (the nn.Module convention).
        # CPU by design: a parameter
        self.token_embedding = nn.Parameter(torch.zeros(models, V, embed))
        # CPU by design: a parameter
        self.position_embedding = nn.Parameter(torch.zeros(models, self.max_answer, embed))
        widths = [(2 * digits + 2 + self.max_answer) * embed] + [hidden] * layers + [V]
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.zeros(models, n_in, n_out))  # CPU by design: a parameter
             for n_in, n_out in zip(widths[:-1], widths[1:])])
        self.biases = nn.ParameterList(
            [nn.Parameter(torch.zeros(models, n_out))  # CPU by design: a parameter
             for n_out in widths[1:]])

    @classmethod
    def from_models(cls, models):
        """Stack the weights of TinyLMs of one shape (copies: the ensemble owns its weights)."""
        first = models[0]
        linears = [m for m in first.mlp if isinstance(m, nn.Linear)]
        ensemble = cls(len(models), linears[0].out_features, len(linears) - 1,
                       first.token_embedding.embedding_dim, first.digits)
        with torch.no_grad():
            ensemble.token_embedding.copy_(torch.stack([m.token_embedding.weight for m in models]))
            ensemble.position_embedding.copy_(
                torch.stack([m.position_embedding.weight for m in models]))
            for i in range(len(linears)):
                layer = [[x for x in m.mlp if isinstance(x, nn.Linear)][i] for m in models]
                ensemble.weights[i].copy_(torch.stack([x.weight.T for x in layer]))
                ensemble.biases[i].copy_(torch.stack([x.bias for x in layer]))
        return ensemble

    def member(self, m):
        """Model ``m`` as a plain [opd_literate.experiment.tinylm.TinyLM][] (copied weights)."""
        hidden, layers = self.weights[0].shape[2], len(self.weights) - 1
        model = TinyLM(hidden, layers, self.embed, self.digits)
        linears = [x for x in model.mlp if isinstance(x, nn.Linear)]
        with torch.no_grad():
            model.token_embedding.weight.copy_(self.token_embedding[m])
            model.position_embedding.weight.copy_(self.position_embedding[m])
            for linear, weight, bias in zip(linears, self.weights, self.biases):
                linear.weight.copy_(weight[m].T)
                linear.bias.copy_(bias[m])
        return model

    def forward(self, context, position):
        """Logits ``(M, ..., V)`` for contexts ``(M, ..., 9)`` at positions ``(M, ...)``.

        A one-model ensemble takes contexts ``(..., 9)`` with any leading dimensions and
        returns ``(..., V)``, as a [opd_literate.experiment.tinylm.TinyLM][] does (the frozen
        teacher of the experiment runs this way).
        """
        if self.models == 1 and (context.ndim < 3 or context.shape[0] != 1):
            return self(context[None], position[None])[0]
        M, lead = context.shape[0], context.shape[1:-1]
        if M != self.models:
            raise ValueError(f"context must have a leading model dimension of {self.models}, "
                             f"got shape {tuple(context.shape)}")
        # The first layer over the concatenated slot embeddings splits by slot:
        #   [e(c_1), ..., e(c_9), e_pos(t)] W = sum_j e(c_j) W_j + e_pos(t) W_10,
        # so a table of every (slot, token) row times its block W_j (9 V + T rows per model,
        # cheap to build) turns the widest matrix product into a gather and a sum.
        slots = context.shape[-1]  # prompt and answer so far: 9 for two-digit operands
        blocks = self.weights[0].view(M, slots + 1, self.embed, -1)  # (M, 10, E, H)
        token_rows = torch.einsum("mve,mseh->msvh", self.token_embedding, blocks[:, :slots])
        position_rows = torch.einsum("mte,meh->mth", self.position_embedding, blocks[:, slots])
        rows_per_model = slots * V + self.max_answer
        table = torch.cat([token_rows.reshape(M, slots * V, -1), position_rows], dim=1)
        # Row of (model m, slot j, token v): m * rows_per_model + j * V + v; position t after.
        context = context.reshape(M, -1, slots)
        model_offset = torch.arange(M, device=context.device).view(M, 1, 1) * rows_per_model
        index = torch.cat([context + torch.arange(slots, device=context.device) * V + model_offset,
                           position.reshape(M, -1, 1) + slots * V + model_offset], dim=-1)
        h = F.embedding_bag(index.reshape(-1, slots + 1), table.reshape(M * rows_per_model, -1),
                            mode="sum").view(M, index.shape[1], -1) + self.biases[0][:, None, :]
        for weight, bias in zip(self.weights[1:], self.biases[1:]):
            # h W + b for every model at once: (M, N, in) @ (M, in, out) -> (M, N, out)
            h = torch.baddbmm(bias[:, None, :], F.gelu(h), weight)
        return h.reshape(M, *lead, V)


@dataclass
class Rollout:
    """What the OPD losses take. Shapes: B prompts, T = MAX_ANSWER, V = 14."""

    prompts: torch.Tensor  # (B, 6) long
    tokens: torch.Tensor  # (B, T) long, <pad> after <eos>
    logp: torch.Tensor  # (B, T) log pi_theta(y_t | s_t), with gradient
    logits: torch.Tensor  # (B, T, V), with gradient
    mask: torch.Tensor  # (B, T) float: 1 up to and including <eos>


@torch.no_grad()
def sample_tokens(model, prompts, generator=None, greedy=False):
    """Sample (or greedily decode) answers without gradient: ``(tokens, mask)``, ``(..., T)``.

    ``prompts`` is ``(B, 6)``, or ``(M, B, 6)`` for an
    [opd_literate.experiment.tinylm.EnsembleLM][].
    """
    lead = prompts.shape[:-1]  # (B,) or (M, B)
    tokens = torch.full((*lead, model.max_answer), PAD, dtype=torch.long, device=prompts.device)
    for t in range(model.max_answer):
        context = model.context_at(prompts, tokens, t)  # reads tokens[..., :t] only
        position = torch.full(lead, t, dtype=torch.long, device=prompts.device)
        logits = model(context, position)  # (..., V)
        if greedy:
            tokens[..., t] = logits.argmax(-1)
        else:
            probs = F.softmax(logits, -1).reshape(-1, V)
            tokens[..., t] = torch.multinomial(probs, 1, generator=generator).reshape(lead)
    mask = answer_mask(tokens)
    # After <eos> the response is over: store <pad> so no later position reads a stray token.
    tokens = torch.where(mask.bool(), tokens, torch.full_like(tokens, PAD))
    return tokens, mask


def rollout(model, prompts, generator=None, greedy=False):
    """Sample answers from ``model`` and recompute their log-probs with gradient.

    Sampling runs without gradient, one position at a time; the log-probs and logits are then
    recomputed for all positions in one teacher-forced pass *with* gradient, which is what a
    trainer does with the inference engine's tokens.

    Examples
    --------
    >>> model = TinyLM()
    >>> out = rollout(model, make_prompts(torch.tensor([[1, 2], [40, 50]])),
    ...               torch.Generator().manual_seed(0))
    >>> out.tokens.shape, out.logp.shape, out.logits.shape, out.mask.shape
    (torch.Size([2, 4]), torch.Size([2, 4]), torch.Size([2, 4, 14]), torch.Size([2, 4]))
    >>> torch.allclose(out.logp, torch.log_softmax(out.logits, -1).gather(
    ...     -1, out.tokens[..., None])[..., 0])
    True
    """
    tokens, mask = sample_tokens(model, prompts, generator, greedy)
    logits = model.logits(prompts, tokens)  # (B, T, V), with gradient
    return Rollout(prompts, tokens, token_logp(logits, tokens), logits, mask)


def token_logp(logits, tokens):
    """``log_softmax(logits)`` at the given tokens: ``(B, T, V)``, ``(B, T)`` -> ``(B, T)``."""
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


@torch.no_grad()
def score(teacher, prompts, tokens):
    """The teacher pass: its log-probs ``(B, T)`` and logits ``(B, T, V)`` of given tokens.

    No gradient: the teacher is frozen, and what it returns is data for the student's loss.
    """
    logits = teacher.logits(prompts, tokens)
    return token_logp(logits, tokens), logits


def supervised_loss(model, prompts, targets, label_smoothing=0.0):
    r"""Token-mean cross-entropy of ``targets`` ``(B, T)`` up to and including ``<eos>``.

    With label smoothing $\varepsilon$ the target of each position is
    $(1 - \varepsilon)\, e_{y_t} + \varepsilon / V$, so the model never drives the
    log-probability of an alternative token towards $-\infty$.
    """
    log_probs = torch.log_softmax(model.logits(prompts, targets), -1)  # (B, T, V)
    nll = -log_probs.gather(-1, targets[..., None])[..., 0]  # (B, T)
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * log_probs.mean(-1)
    mask = answer_mask(targets)
    return (nll * mask).sum() / mask.sum()


@torch.no_grad()
def greedy_accuracy(model, pairs):
    """Fraction of prompts whose greedy answer is exactly right (digits and ``<eos>``)."""
    tokens, _ = sample_tokens(model, make_prompts(pairs, model.digits), None, greedy=True)
    return float((tokens == answer_tokens(pairs, model.digits)).all(dim=1).float().mean())


@torch.no_grad()
def reverse_kl_on_own_samples(student, teacher, pairs, generator):
    r"""Per-token $\mathrm{KL}(\pi_\theta \| \pi_T)$ at the states the student visits.

    One sampled answer per prompt; the exact KL over the vocabulary at each of its positions
    (up to and including ``<eos>``), averaged over tokens: the full-vocabulary OPD loss,
    evaluated.
    """
    prompts = make_prompts(pairs, student.digits)
    out = rollout(student, prompts, generator)
    _, teacher_logits = score(teacher, prompts, out.tokens)
    return float(full_vocab_reverse_kl(out.logits, teacher_logits, out.mask))
