"""docs/integration.md, run: its code blocks against the installed TRL, its verl table.

The page's ``python`` blocks are read from the page and run in order, so the page shows exactly
the code tested here. TRL is an optional extra (``pip install -e ".[trl]"``); without it the TRL
tests skip and say so. Nothing may leave the machine: the Hugging Face offline and telemetry
switches are set before ``transformers`` is imported, ``report_to="none"``, and every socket
connection to an address other than the loopback is refused and recorded.
"""

import ast
import inspect
import json
import os
import pathlib
import re
import socket

import pytest

# Deselected by the default run (pyproject's addopts); .ci/run runs them as their own step.
pytestmark = pytest.mark.trl

# Before transformers / huggingface_hub are imported: they read these at import time.
for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                      "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                      "WANDB_DISABLED": "true", "WANDB_MODE": "disabled"}.items():
    os.environ[_name] = _value

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "integration.md").read_text()
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "verl_rollout_correction.json").read_text())


# ---------------------------------------------------------------------------------------------
# The verl table (no TRL needed)
# ---------------------------------------------------------------------------------------------
def _verl_table():
    header = "| opd_literate.mismatch.correction | verl option | verl default | default here |"
    lines = PAGE[PAGE.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def test_the_verl_table_names_real_options_with_their_defaults():
    from opd_literate.mismatch import correction

    verl_defaults = {**FIXTURE["rollout_correction_yaml_defaults"], **FIXTURE["actor_defaults"]}
    rows = _verl_table()
    assert len(rows) >= 15
    for ours, verl_name, verl_default, our_default in rows:
        function, parameter = ours.split(".")
        signature = inspect.signature(getattr(correction, function))
        assert parameter in signature.parameters, ours
        assert signature.parameters[parameter].default == ast.literal_eval(our_default), ours
        if verl_name == "none":
            assert verl_default == "", ours
            continue
        assert verl_name in verl_defaults, f"{verl_name} is not a verl option at the commit"
        assert verl_defaults[verl_name] == ast.literal_eval(verl_default), verl_name


def test_the_verl_table_covers_every_rollout_correction_option():
    listed = {verl for _, verl, _, _ in _verl_table()}
    yaml_keys = set(FIXTURE["rollout_correction_yaml_defaults"]) - {"bypass_mode", "loss_type"}
    assert yaml_keys <= listed  # bypass_mode and loss_type choose the loss: see the notes
    for text in ("bypass_mode", "loss_type: ppo_clip", "loss_type: reinforce"):
        assert text in PAGE


# ---------------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------------
def _python_blocks():
    return re.findall(r"^```python\n(.*?)^```", PAGE, flags=re.S | re.M)


@pytest.fixture(scope="module")
def no_network():
    """Refuse and record every connection to an address that is not this machine's loopback."""
    attempts = []
    original_connect, original_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def local(address):
        if not isinstance(address, tuple):  # a Unix socket path
            return True
        host = address[0]
        return host in ("localhost", "::1") or str(host).startswith("127.")

    def guarded(original):
        def connect(self, address):
            if not local(address):
                attempts.append(address)
                raise OSError(f"test_integration_trl: connection to {address!r} refused")
            return original(self, address)
        return connect

    socket.socket.connect = guarded(original_connect)
    socket.socket.connect_ex = guarded(original_connect_ex)
    try:
        yield attempts
    finally:
        socket.socket.connect, socket.socket.connect_ex = original_connect, original_connect_ex
    assert attempts == [], f"connections off the machine were attempted: {attempts}"


@pytest.fixture(scope="module")
def page(no_network):
    """The page's code, run: its namespace (two trainers trained for two steps each)."""
    pytest.importorskip("trl", reason="trl is not installed: the TRL integration needs the "
                        "optional extra, pip install -e '.[trl]'")
    namespace = {"__name__": "integration_page"}
    blocks = _python_blocks()
    assert len(blocks) == 4
    for block in blocks:
        exec(compile(block, "docs/integration.md", "exec"), namespace)
    return namespace


def test_the_page_blocks_train_two_steps_each(page, no_network):
    for name in ("distillation", "gkd"):
        trainer = page[name]
        assert trainer.state.global_step == 2, name
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        assert len(losses) == 2 and all(0 < float(v) < 10 for v in losses), (name, losses)
    assert no_network == []


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_loss_equals_trls_on_the_same_batch(page, beta):
    import torch
    from trl import DistillationTrainer

    from opd_literate.opd import full_vocab_reverse_kl, generalized_jsd

    trainer = page["distillation"]
    trainer.beta = beta
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in page["PROMPTS"]])
    student = trainer.model
    results = []
    for compute in (DistillationTrainer._compute_loss, type(trainer)._compute_loss):
        student.zero_grad()
        loss, entropy, n_valid = compute(trainer, student, batch, batch["num_items_in_batch"])
        loss.backward()
        gradient = torch.cat([p.grad.flatten() for p in student.parameters()])
        results.append((loss.detach(), entropy, n_valid, gradient))
    (trl_loss, trl_entropy, trl_n, trl_grad), (loss, entropy, n, grad) = results
    assert trl_loss > 0 and int(trl_n) == int(n) == int(batch["completion_mask"].sum())
    # TRL's chunked float32 kernel forms the KL as a difference of log-normalisers (size ~ log V),
    # which cancel: it is off a float64 reference by ~2e-6 absolute on this batch (0.03%), so
    # the two agree to 1e-5 absolute; this package's loss is checked against float64 below.
    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, trl_entropy, rtol=1e-5, atol=0)
    # the gradients differ by up to 1.5e-3 of the largest entry (measured, the embedding's)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=5e-3 * float(trl_grad.abs().max()))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    K = batch["completion_ids"].size(1)
    with torch.no_grad():
        s = student(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1]
        t = trainer.teacher_model(input_ids=ids, attention_mask=attention).logits[:, -K - 1:-1]
    mask = batch["completion_mask"]
    exact = generalized_jsd(s.double(), t.double(), mask, beta=beta)
    scale = mask.sum() / batch["num_items_in_batch"]
    torch.testing.assert_close(loss.double(), exact * scale, rtol=1e-5, atol=0)
    # the page: TRL's loss is off the float64 reference by less than 1e-5 absolute
    assert abs(float(trl_loss.double() - exact * scale)) < 1e-5
    if beta == 1.0:  # the reverse KL of lab Task 3 is the same loss
        torch.testing.assert_close(full_vocab_reverse_kl(s, t, mask) * scale, loss, rtol=1e-6,
                                   atol=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_loss_equals_trls_on_the_same_batch(page, beta):
    """The same formula: equal to TRL's in float64 to 1e-12. In float32 both sum V terms of
    size ~ p |log p| that cancel to a loss ~1e-3, so each is off the float64 value by rounding
    of that size (TRL's by 1.2e-5 relative at beta = 0.5, measured on a 2-core AMD EPYC with
    AVX-512; 8e-6 on the first AVX2 one): they agree within 4 eps_32 of the summed sizes."""
    import torch
    from trl.experimental.gkd import GKDTrainer

    trainer = page["gkd"]
    batch = trainer.data_collator([{"messages": m} for m in page["conversations"]])
    ids, labels = batch["input_ids"], batch["labels"][:, 1:]
    with torch.no_grad():
        teacher = trainer.teacher_model(input_ids=ids, attention_mask=batch["attention_mask"])
        student = trainer.model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    student, teacher = student[:, :-1], teacher.logits[:, :-1]
    results = {}
    for dtype in (torch.float32, torch.float64):
        for loss_fn in (GKDTrainer.generalized_jsd_loss, type(trainer).generalized_jsd_loss):
            x = student.to(dtype).clone().requires_grad_()
            loss = loss_fn(student_logits=x, teacher_logits=teacher.to(dtype), labels=labels,
                           beta=beta, num_items_in_batch=None)
            loss.backward()
            results[dtype, loss_fn is GKDTrainer.generalized_jsd_loss] = loss.detach(), x.grad
    (trl_loss, trl_grad), (loss, grad) = results[torch.float64, True], results[torch.float64, False]
    assert trl_loss > 0
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=1e-12 * float(trl_grad.abs().max()))
    mask = labels != -100
    sizes = 0.0  # the student's and the teacher's sum_v p_v |log p_v|, averaged over tokens
    for logits in (student, teacher):
        logp = torch.log_softmax(logits.double(), -1)
        sizes += float((logp.exp() * logp.abs()).sum(-1)[mask].mean())
    atol = 4 * torch.finfo(torch.float32).eps * sizes
    (trl_loss, trl_grad), (loss, grad) = results[torch.float32, True], results[torch.float32, False]
    torch.testing.assert_close(loss.double(), trl_loss.double(), rtol=0, atol=atol)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-4, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# The chunked losses against TRL's (benchmarks/bench_large_vocab.py runs both side by side)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_losses_equal_the_trainers_chunked_loss(beta, monkeypatch):
    """``DistillationTrainer``'s memory-efficient loss (``_chunked_divergence_loss``, which runs
    ``ChunkedDivergenceFunction``) and ``large_vocab``'s chunked loss, on the same hidden states
    and heads with masked positions: same value and gradients, both against float64. TRL's
    tiles are made small (8 tokens by 300 entries), so that its online log-sum-exp runs across
    tiles in both directions, as it does at V = 151,936."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    import torch
    from trl.kernels import chunked_divergence
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    monkeypatch.setattr(chunked_divergence, "TOKEN_CHUNK_SIZE", 8)
    monkeypatch.setattr(chunked_divergence, "VOCAB_CHUNK_SIZE", 300)

    from opd_literate.large_vocab.chunked import chunked_generalized_jsd
    from opd_literate.opd import generalized_jsd

    g = torch.Generator().manual_seed(0)
    B, K, H, Ht, V = 3, 7, 16, 24, 1000
    h = torch.randn(B, K, H, generator=g).requires_grad_()
    W = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    th, tW = torch.randn(B, K, Ht, generator=g), 0.3 * torch.randn(V, Ht, generator=g)
    mask = (torch.rand(B, K, generator=g) < 0.7).float()
    mask[0, 0] = 1.0

    trl_loss, _, n_valid = _chunked_divergence_loss(h, th, W, tW, mask, beta=beta)
    trl_grads = torch.autograd.grad(trl_loss, (h, W))
    ours = chunked_generalized_jsd(h.reshape(-1, H), W, mask.reshape(-1), beta=beta,
                                   teacher_hidden=th.reshape(-1, Ht), teacher_weight=tW,
                                   chunk_size=5)
    our_grads = torch.autograd.grad(ours, (h, W))
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    exact = generalized_jsd((h64 @ W64.T), (th.double() @ tW.double().T), mask.double(),
                            beta=beta)
    exact_grads = torch.autograd.grad(exact, (h64, W64))

    assert int(n_valid) == int(mask.sum())
    assert abs(ours.item() - exact.item()) < 1e-5
    assert abs(trl_loss.item() - exact.item()) < 1e-5
    for name, mine, theirs, reference in zip("hW", our_grads, trl_grads, exact_grads):
        scale = float(reference.abs().max())
        torch.testing.assert_close(mine.double(), reference, rtol=0, atol=1e-5 * scale,
                                   msg=f"ours, d/d{name}")
        torch.testing.assert_close(theirs.double(), reference, rtol=0, atol=1e-5 * scale,
                                   msg=f"TRL, d/d{name}")
        assert float(theirs[mask.reshape(B, K) == 0].abs().max() if name == "h" else 0) == 0.0


def test_the_large_vocab_page_states_trls_tile_sizes():
    """docs/large_vocab.md: TRL's tiles and the buffer sizes derived from them, at the
    benchmark's 2,048 tokens, V = 151,936 and our chunk of 128 rows."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    from trl.kernels import chunked_divergence

    page = " ".join((ROOT / "docs" / "large_vocab.md").read_text().split())
    tokens, vocab = chunked_divergence.TOKEN_CHUNK_SIZE, chunked_divergence.VOCAB_CHUNK_SIZE
    assert f"its tiles are {tokens:,} tokens by {vocab:,} vocabulary entries" in page
    tile_mib = min(2048, tokens) * vocab * 4 / 2**20  # float32
    chunk_mib = 128 * 151_936 * 4 / 2**20
    assert f"two {tile_mib:.0f} MiB buffers at 2,048 tokens" in page
    assert f"our 128-token chunks of {chunk_mib:.0f} MiB" in page


# ---------------------------------------------------------------------------------------------
# Which support: TRL's top-k and top-1 losses against large_vocab.supports
# ---------------------------------------------------------------------------------------------
# TRL's functions and large_vocab.supports compute the same formulas in a different order (TRL
# masks with nan_to_num and clamps the mixture at the dtype's tiny; supports.py selects with
# torch.where and forms the mixture with logaddexp). In float64 the two agree to rounding:
# measured 2e-16 relative in the values and 6e-17 absolute in the gradients (largest entries
# about 0.1), so both are held to 1e-12. The async trainer's chunk projects in float32.
def _support_batch(seed=0, B=3, T=6, V=40):
    import torch

    g = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    teacher = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    tokens[0, 0] = teacher[0, 0].argmax()  # one sampled token that is the teacher's top-1
    labels = tokens.clone()
    labels[1, 4:] = -100  # padding after a short completion
    return student, teacher, tokens, labels


def _trl_stub(trainer_class, **attributes):
    """The few attributes TRL's loss methods read, and its own methods bound to the stub."""
    import types

    stub = types.SimpleNamespace(**{"temperature": 1.0, "reverse_kl_top_1_mode": "sampled",
                                    **attributes})
    stub._reduce_divergence_loss = trainer_class._reduce_divergence_loss
    for name in ("_compute_sparse_top_1_divergence_loss", "_get_reverse_kl_top_1_tokens"):
        setattr(stub, name, getattr(trainer_class, name).__get__(stub))
    return stub


def _ours(student, teacher, tokens, labels, beta, k, tail, mode="sampled"):
    """supports.py's per-token loss on TRL's support, reduced as TRL's batchmean."""
    from opd_literate.large_vocab.supports import (
        build_support,
        support_divergence,
        trl_support_rule,
    )

    rule, k = trl_support_rule(beta, k, mode, vocab_size=student.shape[-1])
    support = build_support(rule, k, student, teacher,
                            tokens=tokens if rule.endswith("sampled") else None)
    mask = labels != -100
    per_token = support_divergence(student, support, beta=beta, mask=mask,
                                   approximation="tail" if tail else "renormalize")
    return per_token.sum() / mask.sum()


def _value_and_grad(fn, student):
    import torch

    z = student.detach().clone().requires_grad_(True)
    value = fn(z)
    (grad,) = torch.autograd.grad(value, z)
    return value.detach(), grad


def _assert_same(theirs, ours):
    import torch

    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta, k, mode", [
    (0.0, 1, "sampled"), (0.0, 5, "sampled"), (0.5, 5, "sampled"), (1.0, 5, "sampled"),
    (0.5, 1, "sampled"), (1.0, 1, "sampled"), (0.5, 1, "argmax"), (1.0, 1, "argmax")])
def test_iw_opd_losses_are_supports_on_trls_support(beta, k, mode, tail):
    """``IWOPDTrainer.compute_loss``'s two local-teacher paths (``distillation_objective="jsd"``):
    the top-1 one for beta > 0 and loss_top_k = 1, ``generalized_jsd_loss`` otherwise."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer

    student, teacher, tokens, labels = _support_batch()
    if beta > 0 and k == 1:
        stub = _trl_stub(IWOPDTrainer, beta=beta, loss_add_tail=tail, reverse_kl_top_1_mode=mode)

        def trl(z):
            return IWOPDTrainer._compute_local_sparse_top_1_divergence_loss(
                stub, z, teacher, tokens, labels)
    else:  # reverse_kl_top_1_mode is read by the top-1 path only
        def trl(z):
            return IWOPDTrainer.generalized_jsd_loss(z, teacher, labels=labels, beta=beta,
                                                     top_k=k, add_tail=tail)
    _assert_same(_value_and_grad(trl, student),
                 _value_and_grad(lambda z: _ours(z, teacher, tokens, labels, beta, k, tail, mode),
                                 student))


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta, k", [(0.0, 1), (0.0, 4), (0.5, 1), (1.0, 1)])
def test_server_distillation_losses_are_supports_on_trls_support(beta, k, tail):
    """``ServerDistillationTrainer``: ``_compute_server_forward_kl_loss`` (beta = 0, the served
    teacher's top-k) and ``_compute_server_sparse_top_1_divergence_loss`` (beta > 0, k = 1),
    on what a server returns, computed here from the teacher's full logits."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    import torch
    from trl.experimental.server_distillation.server_distillation_trainer import (
        ServerDistillationTrainer,
    )

    student, teacher, tokens, labels = _support_batch(seed=1)
    log_q = torch.log_softmax(teacher, -1)
    top, ids = log_q.topk(k, dim=-1)
    result = {"actual_logprobs": log_q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
              "topk_logprobs": top, "topk_token_ids": ids}
    stub = _trl_stub(ServerDistillationTrainer, beta=beta, loss_add_tail=tail)
    method = (ServerDistillationTrainer._compute_server_forward_kl_loss if beta == 0 else
              ServerDistillationTrainer._compute_server_sparse_top_1_divergence_loss)
    kwargs = {} if beta == 0 else {"completion_tokens": tokens}

    def trl(z):
        return method(stub, teacher_result=result, student_log_probs=torch.log_softmax(z, -1),
                      labels=labels, **kwargs)
    _assert_same(_value_and_grad(trl, student),
                 _value_and_grad(lambda z: _ours(z, teacher, tokens, labels, beta, k, tail),
                                 student))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_async_distillation_chunk_is_supports_on_its_support(beta):
    """``AsyncDistillationTrainer``: ``_narrow_top1_actual_support`` (beta != 0) and
    ``_jsd_loss_chunk`` on the served teacher's top-8 (which holds the sampled token, as vLLM's
    ``prompt_logprobs`` does), against supports.py on the same float32 logits: 1e-5 relative,
    float32 rounding of TRL's log-softmax over V = 40."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    import torch
    from trl.experimental.async_distillation import async_distillation_trainer as adt

    from opd_literate.large_vocab.supports import Support, support_divergence

    g = torch.Generator().manual_seed(2)
    n, H, V, K = 10, 6, 40, 8
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    log_q = torch.log_softmax(2 * torch.randn(n, V, generator=g), -1)
    teacher_lp, teacher_ids = log_q.topk(K, dim=-1)
    actual = teacher_ids[torch.arange(n), torch.randint(0, K, (n,), generator=g)]
    mask = torch.ones(n, K, dtype=torch.bool)
    if beta == 0.0:
        target, target_lp, valid = teacher_ids, teacher_lp, mask
    else:
        target, target_lp, valid = adt._narrow_top1_actual_support(teacher_ids, teacher_lp,
                                                                    actual, mask, beta)

    def trl(h):
        return adt._jsd_loss_chunk(h, weight, None, 1.0, None, target, target_lp, valid, beta,
                                   1.0, True, None, 1)[0]

    def ours(h):
        logits = (h @ weight.t()).double()
        support = Support(target, valid, target_lp.double())
        return support_divergence(logits, support, beta=beta).sum()
    theirs, mine = _value_and_grad(trl, hidden), _value_and_grad(ours, hidden)
    torch.testing.assert_close(mine[0].float(), theirs[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(mine[1].float(), theirs[1], rtol=1e-4,
                               atol=1e-5 * float(theirs[1].abs().max()))


def test_sdft_top_k_loss_is_supports_student_top_k():
    """TRL's SDFT (``compute_topk_self_distillation_loss``): the student's top-k, the JSD of
    ``distillation_alpha``, renormalised (``distillation_add_tail=False``) or bucketed."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    from trl.experimental.sdft.loss_utils import compute_topk_self_distillation_loss

    from opd_literate.large_vocab.supports import build_support, support_divergence

    student, teacher, _, _ = _support_batch(seed=3)
    for alpha in (0.0, 0.5, 1.0):
        for tail in (False, True):
            support = build_support("student_topk", 6, student, teacher)

            def trl(z, a=alpha, t=tail):
                return compute_topk_self_distillation_loss(
                    z, teacher, distillation_topk=6, distillation_alpha=a,
                    distillation_add_tail=t).sum()

            def ours(z, a=alpha, t=tail, s=support):
                return support_divergence(z, s, beta=a, approximation="tail" if t
                                          else "renormalize").sum()
            _assert_same(_value_and_grad(trl, student), _value_and_grad(ours, student))


def test_the_tail_cap_and_the_defaults_that_choose_the_support():
    """TAIL_MAX_LOG_MASS is TRL's cap; the configs' defaults and refusals the docs state."""
    pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[trl]'")
    import dataclasses
    import math

    import torch
    import trl
    from trl.experimental.async_distillation.async_distillation_config import (
        AsyncDistillationConfig,
    )
    from trl.experimental.iw_opd.iw_opd_config import IWOPDConfig
    from trl.experimental.iw_opd.iw_opd_trainer import _add_tail_bucket
    from trl.experimental.sdft.sdft_config import SDFTConfig
    from trl.experimental.sdpo.sdpo_config import SDPOConfig
    from trl.experimental.server_distillation.server_distillation_config import (
        ServerDistillationConfig,
    )

    from opd_literate.large_vocab import supports

    assert trl.__version__ == supports.TRL_VERSION
    above = torch.tensor([[-1e-9]], dtype=torch.float64)
    tail = _add_tail_bucket(above, torch.ones(1, 1, dtype=torch.bool))[0][0, 1].item()
    assert tail == pytest.approx(math.log(-math.expm1(supports.TAIL_MAX_LOG_MASS)), rel=1e-15)

    def defaults(config):
        return {f.name: f.default for f in dataclasses.fields(config)}
    iw = defaults(IWOPDConfig)
    assert (iw["distillation_objective"], iw["beta"], iw["loss_top_k"], iw["loss_add_tail"],
            iw["reverse_kl_top_1_mode"]) == ("iw_opd", 1.0, 1, True, "sampled")
    server = defaults(ServerDistillationConfig)
    assert (server["loss_top_k"], server["loss_add_tail"], server["reverse_kl_top_1_mode"]) == \
        (1, True, "sampled")
    async_ = defaults(AsyncDistillationConfig)
    assert (async_["beta"], async_["teacher_top_k"], async_["add_tail_bucket"]) == (0.0, 8, True)
    sdft, sdpo = defaults(SDFTConfig), defaults(SDPOConfig)
    assert (sdft["distillation_mode"], sdft["distillation_topk"], sdft["distillation_alpha"],
            sdft["distillation_add_tail"]) == ("topk_logits", 100, 0.5, False)
    assert sdpo["distillation_mode"] == "sampled_token"
    # DistillationTrainer: no top-k support, its top_k is a sampling option
    from trl import DistillationConfig

    fields = {f.name: f for f in dataclasses.fields(DistillationConfig)}
    assert "sampling" in fields["top_k"].metadata["help"].lower()
    assert not {"loss_top_k", "distillation_topk", "teacher_top_k"} & set(fields)
    # the server refuses the argmax token and a top-k above 1 with beta > 0
    url = "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="argmax"):
        ServerDistillationConfig(output_dir="/tmp/opd-trl-config", teacher_model_server_url=url,
                                 reverse_kl_top_1_mode="argmax", report_to="none", bf16=False)
    with pytest.raises(ValueError, match="loss_top_k must be 1 with beta>0"):
        ServerDistillationConfig(output_dir="/tmp/opd-trl-config", teacher_model_server_url=url,
                                 beta=0.5, loss_top_k=4, report_to="none", bf16=False)
