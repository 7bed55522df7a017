r"""The mechanism registry: one row per catalogue entry, read by the contract test and the docs.

A row (`Mechanism`) names a model from `structinfer.mechanisms`, an example factory with
distinct prime sizes, the quantities the engine computes from the model (attention,
output, energy, gradients, fixed points), an independent reference formula of the
paper's closed form and the citation. A row's example factory and reference are written
just above it. A reference uses only `jax.numpy` and the oracle building blocks of
`structinfer.testing.oracles`, never the engine; `evaluate` computes a row's quantities
with the exact engine only — nothing in it knows the mechanism.

Adding a mechanism is adding a row (`docs/architecture.md`, "Adding a mechanism"). The
row then has to pass the contract test (`tests/test_mechanisms.py`): jit, vmap over a
batch, float32 and float64, gradients matching those of the reference, and the paper
check; `docs/gen_catalogue.py` renders it into `docs/catalogue.md`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import beta as beta_dist
from numpyro.handlers import substitute

from .. import mechanisms as mech
from .._checks import NotFoundError, as_arrays
from ..exact import expectation, inspect_model, log_z
from .oracles import (
    NEG_INF,
    attention_out_energy,
    bilinear_term,
    chain_posterior,
    lse,
    masked_attention,
    memory_blocks,
    project_values,
    relative_log_prior,
    self_mask,
    softmax,
    transition_terms,
    uniform_log_prior,
)

__all__ = [
    "Quantity",
    "Example",
    "Mechanism",
    "REGISTRY",
    "get",
    "names",
    "evaluate",
    "attention",
    "output",
    "ENERGY",
    "neg_grad",
    "grad",
    "fixed_point",
    "custom",
]

PAPER_KEYS = ("SB", "T", "M")  # Singh & Buckley; Tschantz; McCarter
"""The papers a row may cite (`Mechanism.paper`): Singh & Buckley, Tschantz, McCarter."""


# ------------------------------------------------------------------------ quantities


@dataclass(frozen=True)
class Quantity:
    r"""What the engine computes for a row; `key` names it in `evaluate`'s output.

    Kinds: `attention` (posterior marginal of an edge site), `output` (posterior
    expectation of a deterministic site), `energy` (collapsed energy), `neg_grad` /
    `grad` ($\mp\partial E/\partial$ an input), `fixed_point`
    ($\mu - \lambda^{-1}\partial E/\partial\mu$, the CCCP update for a latent site
    with quadratic node potential of precision $\lambda$, Singh & Buckley eq. 8) and
    `custom` (`fn(inputs, static) -> dict`).

    Attributes:
        kind: one of the kinds above.
        target: the site or input the quantity is about.
        precision: $\lambda$ of a `fixed_point`.
        fn: the function of a `custom` quantity.
        keys: the keys a `custom` quantity returns.
        gradient_of_energy: whether a `custom` quantity is an energy gradient.
    """

    kind: str
    target: str = ""
    precision: float = 1.0
    fn: Callable[..., dict[str, jax.Array]] | None = None
    keys: tuple[str, ...] = ()
    gradient_of_energy: bool = False  # custom quantities that are energy gradients

    @property
    def is_gradient(self) -> bool:
        """Whether the quantity is itself a gradient of the energy."""
        return self.kind in ("neg_grad", "grad", "fixed_point") or self.gradient_of_energy

    @property
    def key(self) -> str:
        """The quantity's key in `evaluate`'s output and the reference's dict."""
        return {
            "attention": f"attention:{self.target}",
            "output": f"output:{self.target}",
            "energy": "energy",
            "neg_grad": f"-grad:{self.target}",
            "grad": f"grad:{self.target}",
            "fixed_point": f"fixed_point:{self.target}",
            "custom": ",".join(self.keys),
        }[self.kind]


def attention(site: str) -> Quantity:
    r"""The posterior marginals $p(\phi_i = j \mid x)$ of edge site `site`.

    Args:
        site: the edge site's name.

    Returns:
        The quantity, key ``attention:<site>``.
    """
    return Quantity("attention", site)


def output(site: str) -> Quantity:
    r"""The posterior expectation $\mathbb E[v \mid x]$ of deterministic site `site`.

    Args:
        site: the deterministic site's name.

    Returns:
        The quantity, key ``output:<site>``.
    """
    return Quantity("output", site)


ENERGY = Quantity("energy")
r"""The collapsed energy $E = -\log p(x)$ (key ``energy``)."""


def neg_grad(name: str) -> Quantity:
    r"""$-\partial E/\partial$ input `name`.

    Args:
        name: the model argument.

    Returns:
        The quantity, key ``-grad:<name>``.
    """
    return Quantity("neg_grad", name)


def grad(name: str) -> Quantity:
    r"""$\partial E/\partial$ input `name`.

    Args:
        name: the model argument.

    Returns:
        The quantity, key ``grad:<name>``.
    """
    return Quantity("grad", name)


def fixed_point(latent: str, precision: float = 1.0) -> Quantity:
    r"""The CCCP update $\mu - \lambda^{-1}\partial E/\partial\mu$ of latent site `latent`.

    Args:
        latent: the latent site's name.
        precision: $\lambda$, the precision of its quadratic node potential.

    Returns:
        The quantity, key ``fixed_point:<latent>``.
    """
    return Quantity("fixed_point", latent, precision=precision)


def custom(
    fn: Callable[..., dict[str, jax.Array]], *keys: str, gradient_of_energy: bool = False
) -> Quantity:
    """A quantity computed by `fn(inputs, static)` (which must use the engine).

    Args:
        fn: returns ``{key: array}`` for the given keys.
        *keys: the keys `fn` returns.
        gradient_of_energy: whether the quantity is an energy gradient.

    Returns:
        The quantity.
    """
    return Quantity("custom", fn=fn, keys=tuple(keys), gradient_of_energy=gradient_of_energy)


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Example:
    """Example arguments of a row.

    `inputs` are arrays (or pytrees of arrays): data, parameters and the values of
    latent sites — the contract test differentiates the float ones and vmaps over
    `inputs[batch]`. `static` are Python values (sizes, flags, concrete masks).

    Attributes:
        inputs: array arguments, by name.
        static: Python arguments, by name.
        batch: the input the contract test vmaps over.
    """

    inputs: dict[str, Any]
    static: dict[str, Any] = field(default_factory=dict)
    batch: str = ""


@dataclass(frozen=True)
class Mechanism:
    """One catalogue row.

    `model` is a public model of `structinfer.mechanisms`; `paper` one of `PAPER_KEYS`
    (`"SB"` Singh & Buckley, `"T"` Tschantz, `"M"` McCarter) and `section` where in it;
    `example(rng, dtype)` returns an `Example`; `reference(**inputs, **static)` returns
    `{quantity key: array}` from the paper's closed form; `check` says in words what the
    reference checks; `latents` are the model's latent sites given values from `inputs`.

    Attributes:
        name: the row's name (its catalogue anchor).
        title: the row's title.
        model: the model function.
        paper: the paper key.
        section: the section of the paper.
        example: ``example(rng, dtype) -> Example``.
        quantities: what the engine computes for the row.
        reference: the paper's closed form.
        check: what the reference checks, in words.
        latents: latent sites given values from the inputs.
    """

    name: str
    title: str
    model: Callable[..., None]
    paper: str
    section: str
    example: Callable[[np.random.Generator, Any], Example]
    quantities: tuple[Quantity, ...]
    reference: Callable[..., dict[str, jax.Array]]
    check: str
    latents: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys the contract test compares: every quantity's (custom ones: their own)."""
        out: list[str] = []
        for q in self.quantities:
            out.extend(q.keys if q.kind == "custom" else (q.key,))
        return tuple(out)


def _accepted(model, kwargs: dict) -> dict:
    params = inspect.signature(model).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _is_float_tree(x) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating) for v in leaves)


def evaluate(
    row: Mechanism, inputs: dict[str, Any], static: dict[str, Any] | None = None
) -> dict[str, jax.Array]:
    r"""Compute a row's quantities from its model with the exact engine.

    Latent sites named in `row.latents` are given the values `inputs[name]`; everything
    else the model accepts is passed as keyword arguments. Jittable, vmappable and
    differentiable.

    Everything comes from one collapsed pass: $\log Z$ with zero tilts on the edge sites
    and the deterministic value sites, differentiated once with respect to the tilts (the
    attention and the outputs, as in `structinfer.marginals` and `structinfer.expectation`)
    and to the float inputs (the energy gradients, as `jax.grad` of `structinfer.energy`).

    Args:
        row: the registry row.
        inputs: array arguments (`Example.inputs`), including the latent sites' values.
        static: Python arguments (`Example.static`).

    Returns:
        `{quantity key: array}` (custom quantities contribute their own keys).
    """
    static = dict(static or {})

    def bound(inp):
        model = row.model
        if row.latents:
            model = substitute(model, data={k: inp[k] for k in row.latents})
        kwargs = {k: v for k, v in {**inp, **static}.items() if k not in row.latents}
        return model, as_arrays((), _accepted(row.model, kwargs))[1]

    qs = row.quantities
    out: dict[str, jax.Array] = {}
    edges = sorted({q.target for q in qs if q.kind == "attention"})
    values = sorted({q.target for q in qs if q.kind == "output"})
    needs_grad = any(q.kind in ("neg_grad", "grad", "fixed_point") for q in qs)
    if edges or values or needs_grad or any(q.kind == "energy" for q in qs):
        model, kwargs = bound(inputs)
        info = inspect_model(model, **kwargs)
        dtype = jnp.result_type(float)
        for n in values:
            if n not in info.deterministic:
                raise NotFoundError(f"mechanism '{row.name}': the model has no deterministic site '{n}'")
        # a Markov edge (a chain in a scan) takes a pairwise tilt (previous, next); its
        # attention sums the previous out
        markov = {n for n in edges if info[n].edge is not None and info[n].edge.markov}
        zeros = {
            n: jnp.zeros(info.enumerated[n][0] + ((info.enumerated[n][1] + 1,) if n in markov
                                                  else ()) + (info.enumerated[n][1],), dtype)
            for n in edges
        }
        zeros.update({n: jnp.zeros(info.deterministic[n][0], dtype) for n in values})
        diff = {k: v for k, v in inputs.items() if _is_float_tree(v)} if needs_grad else {}

        def tilted_log_z(t, d):
            m, kw = bound({**inputs, **d})
            tilts = {n: (t[n], 0) for n in edges}
            tilts.update({n: (t[n], info.deterministic[n][1]) for n in values})
            return log_z(m, (), kw, info=info, tilts=tilts)

        lz, (g_t, g) = jax.value_and_grad(tilted_log_z, argnums=(0, 1))(zeros, diff)
        for q in qs:
            if q.kind in ("attention", "output"):
                out[q.key] = g_t[q.target].sum(-2) if q.target in markov else g_t[q.target]
            elif q.kind == "energy":
                out[q.key] = -lz
            elif q.kind == "neg_grad":
                out[q.key] = g[q.target]
            elif q.kind == "grad":
                out[q.key] = -g[q.target]
            elif q.kind == "fixed_point":
                out[q.key] = inputs[q.target] + g[q.target] / q.precision
    for q in qs:
        if q.kind == "custom":
            res = q.fn(inputs, static)
            for k in q.keys:
                out[k] = res[k]
    return out


# -------------------------------------------------------------------- example data


class _Gen:
    def __init__(self, rng: np.random.Generator, dtype):
        self.rng, self.dtype = rng, dtype

    def normal(self, *shape, scale=1.0):
        return jnp.asarray(scale * self.rng.normal(size=shape), self.dtype)

    def uniform(self, *shape, low=0.0, high=1.0):
        return jnp.asarray(self.rng.uniform(low, high, size=shape), self.dtype)


def _proj(g: _Gen, *shape):
    return g.normal(*shape, scale=shape[-1] ** -0.5)


# sizes: queries 5, keys 7, features 3, projected 2, values 11 (distinct primes)


def _ex_self(rng, dtype, **static):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), wq=_proj(g, 2, 3), wk=_proj(g, 2, 3), wv=_proj(g, 11, 3)),
        static,
        batch="x",
    )


def _spd(g: _Gen, k, d):
    a = g.normal(k, d, d, scale=0.3)
    return jnp.einsum("kij,klj->kil", a, a) + jnp.eye(d, dtype=g.dtype)


_ATT_OUT_E = (attention("phi"), output("out"), ENERGY)

# ---------------------------------------------------------------------------- the rows
#
# One block per row, in catalogue order: the example factory, the reference (plain
# jax.numpy and the oracles' building blocks), then the row. A row reuses the factory or
# the reference of an earlier one where the paper's formula is the same.

_ROWS: list[Mechanism] = []

# ---------------------------------------------------- Singh & Buckley, Table 1


def _ex_cross(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            xq=g.normal(5, 3),
            xk=g.normal(7, 3),
            wq=_proj(g, 2, 3),
            wk=_proj(g, 2, 3),
            wv=_proj(g, 11, 3),
        ),
        dict(scale=2**-0.5),
        batch="xq",
    )


def _ref_cross_attention(xq, xk, wq, wk, wv=None, scale=None):
    """Sec. 3.2: softmax_j(x'_i^T W_Q^T W_K x_j) W_V x_j; energy -sum lse + n log m."""
    s = (xq @ wq.T) @ (xk @ wk.T).T * (1.0 if scale is None else scale)
    return attention_out_energy(s, -math.log(xk.shape[0]), project_values(xk, wv))


_ROWS.append(
    Mechanism(
        "cross_attention",
        "Cross attention",
        mech.cross_attention,
        "SB",
        "sec. 3.2, Table 1 row 1",
        _ex_cross,
        _ATT_OUT_E,
        _ref_cross_attention,
        "attention = softmax_j(x'_i W_Q^T W_K x_j); output = attention @ W_V X; "
        "energy = -sum_i lse_j + n log m",
    )
)


def _ref_self_attention(x, wq, wk, wv=None, include_self=True, causal=False, scale=None):
    """Appendix 8.1: softmax over the allowed parents."""
    s = (x @ wq.T) @ (x @ wk.T).T * (1.0 if scale is None else scale)
    return masked_attention(s, self_mask(x.shape[0], include_self, causal), project_values(x, wv))


_ROWS.append(
    Mechanism(
        "self_attention",
        "Self attention (directed, no self-edge)",
        mech.self_attention,
        "SB",
        "appendix 8.1, Table 1 row 2",
        lambda r, d: _ex_self(r, d, include_self=False),
        _ATT_OUT_E,
        _ref_self_attention,
        "softmax over j != i of x_i W_Q^T W_K x_j; output and energy",
    )
)


def _ex_graph(rng, dtype):
    ex = _ex_self(rng, dtype)
    adj = rng.random((7, 7)) < 0.4
    adj[np.arange(7), (np.arange(7) + 3) % 7] = True  # every node has a neighbour
    return Example(ex.inputs, dict(adjacency=adj), batch="x")


def _ref_graph_attention(x, wq, wk, wv, adjacency, self_loops=False):
    mask = np.asarray(adjacency) != 0
    if self_loops:
        mask = mask | np.eye(mask.shape[0], dtype=bool)
    return masked_attention((x @ wq.T) @ (x @ wk.T).T, mask, project_values(x, wv))


_ROWS.append(
    Mechanism(
        "graph_attention",
        "Graph attention",
        mech.graph_attention,
        "SB",
        "appendix 8.2, Table 1 row 3",
        _ex_graph,
        _ATT_OUT_E,
        _ref_graph_attention,
        "softmax restricted to the neighbours of a random graph",
    )
)


def _ref_sparse_attention(
    x, wq, wk, wv, window=None, block_mask=None, block_size=None, causal=True
):
    n = x.shape[0]
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    if window is not None:
        mask = (d >= 0) & (d < window) if causal else np.abs(d) < window
    else:
        mask = np.kron(np.asarray(block_mask, bool), np.ones((block_size, block_size), bool))
    return masked_attention((x @ wq.T) @ (x @ wk.T).T, mask, project_values(x, wv))


_ROWS.append(
    Mechanism(
        "sparse_attention",
        "Sparse (sliding-window) attention",
        mech.sparse_attention,
        "SB",
        "appendix 8.2, Table 1 row 3",
        lambda r, d: Example(_ex_self(r, d).inputs, dict(window=3), batch="x"),
        _ATT_OUT_E,
        _ref_sparse_attention,
        "softmax restricted to a causal window of 3",
    )
)


def _ex_relative(rng, dtype, parameterisation):
    ex = _ex_self(rng, dtype)
    g = _Gen(rng, dtype)
    theta = g.normal(7, 7) if parameterisation == "categorical" else g.normal(5)
    return Example(
        {**ex.inputs, "theta": theta}, dict(parameterisation=parameterisation), batch="x"
    )


def _ref_relative_position_attention(x, wq, wk, wv, theta, parameterisation="hartley"):
    """Appendix 8.2: softmax_j(x_i Q^T K x_j + ln p_ij)."""
    ln_p = relative_log_prior(theta, x.shape[0], parameterisation)
    log_prior = ln_p - lse(ln_p)[:, None]
    return attention_out_energy((x @ wq.T) @ (x @ wk.T).T, log_prior, project_values(x, wv))


_ROWS.append(
    Mechanism(
        "relative_position",
        "Relative positional encodings (Hartley prior)",
        mech.relative_position_attention,
        "SB",
        "appendix 8.2, Table 1 row 4",
        lambda r, d: _ex_relative(r, d, "hartley"),
        _ATT_OUT_E,
        _ref_relative_position_attention,
        "softmax_j(x_i Q^T K x_j + ln p_ij), ln p_ij = sum_k beta_k (cos + sin)(2 pi k (i-j)/n)",
    )
)
_ROWS.append(
    Mechanism(
        "relative_position_categorical",
        "Relative positional encodings (categorical prior)",
        mech.relative_position_attention,
        "SB",
        "appendix 8.2, Table 1 row 4",
        lambda r, d: _ex_relative(r, d, "categorical"),
        _ATT_OUT_E,
        _ref_relative_position_attention,
        "softmax_j(x_i Q^T K x_j + ln p_ij) for a free P",
    )
)


def _ex_absolute(rng, dtype):
    ex = _ex_self(rng, dtype)
    return Example(
        {**ex.inputs, "positions": mech.sinusoidal_encoding(7, 3, dtype=dtype)}, {}, batch="x"
    )


def _ref_absolute_position_attention(x, positions, wq, wk, wv=None):
    xt = x + positions
    s = (xt @ wq.T) @ (xt @ wk.T).T
    return attention_out_energy(s, -math.log(x.shape[0]), project_values(x, wv))


_ROWS.append(
    Mechanism(
        "absolute_position",
        "Absolute positional encodings",
        mech.absolute_position_attention,
        "SB",
        "appendix 8.2, Table 1 row 5",
        _ex_absolute,
        _ATT_OUT_E,
        _ref_absolute_position_attention,
        "softmax of (x_i + e_i) W_Q^T W_K (x_j + e_j), value V x_j",
    )
)


def _ex_classification(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            w1=_proj(g, 11, 3),
            b1=g.normal(11),
            w2=_proj(g, 2, 11),
            b2=g.normal(2),
            classes=g.normal(5, 2),
        ),
        {},
        batch="x",
    )


def _ref_classification_layer(x, w1, b1, w2, b2, classes):
    f = jnp.tanh(x @ w1.T + b1) @ w2.T + b2
    a = softmax(f @ classes.T)
    return {
        "attention:class": a,
        "output:out": a @ classes,
        "energy": -jnp.sum(lse(f @ classes.T)) + x.shape[0] * math.log(classes.shape[0]),
    }


_ROWS.append(
    Mechanism(
        "classification_layer",
        "Classification layer",
        mech.classification_layer,
        "SB",
        "Table 1 row 6",
        _ex_classification,
        (attention("class"), output("out"), ENERGY),
        _ref_classification_layer,
        "softmax_j(f_theta(X)_i^T y_j); output = sum_j p_ij y_j",
    )
)


def _ex_hopfield(rng, dtype, node_potential=True):
    g = _Gen(rng, dtype)
    return Example(
        dict(memories=g.normal(7, 3), state=g.normal(5, 3, scale=0.5)),
        dict(num_states=5, beta=1.3 if node_potential else 1.0, node_potential=node_potential),
        batch="state",
    )


def _ref_hopfield(memories, state, num_states, beta=1.0, node_potential=True):
    r"""Ramsauer's update $\xi^{new} = X \mathrm{softmax}(\beta X^\top \xi)$ (S&B sec. 4.2),
    the energy $\beta E_{\mathrm{Ramsauer}}$ + constants, or (no node potential) Tschantz
    v2 eqs. 7-8."""
    s = beta * state @ memories.T
    a = softmax(s)
    n, d = memories.shape
    e = -jnp.sum(lse(s)) + num_states * math.log(n)
    if node_potential:
        e = e + 0.5 * beta * jnp.sum(state**2) + num_states * d * 0.5 * math.log(2 * math.pi / beta)
        return {"attention:phi": a, "energy": e, "fixed_point:state": a @ memories}
    return {
        "attention:phi": a,
        "energy": e,
        "-grad:state": beta * a @ memories,
        "-grad:memories": beta * a.T @ state,
    }


_ROWS.append(
    Mechanism(
        "hopfield",
        "Modern continuous Hopfield network",
        mech.hopfield,
        "SB",
        "sec. 4.2, Table 1 row 7",
        _ex_hopfield,
        (attention("phi"), ENERGY, fixed_point("state", 1.3)),
        _ref_hopfield,
        "xi - beta^-1 dF/dxi (jax.grad of the engine's energy) = X softmax(beta X^T xi) "
        "(Ramsauer's update, eq. 8); F = beta * Ramsauer energy + const",
        latents=("state",),
    )
)


def _ex_slot(rng, dtype, node_potential=True):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), wq=_proj(g, 2, 3), wk=_proj(g, 2, 3), slots=g.normal(5, 3)),
        dict(num_slots=5, node_potential=node_potential),
        batch="x",
    )


def _ref_slot_attention(x, wq, wk, slots, num_slots, node_potential=True):
    r"""S&B sec. 4.3 fixed point / Tschantz v2 eqs. 10-11."""
    a, grad_x, grad_slots, lv = bilinear_term(x, slots, wk, wq)  # children: tokens, parents: slots
    e = -jnp.sum(lv) + x.shape[0] * math.log(num_slots)
    out = {"attention:phi": a}
    if node_potential:
        d = x.shape[1]
        out["energy"] = e + 0.5 * jnp.sum(slots**2) + num_slots * d * 0.5 * math.log(2 * math.pi)
        out["fixed_point:slots"] = grad_slots
    else:
        out["energy"] = e
        out["-grad:slots"] = grad_slots
        out["-grad:x"] = grad_x
    return out


_ROWS.append(
    Mechanism(
        "slot_attention",
        "Slot attention",
        mech.slot_attention,
        "SB",
        "sec. 4.3, Table 1 row 8",
        _ex_slot,
        (attention("phi"), ENERGY, fixed_point("slots")),
        _ref_slot_attention,
        "mu - dF/dmu = sum_j softmax_i(mu_i W_Q^T W_K x_j) W_Q^T W_K x_j (eq. 8, softmax over slots)",
        latents=("slots",),
    )
)


def _ex_block_slot(rng, dtype, blocks):
    g = _Gen(rng, dtype)
    d = 3 * blocks
    mem = g.normal(blocks, 5, 3) if blocks > 1 else g.normal(5, 3)
    return Example(
        dict(
            x=g.normal(7, d),
            memories=mem,
            wq=_proj(g, 11, d),
            wk=_proj(g, 11, d),
            slots=g.normal(2, d),
        ),
        dict(num_slots=2),
        batch="x",
    )


def _ref_block_slot_attention(x, memories, wq, wk, slots, num_slots, node_potential=True):
    r"""Appendix 8.2.1: $\mu_i^* = \sum_j \mathrm{softmax}_i(\cdot) W_Q^\top W_K x_j +
    \sum_{k,b}\mathrm{softmax}_k(\mu_i^{(b)}\cdot m_k^{(b)}) m_k^{(b)}$."""
    mem = memory_blocks(memories)
    nb, nl, db = mem.shape
    a, _, token_term, l1 = bilinear_term(x, slots, wk, wq)
    blocks = slots.reshape(num_slots, nb, db)  # (S, B, db)
    s2 = jnp.einsum("sbd,bld->sbl", blocks, mem)
    h = softmax(s2)
    memory_term = jnp.einsum("sbl,bld->sbd", h, mem).reshape(num_slots, nb * db)
    e = (
        -jnp.sum(l1)
        - jnp.sum(lse(s2))
        + x.shape[0] * math.log(num_slots)
        + num_slots * nb * math.log(nl)
        + 0.5 * jnp.sum(slots**2)
        + slots.size * 0.5 * math.log(2 * math.pi)
    )
    return {
        "attention:token_slot": a,
        "attention:slot_memory": h.swapaxes(0, 1),
        "energy": e,
        "fixed_point:slots": token_term + memory_term,
    }


_ROWS.append(
    Mechanism(
        "block_slot",
        "Block-slot attention (single block)",
        mech.block_slot_attention,
        "SB",
        "appendix 8.2.1, Table 1 row 9",
        lambda r, d: _ex_block_slot(r, d, 1),
        (attention("token_slot"), attention("slot_memory"), ENERGY, fixed_point("slots")),
        _ref_block_slot_attention,
        "mu_i* = sum_j softmax_i(.) Q^T K x_j + sum_k softmax_k(mu_i . m_k) m_k",
        latents=("slots",),
    )
)
_ROWS.append(
    Mechanism(
        "block_slot_multi",
        "Block-slot attention (multi-block)",
        mech.block_slot_attention,
        "SB",
        "appendix 8.2.1, Table 1 row 9",
        lambda r, d: _ex_block_slot(r, d, 2),
        (attention("slot_memory"), ENERGY, fixed_point("slots")),
        _ref_block_slot_attention,
        "mu_i* = sum_j softmax_i(.) Q^T K x_j + sum_{k,b} softmax_k(mu_i^(b) . m_k^(b)) m_k^(b)",
        latents=("slots",),
    )
)


def _ex_pcn(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            y=g.normal(5),
            weights=(g.normal(3, 2), g.normal(5, 3)),
            precisions=(g.uniform(3, low=0.5, high=2.0), g.uniform(5, low=0.5, high=2.0)),
            prior_mean=g.normal(2),
            prior_precision=g.uniform(2, low=0.5, high=2.0),
            z0=g.normal(2),
            z1=g.normal(3),
        ),
        {},
        batch="y",
    )


def _ref_predictive_coding_network(y, weights, precisions, prior_mean, prior_precision, **latents):
    r"""S&B appendix 7.2: softmax over incoming prediction errors; the gradient of F per layer."""
    L = len(weights)
    mus = [latents[f"z{lv}"] for lv in range(L)] + [y]
    alphas, errors = [], []
    for lv in range(L):
        w, k = weights[lv], precisions[lv]
        eps = mus[lv + 1][:, None] - w * mus[lv][None, :]  # (n_{l+1}, n_l)
        alphas.append(softmax(-0.5 * k[:, None] * eps**2))
        errors.append(eps)
    out = {f"attention:phi{lv + 1}": alphas[lv] for lv in range(L)}
    for lv in range(L):  # latent layers
        grad_f = jnp.zeros_like(mus[lv])
        if lv == 0:
            grad_f = grad_f + prior_precision * (mus[0] - prior_mean)
        else:  # incoming edges of layer l (its units are children of layer l-1)
            a, eps, k = alphas[lv - 1], errors[lv - 1], precisions[lv - 1]
            grad_f = grad_f + jnp.sum(a * k[:, None] * eps, -1)
        a, eps, k, w = alphas[lv], errors[lv], precisions[lv], weights[lv]  # outgoing edges
        grad_f = grad_f - jnp.sum(a * k[:, None] * eps * w, 0)
        out[f"-grad:z{lv}"] = -grad_f
    return out


_ROWS.append(
    Mechanism(
        "predictive_coding",
        "Predictive coding network (uniform prior over synapses)",
        mech.predictive_coding_network,
        "SB",
        "sec. 4.4, appendix 7.2, Table 1 row 10",
        _ex_pcn,
        (attention("phi1"), attention("phi2"), neg_grad("z0"), neg_grad("z1")),
        _ref_predictive_coding_network,
        "attention = softmax over incoming prediction errors; -dF/dmu_l = -(sum incoming "
        "softmax k eps - sum outgoing softmax k eps w) (eq. 10 with the softmax)",
        latents=("z0", "z1"),
    )
)


def _ex_multihop(rng, dtype):
    ex = _ex_self(rng, dtype)
    return Example(ex.inputs, dict(hops=3), batch="x")


def _ref_multihop_attention(x, wq, wk, wv=None, hops=2):
    r"""Appendix 7.3 / Algorithm 2: $(\sum_{k=1}^{N} P^k) V X$."""
    p = softmax((x @ wq.T) @ (x @ wk.T).T)
    v = project_values(x, wv)
    out, acc, pk = {"attention:hop1": p}, jnp.zeros_like(v), jnp.eye(x.shape[0], dtype=x.dtype)
    for h in range(1, hops + 1):
        pk = pk @ p
        acc = acc + pk @ v
        out[f"output:out{h}"] = acc
    out["output:out"] = acc
    return out


_ROWS.append(
    Mechanism(
        "multihop",
        "Multi-hop attention (3 hops)",
        mech.multihop_attention,
        "SB",
        "sec. 5.1, appendix 7.3, Algorithm 2, Table 1 row 11",
        _ex_multihop,
        (attention("hop1"), output("out1"), output("out2"), output("out3"), output("out")),
        _ref_multihop_attention,
        "after h hops the output is (P + ... + P^h) V X",
    )
)


def _ex_expanding(rng, dtype):
    ex = _ex_self(rng, dtype)
    return Example(
        {**ex.inputs, "q": jnp.asarray(0.3, dtype)}, dict(alpha=1.7, beta=2.3), batch="x"
    )


def _ref_expanding_attention(x, wq, wk, wv, q, alpha, beta):
    r"""Sec. 5.2 step 2, $p(\phi \mid x, q)$ with the truncated geometric prior; step 3's
    $\mathbb E[d]$; and the exact $\log p(x, q)$."""
    n = x.shape[0]
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    logw = jnp.where(d >= 0, jnp.log(q) + d * jnp.log1p(-q), NEG_INF)
    log_prior = logw - lse(logw)[:, None]
    s = (x @ wq.T) @ (x @ wk.T).T
    a = softmax(s + log_prior)
    return {
        "attention:phi": a,
        "output:out": a @ project_values(x, wv),
        "output:distance": jnp.sum(a * d, -1),
        "energy": -(beta_dist.logpdf(q, alpha, beta) + jnp.sum(lse(s + log_prior))),
    }


_ROWS.append(
    Mechanism(
        "expanding",
        "Expanding attention (geometric x Beta)",
        mech.expanding_attention,
        "SB",
        "sec. 5.2, appendix 7.3, Table 1 row 12",
        _ex_expanding,
        (attention("phi"), output("out"), output("distance"), ENERGY),
        _ref_expanding_attention,
        "p(phi | x, q) = softmax(score + ln Geo_q(i - j)) (step 2), E[d] (step 3's beta update), "
        "and the exact log p(x, q) with the Beta density",
        latents=("q",),
    )
)


def _ex_alignment(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(q=g.normal(5, 2), k=g.normal(3, 2), v=g.normal(3, 7),
             log_stay=jnp.asarray(0.3, dtype), log_advance=jnp.asarray(-0.2, dtype)),
        dict(log_skip=-1.3),
        batch="q",
    )


def _ref_monotonic_alignment(q, k, v, log_stay, log_advance, log_skip):
    r"""Forward-backward over the parents with a stay / advance transition matrix;
    $-\partial E/\partial q = \partial \log Z/\partial q$ by autodiff of it."""
    out = _ref_alignment_chain(q, k, v, log_stay, log_advance, log_skip)
    gq, gk = jax.grad(
        lambda q, k: -_ref_alignment_chain(q, k, v, log_stay, log_advance, log_skip)["energy"],
        argnums=(0, 1))(q, k)
    return {**out, "-grad:q": gq, "-grad:k": gk}


def _ref_alignment_chain(q, k, v, log_stay, log_advance, log_skip):
    m = k.shape[0]
    leak = -30.0
    i, j = np.arange(m)[:, None], np.arange(m)[None, :]
    lt = jnp.where(j == i + 2, log_skip, leak)
    lt = jnp.where(j == i, log_stay, jnp.where(j == i + 1, log_advance, lt))
    lt = lt - lse(lt)[:, None]
    li = jnp.where(np.arange(m) == 0, 0.0, leak)
    li = li - lse(li)
    emit = q @ k.T
    emit = emit.at[-1].add(jnp.where(np.arange(m) == m - 1, 0.0, leak))  # end at the last
    log_z, post = chain_posterior(li, lt, emit)
    return {"attention:align": post, "output:out": post @ v, "energy": -log_z}


_ROWS.append(
    Mechanism(
        "monotonic_alignment",
        "Monotonic alignment attention (Markov edges)",
        mech.monotonic_alignment,
        "SB",
        "sec. 3 (priors over edges), a Markov prior coupling consecutive children",
        _ex_alignment,
        (attention("align"), output("out"), ENERGY, neg_grad("q"), neg_grad("k")),
        _ref_monotonic_alignment,
        "p(phi_t = j | q, k), E[v_phi_t] and log Z by a step-by-step forward-backward over a "
        "stay / advance / skip chain starting at the first parent and ending at the last",
    )
)

# ------------------------------------------------------------------------ Tschantz


def _ex_gmm(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            means=g.normal(5, 3),
            precisions=_spd(g, 5, 3),
            log_weights=g.normal(5),
        ),
        {},
        batch="x",
    )


def _ref_gaussian_mixture(x, means, precisions, log_weights, normalize=False):
    r"""v2 sec. 2: sim = ln pi_k - 1/2 Mahalanobis; -dE/dmu_k = sum_i alpha_ik Sigma_k^{-1}(x_i - mu_k)."""
    assert not normalize
    diff = x[:, None, :] - means[None, :, :]  # (N, K, d)
    maha = jnp.einsum("nkd,kde,nke->nk", diff, precisions, diff)
    sim = (log_weights - lse(log_weights)) - 0.5 * maha
    a = softmax(sim)
    return {
        "attention:component": a,
        "energy": -jnp.sum(lse(sim)),
        # Sigma_k^{-1} (x_i - mu_k) with the symmetric part of the given precision (the
        # Mahalanobis form only sees it; equal to the precision when it is symmetric)
        "-grad:means": jnp.einsum(
            "nk,kde,nke->kd", a, 0.5 * (precisions + precisions.swapaxes(-1, -2)), diff
        ),
    }


_ROWS.append(
    Mechanism(
        "gaussian_mixture",
        "Gaussian mixture",
        mech.gaussian_mixture,
        "T",
        "v2 sec. 2 (eq. 5)",
        _ex_gmm,
        (attention("component"), ENERGY, neg_grad("means")),
        _ref_gaussian_mixture,
        "alpha = softmax_k(ln pi_k - 1/2 Mahalanobis); -dE/dmu_k = sum_i alpha_ik Sigma_k^-1 (x_i - mu_k)",
    )
)
_ROWS.append(
    Mechanism(
        "hopfield_energy",
        "Hopfield energy",
        mech.hopfield,
        "T",
        "v2 sec. 3 (eqs. 6-8)",
        lambda r, d: _ex_hopfield(r, d, node_potential=False),
        (attention("phi"), ENERGY, neg_grad("state"), neg_grad("memories")),
        _ref_hopfield,
        "-dE/dx_i = sum_mu softmax_mu(x_i^T m_mu) m_mu; -dE/dm_mu = sum_i softmax_mu(.) x_i",
        latents=("state",),
    )
)
_ROWS.append(
    Mechanism(
        "slot_energy",
        "Slot attention energy",
        mech.slot_attention,
        "T",
        "v2 sec. 4 (eqs. 9-11)",
        lambda r, d: _ex_slot(r, d, node_potential=False),
        (attention("phi"), ENERGY, neg_grad("slots"), neg_grad("x")),
        _ref_slot_attention,
        "eqs. 10-11: softmax over slots times W_Q^T W_K x_j / W_K^T W_Q mu_i",
        latents=("slots",),
    )
)


def _ref_self_attention_gradients(x, wq, wk, wv=None, include_self=True, causal=False, scale=None):
    """Tschantz v2 eq. 13: child part + parent part."""
    assert scale is None
    mask = self_mask(x.shape[0], include_self, causal)
    _, child, parent, lv = bilinear_term(x, x, wq, wk, mask)
    return {
        "energy": -jnp.sum(lv + uniform_log_prior(mask)),
        "-grad:x": child + parent,
    }


_ROWS.append(
    Mechanism(
        "self_attention_energy",
        "Self attention energy",
        mech.self_attention,
        "T",
        "v2 sec. 5 (eqs. 12-13)",
        lambda r, d: Example(_ex_self(r, d).inputs, {}, batch="x"),
        (ENERGY, neg_grad("x")),
        _ref_self_attention_gradients,
        "eq. 13: -dE/dx_i = child part + parent part",
    )
)


def _ex_cross_grad(rng, dtype):
    ex = _ex_cross(rng, dtype)
    return Example(ex.inputs, {}, batch="xq")


def _ref_cross_attention_gradients(xq, xk, wq, wk, wv=None, scale=None):
    """Tschantz v2 eqs. 30-31 with the chain rule through W_Q, W_K."""
    s_ = 1.0 if scale is None else scale
    q, k = xq @ wq.T, xk @ wk.T
    a = softmax(s_ * q @ k.T)
    return {
        "energy": -jnp.sum(lse(s_ * q @ k.T)) + xq.shape[0] * math.log(xk.shape[0]),
        "-grad:xq": s_ * (a @ k) @ wq,
        "-grad:xk": s_ * (a.T @ q) @ wk,
    }


_ROWS.append(
    Mechanism(
        "cross_attention_energy",
        "Cross attention energy",
        mech.cross_attention,
        "T",
        "v2 sec. 9 (eqs. 29-31)",
        _ex_cross_grad,
        (ENERGY, neg_grad("xq"), neg_grad("xk")),
        _ref_cross_attention_gradients,
        "eqs. 30-31 through the projections: W_Q^T sum_p softmax_p k_p and W_K^T sum_c softmax_p q_c",
    )
)


def _ex_nonlinear(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), mu=g.normal(5, 2), a=_proj(g, 3, 2), b=g.normal(3, scale=0.1)),
        {},
        batch="x",
    )


def _ref_nonlinear_mixture(x, mu, a, b):
    r"""v2 sec. 8 with $f(\mu) = \tanh(A\mu + b)$, $J_f^\top r = A^\top((1-f^2) \odot r)$."""
    f = jnp.tanh(mu @ a.T + b)  # (K, dx)
    r = x[:, None, :] - f[None]  # (N, K, dx)
    sim = -0.5 * jnp.sum(r * r, -1)
    al = softmax(sim)
    jt_r = jnp.einsum("nkx,kx,xm->nkm", r, 1 - f**2, a)
    return {
        "attention:cause": al,
        "energy": -jnp.sum(lse(sim)) + x.shape[0] * math.log(mu.shape[0]),
        "-grad:mu": jnp.einsum("nk,nkm->km", al, jt_r),
        "-grad:x": -jnp.einsum("nk,nkx->nx", al, r),
    }


_ROWS.append(
    Mechanism(
        "nonlinear_mixture",
        "Predictive coding / non-linear mixture",
        mech.nonlinear_mixture,
        "T",
        "v2 sec. 8 (eq. 28), slides",
        _ex_nonlinear,
        (attention("cause"), ENERGY, neg_grad("mu"), neg_grad("x")),
        _ref_nonlinear_mixture,
        "-dE/dmu_k = sum_i alpha_ik J_f^T (x_i - f(mu_k)); -dE/dx_i = -sum_k alpha_ik (x_i - f(mu_k))",
    )
)


def _ex_linear_mixture(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            z=g.normal(5, 2),
            A=_proj(g, 5, 3, 2),
            b=g.normal(5, 3, scale=0.3),
            precisions=g.uniform(5, 3, low=0.5, high=2.0),
        ),
        {},
        batch="x",
    )


def _ref_linear_mixture(x, z, A, b, precisions):
    pred = jnp.einsum("kxz,kz->kx", A, z) + b
    r = x[:, None, :] - pred[None]  # (N, K, dx)
    sim = -0.5 * jnp.sum(r * r * precisions, -1)
    al = softmax(sim)
    lr = r * precisions  # Sigma_k^{-1} r
    return {
        "attention:mode": al,
        "energy": -jnp.sum(lse(sim)) + x.shape[0] * math.log(z.shape[0]),
        "-grad:x": -jnp.einsum("nk,nkx->nx", al, lr),
        "-grad:z": jnp.einsum("nk,kxz,nkx->kz", al, A, lr),
        "-grad:A": jnp.einsum("nk,nkx,kz->kxz", al, lr, z),
        "-grad:b": jnp.einsum("nk,nkx->kx", al, lr),
    }


_ROWS.append(
    Mechanism(
        "linear_mixture",
        "Linear mixture",
        mech.linear_mixture,
        "T",
        "slides: Linear Mixture Model",
        _ex_linear_mixture,
        (attention("mode"), ENERGY, neg_grad("x"), neg_grad("z"), neg_grad("A"), neg_grad("b")),
        _ref_linear_mixture,
        "softmax-weighted Sigma_k^-1 residuals for x, z, A_k, b_k",
    )
)


def _ex_slds(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            A=_proj(g, 5, 3, 3),
            b=g.normal(5, 3, scale=0.3),
            precisions=g.uniform(5, 3, low=0.5, high=2.0),
            log_weights=g.normal(5),
        ),
        {},
        batch="x",
    )


def _ref_switching_linear_dynamics(x, A, b, precisions, log_weights):
    r"""v2 sec. 10 (state gradients with the signs of the definitions)."""
    r, sim = transition_terms(x, A, b, precisions, log_weights - lse(log_weights))
    al = softmax(sim)
    lr = r * precisions
    grad_x = jnp.zeros_like(x)
    grad_x = grad_x.at[1:].add(-jnp.einsum("tk,tkd->td", al, lr))  # x_{t+1} as child
    grad_x = grad_x.at[:-1].add(jnp.einsum("tk,kde,tkd->te", al, A, lr))  # x_t through A_k x_t
    return {
        "attention:mode": al,
        "energy": -jnp.sum(lse(sim)),
        "-grad:A": jnp.einsum("tk,tkd,te->kde", al, lr, x[:-1]),
        "-grad:b": jnp.einsum("tk,tkd->kd", al, lr),
        "-grad:x": grad_x,
    }


_ROWS.append(
    Mechanism(
        "slds",
        "Switching linear dynamical system",
        mech.switching_linear_dynamics,
        "T",
        "v2 sec. 10 (eq. 32)",
        _ex_slds,
        (attention("mode"), ENERGY, neg_grad("A"), neg_grad("b"), neg_grad("x")),
        _ref_switching_linear_dynamics,
        "-dE/dA_k = sum_t alpha Sigma^-1 r x_t^T, -dE/db_k = sum_t alpha Sigma^-1 r, state gradients",
    )
)


def _ex_markov_slds(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(5, 2),
            A=_proj(g, 3, 2, 2),
            b=g.normal(3, 2, scale=0.3),
            precisions=g.uniform(3, 2, low=0.5, high=2.0),
            log_transition=g.normal(3, 3),
            log_initial=g.normal(3),
        ),
        {},
        batch="x",
    )


def _ref_markov_switching_dynamics(x, A, b, precisions, log_transition, log_initial):
    r"""v2 sec. 7: forward-backward over the modes with Gaussian transition densities;
    the $-\partial E$ by autodiff of it."""
    def chain(A, b, log_transition):
        return _ref_markov_modes(x, A, b, precisions, log_transition, log_initial)

    out = chain(A, b, log_transition)
    grads = jax.grad(lambda *a: -chain(*a)["energy"], argnums=(0, 1, 2))(A, b, log_transition)
    return {**out, "-grad:A": grads[0], "-grad:b": grads[1], "-grad:log_transition": grads[2]}


def _ref_markov_modes(x, A, b, precisions, log_transition, log_initial):
    r, _ = transition_terms(x, A, b, precisions)
    emit = (-0.5 * jnp.sum(r * r * precisions, -1) + 0.5 * jnp.sum(jnp.log(precisions), -1)
            - 0.5 * x.shape[-1] * math.log(2 * math.pi))
    lt = log_transition - lse(log_transition)[:, None]
    log_z, post = chain_posterior(log_initial - lse(log_initial), lt, emit)
    return {"attention:mode": post, "energy": -log_z}


_ROWS.append(
    Mechanism(
        "markov_slds",
        "Switching linear dynamics with Markov modes",
        mech.markov_switching_dynamics,
        "T",
        "v2 sec. 7 (switching systems, the mode as a hidden Markov chain)",
        _ex_markov_slds,
        (attention("mode"), ENERGY, neg_grad("A"), neg_grad("b"), neg_grad("log_transition")),
        _ref_markov_switching_dynamics,
        "smoothed modes p(phi_t | x) and log p(x_2..T | x_1) by a step-by-step "
        "forward-backward with Gaussian transition densities",
    )
)


def _ex_dma(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            z=g.normal(5, 2),
            wq=_proj(g, 11, 3),
            wk=_proj(g, 11, 2),
            A=_proj(g, 5, 3, 3),
            b=g.normal(5, 3, scale=0.3),
        ),
        {},
        batch="x",
    )


def _ref_dynamic_mixture_attention(x, z, wq, wk, A, b):
    r"""v2 sec. 7 (eq. 27)."""
    ones = jnp.ones(x.shape[1], x.dtype)
    sim_p = (x[:-1] @ wq.T) @ (z @ wk.T).T  # (T-1, K)
    r, sim_d = transition_terms(x, A, b, ones)
    sim = sim_p + sim_d
    al = softmax(sim)
    grad_x = jnp.zeros_like(x)
    grad_x = grad_x.at[1:].add(-jnp.einsum("tk,tkd->td", al, r))
    grad_x = grad_x.at[:-1].add(al @ (z @ wk.T) @ wq + jnp.einsum("tk,kde,tkd->te", al, A, r))
    return {
        "attention:mode": al,
        "energy": -jnp.sum(lse(sim)) + (x.shape[0] - 1) * math.log(A.shape[0]),
        "-grad:A": jnp.einsum("tk,tkd,te->kde", al, r, x[:-1]),
        "-grad:b": jnp.einsum("tk,tkd->kd", al, r),
        "-grad:z": (al.T @ (x[:-1] @ wq.T)) @ wk,
        "-grad:x": grad_x,
    }


_ROWS.append(
    Mechanism(
        "dynamic_mixture",
        "Dynamic mixture attention",
        mech.dynamic_mixture_attention,
        "T",
        "v2 sec. 7 (eq. 27)",
        _ex_dma,
        (attention("mode"), ENERGY, neg_grad("A"), neg_grad("b"), neg_grad("z"), neg_grad("x")),
        _ref_dynamic_mixture_attention,
        "softmax of attention + dynamics similarity; gradients",
    )
)


def _ex_layer_norm(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(5, 7), gamma=jnp.asarray(1.3, dtype), delta=g.normal(7)), {}, batch="x"
    )


def _ref_layer_norm_energy(x, gamma, delta, eps=1e-5):
    """v2 sec. 11: the LayerNorm output gamma (x - mean) / sqrt(var + eps) + delta."""
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    D = x.shape[-1]
    return {
        "energy": jnp.sum(D * gamma * jnp.sqrt(var[:, 0] + eps)) + jnp.sum(x * delta),
        "grad:x": gamma * (x - mean) / jnp.sqrt(var + eps) + delta,
    }


_ROWS.append(
    Mechanism(
        "layer_norm",
        "Layer-norm energy",
        mech.layer_norm_energy,
        "T",
        "v2 sec. 11",
        _ex_layer_norm,
        (ENERGY, grad("x")),
        _ref_layer_norm_energy,
        "dE/dx = gamma (x - mean) / sqrt(var + eps) + delta, the LayerNorm output",
    )
)


def _ex_kronecker(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            z=g.normal(5, 2),
            u=g.normal(2, 11),
            wz=_proj(g, 2, 3),
            wu=_proj(g, 11, 3),
        ),
        {},
        batch="x",
    )


def _ref_kronecker_attention(x, z, u, wz, wu):
    """Slides: joint softmax over parent pairs of sim_z + sim_u."""
    sz, su = (x @ wz.T) @ z.T, (x @ wu.T) @ u.T
    n, K, L = x.shape[0], z.shape[0], u.shape[0]
    joint = (sz[:, :, None] + su[:, None, :]).reshape(n, K * L)
    al = softmax(joint).reshape(n, K, L)
    return {
        "output:joint": al,
        "energy": -jnp.sum(lse(joint)) + n * math.log(K * L),
        "-grad:z": jnp.sum(al, 2).T @ (x @ wz.T),
        "-grad:u": jnp.sum(al, 1).T @ (x @ wu.T),
        "-grad:x": jnp.sum(al, 2) @ z @ wz + jnp.sum(al, 1) @ u @ wu,
    }


_ROWS.append(
    Mechanism(
        "kronecker",
        "Kronecker log-sum-exp (continuous)",
        mech.kronecker_attention,
        "T",
        "slides: Kronecker log-sum-exp",
        _ex_kronecker,
        (output("joint"), ENERGY, neg_grad("z"), neg_grad("u"), neg_grad("x")),
        _ref_kronecker_attention,
        "joint softmax over parent pairs (k, l) and its gradients",
    )
)


def _ex_tensor(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=jnp.asarray(rng.integers(0, 3, size=7), jnp.int32), log_theta=g.normal(3, 5, 2)),
        {},
        batch="log_theta",
    )


def _ref_tensor_attention(x, log_theta):
    """Slides, discrete case: alpha_ikl = theta_{x_i k l} / sum; expected counts."""
    D, K, L = log_theta.shape
    t = log_theta[x].reshape(x.shape[0], K * L)
    al = softmax(t).reshape(x.shape[0], K, L)
    counts = jnp.einsum("nd,nkl->dkl", jax.nn.one_hot(x, D, dtype=log_theta.dtype), al)
    return {
        "output:joint": al,
        "energy": -jnp.sum(lse(t)) + x.shape[0] * math.log(K * L),
        "-grad:log_theta": counts,
    }


_ROWS.append(
    Mechanism(
        "tensor_attention",
        "Kronecker log-sum-exp (discrete tensor attention)",
        mech.tensor_attention,
        "T",
        "slides: Kronecker log-sum-exp (discrete case)",
        _ex_tensor,
        (output("joint"), ENERGY, neg_grad("log_theta")),
        _ref_tensor_attention,
        "alpha_ikl = theta_{x_i kl} / sum_kl; -dE/dln theta = expected counts",
    )
)


def _ex_multi(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), z=g.normal(5, 3), w=_proj(g, 3, 3)), dict(precision=0.7), batch="x"
    )


def _ref_multi_lse(x, z, w, precision=1.0):
    diff = x[:, None, :] - z[None]
    sim = (x @ w.T) @ z.T - 0.5 * precision * jnp.sum(diff * diff, -1)
    al = softmax(sim)
    return {
        "attention:phi": al,
        "energy": -jnp.sum(lse(sim)) + x.shape[0] * math.log(z.shape[0]),
        "-grad:x": al @ z @ w - precision * jnp.einsum("nk,nkd->nd", al, diff),
        "-grad:z": al.T @ (x @ w.T) + precision * jnp.einsum("nk,nkd->kd", al, diff),
    }


_ROWS.append(
    Mechanism(
        "multi_lse",
        "Multi log-sum-exp",
        mech.multi_lse,
        "T",
        "slides: Multi log-sum-exp",
        _ex_multi,
        (attention("phi"), ENERGY, neg_grad("x"), neg_grad("z")),
        _ref_multi_lse,
        "softmax of summed similarities; gradients sum each similarity's derivative",
    )
)


def _ex_block_slot_energy(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            memories=g.normal(11, 3),
            wq=_proj(g, 2, 3),
            wk=_proj(g, 2, 3),
            slots=g.normal(5, 3),
        ),
        dict(num_slots=5),
        batch="x",
    )


def _ref_block_slot_energy(x, memories, wq, wk, slots, num_slots):
    """Tschantz slides: two lse terms per token."""
    a, child_z, parent_z, l1 = bilinear_term(x, slots, wk, wq)
    sm = x @ memories.T
    h = softmax(sm)
    n = x.shape[0]
    return {
        "attention:slot": a,
        "attention:memory": h,
        "energy": -jnp.sum(l1)
        - jnp.sum(lse(sm))
        + n * math.log(num_slots)
        + n * math.log(memories.shape[0]),
        "-grad:x": child_z + h @ memories,
        "-grad:slots": parent_z,
        "-grad:memories": h.T @ x,
    }


_ROWS.append(
    Mechanism(
        "block_slot_energy",
        "Block-slot attention energy",
        mech.block_slot_energy,
        "T",
        "slides: Block-slot Attention",
        _ex_block_slot_energy,
        (
            attention("slot"),
            attention("memory"),
            ENERGY,
            neg_grad("x"),
            neg_grad("slots"),
            neg_grad("memories"),
        ),
        _ref_block_slot_energy,
        "two lse terms per token; child and parent gradients",
        latents=("slots",),
    )
)


def _ex_energy_transformer(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), memories=g.normal(5, 3), wq=_proj(g, 2, 3), wk=_proj(g, 2, 3)),
        {},
        batch="x",
    )


def _ref_energy_transformer(x, memories, wq, wk):
    a, child, parent, l1 = bilinear_term(x, x, wq, wk)
    sm = x @ memories.T
    h = softmax(sm)
    n = x.shape[0]
    return {
        "attention:self": a,
        "attention:memory": h,
        "energy": -jnp.sum(l1)
        - jnp.sum(lse(sm))
        + n * math.log(n)
        + n * math.log(memories.shape[0]),
        "-grad:x": child + parent + h @ memories,
        "-grad:memories": h.T @ x,
    }


_ROWS.append(
    Mechanism(
        "energy_transformer",
        "Energy transformer",
        mech.energy_transformer,
        "T",
        "slides: Energy Transformer",
        _ex_energy_transformer,
        (attention("self"), attention("memory"), ENERGY, neg_grad("x"), neg_grad("memories")),
        _ref_energy_transformer,
        "self-attention child + parent parts plus the Hopfield memory term",
    )
)


def _ex_atari(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(
            x=g.normal(7, 3),
            A=_proj(g, 5, 3, 3),
            b=g.normal(5, 3, scale=0.3),
            obs_precisions=g.uniform(5, 3, low=0.5, high=2.0),
            dyn_precisions=g.uniform(5, 3, low=0.5, high=2.0),
            z=g.normal(7, 3),
        ),
        {},
        batch="x",
    )


def _ref_atari_model(x, A, b, obs_precisions, dyn_precisions, z):
    r"""Slides "Atari Model": child terms of z_t (GMM and dynamics) plus its parent term."""
    T = x.shape[0]
    K = A.shape[0]
    diff = x - z
    sim_o = -0.5 * jnp.einsum("td,kd->tk", diff * diff, obs_precisions)
    al = softmax(sim_o)
    r, sim_d = transition_terms(z, A, b, dyn_precisions)
    be = softmax(sim_d)
    lr = r * dyn_precisions
    grad_z = jnp.einsum("tk,kd,td->td", al, obs_precisions, diff)
    grad_z = grad_z.at[1:].add(-jnp.einsum("tk,tkd->td", be, lr))
    grad_z = grad_z.at[:-1].add(jnp.einsum("tk,kde,tkd->te", be, A, lr))
    return {
        "attention:obs_mode": al,
        "attention:dyn_mode": be,
        "energy": -jnp.sum(lse(sim_o)) - jnp.sum(lse(sim_d)) + (2 * T - 1) * math.log(K),
        "-grad:z": grad_z,
    }


_ROWS.append(
    Mechanism(
        "atari",
        "Atari model (GMM + linear mixture)",
        mech.atari_model,
        "T",
        "slides: Atari Model",
        _ex_atari,
        (attention("obs_mode"), attention("dyn_mode"), ENERGY, neg_grad("z")),
        _ref_atari_model,
        "-dE/dz_t = GMM child term + dynamics child term + dynamics parent term",
        latents=("z",),
    )
)


def _ex_hierarchy(rng, dtype, renormalised=False):
    g = _Gen(rng, dtype)
    T, sizes = 7, [(5, 3), (3, 2), (2, 5)]  # (K_l, D_l); time 7
    dk = 11
    static: dict[str, Any] = dict(layer_sizes=tuple(sizes[1:]))
    if renormalised:
        static["receptive_fields"] = (
            np.array([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 1, 1]], bool),
            np.array([[1, 1, 0], [0, 1, 1]], bool),
        )
    inputs = dict(
        x=g.normal(T, 5, 3),
        w_inter=tuple(
            (_proj(g, dk, sizes[lv - 1][1]), _proj(g, dk, sizes[lv][1])) for lv in (1, 2)
        ),
        w_intra=tuple((_proj(g, dk, d), _proj(g, dk, d)) for _, d in sizes),
        w_temporal=tuple((_proj(g, dk, d), _proj(g, dk, d)) for _, d in sizes),
        layer2=g.normal(T, 3, 2),
        layer3=g.normal(T, 2, 5),
    )
    return Example(inputs, static, batch="x")


def _ref_spatiotemporal_hierarchy(
    x, layer_sizes, w_inter, w_intra, w_temporal, receptive_fields=None, **latents
):
    r"""v2 sec. 6 eqs. 20, 22, 24, 26 (plus the temporal parent part) / the renormalised form."""
    T = x.shape[0]
    L = len(layer_sizes) + 1
    layers = [x] + [latents[f"layer{lv}"] for lv in range(2, L + 1)]
    grads = [jnp.zeros_like(h) for h in layers]
    energy = 0.0
    for lv in range(2, L + 1):
        lower, upper = layers[lv - 2], layers[lv - 1]
        wk_, wq_ = w_inter[lv - 2]
        if receptive_fields is None:  # lower units choose upper slots
            _, child, parent, ls = bilinear_term(lower, upper, wk_, wq_)
            grads[lv - 2] += child
            grads[lv - 1] += parent
            energy += -jnp.sum(ls) + T * lower.shape[1] * math.log(upper.shape[1])
        else:  # upper units choose within their receptive field
            field = np.asarray(receptive_fields[lv - 2], bool)
            _, child, parent, ls = bilinear_term(upper, lower, wq_, wk_, field)
            grads[lv - 1] += child
            grads[lv - 2] += parent
            energy += -jnp.sum(ls + uniform_log_prior(field))
    for lv in range(1, L + 1):
        h = layers[lv - 1]
        k = h.shape[1]
        wq_, wk_ = w_intra[lv - 1]
        mask = ~np.eye(k, dtype=bool)
        _, child, parent, ls = bilinear_term(h, h, wq_, wk_, mask)  # per time step
        grads[lv - 1] += child + parent
        energy += -jnp.sum(ls) + T * k * math.log(k - 1)
        wq_, wk_ = w_temporal[lv - 1]
        ht = h.swapaxes(0, 1)  # (K, T, D)
        past = np.arange(1, T)[:, None] > np.arange(T)[None, :]
        _, child, parent, ls = bilinear_term(ht[:, 1:], ht, wq_, wk_, past)
        grads[lv - 1] += jnp.zeros_like(ht).at[:, 1:].add(child).swapaxes(0, 1)
        grads[lv - 1] += parent.swapaxes(0, 1)
        energy += -jnp.sum(ls) + k * jnp.sum(jnp.log(np.arange(1, T)))
    out = {"energy": energy}
    for lv in range(2, L + 1):
        out[f"-grad:layer{lv}"] = grads[lv - 1]
    return out


_ROWS.append(
    Mechanism(
        "spatiotemporal",
        "Spatiotemporal hierarchy",
        mech.spatiotemporal_hierarchy,
        "T",
        "v2 sec. 6 (eqs. 14-26), slides",
        _ex_hierarchy,
        (ENERGY, neg_grad("layer2"), neg_grad("layer3")),
        _ref_spatiotemporal_hierarchy,
        "bottom-up (eq. 20) + top-down (eq. 22) + intra-layer (eq. 24, k' != k) + temporal "
        "(eq. 26 and its parent part)",
        latents=("layer2", "layer3"),
    )
)
_ROWS.append(
    Mechanism(
        "renormalised_mixture",
        "Renormalised mixture (local receptive fields)",
        mech.spatiotemporal_hierarchy,
        "T",
        "slides: Renormalised mixture models",
        lambda r, d: _ex_hierarchy(r, d, renormalised=True),
        (ENERGY, neg_grad("layer2"), neg_grad("layer3")),
        _ref_spatiotemporal_hierarchy,
        "softmax over each unit's receptive field; bottom-up and top-down gradients",
        latents=("layer2", "layer3"),
    )
)


def _ex_expansion(rng, dtype):
    g = _Gen(rng, dtype)
    comps = jnp.concatenate([g.normal(3, 2), jnp.zeros((2, 2), dtype)])
    return Example(
        dict(
            x=g.normal(7, 2),
            x_new=g.normal(2) + 6.0,
            components=comps,
            active=jnp.asarray([True, True, True, False, False]),
        ),
        dict(tau=5.0, precision=1.0),
        batch="x_new",
    )


def _expand(inputs, static):
    c, a, e = mech.expand_components(
        inputs["x_new"], inputs["components"], inputs["active"], static["tau"], static["precision"]
    )
    return {"expand:energy_new": e, "expand:components": c, "expand:active": a.astype(c.dtype)}


def _ref_expansion(x, x_new, components, active, tau, precision=1.0):
    """Slides: E_{N+1} = -ln sum_k p(k) exp(sim) > tau => add z_{K+1} = x_{N+1}."""

    def point_energy(v):
        sim = -0.5 * precision * jnp.sum((v - components) ** 2, -1)
        return -lse(sim, active) + jnp.log(jnp.sum(active).astype(v.dtype))

    e_new = point_energy(x_new)
    grow = (e_new > tau) & jnp.any(~active)
    idx = jnp.argmax(~active)
    new_c = jnp.where(grow, components.at[idx].set(x_new), components)
    new_a = jnp.where(grow, active.at[idx].set(True), active)
    return {
        "energy": jnp.sum(jax.vmap(point_energy)(x)),
        "expand:energy_new": e_new,
        "expand:components": new_c,
        "expand:active": new_a.astype(x.dtype),
    }


_ROWS.append(
    Mechanism(
        "model_expansion",
        "Bayesian model expansion",
        mech.expandable_mixture,
        "T",
        "slides: Bayesian model expansion",
        _ex_expansion,
        (ENERGY, custom(_expand, "expand:energy_new", "expand:components", "expand:active")),
        _ref_expansion,
        "E_{N+1} > tau adds a component at x_{N+1}; per-point energies",
    )
)


LSE_TERMS = (
    mech.LSETerm("a", children=(0, 1, 2, 3), parents=(4, 5, 6)),
    mech.LSETerm("b", children=(4, 5), parents=(0, 1, 2, 3, 4)),
    mech.LSETerm("c", children=(0, 1, 2, 3, 4, 5, 6), parents=(0, 1, 2, 3, 4, 5, 6)),
)


def _ex_lse_graph(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(nodes=g.normal(7, 3), weights=tuple(_proj(g, 3, 3) for _ in LSE_TERMS)),
        dict(terms=LSE_TERMS),
        batch="nodes",
    )


def _split(inputs, static):
    child, parent = mech.child_parent_gradients(inputs["nodes"], inputs["weights"], static["terms"])
    return {"split:child": child, "split:parent": parent}


def _ref_lse_graphical_model(nodes, weights, terms):
    r"""v2 eq. 4 with sim_m(v_c, v_p) = v_c^T W_m v_p: the child part and the parent part."""
    child_part = jnp.zeros_like(nodes)
    parent_part = jnp.zeros_like(nodes)
    energy = 0.0
    for t, w in zip(terms, weights):
        c_idx, p_idx = np.asarray(t.children), np.asarray(t.parents)
        vc, vp = nodes[c_idx], nodes[p_idx]
        s = vc @ w @ vp.T
        a = softmax(s)
        child_part = child_part.at[c_idx].add(a @ vp @ w.T)  # d sim / d v_c = W v_p
        parent_part = parent_part.at[p_idx].add(a.T @ vc @ w)  # d sim / d v_p = W^T v_c
        energy = energy - jnp.sum(lse(s)) + len(c_idx) * math.log(len(p_idx))
    return {
        "energy": energy,
        "split:child": child_part,
        "split:parent": parent_part,
        "-grad:nodes": child_part + parent_part,
    }


_ROWS.append(
    Mechanism(
        "lse_graphical_model",
        "General log-sum-exp graphical model",
        mech.lse_graphical_model,
        "T",
        "v2 sec. 1 (eqs. 1-4)",
        _ex_lse_graph,
        (
            ENERGY,
            neg_grad("nodes"),
            custom(_split, "split:child", "split:parent", gradient_of_energy=True),
        ),
        _ref_lse_graphical_model,
        "eq. 4: -dE/dv_a = child part + parent part, each matched separately",
    )
)

# ------------------------------------------------------------------------ McCarter


def _ex_idw(rng, dtype, score):
    g = _Gen(rng, dtype)
    return Example(
        dict(q=g.normal(5, 3), keys=g.normal(7, 3), values=g.normal(7, 2)),
        dict(score=score, p=2.0, eps=1e-2, sigma=1.3),
        batch="q",
    )


def _ref_idw_attention(q, keys, values, score="idw", p=2.0, eps=1e-3, sigma=1.0):
    """McCarter eqs. 1-5."""
    d2 = jnp.sum((q[:, None, :] - keys[None]) ** 2, -1)
    if score == "idw":  # eq. 5 directly: weights proportional to 1 / (eps + d^p)
        w = 1.0 / (eps + d2 ** (p / 2))
        a = w / jnp.sum(w, -1, keepdims=True)
        logits = jnp.log(w)
    else:
        logits = {
            "neg_sq": -d2,
            "gaussian": jnp.exp(-d2 / sigma**2),
            "inverse": 1.0 / (eps + d2 ** (p / 2)),
        }[score]
        a = softmax(logits)
    return {
        "attention:phi": a,
        "output:out": a @ values,
        "energy": -jnp.sum(lse(logits)) + q.shape[0] * math.log(keys.shape[0]),
    }


_ROWS.append(
    Mechanism(
        "idw",
        "Inverse distance weighting attention",
        mech.idw_attention,
        "M",
        "sec. 2.1 (eqs. 4-5)",
        lambda r, d: _ex_idw(r, d, "idw"),
        _ATT_OUT_E,
        _ref_idw_attention,
        "attention = (eps + d_i^p)^-1 / sum_j (eps + d_j^p)^-1 (eq. 5)",
    )
)
_ROWS.append(
    Mechanism(
        "neg_sq_dist_attention",
        "Negative squared distance attention",
        mech.idw_attention,
        "M",
        "sec. 2.1 (eq. 1)",
        lambda r, d: _ex_idw(r, d, "neg_sq"),
        _ATT_OUT_E,
        _ref_idw_attention,
        "softmax(-||q - k||^2)",
    )
)
_ROWS.append(
    Mechanism(
        "gaussian_kernel_attention",
        "Gaussian kernel attention",
        mech.idw_attention,
        "M",
        "sec. 2.1 (eq. 2)",
        lambda r, d: _ex_idw(r, d, "gaussian"),
        _ATT_OUT_E,
        _ref_idw_attention,
        "softmax(exp(-||q - k||^2 / sigma^2))",
    )
)
_ROWS.append(
    Mechanism(
        "inverse_distance_attention",
        "Inverse distance attention",
        mech.idw_attention,
        "M",
        "sec. 2.1 (eq. 3)",
        lambda r, d: _ex_idw(r, d, "inverse"),
        _ATT_OUT_E,
        _ref_idw_attention,
        "softmax(1 / (eps + ||q - k||^p))",
    )
)


def _ex_special(rng, dtype):
    g = _Gen(rng, dtype)
    values = g.normal(7, 3)
    return Example(
        dict(q=g.normal(2), keys=g.normal(7, 2), values=values),
        dict(c=2, p=2.0, eps=1e-2),
        batch="q",
    )


def _special_case(inputs, static):
    q, keys, values, c = inputs["q"], inputs["keys"], inputs["values"], static["c"]
    eta = mech.special_case_eta(q, keys, values, c, static["p"], static["eps"])
    k2, v2 = mech.augment_special_case(keys, values, q, c, eta)
    out = expectation(mech.idw_attention, "out", q[None], k2, v2, "idw", static["p"], static["eps"])
    return {"special:eta": eta, "special:output": out[0]}


def _ref_idw_special_case(q, keys, values, c, p=2.0, eps=1e-3):
    r"""Sec. 2.2. The smallest $\eta$ written in the equivalent form
    $\eta = \epsilon \max_{k\ne c}\sum_j w_j (V_{jk} - V_{jc})$, $w_j = (\epsilon +
    d_j^p)^{-1}$ (eq. 7 with the prefactor cancelled), and the IDW output with the added
    prototype (weight $1/\epsilon$, value $\eta e_c$)."""
    w = 1.0 / (eps + jnp.sum((keys - q) ** 2, -1) ** (p / 2))
    gap = w @ (values - values[:, c : c + 1])
    gap = jnp.where(jnp.arange(values.shape[1]) == c, NEG_INF, gap)
    eta = eps * jnp.max(gap)
    num = w @ values + (1.0 / eps) * eta * jax.nn.one_hot(c, values.shape[1], dtype=values.dtype)
    return {"special:eta": eta, "special:output": num / (jnp.sum(w) + 1.0 / eps)}


_ROWS.append(
    Mechanism(
        "idw_special_case",
        "IDW special-case augmentation",
        mech.idw_attention,
        "M",
        "sec. 2.2 (eqs. 6-7)",
        _ex_special,
        (custom(_special_case, "special:eta", "special:output"),),
        _ref_idw_special_case,
        "eta from eq. 7 equals the smallest flipping weight; the augmented output ties class c "
        "with the best other class",
    )
)

# ------------------------------------------------------------------------ the registry

REGISTRY: tuple[Mechanism, ...] = tuple(_ROWS)
"""Every row, in catalogue order."""
del _ROWS


def names() -> tuple[str, ...]:
    """The registry's row names.

    Returns:
        The names, in catalogue order.
    """
    return tuple(m.name for m in REGISTRY)


def get(name: str) -> Mechanism:
    """The row called `name`.

    Args:
        name: the row's name.

    Returns:
        The row.

    Raises:
        KeyError: if there is no such row, listing the registered names.
    """
    for m in REGISTRY:
        if m.name == name:
            return m
    raise NotFoundError(f"no mechanism named {name!r}; registered: {', '.join(names())}")
