"""SGLang's reported log-probs and the kept-mass corrections of the ratio
(opd_literate.mismatch.engine: reported="tempered", kept_mass=), proved by enumeration against
computations written here from the definitions, and against the two frameworks' rules restated
from their sources: SGLang 0.5.23 (python/sglang/srt/layers/sampler.py, sha256 b9b0c965...,
Sampler.forward lines 148-331) and TRL's pull request #7269 (log_kept_mass in
trl/trainer/utils.py; closed, in no TRL release: the installed 1.16.0 and main at
f2cd57710ae345ea6428ae95363267fcf38a3dc8 compute no kept mass)."""

import itertools
import pathlib
import re

import numpy as np
import pytest
import torch

from opd_literate.mismatch.engine import (
    KEPT_MASS,
    KEPT_MASS_CHOICES,
    REPORTED,
    SAMPLERS,
    engine_toy,
    kept_mass_table,
    processed_log_probs,
)
from opd_literate.mismatch.estimators import naive, seq_is, token_ratios
from opd_literate.mismatch.toy import (
    estimator_moments,
    log_softmax,
    make_ar_toy,
    make_toy,
    toy_from_logits,
)
from tests.helpers.committed import assert_matches_committed

CUTS = [dict(temperature=0.7, top_p=0.93), dict(top_k=2), dict(temperature=1.3, min_p=0.3),
        dict(temperature=0.8, top_k=3, top_p=0.9)]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def mean_of(engine, estimator=seq_is, **kwargs):
    return estimator_moments(engine, estimator(engine, **kwargs))["mean"]


def kept_sets(toy, **cut):
    """Each position's kept tokens (T, V), read off the processed log-probs of a 1-token
    engine per position (independent positions only)."""
    z = toy["theta"] + toy["mismatch"] * toy["b"]
    rows = []
    for t in range(toy["T"]):
        one = toy_from_logits(z[t:t + 1], z[t:t + 1])
        written = engine_toy(one, **cut)["Y"][:, 0]
        rows.append(np.isin(np.arange(toy["V"]), written))
    return np.array(rows)


# ---------------------------------------------------------------------------------------------
# SGLang's log-probs
# ---------------------------------------------------------------------------------------------
def sglang_reported(logits, temperature, token):
    """SGLang 0.5.23's returned log-prob of the sampled token, its standard path restated in
    torch: logits.div_(temperatures) (line 275), probs = softmax (line 297), sampling through
    top_k_top_p_min_p_sampling_from_probs_torch, which sorts into a new tensor and cuts that
    (lines 821-835), then logprobs = torch.log(probs) (line 315) gathered at the token."""
    z = torch.tensor(logits, dtype=torch.float64)
    z.div_(temperature)
    probs = torch.softmax(z, dim=-1)
    before = probs.clone()
    probs_sort, _ = probs.sort(dim=-1, descending=True)
    probs_sort[torch.arange(len(z)) >= 2] = 0.0  # the cuts work on the sorted copy
    assert torch.equal(probs, before)  # so the log-probs read the full tempered softmax
    return float(torch.log(probs)[token])


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("cut", CUTS)
def test_sglangs_log_probs_are_the_tempered_softmax_before_every_cut(make, cut):
    toy = make(mismatch=0.3)
    engine = engine_toy(toy, reported="tempered", **cut)
    z = toy["theta"] + toy["mismatch"] * toy["b"]
    tau = cut.get("temperature", 1.0)
    for m in range(0, len(engine["Y"]), max(1, len(engine["Y"]) // 40)):
        for t in range(engine["Y"].shape[1]):
            if "mask" in engine and engine["mask"][m, t] == 0:
                assert engine["logp_sampler"][m, t] == 0.0
                continue
            row = z[t] if "prev" not in engine else z[t, engine["prev"][m, t]]
            expected = sglang_reported(row, tau, engine["Y"][m, t])
            assert engine["logp_sampler"][m, t] == pytest.approx(expected, abs=1e-12)


def test_at_temperature_one_sglangs_log_probs_are_the_raw_ones():
    toy = make_toy()
    tempered = engine_toy(toy, top_p=0.9, reported="tempered")["logp_sampler"]
    np.testing.assert_allclose(tempered, engine_toy(toy, top_p=0.9, reported="raw")
                               ["logp_sampler"], rtol=0, atol=1e-13)


def test_without_a_cut_sglangs_log_probs_are_the_processed_ones():
    toy = make_toy()
    np.testing.assert_allclose(engine_toy(toy, temperature=0.7, reported="tempered")
                               ["logp_sampler"], engine_toy(toy, temperature=0.7)
                               ["logp_sampler"], rtol=0, atol=1e-13)


def test_sglangs_ratio_hides_the_kept_mass_without_the_mismatch():
    """epsilon = 0: every tempered ratio is 1, where the processed one is the kept mass."""
    toy = make_toy(mismatch=0.0)
    engine = engine_toy(toy, temperature=0.7, top_p=0.93, reported="tempered")
    np.testing.assert_allclose(token_ratios(engine), 1.0, rtol=0, atol=1e-12)
    processed = engine_toy(toy, temperature=0.7, top_p=0.93)
    np.testing.assert_allclose(token_ratios(processed), np.exp(processed["log_kept_trainer"]),
                               rtol=1e-12)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("cut", CUTS)
def test_sglangs_log_probs_renormalised_on_the_kept_set_are_the_processed_ones(make, sampler,
                                                                              cut):
    toy = make(mismatch=0.3)
    corrected = engine_toy(toy, reported="tempered", kept_mass="sampler", sampler=sampler, **cut)
    processed = engine_toy(toy, sampler=sampler, **cut)
    np.testing.assert_allclose(corrected["logp_sampler"], processed["logp_sampler"], rtol=0,
                               atol=1e-12)


def test_the_sampler_correction_leaves_the_processed_log_probs_bit_for_bit():
    toy = make_toy()
    a = engine_toy(toy, temperature=0.7, top_p=0.93)
    b = engine_toy(toy, temperature=0.7, top_p=0.93, kept_mass="sampler")
    assert np.array_equal(a["logp_sampler"], b["logp_sampler"])


def test_the_raw_log_probs_renormalised_are_processed_only_at_temperature_one():
    toy = make_toy()
    for tau, close in ((1.0, True), (0.7, False)):
        raw = engine_toy(toy, temperature=tau, top_p=0.9, reported="raw", kept_mass="sampler")
        processed = engine_toy(toy, temperature=tau, top_p=0.9)
        assert np.allclose(raw["logp_sampler"], processed["logp_sampler"], rtol=0,
                           atol=1e-12) is close


# ---------------------------------------------------------------------------------------------
# The kept masses
# ---------------------------------------------------------------------------------------------
def trl_log_kept_mass(logits, support_ids):
    """TRL's PR #7269, log_kept_mass (trl/trainer/utils.py in its diff) restated: the kept ids
    right-padded with -1, logsumexp of the gathered logits minus logsumexp of all of them, 0
    where a position has no kept id."""
    valid = support_ids >= 0
    kept = torch.gather(logits, -1, support_ids.clamp(min=0)).masked_fill(~valid, -torch.inf)
    log_mass = torch.logsumexp(kept, dim=-1) - torch.logsumexp(logits, dim=-1)
    return torch.where(valid.any(dim=-1), log_mass, torch.zeros_like(log_mass))


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("trainer_temperature", [True, False])
def test_the_trainers_kept_mass_is_trls_log_kept_mass(cut, trainer_temperature):
    toy = make_toy()
    engine = engine_toy(toy, trainer_temperature=trainer_temperature, **cut)
    S = kept_sets(toy, **cut)  # (T, V)
    ids = torch.tensor([[v if S[t, v] else -1 for v in np.argsort(~S[t], kind="stable")]
                        for t in range(toy["T"])])
    tau = cut.get("temperature", 1.0) if trainer_temperature else 1.0
    logits = torch.tensor(toy["theta"] / tau)
    per_position = trl_log_kept_mass(logits, ids).numpy()
    np.testing.assert_allclose(engine["log_kept_trainer"],
                               np.broadcast_to(per_position, engine["Y"].shape), rtol=0,
                               atol=1e-13)
    z = (toy["theta"] + toy["mismatch"] * toy["b"]) / cut.get("temperature", 1.0)
    sampler = trl_log_kept_mass(torch.tensor(z), ids).numpy()
    np.testing.assert_allclose(engine["log_kept_sampler"],
                               np.broadcast_to(sampler, engine["Y"].shape), rtol=0, atol=1e-13)


def test_kept_masses_are_zero_on_padding_and_below_zero_where_a_token_is_cut():
    engine = engine_toy(make_ar_toy(), temperature=0.8, top_k=2)
    padding = engine["mask"] == 0
    assert padding.any() and (engine["log_kept_trainer"][padding] == 0).all()
    assert (engine["log_kept_sampler"][padding] == 0).all()
    assert (engine["log_kept_trainer"][~padding] < 0).all()  # V = 3, top-k 2 always cuts


def test_a_trainers_top_token_cut_by_the_engine_does_not_underflow():
    """The trainer's most likely token is the engine's least likely and is cut; its kept mass,
    e^-800 / (1 + e^-800) relative, is still a finite log."""
    theta = np.array([[800.0, 0.0, 0.0]])
    b = np.array([[-1700.0, 0.0, 100.0]])  # sampler logits -900, 0, 100: top-k 2 cuts token 0
    toy = dict(toy_from_logits(theta, theta + b), theta=theta, b=b, mismatch=1.0)
    engine = engine_toy(toy, top_k=2)
    assert engine["Y"][:, 0].tolist() == [1, 2]
    np.testing.assert_allclose(engine["log_kept_trainer"], np.log(2.0) - 800.0, rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# What each ratio is unbiased for, by enumeration
# ---------------------------------------------------------------------------------------------
def kept_mass_term(engine, S_of, tau):
    r"""E_{pi_S}[R sum_t grad log pi_tau(S_t)], each row's grad (pi_S - pi_tau) / tau, written
    from the definitions: pi_S of each written sequence from the trainer's log-probs minus its
    kept masses; S_of(m, t) the kept set of token t of sequence m."""
    theta = engine["theta"] / tau
    total = np.zeros_like(engine["true_grad"])
    for m, y in enumerate(engine["Y"]):
        pi_S = np.exp((engine["logp_train"][m] - engine["log_kept_trainer"][m]).sum())
        for t in range(len(y)):
            if "mask" in engine and engine["mask"][m, t] == 0:
                continue
            row = (t,) if "prev" not in engine else (t, engine["prev"][m, t])
            p = np.exp(log_softmax(theta[row]))
            p_S = np.where(S_of(m, t), p, 0.0) / p[S_of(m, t)].sum()
            total[row] += pi_S * engine["R"][m] * (p_S - p) / tau
    return total


@pytest.mark.parametrize("mismatch", [0.0, 0.3])
@pytest.mark.parametrize("cut", CUTS)
def test_the_exact_ratio_is_unbiased_for_the_objective_on_the_writable_sequences(mismatch, cut):
    toy = make_toy(mismatch=mismatch)
    restricted = None
    for options in (dict(), dict(reported="tempered", kept_mass="sampler")):
        engine = engine_toy(toy, **cut, **options)
        restricted = engine["true_grad"] - engine["truncated_grad"]
        np.testing.assert_allclose(mean_of(engine), restricted, rtol=0, atol=1e-14)
    # sum over y in W of pi_tau(y) R(y) s(y), written here
    tau = cut.get("temperature", 1.0)
    full = engine_toy(toy, temperature=tau)  # every sequence, the trainer's score at tau
    S = kept_sets(toy, **cut)
    writable = np.array([S[np.arange(toy["T"]), y].all() for y in full["Y"]])
    direct = np.einsum("m,m,mtv->tv", full["p_train"][writable], full["R"][writable],
                       full["score"][writable])
    np.testing.assert_allclose(restricted, direct, rtol=0, atol=1e-14)


def test_under_the_support_condition_the_exact_ratio_is_unbiased_for_the_true_gradient():
    """R = 1 for token 0 alone; top-p 0.7 cuts token 2: R = 0 wherever the engine cannot
    write. Cutting token 0 instead breaks the condition, and every estimate is 0."""
    for probs, unbiased in (([0.5, 0.3, 0.2], True), ([0.2, 0.5, 0.3], False)):
        logits = np.log([probs])
        toy = toy_from_logits(logits, logits + 0.03 * np.array([[1.0, -2.0, 0.5]]))
        engine = engine_toy(toy, top_p=0.7)
        error = rel(mean_of(engine), engine["true_grad"])
        assert (error < 1e-12) is unbiased
        if not unbiased:
            assert error == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("mismatch", [0.0, 0.3])
@pytest.mark.parametrize("cut", [dict(temperature=0.7, top_p=0.93), dict(temperature=0.7,
                                                                          min_p=0.2)])
def test_the_trainers_kept_mass_is_the_truncated_gradient_plus_the_kept_mass_term(make,
                                                                                  mismatch,
                                                                                  cut):
    toy = make(mismatch=mismatch)
    engine = engine_toy(toy, kept_mass="trainer", **cut)
    tau = cut.get("temperature", 1.0)
    # the kept set of each token: the tokens of its row that the processed log-probs keep
    z = (toy["theta"] + toy["mismatch"] * toy["b"])
    keep = np.isfinite(processed_log_probs(z, **cut))

    def S_of(m, t):
        return keep[t] if "prev" not in engine else keep[t, engine["prev"][m, t]]

    term = kept_mass_term(engine, S_of, tau)
    assert np.linalg.norm(term) > 1e-3  # the term bites
    np.testing.assert_allclose(mean_of(engine), engine["masked_grad"] + term, rtol=0,
                               atol=1e-14)


@pytest.mark.parametrize("mismatch", [0.0, 0.3])
def test_on_independent_positions_the_trainers_kept_mass_scales_the_exact_mean(mismatch):
    toy = make_toy(mismatch=mismatch)
    cut = dict(temperature=0.7, top_p=0.93)
    engine = engine_toy(toy, kept_mass="trainer", **cut)
    exact = engine_toy(toy, **cut)
    restricted = exact["true_grad"] - exact["truncated_grad"]
    np.testing.assert_allclose(mean_of(engine), restricted / (1 - exact["truncated_mass"]),
                               rtol=0, atol=1e-14)


def test_the_trainers_kept_mass_is_autograds_gradient_with_the_masses_held_fixed():
    """sum over W of pi_S R s_tau = grad of sum over W of pi_tau(y) R(y) / K(y), K detached."""
    toy = make_toy(T=3, V=3)
    cut = dict(temperature=0.7, top_k=2)
    engine = engine_toy(toy, kept_mass="trainer", **cut)
    theta = torch.tensor(toy["theta"], requires_grad=True)
    logp = torch.log_softmax(theta / 0.7, dim=-1)
    Y = torch.tensor(engine["Y"])
    logp_y = logp[torch.arange(3)[None, :], Y].sum(dim=1)
    K = torch.tensor(engine["log_kept_trainer"].sum(axis=1))  # held fixed
    objective = (torch.exp(logp_y - K) * torch.tensor(engine["R"])).sum()
    objective.backward()
    np.testing.assert_allclose(mean_of(engine), theta.grad.numpy(), rtol=0, atol=1e-14)


def test_a_baseline_at_the_truncated_mean_reward_cancels_the_kept_mass_term():
    """On independent positions (make_toy) only; the AR toy's test below is the converse."""
    toy = make_toy()
    cut = dict(temperature=0.7, top_p=0.93)
    engine = engine_toy(toy, kept_mass="trainer", **cut)
    pi_S = np.exp((engine["logp_train"] - engine["log_kept_trainer"]).sum(axis=1))
    assert pi_S.sum() == pytest.approx(1.0, abs=1e-12)
    beta = float(pi_S @ engine["R"])
    np.testing.assert_allclose(mean_of(engine, baseline=beta), engine["masked_grad"], rtol=0,
                               atol=1e-14)
    assert rel(mean_of(engine, baseline=0.5 * beta), engine["masked_grad"]) > 0.05


def test_on_the_ar_toy_no_baseline_cancels_the_kept_mass_term():
    """The kept sets depend on the prefix: the term is not a multiple of one vector."""
    toy = make_ar_toy()
    cut = dict(temperature=0.8, top_k=2)
    engine = engine_toy(toy, kept_mass="trainer", **cut)
    pi_S = np.exp((engine["logp_train"] - engine["log_kept_trainer"]).sum(axis=1))
    beta = float(pi_S @ engine["R"])
    errors = [rel(mean_of(engine, baseline=b), engine["masked_grad"])
              for b in [*np.linspace(0, 1, 41), beta]]
    assert min(errors) > 1e-3


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
def test_sglangs_ratio_divides_by_the_engines_kept_masses(make):
    """sum over W of pi_tau(y) R(y) s_tau(y) / prod_t mu_tau(S_t)."""
    toy = make()
    cut = dict(temperature=0.7, top_k=2)
    engine = engine_toy(toy, reported="tempered", **cut)
    divided = engine["p_train"] * np.exp(-engine["log_kept_sampler"].sum(axis=1))
    np.testing.assert_allclose(mean_of(engine), np.einsum("m,m,m...->...", divided,
                                                          engine["R"], engine["score"]),
                               rtol=0, atol=1e-14)


def test_without_the_mismatch_the_trainers_kept_mass_and_sglang_are_the_uncorrected_estimator():
    """epsilon = 0: pi_S = mu, every ratio 1: seq_is is naive, TRL's own generation."""
    toy = make_toy(mismatch=0.0)
    cut = dict(temperature=0.7, top_p=0.93)
    for options in (dict(kept_mass="trainer"), dict(reported="tempered")):
        engine = engine_toy(toy, **cut, **options)
        np.testing.assert_allclose(seq_is(engine), naive(engine), rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# The chapter's table (docs/hooks/generate.py, _engine_kept_mass: make_toy, temperature 0.7,
# top-p 0.93) and its sentences
# ---------------------------------------------------------------------------------------------
PAGE = pathlib.Path(__file__).parents[2] / "docs" / "mismatch_practice.md"


def test_the_kept_mass_tables_rows_are_engine_toys_options():
    rows = kept_mass_table(make_toy(), temperature=0.7, top_p=0.93)
    assert [r["options"] for r in rows] == [dict(o) for _, o in KEPT_MASS_CHOICES]
    for row in rows:
        engine = engine_toy(make_toy(), temperature=0.7, top_p=0.93, **row["options"])
        mean = mean_of(engine)
        assert row["rel_bias_true"] == pytest.approx(rel(mean, engine["true_grad"]), rel=1e-12)
        assert row["rel_bias_masked"] == pytest.approx(rel(mean, engine["masked_grad"]),
                                                       rel=1e-12)
    # the identities the table shows: exact ratio unbiased for J^W, the mask replayed for the
    # engine's policy, SGLang's renormalised the processed one
    assert rows[0]["rel_bias_writable"] < 1e-12 and rows[2]["rel_bias_masked"] < 1e-12
    for key in ("rel_bias_true", "rel_bias_writable", "rel_bias_masked"):
        assert rows[6][key] == pytest.approx(rows[0][key], rel=1e-9, abs=1e-12)


def test_the_chapters_sentences_on_the_kept_masses():
    page = " ".join(PAGE.read_text().split())
    found = re.search(
        r"its bias against \$\\nabla \\mathbb\{E\}_\{\\pi_S\}\[R\]\$ falls from ([0-9.]+) to "
        r"([0-9.]+), against \$\\nabla J_\\tau\^W\$ it rises from 0 to ([0-9.]+), and only the "
        r"mask replayed removes it \(([0-9.]+)\)\. SGLang's log-probs, used as they come, are "
        r"biased for every target \(([0-9.]+), ([0-9.]+) and ([0-9.]+)\); renormalised they are "
        r"the processed ones, and with the trainer's kept mass on top they count it twice "
        r"\(([0-9.]+) against \$\\nabla J_\\tau\^W\$\)", page)
    assert found, "the sentences on the kept masses are not on the page"
    rows = kept_mass_table(make_toy(), temperature=0.7, top_p=0.93)
    computed = [rows[0]["rel_bias_masked"], rows[1]["rel_bias_masked"],
                rows[1]["rel_bias_writable"], rows[2]["rel_bias_masked"],
                rows[5]["rel_bias_true"], rows[5]["rel_bias_writable"],
                rows[5]["rel_bias_masked"], rows[7]["rel_bias_writable"]]
    assert_matches_committed(computed, [float(x) for x in found.groups()], rtol=0, atol=5e-4,
                             why="three decimals on the page: half a unit of the last")
    assert min(r["rel_bias_writable"] for r in rows[1:] if r is not rows[6]) > 0.1


def test_the_variance_column_and_the_min_p_table():
    """The variance is estimator_moments' of seq_is on each engine; at min-p 0.3 the three
    identities hold again and the chapter's figures are the table's."""
    from opd_literate.mismatch.estimators import seq_is
    from opd_literate.mismatch.toy import estimator_moments

    rows = kept_mass_table(make_toy(), temperature=0.7, top_p=0.93)
    for row in rows:
        engine = engine_toy(make_toy(), temperature=0.7, top_p=0.93, **row["options"])
        assert row["var"] == pytest.approx(estimator_moments(engine, seq_is(engine))["var"],
                                           rel=1e-12)
    page = " ".join(PAGE.read_text().split())
    assert ("the trainer's kept mass doubles the processed ratio's (0.237 to 0.469)") in page
    assert_matches_committed([rows[0]["var"], rows[1]["var"]], [0.237, 0.469], rtol=0,
                             atol=5e-4, why="three decimals on the page")
    assert 1.9 < rows[1]["var"] / rows[0]["var"] < 2.1  # "doubles"
    cut = kept_mass_table(make_toy(), temperature=0.7, top_p=1.0, min_p=0.3)
    assert cut[0]["rel_bias_writable"] < 1e-12 and cut[2]["rel_bias_masked"] < 1e-12
    for key in ("rel_bias_true", "rel_bias_writable", "rel_bias_masked", "var"):
        assert cut[6][key] == pytest.approx(cut[0][key], rel=1e-9, abs=1e-12)
    assert "The trainer's kept mass costs more here, a bias of 4.252 against" in page
    assert_matches_committed(cut[1]["rel_bias_writable"], 4.252, rtol=0, atol=5e-4,
                             why="three decimals on the page")
    assert cut[1]["rel_bias_writable"] > rows[1]["rel_bias_writable"]  # "costs more here"


def test_the_chapters_sentence_on_the_kept_mass_explorer():
    """The figure's sentence, on every top-p in hundredths of its range (the figure shows ten
    of them, docs/hooks/explorables.py): the two identities at each, the trainer's kept mass's
    bias against J^W growing as top-p falls, and its two values."""
    page = " ".join(PAGE.read_text().split())
    found = re.search(
        r"gives the first table at ten top-\$p\$ from ([0-9.]+) to ([0-9.]+) \(each position is "
        r"\[`kept_mass_table`\]\[opd_literate\.mismatch\.engine\.kept_mass_table\] at that "
        r"top-\$p\$, \$\\tau = ([0-9.]+)\$\): the processed log-probs stay unbiased for "
        r"\$\\nabla J_\\tau\^W\$ and the mask replayed for "
        r"\$\\nabla \\mathbb\{E\}_\{\\pi_S\}\[R\]\$ at every position, while the trainer's "
        r"kept mass moves away from \$\\nabla J_\\tau\^W\$ as the cut deepens, from a "
        r"relative bias of ([0-9.]+) at top-\$p\$ ([0-9.]+) to "
        r"([0-9.]+) at ([0-9.]+)\.", page)
    assert found, "the sentence on the kept-mass explorer is not on the page"
    low, high, tau, near, near_p, far, far_p = (float(x) for x in found.groups())
    assert far_p == low < near_p < high
    growth = []
    for top_p in np.round(np.arange(low, high + 1e-9, 0.01), 2):
        rows = kept_mass_table(make_toy(), temperature=tau, top_p=float(top_p))
        assert rows[0]["rel_bias_writable"] < 1e-12 and rows[2]["rel_bias_masked"] < 1e-12
        growth.append(rows[1]["rel_bias_writable"])
    assert all(a >= b - 1e-12 for a, b in zip(growth, growth[1:]))  # falls as top-p rises
    computed = [kept_mass_table(make_toy(), temperature=tau, top_p=p)[1]["rel_bias_writable"]
                for p in (near_p, far_p)]
    assert_matches_committed(computed, [near, far], rtol=0, atol=5e-4,
                             why="three decimals on the page: half a unit of the last")


def test_a_target_the_cuts_leave_without_reward_is_refused():
    # top-k 2 on this toy leaves the engine's policy a gradient of 0
    with pytest.raises(ValueError, match="is 0 for .* its relative bias is undefined"):
        kept_mass_table(make_toy(), temperature=0.7, top_p=1.0, top_k=2)


def test_the_baseline_row_of_the_table():
    engine = engine_toy(make_toy(), temperature=0.7, top_p=0.93, kept_mass="trainer")
    pi_S = np.exp((engine["logp_train"] - engine["log_kept_trainer"]).sum(axis=1))
    assert round(rel(mean_of(engine, baseline=float(pi_S @ engine["R"])),
                     engine["masked_grad"]), 12) == 0.0


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def test_the_options_are_named():
    assert REPORTED == ("processed", "raw", "tempered") and KEPT_MASS == ("sampler", "trainer")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(kept_mass="engine"), ValueError, r"kept_mass must be None or one of \('sampler', "
                                           r"'trainer'\), got 'engine'"),
    (dict(kept_mass=1), TypeError, r"kept_mass must be None or one of .*, got int 1$"),
    (dict(kept_mass="trainer", trainer_mask=True), ValueError, "counts the trainer's kept mass"),
    (dict(reported="sglang"), ValueError, r"reported must be one of .*'tempered'\), got"),
])
def test_bad_kept_mass_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        engine_toy(make_toy(T=2, V=2), **kwargs)


def test_the_correction_is_recorded_and_off_by_default():
    assert engine_toy(make_toy(T=2, V=2))["kept_mass"] is None
    recorded = engine_toy(make_toy(T=2, V=2), reported="tempered", kept_mass="sampler")
    assert (recorded["reported"], recorded["kept_mass"]) == ("tempered", "sampler")


def test_every_option_combination_is_a_toy_the_estimators_accept():
    toy = make_ar_toy()
    for reported, kept_mass, mask in itertools.product(REPORTED, (None, *KEPT_MASS),
                                                       (False, True)):
        if kept_mass == "trainer" and mask:
            continue
        engine = engine_toy(toy, temperature=0.8, top_p=0.9, reported=reported,
                            kept_mass=kept_mass, trainer_mask=mask)
        assert np.isfinite(engine["logp_sampler"]).all()
        assert np.isfinite(mean_of(engine)).all()
