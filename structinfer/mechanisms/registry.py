r"""The mechanism registry: one row per mechanism, read by the contract test and the docs.

A row (:class:`Mechanism`) names a model from :mod:`structinfer.mechanisms`, an example
factory with distinct prime sizes, the quantities the engine computes from the model
(attention, output, energy, gradients, fixed points), an independent reference
implementation of the paper's closed form (:mod:`structinfer.mechanisms.references`) and
the citation. :func:`evaluate` computes a row's quantities with the exact engine only —
nothing in it knows the mechanism — and :func:`render_catalogue` prints the Markdown
catalogue (``docs/catalogue.md``).

Adding a mechanism is adding a row: it then has to pass the contract test
(``tests/test_mechanisms.py``): jit, vmap over a batch, float32 and float64, gradients
matching those of the reference, and the paper check.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.handlers import substitute

from .._checks import as_arrays
from ..exact import _log_z, inspect_model
from ..exact import expectation as _expectation
from . import references as ref
from .block_slot import block_slot_attention, block_slot_energy
from .classification import classification_layer
from .cross import cross_attention
from .dynamics import atari_model, dynamic_mixture_attention, switching_linear_dynamics
from .energy_transformer import energy_transformer
from .expanding import expanding_attention
from .expansion import expand_components, expandable_mixture
from .graph import graph_attention, sparse_attention
from .hierarchy import spatiotemporal_hierarchy
from .hopfield import hopfield
from .idw import augment_special_case, idw_attention, special_case_eta
from .kronecker import kronecker_attention, multi_lse, tensor_attention
from .layer_norm import layer_norm_energy
from .lse_graph import LSETerm, child_parent_gradients, lse_graphical_model
from .mixtures import gaussian_mixture, linear_mixture
from .multihop import multihop_attention
from .positional import (
    absolute_position_attention,
    relative_position_attention,
    sinusoidal_encoding,
)
from .predictive_coding import nonlinear_mixture, predictive_coding_network
from .self_attention import self_attention
from .slot import slot_attention

__all__ = [
    "Quantity",
    "Example",
    "Mechanism",
    "REGISTRY",
    "get",
    "names",
    "evaluate",
    "model_columns",
    "model_excerpt",
    "render_catalogue",
    "attention",
    "output",
    "ENERGY",
    "neg_grad",
    "grad",
    "fixed_point",
    "custom",
]

PAPERS = {
    "SB": "Singh & Buckley, *Attention as implicit structural inference*",
    "T": "Tschantz, *Attention via log-sum-exp energy* (v1, v2, slides)",
    "M": "McCarter, *Inverse distance weighting attention*",
}


# ------------------------------------------------------------------------ quantities


@dataclass(frozen=True)
class Quantity:
    """What the engine computes for a row; ``key`` names it in :func:`evaluate`'s output.

    Kinds: ``attention`` (posterior marginal of an edge site), ``output`` (posterior
    expectation of a deterministic site), ``energy`` (collapsed energy), ``neg_grad`` /
    ``grad`` (:math:`\\mp\\partial E/\\partial` an input), ``fixed_point``
    (:math:`\\mu - \\lambda^{-1}\\partial E/\\partial\\mu`, the CCCP update for a latent site
    with quadratic node potential of precision :math:`\\lambda`, Singh & Buckley eq. 8) and
    ``custom`` (``fn(inputs, static) -> dict``).
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
        return {
            "attention": f"attention:{self.target}",
            "output": f"output:{self.target}",
            "energy": "energy",
            "neg_grad": f"-grad:{self.target}",
            "grad": f"grad:{self.target}",
            "fixed_point": f"fixed_point:{self.target}",
            "custom": ",".join(self.keys),
        }[self.kind]

    def describe(self) -> str:
        t = self.target
        return {
            "attention": f"attention `p({t} | x)`",
            "output": f"output `E[{t}]`",
            "energy": "energy `-log p(x)`",
            "neg_grad": f"`-dE/d{t}`",
            "grad": f"`dE/d{t}`",
            "fixed_point": f"fixed point `{t} - dE/d{t} / {self.precision:g}`",
            "custom": ", ".join(f"`{k}`" for k in self.keys),
        }[self.kind]


def attention(site: str) -> Quantity:
    """The posterior marginals of edge site ``site``."""
    return Quantity("attention", site)


def output(site: str) -> Quantity:
    """The posterior expectation of deterministic site ``site``."""
    return Quantity("output", site)


#: the collapsed energy
ENERGY = Quantity("energy")


def neg_grad(name: str) -> Quantity:
    """:math:`-\\partial E/\\partial` input ``name``."""
    return Quantity("neg_grad", name)


def grad(name: str) -> Quantity:
    """:math:`\\partial E/\\partial` input ``name``."""
    return Quantity("grad", name)


def fixed_point(latent: str, precision: float = 1.0) -> Quantity:
    """The CCCP update of latent site ``latent``."""
    return Quantity("fixed_point", latent, precision=precision)


def custom(
    fn: Callable[..., dict[str, jax.Array]], *keys: str, gradient_of_energy: bool = False
) -> Quantity:
    """A quantity computed by ``fn(inputs, static)`` (which must use the engine)."""
    return Quantity("custom", fn=fn, keys=tuple(keys), gradient_of_energy=gradient_of_energy)


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Example:
    """Example arguments of a row.

    ``inputs`` are arrays (or pytrees of arrays): data, parameters and the values of
    latent sites — the contract test differentiates the float ones and vmaps over
    ``inputs[batch]``. ``static`` are Python values (sizes, flags, concrete masks).
    """

    inputs: dict[str, Any]
    static: dict[str, Any] = field(default_factory=dict)
    batch: str = ""


@dataclass(frozen=True)
class Mechanism:
    """One catalogue row."""

    name: str
    title: str
    model: Callable[..., None]
    paper: str  # key of PAPERS
    section: str
    example: Callable[[np.random.Generator, Any], Example]
    quantities: tuple[Quantity, ...]
    reference: Callable[..., dict[str, jax.Array]]
    check: str
    latents: tuple[str, ...] = ()

    @property
    def citation(self) -> str:
        return f"{PAPERS[self.paper]}, {self.section}"

    @property
    def keys(self) -> tuple[str, ...]:
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


def evaluate(mech: Mechanism, inputs: dict[str, Any], static: dict[str, Any] | None = None):
    """Compute a row's quantities from its model with the exact engine.

    Latent sites named in ``mech.latents`` are given the values ``inputs[name]``;
    everything else the model accepts is passed as keyword arguments. Jittable,
    vmappable and differentiable.

    Everything comes from one collapsed pass: :math:`\\log Z` with zero tilts on the edge
    sites and the deterministic value sites, differentiated once with respect to the
    tilts (the attention and the outputs, as in :func:`structinfer.marginals` and
    :func:`structinfer.expectation`) and to the float inputs (the energy gradients, as
    ``jax.grad`` of :func:`structinfer.energy`).

    Returns:
        ``{quantity key: array}`` (custom quantities contribute their own keys).
    """
    static = dict(static or {})

    def bound(inp):
        model = mech.model
        if mech.latents:
            model = substitute(model, data={k: inp[k] for k in mech.latents})
        kwargs = {k: v for k, v in {**inp, **static}.items() if k not in mech.latents}
        return model, as_arrays((), _accepted(mech.model, kwargs))[1]

    qs = mech.quantities
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
                raise KeyError(
                    f"mechanism '{mech.name}': the model has no deterministic site '{n}'"
                )
        zeros = {
            n: jnp.zeros(info.enumerated[n][0] + (info.enumerated[n][1],), dtype) for n in edges
        }
        zeros.update({n: jnp.zeros(info.deterministic[n][0], dtype) for n in values})
        diff = {k: v for k, v in inputs.items() if _is_float_tree(v)} if needs_grad else {}

        def log_z(t, d):
            m, kw = bound({**inputs, **d})
            tilts = {n: (t[n], 0) for n in edges}
            tilts.update({n: (t[n], info.deterministic[n][1]) for n in values})
            return _log_z(m, (), kw, info, tilts)

        lz, (g_t, g) = jax.value_and_grad(log_z, argnums=(0, 1))(zeros, diff)
        for q in qs:
            if q.kind in ("attention", "output"):
                out[q.key] = g_t[q.target]
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


def _ex_cross_grad(rng, dtype):
    ex = _ex_cross(rng, dtype)
    return Example(ex.inputs, {}, batch="xq")


def _ex_self(rng, dtype, **static):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), wq=_proj(g, 2, 3), wk=_proj(g, 2, 3), wv=_proj(g, 11, 3)),
        static,
        batch="x",
    )


def _ex_graph(rng, dtype):
    ex = _ex_self(rng, dtype)
    adj = rng.random((7, 7)) < 0.4
    adj[np.arange(7), (np.arange(7) + 3) % 7] = True  # every node has a neighbour
    return Example(ex.inputs, dict(adjacency=adj), batch="x")


def _ex_relative(rng, dtype, parameterisation):
    ex = _ex_self(rng, dtype)
    g = _Gen(rng, dtype)
    theta = g.normal(7, 7) if parameterisation == "categorical" else g.normal(5)
    return Example(
        {**ex.inputs, "theta": theta}, dict(parameterisation=parameterisation), batch="x"
    )


def _ex_absolute(rng, dtype):
    ex = _ex_self(rng, dtype)
    return Example(
        {**ex.inputs, "positions": sinusoidal_encoding(7, 3, dtype=dtype)}, {}, batch="x"
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


def _ex_hopfield(rng, dtype, node_potential=True):
    g = _Gen(rng, dtype)
    return Example(
        dict(memories=g.normal(7, 3), state=g.normal(5, 3, scale=0.5)),
        dict(num_states=5, beta=1.3 if node_potential else 1.0, node_potential=node_potential),
        batch="state",
    )


def _ex_slot(rng, dtype, node_potential=True):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), wq=_proj(g, 2, 3), wk=_proj(g, 2, 3), slots=g.normal(5, 3)),
        dict(num_slots=5, node_potential=node_potential),
        batch="x",
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


def _ex_multihop(rng, dtype):
    ex = _ex_self(rng, dtype)
    return Example(ex.inputs, dict(hops=3), batch="x")


def _ex_expanding(rng, dtype):
    ex = _ex_self(rng, dtype)
    return Example(
        {**ex.inputs, "q": jnp.asarray(0.3, dtype)}, dict(alpha=1.7, beta=2.3), batch="x"
    )


def _spd(g: _Gen, k, d):
    a = g.normal(k, d, d, scale=0.3)
    return jnp.einsum("kij,klj->kil", a, a) + jnp.eye(d, dtype=g.dtype)


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


def _ex_nonlinear(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), mu=g.normal(5, 2), a=_proj(g, 3, 2), b=g.normal(3, scale=0.1)),
        {},
        batch="x",
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


def _ex_layer_norm(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(5, 7), gamma=jnp.asarray(1.3, dtype), delta=g.normal(7)), {}, batch="x"
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


def _ex_tensor(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=jnp.asarray(rng.integers(0, 3, size=7), jnp.int32), log_theta=g.normal(3, 5, 2)),
        {},
        batch="log_theta",
    )


def _ex_multi(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), z=g.normal(5, 3), w=_proj(g, 3, 3)), dict(precision=0.7), batch="x"
    )


def _ex_energy_transformer(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(x=g.normal(7, 3), memories=g.normal(5, 3), wq=_proj(g, 2, 3), wk=_proj(g, 2, 3)),
        {},
        batch="x",
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


LSE_TERMS = (
    LSETerm("a", children=(0, 1, 2, 3), parents=(4, 5, 6)),
    LSETerm("b", children=(4, 5), parents=(0, 1, 2, 3, 4)),
    LSETerm("c", children=(0, 1, 2, 3, 4, 5, 6), parents=(0, 1, 2, 3, 4, 5, 6)),
)


def _ex_lse_graph(rng, dtype):
    g = _Gen(rng, dtype)
    return Example(
        dict(nodes=g.normal(7, 3), weights=tuple(_proj(g, 3, 3) for _ in LSE_TERMS)),
        dict(terms=LSE_TERMS),
        batch="nodes",
    )


def _ex_idw(rng, dtype, score):
    g = _Gen(rng, dtype)
    return Example(
        dict(q=g.normal(5, 3), keys=g.normal(7, 3), values=g.normal(7, 2)),
        dict(score=score, p=2.0, eps=1e-2, sigma=1.3),
        batch="q",
    )


def _ex_special(rng, dtype):
    g = _Gen(rng, dtype)
    values = g.normal(7, 3)
    return Example(
        dict(q=g.normal(2), keys=g.normal(7, 2), values=values),
        dict(c=2, p=2.0, eps=1e-2),
        batch="q",
    )


# --------------------------------------------------------------------- custom quantities


def _expand(inputs, static):
    c, a, e = expand_components(
        inputs["x_new"], inputs["components"], inputs["active"], static["tau"], static["precision"]
    )
    return {"expand:energy_new": e, "expand:components": c, "expand:active": a.astype(c.dtype)}


def _split(inputs, static):
    child, parent = child_parent_gradients(inputs["nodes"], inputs["weights"], static["terms"])
    return {"split:child": child, "split:parent": parent}


def _special_case(inputs, static):
    q, keys, values, c = inputs["q"], inputs["keys"], inputs["values"], static["c"]
    eta = special_case_eta(q, keys, values, c, static["p"], static["eps"])
    k2, v2 = augment_special_case(keys, values, q, c, eta)
    out = _expectation(idw_attention, "out", q[None], k2, v2, "idw", static["p"], static["eps"])
    return {"special:eta": eta, "special:output": out[0]}


def _ref_special(q, keys, values, c, p, eps):
    return ref.idw_special_case(q, keys, values, c, p, eps)


def _ref_expansion(x, x_new, components, active, tau, precision):
    return ref.expansion(x, x_new, components, active, tau, precision)


# ---------------------------------------------------------------------------- the rows

_ATT_OUT_E = (attention("phi"), output("out"), ENERGY)

REGISTRY: tuple[Mechanism, ...] = (
    # ---------------------------------------------------- Singh & Buckley, Table 1
    Mechanism(
        "cross_attention",
        "Cross attention",
        cross_attention,
        "SB",
        "sec. 3.2, Table 1 row 1",
        _ex_cross,
        _ATT_OUT_E,
        ref.cross_attention,
        "attention = softmax_j(x'_i W_Q^T W_K x_j); output = attention @ W_V X; "
        "energy = -sum_i lse_j + n log m",
    ),
    Mechanism(
        "self_attention",
        "Self attention (directed, no self-edge)",
        self_attention,
        "SB",
        "appendix 8.1, Table 1 row 2",
        lambda r, d: _ex_self(r, d, include_self=False),
        _ATT_OUT_E,
        ref.self_attention,
        "softmax over j != i of x_i W_Q^T W_K x_j; output and energy",
    ),
    Mechanism(
        "graph_attention",
        "Graph attention",
        graph_attention,
        "SB",
        "appendix 8.2, Table 1 row 3",
        _ex_graph,
        _ATT_OUT_E,
        ref.graph_attention,
        "softmax restricted to the neighbours of a random graph",
    ),
    Mechanism(
        "sparse_attention",
        "Sparse (sliding-window) attention",
        sparse_attention,
        "SB",
        "appendix 8.2, Table 1 row 3",
        lambda r, d: Example(_ex_self(r, d).inputs, dict(window=3), batch="x"),
        _ATT_OUT_E,
        ref.sparse_attention,
        "softmax restricted to a causal window of 3",
    ),
    Mechanism(
        "relative_position",
        "Relative positional encodings (Hartley prior)",
        relative_position_attention,
        "SB",
        "appendix 8.2, Table 1 row 4",
        lambda r, d: _ex_relative(r, d, "hartley"),
        _ATT_OUT_E,
        ref.relative_position_attention,
        "softmax_j(x_i Q^T K x_j + ln p_ij), ln p_ij = sum_k beta_k (cos + sin)(2 pi k (i-j)/n)",
    ),
    Mechanism(
        "relative_position_categorical",
        "Relative positional encodings (categorical prior)",
        relative_position_attention,
        "SB",
        "appendix 8.2, Table 1 row 4",
        lambda r, d: _ex_relative(r, d, "categorical"),
        _ATT_OUT_E,
        ref.relative_position_attention,
        "softmax_j(x_i Q^T K x_j + ln p_ij) for a free P",
    ),
    Mechanism(
        "absolute_position",
        "Absolute positional encodings",
        absolute_position_attention,
        "SB",
        "appendix 8.2, Table 1 row 5",
        _ex_absolute,
        _ATT_OUT_E,
        ref.absolute_position_attention,
        "softmax of (x_i + e_i) W_Q^T W_K (x_j + e_j), value V x_j",
    ),
    Mechanism(
        "classification_layer",
        "Classification layer",
        classification_layer,
        "SB",
        "Table 1 row 6",
        _ex_classification,
        (attention("class"), output("out"), ENERGY),
        ref.classification_layer,
        "softmax_j(f_theta(X)_i^T y_j); output = sum_j p_ij y_j",
    ),
    Mechanism(
        "hopfield",
        "Modern continuous Hopfield network",
        hopfield,
        "SB",
        "sec. 4.2, Table 1 row 7",
        _ex_hopfield,
        (attention("phi"), ENERGY, fixed_point("state", 1.3)),
        ref.hopfield,
        "xi - beta^-1 dF/dxi (jax.grad of the engine's energy) = X softmax(beta X^T xi) "
        "(Ramsauer's update, eq. 8); F = beta * Ramsauer energy + const",
        latents=("state",),
    ),
    Mechanism(
        "slot_attention",
        "Slot attention",
        slot_attention,
        "SB",
        "sec. 4.3, Table 1 row 8",
        _ex_slot,
        (attention("phi"), ENERGY, fixed_point("slots")),
        ref.slot_attention,
        "mu - dF/dmu = sum_j softmax_i(mu_i W_Q^T W_K x_j) W_Q^T W_K x_j (eq. 8, softmax over slots)",
        latents=("slots",),
    ),
    Mechanism(
        "block_slot",
        "Block-slot attention (single block)",
        block_slot_attention,
        "SB",
        "appendix 8.2.1, Table 1 row 9",
        lambda r, d: _ex_block_slot(r, d, 1),
        (attention("token_slot"), attention("slot_memory"), ENERGY, fixed_point("slots")),
        ref.block_slot_attention,
        "mu_i* = sum_j softmax_i(.) Q^T K x_j + sum_k softmax_k(mu_i . m_k) m_k",
        latents=("slots",),
    ),
    Mechanism(
        "block_slot_multi",
        "Block-slot attention (multi-block)",
        block_slot_attention,
        "SB",
        "appendix 8.2.1, Table 1 row 9",
        lambda r, d: _ex_block_slot(r, d, 2),
        (attention("slot_memory"), ENERGY, fixed_point("slots")),
        ref.block_slot_attention,
        "mu_i* = sum_j softmax_i(.) Q^T K x_j + sum_{k,b} softmax_k(mu_i^(b) . m_k^(b)) m_k^(b)",
        latents=("slots",),
    ),
    Mechanism(
        "predictive_coding",
        "Predictive coding network (uniform prior over synapses)",
        predictive_coding_network,
        "SB",
        "sec. 4.4, appendix 7.2, Table 1 row 10",
        _ex_pcn,
        (attention("phi1"), attention("phi2"), neg_grad("z0"), neg_grad("z1")),
        ref.predictive_coding_network,
        "attention = softmax over incoming prediction errors; -dF/dmu_l = -(sum incoming "
        "softmax k eps - sum outgoing softmax k eps w) (eq. 10 with the softmax)",
        latents=("z0", "z1"),
    ),
    Mechanism(
        "multihop",
        "Multi-hop attention (3 hops)",
        multihop_attention,
        "SB",
        "sec. 5.1, appendix 7.3, Algorithm 2, Table 1 row 11",
        _ex_multihop,
        (attention("hop1"), output("out1"), output("out2"), output("out3"), output("out")),
        ref.multihop_attention,
        "after h hops the output is (P + ... + P^h) V X",
    ),
    Mechanism(
        "expanding",
        "Expanding attention (geometric x Beta)",
        expanding_attention,
        "SB",
        "sec. 5.2, appendix 7.3, Table 1 row 12",
        _ex_expanding,
        (attention("phi"), output("out"), output("distance"), ENERGY),
        ref.expanding_attention,
        "p(phi | x, q) = softmax(score + ln Geo_q(i - j)) (step 2), E[d] (step 3's beta update), "
        "and the exact log p(x, q) with the Beta density",
        latents=("q",),
    ),
    # ------------------------------------------------------------------------ Tschantz
    Mechanism(
        "gaussian_mixture",
        "Gaussian mixture",
        gaussian_mixture,
        "T",
        "v2 sec. 2 (eq. 5)",
        _ex_gmm,
        (attention("component"), ENERGY, neg_grad("means")),
        ref.gaussian_mixture,
        "alpha = softmax_k(ln pi_k - 1/2 Mahalanobis); -dE/dmu_k = sum_i alpha_ik Sigma_k^-1 (x_i - mu_k)",
    ),
    Mechanism(
        "hopfield_energy",
        "Hopfield energy",
        hopfield,
        "T",
        "v2 sec. 3 (eqs. 6-8)",
        lambda r, d: _ex_hopfield(r, d, node_potential=False),
        (attention("phi"), ENERGY, neg_grad("state"), neg_grad("memories")),
        ref.hopfield,
        "-dE/dx_i = sum_mu softmax_mu(x_i^T m_mu) m_mu; -dE/dm_mu = sum_i softmax_mu(.) x_i",
        latents=("state",),
    ),
    Mechanism(
        "slot_energy",
        "Slot attention energy",
        slot_attention,
        "T",
        "v2 sec. 4 (eqs. 9-11)",
        lambda r, d: _ex_slot(r, d, node_potential=False),
        (attention("phi"), ENERGY, neg_grad("slots"), neg_grad("x")),
        ref.slot_attention,
        "eqs. 10-11: softmax over slots times W_Q^T W_K x_j / W_K^T W_Q mu_i",
        latents=("slots",),
    ),
    Mechanism(
        "self_attention_energy",
        "Self attention energy",
        self_attention,
        "T",
        "v2 sec. 5 (eqs. 12-13)",
        lambda r, d: Example(_ex_self(r, d).inputs, {}, batch="x"),
        (ENERGY, neg_grad("x")),
        ref.self_attention_gradients,
        "eq. 13: -dE/dx_i = child part + parent part",
    ),
    Mechanism(
        "cross_attention_energy",
        "Cross attention energy",
        cross_attention,
        "T",
        "v2 sec. 9 (eqs. 29-31)",
        _ex_cross_grad,
        (ENERGY, neg_grad("xq"), neg_grad("xk")),
        ref.cross_attention_gradients,
        "eqs. 30-31 through the projections: W_Q^T sum_p softmax_p k_p and W_K^T sum_c softmax_p q_c",
    ),
    Mechanism(
        "nonlinear_mixture",
        "Predictive coding / non-linear mixture",
        nonlinear_mixture,
        "T",
        "v2 sec. 8 (eq. 28), slides",
        _ex_nonlinear,
        (attention("cause"), ENERGY, neg_grad("mu"), neg_grad("x")),
        ref.nonlinear_mixture,
        "-dE/dmu_k = sum_i alpha_ik J_f^T (x_i - f(mu_k)); -dE/dx_i = -sum_k alpha_ik (x_i - f(mu_k))",
    ),
    Mechanism(
        "linear_mixture",
        "Linear mixture",
        linear_mixture,
        "T",
        "slides: Linear Mixture Model",
        _ex_linear_mixture,
        (attention("mode"), ENERGY, neg_grad("x"), neg_grad("z"), neg_grad("A"), neg_grad("b")),
        ref.linear_mixture,
        "softmax-weighted Sigma_k^-1 residuals for x, z, A_k, b_k",
    ),
    Mechanism(
        "slds",
        "Switching linear dynamical system",
        switching_linear_dynamics,
        "T",
        "v2 sec. 10 (eq. 32)",
        _ex_slds,
        (attention("mode"), ENERGY, neg_grad("A"), neg_grad("b"), neg_grad("x")),
        ref.switching_linear_dynamics,
        "-dE/dA_k = sum_t alpha Sigma^-1 r x_t^T, -dE/db_k = sum_t alpha Sigma^-1 r, state gradients",
    ),
    Mechanism(
        "dynamic_mixture",
        "Dynamic mixture attention",
        dynamic_mixture_attention,
        "T",
        "v2 sec. 7 (eq. 27)",
        _ex_dma,
        (attention("mode"), ENERGY, neg_grad("A"), neg_grad("b"), neg_grad("z"), neg_grad("x")),
        ref.dynamic_mixture_attention,
        "softmax of attention + dynamics similarity; gradients",
    ),
    Mechanism(
        "layer_norm",
        "Layer-norm energy",
        layer_norm_energy,
        "T",
        "v2 sec. 11",
        _ex_layer_norm,
        (ENERGY, grad("x")),
        ref.layer_norm_energy,
        "dE/dx = gamma (x - mean) / sqrt(var + eps) + delta, the LayerNorm output",
    ),
    Mechanism(
        "kronecker",
        "Kronecker log-sum-exp (continuous)",
        kronecker_attention,
        "T",
        "slides: Kronecker log-sum-exp",
        _ex_kronecker,
        (output("joint"), ENERGY, neg_grad("z"), neg_grad("u"), neg_grad("x")),
        ref.kronecker_attention,
        "joint softmax over parent pairs (k, l) and its gradients",
    ),
    Mechanism(
        "tensor_attention",
        "Kronecker log-sum-exp (discrete tensor attention)",
        tensor_attention,
        "T",
        "slides: Kronecker log-sum-exp (discrete case)",
        _ex_tensor,
        (output("joint"), ENERGY, neg_grad("log_theta")),
        ref.tensor_attention,
        "alpha_ikl = theta_{x_i kl} / sum_kl; -dE/dln theta = expected counts",
    ),
    Mechanism(
        "multi_lse",
        "Multi log-sum-exp",
        multi_lse,
        "T",
        "slides: Multi log-sum-exp",
        _ex_multi,
        (attention("phi"), ENERGY, neg_grad("x"), neg_grad("z")),
        ref.multi_lse,
        "softmax of summed similarities; gradients sum each similarity's derivative",
    ),
    Mechanism(
        "block_slot_energy",
        "Block-slot attention energy",
        block_slot_energy,
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
        ref.block_slot_energy,
        "two lse terms per token; child and parent gradients",
        latents=("slots",),
    ),
    Mechanism(
        "energy_transformer",
        "Energy transformer",
        energy_transformer,
        "T",
        "slides: Energy Transformer",
        _ex_energy_transformer,
        (attention("self"), attention("memory"), ENERGY, neg_grad("x"), neg_grad("memories")),
        ref.energy_transformer,
        "self-attention child + parent parts plus the Hopfield memory term",
    ),
    Mechanism(
        "atari",
        "Atari model (GMM + linear mixture)",
        atari_model,
        "T",
        "slides: Atari Model",
        _ex_atari,
        (attention("obs_mode"), attention("dyn_mode"), ENERGY, neg_grad("z")),
        ref.atari_model,
        "-dE/dz_t = GMM child term + dynamics child term + dynamics parent term",
        latents=("z",),
    ),
    Mechanism(
        "spatiotemporal",
        "Spatiotemporal hierarchy",
        spatiotemporal_hierarchy,
        "T",
        "v2 sec. 6 (eqs. 14-26), slides",
        _ex_hierarchy,
        (ENERGY, neg_grad("layer2"), neg_grad("layer3")),
        ref.spatiotemporal_hierarchy,
        "bottom-up (eq. 20) + top-down (eq. 22) + intra-layer (eq. 24, k' != k) + temporal "
        "(eq. 26 and its parent part)",
        latents=("layer2", "layer3"),
    ),
    Mechanism(
        "renormalised_mixture",
        "Renormalised mixture (local receptive fields)",
        spatiotemporal_hierarchy,
        "T",
        "slides: Renormalised mixture models",
        lambda r, d: _ex_hierarchy(r, d, renormalised=True),
        (ENERGY, neg_grad("layer2"), neg_grad("layer3")),
        ref.spatiotemporal_hierarchy,
        "softmax over each unit's receptive field; bottom-up and top-down gradients",
        latents=("layer2", "layer3"),
    ),
    Mechanism(
        "model_expansion",
        "Bayesian model expansion",
        expandable_mixture,
        "T",
        "slides: Bayesian model expansion",
        _ex_expansion,
        (ENERGY, custom(_expand, "expand:energy_new", "expand:components", "expand:active")),
        _ref_expansion,
        "E_{N+1} > tau adds a component at x_{N+1}; per-point energies",
    ),
    Mechanism(
        "lse_graphical_model",
        "General log-sum-exp graphical model",
        lse_graphical_model,
        "T",
        "v2 sec. 1 (eqs. 1-4)",
        _ex_lse_graph,
        (
            ENERGY,
            neg_grad("nodes"),
            custom(_split, "split:child", "split:parent", gradient_of_energy=True),
        ),
        ref.lse_graphical_model,
        "eq. 4: -dE/dv_a = child part + parent part, each matched separately",
    ),
    # ------------------------------------------------------------------------ McCarter
    Mechanism(
        "idw",
        "Inverse distance weighting attention",
        idw_attention,
        "M",
        "sec. 2.1 (eqs. 4-5)",
        lambda r, d: _ex_idw(r, d, "idw"),
        _ATT_OUT_E,
        ref.idw_attention,
        "attention = (eps + d_i^p)^-1 / sum_j (eps + d_j^p)^-1 (eq. 5)",
    ),
    Mechanism(
        "neg_sq_dist_attention",
        "Negative squared distance attention",
        idw_attention,
        "M",
        "sec. 2.1 (eq. 1)",
        lambda r, d: _ex_idw(r, d, "neg_sq"),
        _ATT_OUT_E,
        ref.idw_attention,
        "softmax(-||q - k||^2)",
    ),
    Mechanism(
        "gaussian_kernel_attention",
        "Gaussian kernel attention",
        idw_attention,
        "M",
        "sec. 2.1 (eq. 2)",
        lambda r, d: _ex_idw(r, d, "gaussian"),
        _ATT_OUT_E,
        ref.idw_attention,
        "softmax(exp(-||q - k||^2 / sigma^2))",
    ),
    Mechanism(
        "inverse_distance_attention",
        "Inverse distance attention",
        idw_attention,
        "M",
        "sec. 2.1 (eq. 3)",
        lambda r, d: _ex_idw(r, d, "inverse"),
        _ATT_OUT_E,
        ref.idw_attention,
        "softmax(1 / (eps + ||q - k||^p))",
    ),
    Mechanism(
        "idw_special_case",
        "IDW special-case augmentation",
        idw_attention,
        "M",
        "sec. 2.2 (eqs. 6-7)",
        _ex_special,
        (custom(_special_case, "special:eta", "special:output"),),
        _ref_special,
        "eta from eq. 7 equals the smallest flipping weight; the augmented output ties class c "
        "with the best other class",
    ),
)


def names() -> tuple[str, ...]:
    """The registry's row names."""
    return tuple(m.name for m in REGISTRY)


def get(name: str) -> Mechanism:
    """The row called ``name``."""
    for m in REGISTRY:
        if m.name == name:
            return m
    raise KeyError(f"no mechanism named {name!r}; registered: {', '.join(names())}")


# -------------------------------------------------------------------------- rendering

_SECTIONS = ("Graph", "Prior", "Potentials", "Value")


def _math(tex: str) -> str:
    # bars would end a Markdown table cell: spell them as LaTeX commands
    tex = tex.strip().replace("\\|", "\\Vert ").replace("|", "\\vert ")
    return "$" + tex + "$"


def _rst_to_md(text: str) -> str:
    parts = re.split(r"(:math:`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith(":math:`"):
            out.append(_math(part[len(":math:`") : -1]))
        else:
            part = re.sub(r":(?:func|data|class|mod):`~?([^`]*)`", r"`\1`", part)
            out.append(part.replace("``", "`").replace("|", "\\|"))
    return "".join(out)


def model_columns(model: Callable[..., None]) -> dict[str, str]:
    """The Graph / Prior / Potentials / Value sections of a model's docstring, as Markdown."""
    doc = inspect.cleandoc(model.__doc__ or "")
    cols: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        head = line.strip().rstrip(":")
        if line and not line.startswith(" ") and line.rstrip().endswith(":"):
            current = head if head in _SECTIONS else None
            if current:
                cols[current] = []
            continue
        if current and line.startswith(" "):
            cols[current].append(line.strip())
        elif current and line.strip() == "":
            current = None
    missing = [s for s in _SECTIONS if s not in cols]
    if missing:
        raise ValueError(f"{model.__name__}: docstring lacks the section(s) {missing}")
    return {k: _rst_to_md(" ".join(v)) for k, v in cols.items()}


_MODEL_STATEMENT = re.compile(r"\b(latent_nodes|numpyro\.|edge\(|with numpyro)")


def model_excerpt(model: Callable[..., None], max_lines: int = 10) -> str:
    """Up to ``max_lines`` lines of the model body, from its first probabilistic statement."""
    src = inspect.getsource(model).splitlines()
    body_start = next(
        i
        for i, line in enumerate(src)
        if line.rstrip().endswith('"""') and i > 0 and src[i].strip() != 'r"""'
    )
    body = src[body_start + 1 :]
    start = next((i for i, line in enumerate(body) if _MODEL_STATEMENT.search(line)), 0)

    def indent(s: str) -> int:
        return len(s) - len(s.lstrip())

    base = min(indent(s) for s in body if s.strip())
    while start > 0 and (not body[start].strip() or indent(body[start]) > base):
        start -= 1  # begin at the enclosing statement (e.g. the loop around a site)
    lines = body[start : start + max_lines]
    indent = min(len(s) - len(s.lstrip()) for s in lines if s.strip())
    return "\n".join(s[indent:] for s in lines)


def render_catalogue() -> str:
    """The Markdown catalogue page (``docs/catalogue.md``), generated from :data:`REGISTRY`."""
    out = [
        "# Mechanism catalogue",
        "",
        "<!-- generated by docs/gen_catalogue.py from structinfer.mechanisms.registry; do not edit -->",
        "",
        "Every attention and energy model of the papers, written as a NumPyro model with",
        "`structinfer.edge` sites. The four columns are those of Singh & Buckley Table 1.",
        "Each row is checked by `tests/test_mechanisms.py` against an independent",
        "implementation of the paper's closed form (`structinfer.mechanisms.references`):",
        "jit, vmap over a batch, float32 and float64, gradients and the paper check.",
        "",
        "| mechanism | graph | prior | potentials | value | reference |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in REGISTRY:
        c = model_columns(m.model)
        out.append(
            f"| [{m.title}](#{m.name}) | {c['Graph']} | {c['Prior']} | "
            f"{c['Potentials']} | {c['Value']} | {m.citation} |"
        )
    out.append("")
    for m in REGISTRY:
        out += [
            f"## {m.name}",
            "",
            f"**{m.title}** — {m.citation}.",
            "",
            f"Model: `structinfer.mechanisms.{m.model.__name__}`"
            + (
                f" (latent sites given values: {', '.join(f'`{s}`' for s in m.latents)})"
                if m.latents
                else ""
            )
            + ".",
            "",
            "Engine quantities: " + ", ".join(q.describe() for q in m.quantities) + ".",
            "",
            f"Paper check: {m.check}.",
            "",
            "```python",
            model_excerpt(m.model),
            "```",
            "",
        ]
    return "\n".join(out)
