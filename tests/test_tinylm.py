"""tinylm: the sampler, the mask and the teacher pass give the OPD functions what they expect."""

import torch

from opd_literate import tinylm as lm
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


def test_teacher_forced_logits_equal_the_step_by_step_sampler_logits():
    """The recomputed logits must be those the sampler drew from (no train-inference gap)."""
    model = _model(2)
    prompts = _prompts(16, seed=3)
    g = torch.Generator().manual_seed(4)
    tokens, mask = lm.sample_tokens(model, prompts, g)
    with torch.no_grad():
        forced = model.logits(prompts, tokens)
        for t in range(lm.MAX_ANSWER):
            step = model(model.window(prompts, tokens)[:, t],
                         torch.full((16,), t, dtype=torch.long))
            torch.testing.assert_close(forced[:, t], step)


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
