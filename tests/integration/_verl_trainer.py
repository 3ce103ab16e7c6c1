"""verl 0.9.1 as its users run it, for the verl tests (marker ``verl``, in ``.venv-verl``): the
trainer's config composed as ``python -m verl.trainer.main_ppo`` composes it, and the data of one
sequence that verl's distillation losses read. Hydra and tensordict are imported where they are
used, so importing this module needs neither. The verl tests import it as a sibling module
(``from _verl_trainer import ...``): the verl environment ships a top-level ``tests`` package of
its own, which hides this repository's ``tests.helpers`` there."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import types

import torch


def trainer_entry():
    """``(config folder, config name)`` of ``main_ppo.main``'s ``@hydra.main``, from its source."""
    origin = pathlib.Path(importlib.util.find_spec("verl.trainer.main_ppo").origin)
    [main] = [node for node in ast.parse(origin.read_text()).body
              if isinstance(node, ast.FunctionDef) and node.name == "main"]
    [decorator] = [d for d in main.decorator_list if isinstance(d, ast.Call)
                   and ast.unparse(d.func) == "hydra.main"]
    arguments = {k.arg: ast.literal_eval(k.value) for k in decorator.keywords}
    return origin.parent / arguments["config_path"], arguments["config_name"]


def compose_trainer_config(overrides=()):
    """The trainer's config, composed as its ``hydra.main`` composes it, with ``overrides``."""
    from hydra import compose, initialize_config_dir

    folder, name = trainer_entry()
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def one_sequence_data(T, **entries):
    """verl's ``TensorDict`` for one sequence of one prompt token and ``T`` response tokens,
    every token valid, a global batch of one; ``entries`` adds its other fields
    (``old_log_probs``, ``teacher_logprobs``, ...)."""
    from tensordict import TensorDict

    return TensorDict({
        "prompts": torch.zeros(1, 1, dtype=torch.long),
        "responses": torch.zeros(1, T, dtype=torch.long),
        "attention_mask": torch.ones(1, 1 + T, dtype=torch.long),
        "response_mask": torch.ones(1, T, dtype=torch.long),
        "dp_size": torch.tensor(1), "batch_num_tokens": torch.tensor(T),
        "global_batch_size": torch.tensor(1),
        **entries,
    }, batch_size=[])


def unpadded(per_token):
    """A ``(T, ...)`` tensor of the response's tokens as verl's unpadded model output of that
    sequence holds it: one more entry at the end, for the last position, which predicts nothing
    and is never read."""
    return torch.cat([per_token, per_token[-1:]])


def token_sum_actor():
    """The actor fields ``distillation_loss`` reads, summing over the tokens; a new one each
    call, since the loss writes its batch sizes into ``global_batch_info``."""
    return types.SimpleNamespace(loss_agg_mode="token-sum", global_batch_info={},
                                 loss_scale_factor=None)
