"""SVI and NUTS with the edges enumerated: the worked examples recover the parameters
that simulated their data (run in --quick mode), and fit_svi reports failures."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import structinfer as si

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_conditional_edge_is_the_normalised_posterior(x64):
    r = np.random.default_rng(0)
    S = r.normal(size=(5, 7))
    y = r.normal(size=5)
    v = r.normal(size=7)

    def model(S, y):
        with numpyro.plate("q", 5):
            j = si.infer.conditional_edge("phi", si.priors.Uniform(7), si.scores.Custom(S))
            numpyro.sample("y", dist.Normal(jnp.asarray(v)[j], 0.5), obs=y)

    P = np.exp(S - S.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    lik = np.exp(-0.5 * ((y[:, None] - v[None]) / 0.5) ** 2) / (0.5 * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(si.log_marginal(model, S, y), np.log((P * lik).sum(1)).sum(),
                               rtol=1e-12)


def test_svi_recovers_attention_weights():
    ex = load("infer_svi_attention")
    out = ex.main(["--quick"])
    info = out["info"]
    n = int(info.num_steps)
    assert float(info.energy[n]) < float(info.energy[0])
    # 32 x 5 noisy observations: loose, but far below the error of the initial guess (~1)
    assert out["err_bilinear"] < 0.3
    assert out["err_wv"] < 0.1


def test_nuts_recovers_temperature_and_rate():
    ex = load("infer_nuts_expanding")
    out = ex.main(["--quick"])
    s, true = out["samples"], out["true"]
    for name in ("q", "beta"):
        draws = np.asarray(s[name])
        assert np.all(np.isfinite(draws))
        # the truth lies within 3.5 posterior standard deviations of the posterior mean
        assert abs(draws.mean() - true[name]) < 3.5 * draws.std() + 0.02, name
    # and the posterior is informative: narrower than the prior
    assert np.asarray(s["q"]).std() < 0.2  # Beta(1, 1) has sd 0.29


def test_fit_svi_nonfinite_names_the_step():
    x = jnp.array([1.0, 2.0, 3.0])

    def model(x):
        s = numpyro.param("s", jnp.array(1.0))
        with numpyro.plate("c", 3):
            si.edge("phi", si.priors.Uniform(2), si.scores.Custom(jnp.stack([x, -x], -1)))
            numpyro.factor("bad", -jnp.log(s) * x)  # Adam drives s below 0

    with pytest.raises(si.infer.NonFiniteEnergyError, match="fit_svi.*step") as err:
        si.infer.fit_svi(model, x, guide=None, learning_rate=5.0, num_steps=20,
                         rng_key=jax.random.PRNGKey(0))
    assert err.value.step >= 1


def test_posterior_marginals_average_the_attention_over_draws(x64):
    r = np.random.default_rng(1)
    n = 5
    S = r.normal(size=(n, n))

    def model(S):
        q = numpyro.sample("q", dist.Beta(2.0, 2.0))
        with numpyro.plate("queries", n):
            si.edge("phi", si.priors.Geometric(q, n), si.scores.Custom(S))

    qs = np.array([0.2, 0.5, 0.7])
    got = si.infer.posterior_marginals(model, {"q": jnp.asarray(qs)}, S)["phi"]
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    ref = 0
    for q in qs:
        logits = np.where(d >= 0, S + d * np.log1p(-q), -np.inf)
        P = np.exp(logits - logits.max(1, keepdims=True))
        ref = ref + P / P.sum(1, keepdims=True) / len(qs)
    np.testing.assert_allclose(got, ref, atol=1e-12)
