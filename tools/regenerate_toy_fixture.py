"""Regenerate tests/fixtures/toy_seed_reference.npz from the seed's given code.

The seed (``../shared/seeds/003_*.txt``, the mismatch lab's given ``make_toy``,
``sample_from_sampler`` and ``estimator_moments``) is not part of the repository, so
``tests/mismatch/test_toy.py`` compares ``opd_literate.mismatch.toy`` with the arrays saved here
instead. Run from the repository root when the seed is at hand:

    python tools/regenerate_toy_fixture.py [path/to/003_seed.txt]

The file holds, for each configuration of ``CONFIGS``, every array the seed's ``make_toy``
returns, the indices its ``sample_from_sampler`` draws with ``default_rng(5)``, and its
``estimator_moments`` of a seeded random estimate (compressed; about 130 KiB).
"""

from __future__ import annotations

import pathlib
import sys
import types

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "toy_seed_reference.npz"
CONFIGS = (
    {},
    {"T": 3, "V": 5, "mismatch": 1.2, "seed": 7},
    {"T": 5, "V": 3, "mismatch": -0.4},
    {"T": 2, "V": 2, "mismatch": 0.0, "seed": 123},
)
"""The make_toy keyword arguments saved (the default toy first)."""
ARRAY_KEYS = ("Y", "logp_train", "logp_sampler", "p_train", "p_sampler", "R", "score",
              "true_grad", "theta", "b")
SCALAR_KEYS = ("mismatch", "T", "V")
RMSE_BATCH = 17


def seed_file() -> pathlib.Path:
    matches = sorted((ROOT.parent / "shared" / "seeds").glob("003_*.txt"))
    if not matches:
        raise FileNotFoundError("no ../shared/seeds/003_*.txt beside the repository; pass a path")
    return matches[0]


def load_seed(path: pathlib.Path) -> types.ModuleType:
    module = types.ModuleType("seed_toy")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def random_estimate(shape):
    """The estimate whose moments are saved: standard normal from default_rng(1)."""
    return np.random.default_rng(1).normal(size=shape)


def reference_arrays(seed) -> dict[str, np.ndarray]:
    arrays = {}
    for i, kwargs in enumerate(CONFIGS):
        toy = seed.make_toy(**kwargs)
        prefix = f"c{i}_"
        for key in ARRAY_KEYS:
            arrays[prefix + key] = np.asarray(toy[key])
        for key in SCALAR_KEYS:
            arrays[prefix + key] = np.asarray(toy[key])
        arrays[prefix + "samples"] = seed.sample_from_sampler(toy, 200, np.random.default_rng(5))
        moments = seed.estimator_moments(toy, random_estimate(toy["score"].shape))
        arrays[prefix + "moment_mean"] = moments["mean"]
        arrays[prefix + "moment_scalars"] = np.array(
            [moments["bias"], moments["var"], moments["rel_bias"], moments["rel_rmse"](RMSE_BATCH)])
    return arrays


def main(argv: list[str]) -> None:
    path = pathlib.Path(argv[0]) if argv else seed_file()
    arrays = reference_arrays(load_seed(path))
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE.relative_to(ROOT)} ({FIXTURE.stat().st_size / 1024:.0f} KiB) "
          f"from {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
