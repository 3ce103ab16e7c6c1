"""tinylm: the sampler, the mask and the teacher pass give the OPD functions what they expect."""

from collections import Counter

import torch

from opd_literate.experiment import tinylm as lm
from opd_literate.opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards


def _model(seed=0, hidden=32):
    torch.manual_seed(seed)
    return lm.TinyLM(hidden=hidden, layers=1)


def _prompts(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lm.make_prompts(torch.randint(0, 100, (n, 2), generator=g))


def test_answers_are_the_sums():
    pairs = torch.cartesian_prod(torch.arange(100), torch.arange(100))
    answers = lm.answer_tokens(pairs)
    for (a, b), row in zip(pairs[::97].tolist(), answers[::97]):
        text = lm.decode(row).replace("<pad>", "")
        assert text == f"{a + b}<eos>"
    assert answers.shape == (10_000, lm.MAX_ANSWER)


def test_sampler_logp_is_log_softmax_of_its_logits_at_the_sampled_tokens():
    model = _model()
    out = lm.rollout(model, _prompts(), torch.Generator().manual_seed(1))
    reference = torch.log_softmax(out.logits, -1)
    for b in range(out.tokens.shape[0]):
        for t in range(lm.MAX_ANSWER):
            assert out.logp[b, t].item() == reference[b, t, out.tokens[b, t]].item()
    assert out.logp.requires_grad and out.logits.requires_grad


def _plain_forward(model, prompts, tokens):
    """Teacher forcing written out here, one sequence and one position at a time, with no
    helper of the module: position t sees the prompt, ``tokens[:t]``, then ``<pad>``."""
    B = prompts.shape[0]
    logits = torch.empty(B, lm.MAX_ANSWER, lm.V)
    with torch.no_grad():
        for b in range(B):
            for t in range(lm.MAX_ANSWER):
                context = (prompts[b].tolist() + tokens[b, :t].tolist()
                           + [lm.PAD] * (lm.MAX_ANSWER - 1 - t))
                assert len(context) == lm.PROMPT_LEN + lm.MAX_ANSWER - 1
                logits[b, t] = model(torch.tensor(context), torch.tensor(t))
    return logits


def _sampler_vs_plain_forward(model, prompts, generator, greedy=False):
    """Sample with the sampler while recording the logits it computes at each step; return
    them ``(B, T, V)``, the plain forward's logits of the tokens it returned, the tokens and
    the mask. Up to and including ``<eos>`` the two must agree."""
    steps = []
    hook = model.register_forward_hook(lambda module, args, out: steps.append(out.clone()))
    try:
        tokens, mask = lm.sample_tokens(model, prompts, generator, greedy=greedy)
    finally:
        hook.remove()
    assert len(steps) == lm.MAX_ANSWER  # one call per answer position
    return torch.stack(steps, dim=1), _plain_forward(model, prompts, tokens), tokens, mask


def test_the_sampler_draws_from_the_logits_of_its_own_prefix():
    """The logits the sampler computed at each position are those of an independent
    teacher-forced pass over the tokens it returned (so each conditions on the tokens sampled
    before it), and greedy decoding takes their argmax."""
    model = _model(2)
    prompts = _prompts(24, seed=3)
    own, plain, tokens, mask = _sampler_vs_plain_forward(model, prompts,
                                                         torch.Generator().manual_seed(4))
    inside = mask.bool()
    assert inside[:, 1:].sum() > 20  # positions after the first are compared too
    torch.testing.assert_close(own[inside], plain[inside], rtol=1e-5, atol=1e-5)
    own, plain, tokens, mask = _sampler_vs_plain_forward(model, prompts, None, greedy=True)
    inside = mask.bool()
    torch.testing.assert_close(own[inside], plain[inside], rtol=1e-5, atol=1e-5)
    assert (tokens[inside] == plain.argmax(-1)[inside]).all()


def test_the_check_catches_a_sampler_that_ignores_its_prefix(monkeypatch):
    """A sampler whose contexts leave out the answer written so far (every position sees the
    prompt and ``<pad>``) must fail the comparison above at the later positions."""

    def prefix_blind(prompts, answers, t):
        return torch.cat([prompts, torch.full((prompts.shape[0], lm.MAX_ANSWER - 1), lm.PAD)],
                         dim=1)

    monkeypatch.setattr(lm.TinyLM, "context_at", staticmethod(prefix_blind))
    model = _model(2)
    own, plain, _, mask = _sampler_vs_plain_forward(model, _prompts(24, seed=3),
                                                    torch.Generator().manual_seed(4))
    inside = mask.bool()
    torch.testing.assert_close(own[:, 0], plain[:, 0], rtol=1e-5, atol=1e-5)  # no prefix yet
    gap = (own - plain).abs().amax(-1)[:, 1:][inside[:, 1:]]
    assert gap.max() > 0.1  # the check above fails for this sampler


def test_sampled_token_frequencies_match_the_plain_forward_probabilities():
    """20,000 answers to one prompt: at every position and prefix seen at least 1,000 times,
    each token's frequency is within 5 standard errors, sqrt(p (1 - p) / n), of its
    probability under the plain forward. A sampler that ignored its prefix, or sampled from
    the wrong position, would be off by far more at the later positions."""
    model = _model(5)
    n = 20_000
    prompt = lm.make_prompts(torch.tensor([[37, 48]]))
    tokens, mask = lm.sample_tokens(model, prompt.expand(n, -1),
                                    torch.Generator().manual_seed(6))
    checked = 0
    for t in range(lm.MAX_ANSWER):
        live = mask[:, t].bool()  # sequences still going at position t
        for prefix, count in Counter(map(tuple, tokens[live, :t].tolist())).items():
            if count < 1000:
                continue
            rows = live & (tokens[:, :t] == torch.tensor(prefix, dtype=torch.long)).all(dim=1)
            frequency = torch.bincount(tokens[rows, t], minlength=lm.V).double() / count
            answer = torch.tensor([list(prefix) + [lm.PAD] * (lm.MAX_ANSWER - t)])
            probs = torch.softmax(_plain_forward(model, prompt, answer)[0, t].double(), -1)
            bound = 5 * (probs * (1 - probs) / count).sqrt() + 1e-9
            assert ((frequency - probs).abs() <= bound).all(), (t, prefix)
            checked += 1
    assert checked >= 4  # several positions and prefixes, not only the first token


def test_teacher_pass_equals_the_plain_forward():
    """``score``: the teacher's logits and log-probs of given tokens are the plain forward's."""
    teacher = _model(1, hidden=64)
    prompts = _prompts(16, seed=7)
    tokens, _ = lm.sample_tokens(_model(0), prompts, torch.Generator().manual_seed(8))
    logp, logits = lm.score(teacher, prompts, tokens)
    plain = _plain_forward(teacher, prompts, tokens)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)
    expected = torch.log_softmax(plain.double(), -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(logp.double(), expected, rtol=1e-5, atol=1e-5)


def test_mask_includes_eos_and_nothing_after():
    tokens = torch.tensor([lm.encode("1<eos>23"), lm.encode("12<eos><pad>"),
                           lm.encode("123<eos>"), lm.encode("1234")])
    assert lm.answer_mask(tokens).tolist() == [
        [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    model = _model()
    out = lm.rollout(model, _prompts(), torch.Generator().manual_seed(5))
    after_eos = out.mask == 0
    assert (out.tokens[after_eos] == lm.PAD).all()
    has_eos = (out.tokens == lm.EOS).any(1)
    assert (out.mask.sum(1)[has_eos] == (out.tokens == lm.EOS).float().argmax(1)[has_eos] + 1).all()


def test_nothing_after_eos_contributes_to_any_loss():
    model, teacher = _model(0), _model(1, hidden=64)
    prompts = _prompts(32)
    out = lm.rollout(model, prompts, torch.Generator().manual_seed(6))
    t_logp, t_logits = lm.score(teacher, prompts, out.tokens)
    after = out.mask == 0
    assert after.any()
    garbage_logits = torch.where(after[..., None], torch.randn_like(out.logits) * 50, out.logits)
    garbage_logp = torch.where(after, torch.full_like(out.logp, -1e9), out.logp)
    garbage_t = torch.where(after, torch.full_like(t_logp, 123.0), t_logp)
    r1 = reverse_kl_rewards(out.logp, t_logp, out.mask)
    r2 = reverse_kl_rewards(garbage_logp, garbage_t, out.mask)
    torch.testing.assert_close(opd_pg_loss(out.logp, r1, out.mask),
                               opd_pg_loss(garbage_logp, r2, out.mask))
    torch.testing.assert_close(full_vocab_reverse_kl(out.logits, t_logits, out.mask),
                               full_vocab_reverse_kl(garbage_logits, t_logits, out.mask))
    # The gradient reaches no logit after <eos>.
    model.zero_grad()
    logits = out.logits.detach().requires_grad_(True)
    full_vocab_reverse_kl(logits, t_logits, out.mask).backward()
    assert (logits.grad[after] == 0).all()


def test_teacher_pass_carries_no_gradient():
    teacher = _model(1)
    prompts = _prompts(8)
    tokens, _ = lm.sample_tokens(_model(0), prompts, torch.Generator().manual_seed(0))
    logp, logits = lm.score(teacher, prompts, tokens)
    assert not logp.requires_grad and not logits.requires_grad
    assert all(p.grad is None for p in teacher.parameters())


def test_greedy_accuracy_of_a_perfect_model_is_one():
    """A model whose logits are the right answer (built by hand) scores 1."""

    class Oracle(lm.TinyLM):
        def forward(self, context, position):
            a = context[..., 0] * 10 + context[..., 1]
            b = context[..., 3] * 10 + context[..., 4]
            answers = lm.answer_tokens(torch.stack([a.flatten(), b.flatten()], 1))
            target = answers.gather(1, position.flatten()[:, None])[:, 0]
            return (torch.nn.functional.one_hot(target, lm.V).float() * 20).reshape(
                *position.shape, lm.V)

    pairs = torch.randint(0, 100, (200, 2), generator=torch.Generator().manual_seed(0))
    assert lm.greedy_accuracy(Oracle(), pairs) == 1.0
    assert lm.greedy_accuracy(_model(), pairs) < 0.2


def test_three_digit_prompts_and_answers_are_the_written_sums():
    """The second regime: every answer of a sample of three-digit pairs is str(a + b) and
    <eos>, padded to digits + 2 = 5 tokens; the prompt is the zero-padded operands."""
    g = torch.Generator().manual_seed(0)
    pairs = torch.cat([torch.randint(0, 1000, (300, 2), generator=g),
                       torch.tensor([[0, 0], [999, 999], [1, 9], [500, 500], [99, 1]])])
    answers, prompts = lm.answer_tokens(pairs, digits=3), lm.make_prompts(pairs, digits=3)
    assert answers.shape == (305, 5) and prompts.shape == (305, 8)
    for (a, b), answer, prompt in zip(pairs.tolist(), answers, prompts):
        assert lm.decode(answer).replace("<pad>", "") == f"{a + b}<eos>"
        assert lm.decode(prompt) == f"{a:03d}+{b:03d}="


def test_three_digit_models_roll_out_five_positions_and_stack():
    torch.manual_seed(0)
    models = [lm.TinyLM(16, 1, digits=3) for _ in range(2)]
    pairs = torch.randint(0, 1000, (2, 12, 2), generator=torch.Generator().manual_seed(1))
    prompts = lm.make_prompts(pairs, digits=3)
    out = lm.rollout(models[0], prompts[0], torch.Generator().manual_seed(2))
    assert out.tokens.shape == (12, 5) and out.logits.shape == (12, 5, lm.V)
    ensemble = lm.EnsembleLM.from_models(models)
    answers = lm.answer_tokens(pairs, digits=3)
    stacked = ensemble.logits(prompts, answers)
    torch.testing.assert_close(stacked[1], models[1].logits(prompts[1], answers[1]),
                               rtol=1e-5, atol=1e-5)
