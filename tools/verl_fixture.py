"""Write tests/fixtures/verl_rollout_correction.json from the installed verl release.

The fixture lets the fast tier (which has no verl) check option names, defaults and metric names
against verl; ``tests/integration/test_verl.py`` regenerates it with verl installed and fails if
the committed file differs. Run it inside the verl environment
(``bash tools/env.sh verl .venv-verl``):

    .venv-verl/bin/python tools/verl_fixture.py          # rewrite the fixture
    .venv-verl/bin/python tools/verl_fixture.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "verl_rollout_correction.json"


def build() -> dict:
    """The fixture's content, read from verl's own objects (nothing typed by hand but names)."""
    import omegaconf
    import verl
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo import rollout_corr_helper as helper
    from verl.workers.config.actor import ActorConfig

    package = pathlib.Path(verl.__file__).parent
    yaml = omegaconf.OmegaConf.load(package / "trainer/config/algorithm/rollout_correction.yaml")
    yaml_defaults = {k: v for k, v in omegaconf.OmegaConf.to_container(yaml).items()
                     if not k.startswith("_")}
    config = RolloutCorrectionConfig()
    dataclass_defaults = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                          if not f.name.startswith("_")}
    presets = sorted(name for name, value in vars(RolloutCorrectionConfig).items()
                     if isinstance(value, classmethod) and name not in ("from_dict",))
    preset_fields = {}
    for name in presets:
        made = getattr(RolloutCorrectionConfig, name)()
        preset_fields[name] = {k: getattr(made, k) for k in dataclass_defaults}
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    actor_yaml = omegaconf.OmegaConf.load(package / "trainer/config/actor/actor.yaml")

    # every metric name, by running verl's helper with every option on one small batch
    torch.manual_seed(0)
    old, rollout = -torch.rand(3, 4), -torch.rand(3, 4)
    mask = torch.ones(3, 4)
    names = set()
    for rollout_is, threshold, normalize in [("token", 2.0, True), ("sequence", 2.0, True),
                                             ("token", "0.5_5.0", False)]:
        _, _, m = helper.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=threshold,
            rollout_is_batch_normalize=normalize, rollout_rs="token_k1",
            rollout_rs_threshold=2.0)
        names |= {n for n in m if "rollout_rs_token_k1_" not in n}
    prefix = "rollout_corr/"
    per_option = set()
    for option in sorted(helper.SUPPORTED_ROLLOUT_RS_OPTIONS):
        _, _, m = helper.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, rollout_rs=option, rollout_rs_threshold=2.0)
        per_option |= {n.replace(option, "{option}") for n in m if f"rollout_rs_{option}_" in n}
        names |= {n for n in m if not n.startswith(f"{prefix}rollout_rs_{option}_")}
    names = {n.removeprefix(prefix) for n in names}
    per_option = {n.removeprefix(prefix) for n in per_option}
    kl_names = []
    for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k1+", "k3+",
                 "low_var_kl+", "k2+"):
        try:
            core_algos.kl_penalty(old, rollout, name)
            kl_names.append(name)
        except NotImplementedError:
            pass
    return {
        "repo": "verl-project/verl",
        "version": verl.__version__,
        "read_from": {
            "rollout_correction_yaml": "verl/trainer/config/algorithm/rollout_correction.yaml",
            "rollout_correction_dataclass":
                "verl/trainer/config/algorithm.py (RolloutCorrectionConfig)",
            "actor": "verl/workers/config/actor.py (ActorConfig), "
                     "verl/trainer/config/actor/actor.yaml",
            "helper": "verl/trainer/ppo/rollout_corr_helper.py",
            "losses": "verl/trainer/ppo/core_algos.py",
        },
        "rollout_correction_yaml_defaults": yaml_defaults,
        "rollout_correction_dataclass_defaults": dataclass_defaults,
        "presets": preset_fields,
        "rollout_is_levels": ["token", "sequence"],
        "loss_types": ["ppo_clip", "reinforce"],
        "rollout_rs_options": [o for o in ("token_k1", "token_k2", "token_k3", "seq_sum_k1",
                                           "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                                           "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                                           "seq_max_k3")
                               if o in helper.SUPPORTED_ROLLOUT_RS_OPTIONS],
        "safety_bound": helper.SAFETY_BOUND,
        "actor_defaults": {
            "clip_ratio": actor.clip_ratio,
            "clip_ratio_low": actor.clip_ratio_low,
            "clip_ratio_high": actor.clip_ratio_high,
            "clip_ratio_c": actor.get("clip_ratio_c", None),
            "loss_agg_mode": actor.loss_agg_mode,
            "kl_loss_type": actor_yaml["kl_loss_type"],
        },
        "policy_loss_modes": sorted(core_algos.POLICY_LOSS_REGISTRY),
        "kl_penalty_names": kl_names,
        "metric_prefix": prefix,
        "metrics": sorted(names),
        "metrics_per_rs_option": sorted(per_option),
        "actor_metrics": ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"],
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = json.dumps(build(), indent=2, sort_keys=False) + "\n"
    if "--check" in argv:
        if FIXTURE.read_text() != text:
            print(f"{FIXTURE.relative_to(ROOT)} is stale: rerun tools/verl_fixture.py",
                  file=sys.stderr)
            return 1
        return 0
    FIXTURE.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
