"""opd_literate.teachers.many_teachers against verl 0.9.1's multi-teacher OPD, installed.

verl's trainer config is composed as ``main_ppo`` composes it, with two teachers keyed by
source (the overrides its ``distillation.yaml`` documents), and turned into its
``DistillationConfig``. Its ``AsyncTeacherLLMServerManager`` is then run with one stand-in
server per teacher that answers, for the sequence it is sent, that teacher's log-probabilities
on the enumerable toy; verl's own ``distillation_loss`` (``loss_mode: k1``,
``use_policy_gradient: true``, ``use_task_rewards: false``) turns them into its policy loss,
with the sampler's log-probabilities as ``old_log_probs`` (ratio 1: the first mini-batch of an
on-policy step, no importance weight), summed over the tokens (``loss_agg_mode: token-sum``;
the composed ``token-mean`` divides by the batch's token count), and autograd gives the
gradient in each token's log-probability. The exact mean of that gradient times each token's
score, summed over every prompt, response and routing label, must be
``expected_estimate(prompts, "routed", C, gamma=0.0)``, correctly routed and misrouted.

Tolerance ``1e-12``: verl's manager reads the server's log-probabilities as float32
(``torch.tensor`` of a list, ``teacher_manager.py`` line 142), so the toy's teachers are rounded
to float32 first, on both sides; ``kl_penalty`` is then a subtraction for ``k1`` and the sums
are in float64.
Marker ``verl``, like ``test_verl.py``; skipped where verl's teacher loop cannot be imported
(it imports ``cachetools``, ``fastapi`` and ``uvicorn`` through ``verl.workers.rollout``).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import pathlib
import types

import numpy as np
import pytest
import torch

try:
    import tensordict  # noqa: F401 (skip without it: _verl_trainer builds the data)
    from hydra.errors import InstantiationException
    from verl.experimental.teacher_loop.teacher_manager import AsyncTeacherLLMServerManager
    from verl.trainer.distillation import losses as verl_losses
    from verl.utils import omega_conf_to_dataclass
    from verl.workers.config.distillation import (
        DistillationConfig,
        DistillationTeacherModelConfig,
    )
except ImportError as error:
    pytest.skip(f"verl's teacher loop is not importable ({error}); build it with tools/env.sh "
                "verl .venv-verl", allow_module_level=True)

from _verl_trainer import (
    compose_trainer_config,
    one_sequence_data,
    token_sum_actor,
    unpadded,
)

from opd_literate.mismatch.toy import response_mask
from opd_literate.teachers import many_teachers
from opd_literate.teachers.many_teachers import expected_estimate, make_prompts, misrouting_matrix

pytestmark = pytest.mark.verl
F64 = torch.float64
ATOL = 1e-12
SOURCES = ("gsm8k", "geo3k")  # the values of the samples' data_source field
PROMPT_TOKEN = 1000  # prompt x is the one token PROMPT_TOKEN + x; responses are toy tokens


K1_REWARD = ["distillation.distillation_loss.loss_mode=k1",
             "distillation.distillation_loss.use_policy_gradient=true",
             "distillation.distillation_loss.use_task_rewards=false"]


def _overrides(sources, loss=K1_REWARD):
    """Multi-teacher OPD (with k1 as a reward by default): one teacher entry per source, named
    apart from the default ``teacher_model`` (which verl drops when others are added)."""
    overrides = ["distillation.enabled=true", "distillation.nnodes=1",
                 f"distillation.n_gpus_per_node={len(sources)}", *loss]
    for i, source in enumerate(sources):
        entry = f"+distillation.teacher_models.teacher{i}"
        overrides += [f"{entry}.key={source}", f"{entry}.model_path=/teachers/{source}",
                      f"{entry}.num_replicas=1", f"{entry}.inference.name=vllm",
                      f"{entry}.inference.tensor_model_parallel_size=1"]
    return overrides


@pytest.fixture(scope="module")
def composed():
    return compose_trainer_config(_overrides(SOURCES))


class _ToyTeacherServer:
    """Answers verl's prompt-logprob request with teacher k's log-probabilities on the toy."""

    def __init__(self, prompts, k):
        self.table = {}
        for x, toy in enumerate(prompts["toys"]):
            lengths = response_mask(toy).sum(axis=1).astype(int)
            for m, n in enumerate(lengths):
                sequence = (PROMPT_TOKEN + x, *toy["Y"][m, :n].tolist())
                # the prompt token has no log-probability of its own (verl trims it away)
                self.table[sequence] = [0.0, *toy["logp_teachers"][k, m, :n].tolist()]

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        assert sampling_params["max_tokens"] == 1 and sampling_params["prompt_logprobs"] == 0
        logprobs = self.table[tuple(prompt_ids)]
        return types.SimpleNamespace(extra_fields={
            "prompt_ids": [[t] for t in prompt_ids],
            "prompt_logprobs": [[v] for v in logprobs]})


def _float32_teachers(prompts):
    """The prompts with the teachers' log-probabilities rounded to float32: verl reads the
    server's answer with ``torch.tensor(...)`` (``teacher_manager.py`` line 142), float32, so
    both sides then start from the same numbers."""
    toys = [dict(toy, logp_teachers=toy["logp_teachers"].astype(np.float32).astype(np.float64))
            for toy in prompts["toys"]]
    return dict(prompts, toys=toys)


def _manager(config, prompts):
    clients = {source: _ToyTeacherServer(prompts, k) for k, source in enumerate(SOURCES)}
    return AsyncTeacherLLMServerManager(config=config, teacher_client=clients)


def _verl_token_gradients(config, student, teacher):
    """The gradient of verl's ``distillation_loss`` in each response token's log-probability,
    for one sequence of one prompt token and ``len(student)`` response tokens."""
    leaf = student.clone().requires_grad_(True)
    data = one_sequence_data(student.shape[0],
                             old_log_probs=student[None].clone(),  # the sampler: ratio 1
                             teacher_logprobs=unpadded(teacher)[:, None])
    loss, _ = verl_losses.distillation_loss(token_sum_actor(), config,
                                            {"log_probs": unpadded(leaf)}, data)
    (gradient,) = torch.autograd.grad(loss, leaf)
    return gradient.numpy()


def _verl_mean_estimate(composed, manager, prompts, labels):
    r"""$\sum_x \rho(x) \sum_\ell C_{x,\ell} \sum_y \pi_x(y) \sum_t g_t s_t$ with $g_t$ the
    gradient of verl's loss in $\log \pi(y_t)$, the teacher the one verl routes label $\ell$ to."""
    config = omega_conf_to_dataclass(composed.distillation)
    assert (config.distillation_loss.loss_mode, config.distillation_loss.use_policy_gradient,
            config.distillation_loss.use_task_rewards) == ("k1", True, False)
    per_prompt = []  # each prompt's own student parameters
    for x, toy in enumerate(prompts["toys"]):
        total = np.zeros(toy["score"].shape[1:])
        lengths = response_mask(toy).sum(axis=1).astype(int)
        for label, probability in zip(SOURCES, labels[x]):
            if probability == 0:
                continue
            for m, n in enumerate(lengths):
                sequence = [PROMPT_TOKEN + x, *toy["Y"][m, :n].tolist()]
                _, teacher = asyncio.run(manager.compute_teacher_logprobs_single(
                    sequence_ids=sequence, routing_key=label))
                teacher = teacher[1:, 0].to(F64)  # the response's tokens
                student = torch.as_tensor(toy["logp_train"][m, :n], dtype=F64)
                gradient = _verl_token_gradients(config, student, teacher)
                row = np.zeros_like(toy["score"][m])
                row[:n] = gradient.reshape((n,) + (1,) * (row.ndim - 1)) * toy["score"][m, :n]
                total += prompts["prompt_probs"][x] * probability * toy["p_train"][m] * row
        per_prompt.append(total)
    return np.stack(per_prompt)


@pytest.fixture(scope="module")
def stock():
    """The distillation config of a run with the two teachers and no loss switched."""
    return omega_conf_to_dataclass(
        compose_trainer_config(_overrides(SOURCES, loss=())).distillation)


def test_the_composed_loss_is_k3_backpropagated_unless_switched(stock):
    """The module docstring: routing changes the teacher, not the loss; a stock run's loss is
    ``k3`` with ``use_policy_gradient: false``, the k1 reward is a switch."""
    assert (stock.distillation_loss.loss_mode, stock.distillation_loss.use_policy_gradient) \
        == ("k3", False)
    doc = " ".join(many_teachers.__doc__.split())
    assert "composes has ``loss_mode: k3`` and ``use_policy_gradient: false``" in doc


def test_verl_keys_the_teachers_by_source(composed):
    config = omega_conf_to_dataclass(composed.distillation)
    assert isinstance(config, DistillationConfig)
    assert sorted(config.teacher_models) == sorted(SOURCES)
    assert config.teacher_key == "data_source"


@pytest.mark.parametrize("autoregressive", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 0.25, 1.0])
def test_verls_routed_k1_reward_has_the_routed_estimators_mean(composed, autoregressive,
                                                               epsilon):
    prompts = _float32_teachers(make_prompts(P=3, K=2, T=3, V=3, autoregressive=autoregressive,
                                             seed=3, prompt_probs=[0.5, 0.3, 0.2]))
    labels = misrouting_matrix(prompts, epsilon)  # a sample's data_source: wrong w.p. epsilon
    ours = expected_estimate(prompts, "routed", labels, gamma=0.0)
    theirs = _verl_mean_estimate(composed, _manager(composed, prompts), prompts, labels)
    assert np.allclose(theirs, ours, rtol=0, atol=ATOL)


def test_verl_refuses_a_missing_or_unknown_source_with_two_teachers(composed):
    prompts = make_prompts(P=1, K=2, T=1, V=2)
    manager = _manager(composed, prompts)
    for key, message in ((None, "Routing key is required"), ("mmlu", "No teacher configured")):
        with pytest.raises(ValueError, match=message):
            asyncio.run(manager.compute_teacher_logprobs_single([PROMPT_TOKEN, 0],
                                                                routing_key=key))


def test_one_teacher_takes_every_sample_whatever_its_source():
    config = compose_trainer_config(["distillation.enabled=true", "distillation.nnodes=1",
                       "distillation.n_gpus_per_node=2",
                       "distillation.teacher_models.teacher_model.model_path=/teachers/one"])
    resolved = omega_conf_to_dataclass(config.distillation)
    [only] = resolved.teacher_models
    prompts = _float32_teachers(make_prompts(P=1, K=1, T=1, V=2))
    manager = AsyncTeacherLLMServerManager(config=config,
                                           teacher_client={only: _ToyTeacherServer(prompts, 0)})
    for key in (None, "mmlu", only):
        _, logprobs = asyncio.run(manager.compute_teacher_logprobs_single([PROMPT_TOKEN, 0],
                                                                          routing_key=key))
        assert logprobs[1, 0].item() == prompts["toys"][0]["logp_teachers"][0, 0, 0]


def test_verl_drops_the_default_teacher_entry_when_another_is_added():
    """The chapter: name the teachers apart from ``teacher_model``. Adding a second entry
    beside the default one leaves one teacher, which then takes every sample, whatever its
    source, unless the resource pool is sized for both."""
    overrides = ["distillation.enabled=true", "distillation.nnodes=1",
                 "distillation.n_gpus_per_node=1",
                 "distillation.teacher_models.teacher_model.key=gsm8k",
                 "distillation.teacher_models.teacher_model.model_path=/teachers/gsm8k",
                 "+distillation.teacher_models.teacher2.key=geo3k",
                 "+distillation.teacher_models.teacher2.model_path=/teachers/geo3k",
                 "+distillation.teacher_models.teacher2.num_replicas=1",
                 "+distillation.teacher_models.teacher2.inference.name=vllm",
                 "+distillation.teacher_models.teacher2.inference.tensor_model_parallel_size=1"]
    resolved = omega_conf_to_dataclass(compose_trainer_config(overrides).distillation)
    assert sorted(resolved.teacher_models) == ["geo3k"]
    # a pool sized for the two teachers refuses the one left (hydra wraps verl's ValueError)
    with pytest.raises(InstantiationException, match="must match the distillation resource"):
        omega_conf_to_dataclass(compose_trainer_config(
            [o.replace("n_gpus_per_node=1", "n_gpus_per_node=2") for o in overrides]
        ).distillation)


def test_the_composed_config_adds_the_task_loss_unless_switched_off(stock):
    """The chapter's condition ``use_task_rewards: false``: the composed config has it true,
    and ``distillation_ppo_loss`` then adds the task's PPO loss to the distillation term."""
    assert stock.distillation_loss.use_task_rewards is True
    source = ast.unparse(ast.parse(pathlib.Path(verl_losses.__file__).read_text()))
    assert "policy_loss += distill_loss * distillation_loss_coef" in source


def test_the_agent_loop_routes_by_the_samples_teacher_key_field():
    """``AgentLoopWorker._compute_teacher_logprobs`` reads the routing key from the sample's
    field named by ``distillation.teacher_key`` (read from the installed source: importing the
    agent loop needs more of verl's serving stack than the teacher loop does)."""
    origin = pathlib.Path(importlib.util.find_spec("verl").origin).parent
    source = (origin / "experimental/agent_loop/agent_loop.py").read_text()
    [method] = [node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.AsyncFunctionDef)
                and node.name == "_compute_teacher_logprobs"]
    body = ast.unparse(method)
    assert "sample_kwargs.get(self.teacher_key)" in body
    assert "routing_key=routing_key" in body


def test_verl_has_no_mixture_or_weight_of_teachers():
    """The config users set: a teacher is a key, a model and its serving; nothing weighs or
    mixes teachers, and the reward is one teacher's log-probability per token."""
    fields = {f.name for f in dataclasses.fields(DistillationTeacherModelConfig)}
    assert fields - {"_target_"} == {"key", "model_path", "inference", "num_replicas"}
    assert not {f.name for f in dataclasses.fields(DistillationConfig)} & {"weights", "mixture"}
    source = pathlib.Path(verl_losses.__file__).read_text()
    assert "advantages=-distillation_losses.detach()," in source


def test_the_line_numbers_the_module_cites_are_the_installed_ones():
    root = pathlib.Path(importlib.util.find_spec("verl").origin).parent
    doc = " ".join(many_teachers.__doc__.split())
    yaml = (root / "trainer/config/distillation/distillation.yaml").read_text().splitlines()
    assert "lines 65 and 113" in doc
    assert yaml[64] == "teacher_models:" and yaml[112] == "teacher_key: data_source"
    manager = (root / "experimental/teacher_loop/teacher_manager.py").read_text().splitlines()
    assert "teacher_manager.py`` lines 100 to 114" in doc
    assert manager[99].strip().startswith("def _resolve_teacher_key")
    assert manager[113].strip() == "return routing_key"
    losses = (root / "trainer/distillation/losses.py").read_text().splitlines()
    assert "(line 283)" in doc
    assert losses[282].strip() == "advantages=-distillation_losses.detach(),"
