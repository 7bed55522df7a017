"""The lowering rule table and the typed restriction patterns.

Oracle: the exact engine (``si.expectation``) on the same model, and a NumPy softmax
over the prior's own ``log_table`` (a user prior defines its numbers there, the rule
rewrites them). Sizes are small distinct primes (5 children, 7 parents).
"""

import dataclasses
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from conftest import matrix

import structinfer as si
import structinfer.lowering as L
from structinfer.lowering import (
    DistanceBand,
    NotLowered,
    attention,
    explain,
    register_pattern_rule,
    register_prior_rule,
    register_score_rule,
)

P = si.priors
N, M, D = 5, 7, 3
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _data(seed=0):
    r = np.random.default_rng(seed)
    return (r.normal(size=(N, D)).astype(np.float32), r.normal(size=(M, D)).astype(np.float32),
            r.normal(size=(M, 2)).astype(np.float32))


def _model(prior_fn, score_fn=lambda q, k: si.scores.Dot(q, k)):
    def model(q, k, v):
        with numpyro.plate("queries", q.shape[0]):
            j = si.edge("phi", prior_fn(q.shape[0], k.shape[0]), score_fn(q, k))
            numpyro.deterministic("out", v[j])

    return model


def _reference(prior, q, k, v):
    logits = np.asarray(prior.log_table(N), np.float64) + np.float64(q) @ np.float64(k).T
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ np.float64(v)


def _alibi_class():
    """A fresh user prior class (a new type per call, so registrations do not leak)."""

    class ALiBi(P.StructuralPrior):
        kind = "alibi"

        def __init__(self, slope, num_parents, offset=0):
            self.slope, self.num_parents, self.offset = jnp.asarray(slope), num_parents, offset

        def _log_weights(self, num_children):
            d = jnp.arange(num_children)[:, None] + self.offset - jnp.arange(self.num_parents)
            return jnp.where(d >= 0, -self.slope * d, -jnp.inf)

    return ALiBi


def _alibi_rule(prior, terms):
    terms.add_column_bias(prior.slope * jnp.arange(terms.num_parents))
    terms.restrict_band(dmin=0, offset=prior.offset)
    terms.note("prior ALiBi (per-parent bias on the causal band)")


# --- user rules for user classes ----------------------------------------------------


def test_user_prior_with_a_rule_is_lowered_and_equals_the_exact_engine():
    ALiBi = _alibi_class()
    register_prior_rule(ALiBi)(_alibi_rule)
    model = _model(lambda n, m: ALiBi(0.7, m, offset=m - n))
    q, k, v = _data()
    ex = explain(model, "out", q, k, v)
    assert ex.path == "lowered" and "prior ALiBi (per-parent bias" in str(ex), str(ex)
    exact = si.expectation(model, "out", q, k, v)
    np.testing.assert_allclose(exact, _reference(ALiBi(0.7, M, offset=M - N), q, k, v),
                               atol=2e-5)
    for backend in ("dense", "blocked"):
        y = attention(model, "out", backend, block_q=2, block_k=3)(q, k, v)
        np.testing.assert_allclose(y, exact, atol=2e-5, err_msg=backend)


def test_user_prior_without_a_rule_falls_back_and_explain_names_the_type():
    ALiBi = _alibi_class()  # never registered
    model = _model(lambda n, m: ALiBi(0.7, m, offset=m - n))
    q, k, v = _data(1)
    ex = explain(model, "out", q, k, v)
    assert ex.path == "exact" and ex.fallback.site == "phi", str(ex)
    assert ex.fallback.part == "prior ALiBi" and "register_prior_rule" in str(ex), str(ex)
    np.testing.assert_allclose(attention(model, "out")(q, k, v),
                               si.expectation(model, "out", q, k, v), atol=1e-6)
    with pytest.raises(L.NotLowerableError, match="prior ALiBi"):
        attention(model, "out", "blocked")(q, k, v)


def test_subclasses_inherit_a_rule_unless_they_change_the_numbers():
    ALiBi = _alibi_class()
    register_prior_rule(ALiBi)(_alibi_rule)

    class Named(ALiBi):  # same numbers: the base's rule describes it
        kind = "named_alibi"

    class Doubled(ALiBi):  # other numbers: the base's rule would be wrong
        def _log_weights(self, num_children):
            return 2.0 * super()._log_weights(num_children)

    q, k, v = _data(2)
    named = _model(lambda n, m: Named(0.4, m, offset=m - n))
    assert explain(named, "out", q, k, v).path == "lowered"
    np.testing.assert_allclose(attention(named, "out")(q, k, v),
                               si.expectation(named, "out", q, k, v), atol=2e-5)
    doubled = _model(lambda n, m: Doubled(0.4, m, offset=m - n))
    ex = explain(doubled, "out", q, k, v)
    assert ex.path == "exact" and "overrides _log_weights" in str(ex), str(ex)
    np.testing.assert_allclose(attention(doubled, "out")(q, k, v),
                               _reference(Doubled(0.4, M, offset=M - N), q, k, v), atol=2e-5)
    # its own rule takes precedence over the base's
    @register_prior_rule(Doubled)
    def _doubled(prior, terms):
        terms.add_column_bias(2.0 * prior.slope * jnp.arange(terms.num_parents))
        terms.restrict_band(dmin=0, offset=prior.offset)

    assert explain(doubled, "out", q, k, v).path == "lowered"
    np.testing.assert_allclose(attention(doubled, "out")(q, k, v),
                               _reference(Doubled(0.4, M, offset=M - N), q, k, v), atol=2e-5)


def test_user_score_rule_inside_a_sum():
    class ParentBias(si.scores.Score):
        """psi_ij = b_j."""

        kind = "parent_bias"

        def __init__(self, b, n):
            self.b, self._n = jnp.asarray(b), n

        num_children = property(lambda self: self._n)
        num_parents = property(lambda self: int(self.b.shape[-1]))

        def dense(self):
            return jnp.broadcast_to(self.b, (self._n, self.b.shape[-1]))

    q, k, v = _data(3)
    b = np.random.default_rng(3).normal(size=M).astype(np.float32)
    model = _model(lambda n, m: P.Uniform(m),
                   lambda q, k: si.scores.Sum(si.scores.Dot(q, k), ParentBias(b, q.shape[0])))
    ex = explain(model, "out", q, k, v)
    assert ex.path == "exact" and ex.fallback.part == "score ParentBias", str(ex)

    @register_score_rule(ParentBias)
    def _bias(score, terms):
        terms.add_column_bias(score.b)
        terms.note("score ParentBias (per-parent bias)")

    ex = explain(model, "out", q, k, v)
    assert ex.path == "lowered" and "score ParentBias" in str(ex), str(ex)
    np.testing.assert_allclose(attention(model, "out", "blocked", block_q=2, block_k=3)(q, k, v),
                               si.expectation(model, "out", q, k, v), atol=2e-5)


def test_a_rule_may_decline_with_not_lowered():
    ALiBi = _alibi_class()

    @register_prior_rule(ALiBi)
    def _only_static(prior, terms):
        raise NotLowered("prior ALiBi", "this rule lowers nothing")

    model = _model(lambda n, m: ALiBi(0.3, m, offset=m - n))
    q, k, v = _data(4)
    ex = explain(model, "out", q, k, v)
    assert ex.path == "exact" and "this rule lowers nothing" in str(ex), str(ex)
    np.testing.assert_allclose(attention(model, "out")(q, k, v),
                               si.expectation(model, "out", q, k, v), atol=1e-6)


def test_registration_checks_its_arguments():
    with pytest.raises(TypeError, match="not a subclass of structinfer.priors.StructuralPrior"):
        register_prior_rule(si.scores.Dot)
    with pytest.raises(TypeError, match="not a subclass of structinfer.scores.Score"):
        register_score_rule("Dot")
    with pytest.raises(TypeError, match="RestrictionPattern"):
        register_pattern_rule(dict)
    with pytest.raises(TypeError, match="at least one"):
        register_prior_rule()
    with pytest.raises(TypeError, match="callable"):
        register_prior_rule(_alibi_class())(42)


def test_the_docs_example_runs():
    """docs/performance.md's rule example: lowered result == exact engine (asserted inside)."""
    text = (ROOT / "docs" / "performance.md").read_text()
    code = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if "register_prior_rule(ALiBi)" in b]
    assert len(code) == 1
    exec(compile(code[0], "docs/performance.md", "exec"), {"__name__": "docs_example"})


# --- typed restriction patterns ------------------------------------------------------


def test_constructors_set_typed_patterns():
    R = P.Restricted
    cases = [
        (R.causal(N, M, include_self=False, offset=2), P.Causal(include_self=False, offset=2),
         {"type": "causal", "include_self": False, "offset": 2}),
        (R.window(N, 3, M, causal=False, include_self=False, offset=1),
         P.Window(3, causal=False, include_self=False, offset=1),
         {"type": "window", "size": 3, "causal": False, "include_self": False, "offset": 1}),
        (R.from_graph(np.ones((N, M))), P.Graph(), {"type": "graph", "offset": 0}),
        (R.block_sparse(np.ones((2, 3), bool), (3, 4)), P.BlockSparse((3, 4)),
         {"type": "block_sparse", "block_size": (3, 4), "offset": 0}),
        (R.block_sparse(np.ones((2, 2), bool), 3), P.BlockSparse((3, 3)),
         {"type": "block_sparse", "block_size": (3, 3), "offset": 0}),
        (R(np.ones((N, M), bool)), P.Mask(), {"type": "mask", "offset": 0}),
        (R(np.ones((N, M), bool), pattern=P.Mask("no_self")), P.Mask(label="no_self"),
         {"type": "mask", "label": "no_self", "offset": 0}),
    ]
    for prior, pattern, desc in cases:
        assert type(prior.pattern) is type(pattern) and prior.pattern == pattern
        d = prior.describe()
        assert d.pop("kind") == "restricted" and d.pop("num_parents") == prior.num_parents
        assert d == desc and list(d) == list(desc)  # same keys, same order as before
        with pytest.raises(dataclasses.FrozenInstanceError):
            prior.pattern.offset = 5
    assert R.causal(N, M, offset=3).offset == 3  # a pattern's offset is the prior's


def test_a_dict_or_a_bad_field_is_a_clear_error():
    mask = np.ones((N, M), bool)
    with pytest.raises(TypeError, match=r"not a dict.*Causal\(include_self=False, offset=0\)"):
        P.Restricted(mask, pattern={"type": "causal", "include_self": False, "offset": 0})
    with pytest.raises(TypeError, match=r"Mask\(label='no_self'\)"):
        P.Restricted(mask, pattern={"type": "no_self"})
    with pytest.raises(TypeError, match="RestrictionPattern"):
        P.Restricted(mask, pattern="causal")
    with pytest.raises(ValueError, match="size must be >= 1"):
        P.Window(0)
    with pytest.raises(TypeError, match="size must be a positive int"):
        P.Window(2.5)
    with pytest.raises(TypeError, match="offset must be an int"):
        P.Causal(offset=1.5)
    with pytest.raises(TypeError, match="include_self must be a bool"):
        P.Causal(include_self="yes")
    with pytest.raises(ValueError, match="block_size"):
        P.BlockSparse((2, 3, 4))
    with pytest.raises(TypeError, match="label"):
        P.Mask(3)


def test_pattern_rules_dispatch_on_the_pattern_type():
    class Diagonal(P.RestrictionPattern):
        """Only the self-edge (a band of width 1)."""

        kind = "diagonal"

    mask = np.eye(N, M, k=M - N, dtype=bool)
    model = _model(lambda n, m: P.Restricted(mask, pattern=Diagonal()))
    q, k, v = _data(5)
    ref = si.expectation(model, "out", q, k, v)
    # no rule of its own: the base pattern's rule lowers it as its mask
    assert "diagonal mask; empty blocks skipped" in str(explain(model, "out", q, k, v))

    @register_pattern_rule(Diagonal)
    def _diag(pattern):
        return DistanceBand(dmin=0, dmax=0, offset=M - N)

    ex = explain(model, "out", q, k, v)
    assert ex.path == "lowered" and "Restricted.diagonal (distance band 0 <= d <= 0" in str(ex)
    np.testing.assert_allclose(attention(model, "out", "windowed", block_q=2)(q, k, v), ref,
                               atol=1e-6)

    @register_pattern_rule(Diagonal)
    def _bad(pattern):
        return {"dmin": 0}

    with pytest.raises(TypeError, match="returns a structinfer.lowering.DistanceBand"):
        explain(model, "out", q, k, v)


def test_distance_band_mask():
    band = DistanceBand(dmin=-1, dmax=2, exclude_zero=True, offset=1)
    d = np.arange(N)[:, None] + 1 - np.arange(M)[None, :]
    np.testing.assert_array_equal(band.mask(N, M), (d >= -1) & (d <= 2) & (d != 0))
    assert DistanceBand().mask(2, 3).all()


# --- the public surface ---------------------------------------------------------------


def test_lowering_namespace_is_what_users_call():
    internals = ["Terms", "Problem", "Rows", "Cols", "Pairs", "Globals", "Consts", "RelPos",
                 "Plan", "Fallback", "recognise", "lower_edge", "Lowered", "block_logits",
                 "Schedule", "make_schedule", "band_blocks", "blocked_attention",
                 "dense_attention", "dense_logits", "band_logits", "windowed_kernel"]
    for name in internals:
        assert not hasattr(L, name), name
    for name in L.__all__:
        assert getattr(L, name) is not None
    assert {"attention", "explain", "register_prior_rule", "register_score_rule",
            "register_pattern_rule"} <= set(L.__all__)


def test_a_concrete_mask_is_kept_only_when_every_per_edge_mask_is_concrete():
    """`Lowered.mask` is the value of the whole per-edge mask or nothing: a rule that
    restricts the edges twice, once with the mask's concrete value and once without (a
    traced mask), lowers with no concrete mask, since the Pallas kernel computes a block
    the concrete mask allows entirely without reading the mask. Two concrete masks give
    their intersection."""
    import jax

    from structinfer.lowering._lower import lower_edge

    class Twice(P.StructuralPrior):
        kind = "twice"

        def __init__(self, a, b, concrete_b):
            self.a, self.b, self.concrete_b = a, b, concrete_b

        num_parents = property(lambda self: M)

    @register_prior_rule(Twice)
    def _twice(prior, terms):
        terms.restrict_pairs(jnp.asarray(prior.a), prior.a)
        terms.restrict_pairs(prior.b, prior.b if prior.concrete_b else None)

    r = np.random.default_rng(7)
    a, b = r.random((N, M)) < 0.6, r.random((N, M)) < 0.6
    q, k, v = _data(7)

    def lowered(b, concrete_b):
        return lower_edge(Twice(a, b, concrete_b), si.scores.Dot(q, k), jnp.asarray(v), N)

    low = lowered(b, True)
    assert low.terms.pair_ok
    np.testing.assert_array_equal(low.mask, a & b)
    assert lowered(b, False).mask is None
    masks = []
    jax.jit(lambda b: masks.append(lowered(b, False).mask) or b)(jnp.asarray(b))
    assert masks == [None]


SCALE_SHAPES = [(), (1,), (4,), (2, 1, 4), (2, 6, 1), (6, 1), (2, 1, 1), (6, 4)]


# d = 4: as many features as parents (the silent wrong answer), every shape with Dot and a
# scalar, a per-parent and a child-and-parent scale with Cosine; d = 3 (a broadcasting
# error) a per-parent and a child-and-parent scale with Dot; the rest exhaustive
_SCALE_KEPT = {(4, "Cosine", (4,)), (4, "Cosine", ()), (4, "Cosine", (6, 4)),
               (3, "Dot", (4,)), (3, "Dot", (6, 4))}


@pytest.mark.parametrize("d, score, shape", matrix(
    [(d, score, shape) for d in (4, 3) for score in ("Dot", "Cosine") for shape in SCALE_SHAPES],
    lambda d, score, shape: (d, score) == (4, "Dot") or (d, score, shape) in _SCALE_KEPT,
    ids=[f"{d}-{score}-shape{i}" for d in (4, 3) for score in ("Dot", "Cosine")
         for i in range(len(SCALE_SHAPES))]))
def test_a_scale_array_scales_the_scores_not_the_features(shape, score, d):
    """Regression: an array ``scale`` multiplies the score table, as the exact engine
    reads it; the lowering multiplied the queries' features by it, so a per-parent scale
    gave a finite wrong answer when the parents were as many as the features, and a
    broadcasting error otherwise. A scale per child, per parent or per head is lowered;
    one varying with both child and parent falls back to the exact engine."""
    import jax
    from numpyro.ops.indexing import Vindex

    H, n, m = 2, 6, 4
    r = np.random.default_rng(9)
    q, k = (jnp.asarray(r.normal(size=(H, s, d)), jnp.float32) for s in (n, m))
    v = jnp.asarray(r.normal(size=(H, m, 2)), jnp.float32)
    scale = jnp.asarray(r.uniform(0.2, 3.0, size=shape), jnp.float32)
    make = {"Dot": si.scores.Dot, "Cosine": si.scores.Cosine}[score]

    def model(q, k, v, scale):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("q", n, dim=-1):
            j = si.edge("phi", si.priors.Uniform(m), make(q, k, scale=scale))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    want = si.expectation(model, "out", q, k, v, scale)
    ex = L.explain(model, "out", q, k, v, scale)
    assert ex.path == ("exact" if shape == (6, 4) else "lowered"), str(ex)
    if shape == (6, 4):
        assert "varies with both the child and the parent" in str(ex), str(ex)
    for backend in ("auto", "dense", "blocked"):
        got = jax.jit(si.attention(model, "out", backend if ex.path == "lowered" else "auto",
                                   block_q=4, block_k=2))(q, k, v, scale)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend)


@pytest.mark.parametrize("p_shape", [(), (1, 1), (300,), (300, 1)])
def test_an_idw_exponent_per_child_or_parent_falls_back(p_shape):
    """Regression: `NegLogDist` with an exponent (or eps) per parent or child was
    reported lowered, and `attention` then failed with a broadcasting error past one
    block (the kernels slice no table of them). A scalar is lowered; one per child or
    parent falls back to the exact engine, which `explain` says."""
    import jax
    from numpyro.ops.indexing import Vindex

    H, n, d = 2, 300, 4
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(H, n, d)), jnp.float32) for _ in range(3))
    p = jnp.asarray(r.uniform(1.0, 3.0, size=p_shape), jnp.float32)

    def model(q, k, v, p):
        with numpyro.plate("heads", H, dim=-2), numpyro.plate("q", n, dim=-1):
            j = si.edge("phi", si.priors.Uniform(n), si.scores.NegLogDist(q, k, p=p, eps=0.1))
            numpyro.deterministic("out", Vindex(v[:, None])[..., j, :])

    ex = L.explain(model, "out", q, k, v, p)
    varies = p_shape in ((300,), (300, 1))
    assert ex.path == ("exact" if varies else "lowered"), str(ex)
    if varies:
        assert "its p of shape" in str(ex) and "varies with the child or the parent" in str(ex)
    got = jax.jit(si.attention(model, "out"))(q, k, v, p)
    np.testing.assert_allclose(got, si.expectation(model, "out", q, k, v, p), rtol=1e-4,
                               atol=1e-5)
