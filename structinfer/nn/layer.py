r"""[`Attention`][structinfer.nn.Attention]: multi-head attention whose heads are a structinfer model.

For inputs $x^Q \in \mathbb R^{n \times F}$, $x^K, x^V \in \mathbb R^{m \times F'}$ the
layer projects per head, $q^h = x^Q W_Q^h$, $k^h = x^K W_K^h$, $v^h = x^V W_V^h$
(``flax.nnx.LinearGeneral``, the same parameters as ``flax.nnx.MultiHeadAttention``),
runs the mechanism's posterior expectation

$$
o^h_i = \mathbb E_{p_\theta(\phi^h_i \mid q, k)}\big[\mathrm{out}^h_i(\phi)\big]
      = \sum_j \mathrm{softmax}_j\big(\psi(q^h_i, k^h_j) + \log p_\theta(\phi^h_i = j)\big)\, v^h_j
$$

through [`attention`][structinfer.attention] (the second equality when
the value is the parent's value), and projects back, $y_i = \sum_h o^h_i W_O^h$.
The prior's hyperparameters $\theta$ are the mechanism's ``numpyro.param`` sites,
stored unconstrained as ``nnx.Param`` under ``layer.hyper``.

Reference:
    Singh & Buckley, "Attention as implicit structural inference", sec. 3 and Table 1.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from flax import nnx
from flax.nnx.nn import initializers
from jax import lax
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from .._checks import NotFoundError, is_concrete, model_name
from ..handlers import mask_parents
from ..lowering import BACKENDS, Explanation, accum_dtype, attention, check_rows
from ..primitives import EDGE_INFO_KEY, is_enumerated
from .heads import causal, geometric, geometric_beta, relative_position, uniform, window

#: the ready-made mechanisms' factories, which a mechanism argument must not be
_FACTORIES = (uniform, causal, window, relative_position, geometric, geometric_beta)

__all__ = ["Attention", "Hyperparameter", "MechanismInfo", "describe_mechanism"]

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()

#: the length of the dummy sequence a mechanism is traced on to read its sites
_PROBE_LENGTH = 3


@dataclass(frozen=True)
class Hyperparameter:
    """A mechanism's ``numpyro.param`` site, learned by the layer.

    Attributes:
        name: the site name (also the key under ``layer.hyper``).
        init: the initial value, in the constrained space, as the mechanism declares it.
        constraint: the site's constraint; the layer stores
            ``biject_to(constraint).inv(value)`` and the mechanism sees ``value``.
    """

    name: str
    init: jax.Array
    constraint: constraints.Constraint


@dataclass(frozen=True)
class MechanismInfo:
    """What [`describe_mechanism`][structinfer.nn.describe_mechanism] reads from one trace of a mechanism.

    Attributes:
        hyperparameters: the ``numpyro.param`` sites, by name.
        edges: the edge sites.
        causal: every edge's prior gives zero probability to keys after the query
            (the condition for an exact ``decode`` cache).
        value_shape: shape of the value site for the traced ``(heads, length, d)`` input.
    """

    hyperparameters: dict[str, Hyperparameter]
    edges: tuple[str, ...]
    causal: bool
    value_shape: tuple[int, ...]


def _is_causal(table: np.ndarray, offset: int) -> bool:
    """Whether an edge's log-prior table forbids every parent after its child (d < 0)."""
    n, m = table.shape[-2:]
    d = np.arange(n)[:, None] + offset - np.arange(m)[None, :]
    return bool(np.all(np.isneginf(table[..., d < 0])))


def describe_mechanism(
    mechanism: Callable,
    num_heads: int,
    head_dim: int,
    *,
    value: str = "out",
    length: int = _PROBE_LENGTH,
    dtype: Any = jnp.float32,
) -> MechanismInfo:
    """Trace ``mechanism`` once and read its hyperparameters, edges and value site.

    The trace runs under ``jit`` on zero ``(num_heads, length, head_dim)`` queries,
    keys and values.

    Args:
        mechanism: a NumPyro model ``mechanism(q, k, v)`` (see
            [`Attention`][structinfer.nn.Attention]).
        num_heads: the number of heads the layer will call it with.
        head_dim: the per-head feature size the layer will call it with.
        value: the name of its deterministic value site.
        length: the dummy sequence length.
        dtype: floating dtype of the dummy inputs (and of the initial values).

    Returns:
        A [`MechanismInfo`][structinfer.nn.MechanismInfo].

    Raises:
        ValueError: a latent (unobserved, not enumerated) sample site, no edge site,
            no value site ``value``, or a value that is not ``(heads, length, head_dim)``.
    """
    name = model_name(mechanism)
    shape_in = (num_heads, length, head_dim)
    sites: dict[str, dict] = {}

    def run():
        # one jitted trace (not one compiled op per eager call); block(): the layer may be
        # built inside a NumPyro model, and its sites stay inside
        x = jnp.zeros(shape_in, dtype)
        with handlers.block(), handlers.trace() as tr, handlers.seed(rng_seed=0):
            mechanism(x, x, x)
        arrays = {}
        for site_name, site in tr.items():
            entry = {"type": site["type"], "observed": site.get("is_observed", False),
                     "enumerated": is_enumerated(site)}
            if site["type"] == "param":
                entry["constraint"] = site["kwargs"].get("constraint", constraints.real)
                arrays[site_name] = site["value"]
            elif entry["enumerated"]:
                info = (site.get("infer") or {}).get(EDGE_INFO_KEY)
                entry["offset"] = None if info is None else info.prior.offset
                if info is not None:
                    arrays[site_name] = info.prior.log_table(info.num_children)
            elif site["type"] == "deterministic":
                entry["shape"] = tuple(jnp.shape(site["value"]))
            sites[site_name] = entry
        return arrays

    try:
        # concrete even when the layer is built under a trace (nnx.eval_shape, nnx.jit)
        with jax.ensure_compile_time_eval():
            arrays = jax.jit(run)()
    except Exception as e:
        e.add_note(
            f"(while structinfer.nn traced the mechanism '{name}' on q, k, v of shape "
            f"{shape_in}: it must accept per-head (heads, length, head_dim) arrays)"
        )
        raise
    hyper: dict[str, Hyperparameter] = {}
    edges: list[str] = []
    causal = True
    for site_name, site in sites.items():
        if site["type"] == "param":
            hyper[site_name] = Hyperparameter(site_name, arrays[site_name], site["constraint"])
        elif site["enumerated"]:
            edges.append(site_name)
            causal = causal and site_name in arrays and _is_causal(
                np.asarray(arrays[site_name]), site["offset"])
        elif site["type"] == "sample" and not site["observed"]:
            raise ValueError(
                f"mechanism '{name}': site '{site_name}' is a latent sample site; a layer "
                "learns hyperparameters as numpyro.param sites (lift the layer with "
                "numpyro.contrib.module.random_nnx_module and Attention.hyperprior for a "
                "prior over them)"
            )
    if not edges:
        raise ValueError(f"mechanism '{name}' declares no edge site (structinfer.edge)")
    if value not in sites or sites[value]["type"] != "deterministic":
        raise ValueError(
            f"mechanism '{name}' has no deterministic value site '{value}' "
            f"(sites: {sorted(sites)})"
        )
    shape = sites[value]["shape"]
    if shape != (num_heads, length, head_dim):
        raise ValueError(
            f"mechanism '{name}': value site '{value}' has shape {shape}, expected "
            f"(heads, length, head_dim) = {(num_heads, length, head_dim)}"
        )
    return MechanismInfo(hyper, tuple(edges), causal, shape)


@functools.lru_cache(maxsize=256)
def _value_and_param_shapes(mechanism, value, q_shape, k_shape, v_shape, dtype):
    """Shapes of the value site and the param sites for these input shapes (shape-only)."""

    def run(q, k, v):
        with handlers.block(), handlers.trace() as tr, handlers.seed(rng_seed=0):
            mechanism(q, k, v)
        return tr[value]["value"], {s: t["value"] for s, t in tr.items() if t["type"] == "param"}

    args = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, k_shape, v_shape)]
    out, params = jax.eval_shape(run, *args)
    return tuple(out.shape), {s: tuple(p.shape) for s, p in params.items()}


def _bind(mechanism: Callable) -> Callable:
    """``bound(q, k, v, hyper)``: the mechanism with its param sites set to ``hyper``."""

    def bound(q, k, v, hyper):
        with handlers.substitute(data=hyper):
            mechanism(q, k, v)

    bound.__name__ = model_name(mechanism)
    bound.__doc__ = mechanism.__doc__
    return bound


def _bind_masked(bound: Callable) -> Callable:
    """``masked(q, k, v, hyper, mask)``: ``bound`` with its edges restricted by ``mask``."""

    def masked(q, k, v, hyper, mask):
        with mask_parents(mask=mask):
            bound(q, k, v, hyper)

    masked.__name__ = bound.__name__
    masked.__doc__ = bound.__doc__
    return masked


def _check_keys(query: jax.Array, key: jax.Array) -> None:
    """Zero keys with some queries: every query would have no parent to attend to."""
    if key.shape[-3] == 0 and query.shape[-3] > 0:
        raise ValueError(
            f"structinfer.nn.Attention: inputs_k has no positions (length 0) but inputs_q "
            f"has {query.shape[-3]}: every query needs at least one key to attend to"
        )


def _name_heads(said: str) -> str:
    """An error of the mechanism's model with its batch index named as the head it is: the
    heads are the one batch dim of the model of one sequence."""
    return re.sub(r"\(batch index \((\d+),\)\)", r"(head \1)", said)


def _as_array(x, name: str):
    """An input as an array: arrays (JAX, NumPy, tracers) as they are, array-likes (nested
    lists) converted, anything else a TypeError naming the argument."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(
            f"structinfer.nn.Attention: {name} must be an array (..., length, features), got "
            f"{type(x).__name__}"
        ) from None


def _check_int(x, what: str, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < minimum:
        raise ValueError(f"structinfer.nn.Attention: {what} must be an int >= {minimum}, got {x!r}")
    return int(x)


class Attention(nnx.Module):
    r"""Multi-head attention whose heads are a structinfer model (Flax NNX).

    $$
    y = W_O\Big[\;\mathbb E_{p_\theta(\phi^h \mid q^h, k^h)}\big[\mathrm{out}^h(\phi^h)\big]\;\Big]_{h},
    \qquad q^h = x^Q W^h_Q,\; k^h = x^K W^h_K,\; v^h = x^V W^h_V .
    $$

    The mechanism is an ordinary structinfer model of all the heads of one sequence:
    ``mechanism(q, k, v)`` with ``q`` of shape ``(heads, n, head_dim)`` and ``k``, ``v``
    of shape ``(heads, m, head_dim)`` (the queries are the last ``n`` of the ``m``
    positions); it declares edge sites ([`edge`][structinfer.edge]) and a
    deterministic value site ``value`` of shape ``(heads, n, head_dim)``. Its
    ``numpyro.param`` sites are the prior's hyperparameters: each becomes an
    ``nnx.Param`` under ``layer.hyper``, stored unconstrained (the logit of a ``q``
    constrained to the unit interval), so an optimiser may move it freely. The ready-made
    mechanisms are in `structinfer.nn.heads`; the layer built from
    [`uniform()`][structinfer.nn.uniform] (or [`causal()`][structinfer.nn.causal]) equals
    ``flax.nnx.MultiHeadAttention``
    (with a causal mask) given the same weights, whose names and shapes it shares.

    Forward and backward run through [`attention`][structinfer.attention]: a lowered kernel
    when the model is recognised (blocked online softmax with a memory-light custom
    VJP that also differentiates the hyperparameters), the exact engine otherwise —
    ``layer.explain(x)`` says which. The batch dims of the inputs are mapped over with
    ``jax.vmap``; the hyperparameters are shared.

    Lifting: under ``numpyro.contrib.module.nnx_module`` the hyperparameters are
    ``numpyro.param`` values; under ``random_nnx_module(name, layer,
    prior=layer.hyperprior({"q": Beta(a, b)}))`` they are sample sites with that prior
    (``hyperprior`` moves it to the unconstrained scale): the same model plus a
    hyperprior.

    Args:
        mechanism: the model ``mechanism(q, k, v)`` (see above).
        num_heads: number of heads $H$.
        in_features: features $F$ of ``inputs_q``.
        qkv_features: total query/key/value features $H \cdot d$ (default ``in_features``).
        out_features: output features (default ``in_features``).
        num_kv_heads: key/value heads (grouped-query attention; divides ``num_heads``;
            each key/value head is shared by ``num_heads / num_kv_heads`` query heads).
        in_kv_features: features of ``inputs_k`` / ``inputs_v`` (default ``in_features``).
        value: the mechanism's value site.
        backend: [`attention`][structinfer.attention]'s backend (``"auto"``, ``"exact"``,
            or a kernel of `structinfer.lowering.BACKENDS`: ``"dense"``, ``"blocked"``,
            ``"windowed"``, ``"cudnn"``, ``"pallas"``, ``"mosaic"``).
        block_q: query block size of the blocked and windowed kernels.
        block_k: key block size of the blocked kernel.
        dtype: computation dtype, as in ``flax.nnx.MultiHeadAttention``: the
            projections, the queries, keys and values of the heads and the output are
            in it (default: inferred from the inputs and the parameters). The heads
            multiply in it and accumulate in float32, with the prior's hyperparameters
            in float32 (float64 for a float64 computation): ``dtype=jnp.bfloat16``
            with float32 parameters runs bfloat16 kernels (cuDNN on a GPU when the
            mechanism allows) and answers in bfloat16.
        param_dtype: dtype of the parameters (projections, LayerNorm scales and the
            hyperparameters under ``layer.hyper``).
        dropout_rate: dropout on each head's output $o^h$ while training. (Unlike
            ``flax.nnx.MultiHeadAttention`` it does not drop attention weights: they
            are never materialised.)
        deterministic: default for ``__call__``'s ``deterministic`` (dropout off).
        precision: the matmuls' precision, as in ``flax.nnx.MultiHeadAttention``: of the
            projections and of the heads' kernels
            ([`attention`][structinfer.attention]'s ``precision``). ``None`` is JAX's
            default, which follows ``jax.default_matmul_precision``.
        kernel_init: initialiser of the query, key and value kernels.
        out_kernel_init: initialiser of the output kernel (default ``kernel_init``).
        bias_init: initialiser of the query, key and value biases.
        out_bias_init: initialiser of the output bias (default ``bias_init``).
        use_bias: give the projections biases.
        normalize_qk: LayerNorm the queries and keys of each head (as flax).
        decode: default for ``__call__``'s ``decode`` (see
            [`init_cache`][structinfer.nn.Attention.init_cache]).
        rngs: ``nnx.Rngs`` for the projections' initialisers and dropout.

    Raises:
        ValueError: a bad size, backend or mechanism (see
            [`describe_mechanism`][structinfer.nn.describe_mechanism]).
        TypeError: ``mechanism`` is not callable.

    Reference:
        Singh & Buckley, "Attention as implicit structural inference" (sec. 3,
        Table 1); the layer's parameters follow ``flax.nnx.MultiHeadAttention``.
    """

    def __init__(
        self,
        mechanism: Callable,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        value: str = "out",
        backend: str = "auto",
        block_q: int = 256,
        block_k: int = 512,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: Any = None,
        kernel_init: Callable = default_kernel_init,
        out_kernel_init: Callable | None = None,
        bias_init: Callable = default_bias_init,
        out_bias_init: Callable | None = None,
        use_bias: bool = True,
        decode: bool | None = None,
        normalize_qk: bool = False,
        rngs: nnx.Rngs,
    ):
        if not callable(mechanism):
            raise TypeError(
                f"structinfer.nn.Attention: mechanism must be a model (callable), got "
                f"{type(mechanism).__name__}"
            )
        if any(mechanism is f for f in _FACTORIES):
            raise TypeError(
                f"structinfer.nn.Attention: si.nn.{mechanism.__name__} makes a mechanism: "
                f"call it (si.nn.{mechanism.__name__}(...)) and pass the mechanism it returns"
            )
        if not isinstance(value, str):
            raise TypeError(f"structinfer.nn.Attention: value must be a site name, got {value!r}")
        if backend not in BACKENDS:
            raise ValueError(
                f"structinfer.nn.Attention: backend must be one of {BACKENDS}, got {backend!r}"
            )
        self.num_heads = _check_int(num_heads, "num_heads")
        self.in_features = _check_int(in_features, "in_features")
        self.qkv_features = _check_int(
            in_features if qkv_features is None else qkv_features, "qkv_features")
        self.out_features = _check_int(
            in_features if out_features is None else out_features, "out_features")
        self.in_kv_features = _check_int(
            in_features if in_kv_features is None else in_kv_features, "in_kv_features")
        self.num_kv_heads = _check_int(
            num_heads if num_kv_heads is None else num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"structinfer.nn.Attention: num_heads ({self.num_heads}) must be divisible "
                f"by num_kv_heads ({self.num_kv_heads})"
            )
        if self.qkv_features % self.num_heads:
            raise ValueError(
                f"structinfer.nn.Attention: qkv_features ({self.qkv_features}) must be "
                f"divisible by num_heads ({self.num_heads})"
            )
        if (isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float, np.number))
                or not 0.0 <= float(dropout_rate) < 1.0):
            raise ValueError(
                f"structinfer.nn.Attention: dropout_rate must lie in [0, 1) (a number), got "
                f"{dropout_rate!r}"
            )
        for what, dt, optional in (("param_dtype", param_dtype, False), ("dtype", dtype, True)):
            if optional and dt is None:
                continue
            try:
                ok = jnp.issubdtype(jnp.dtype(dt), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"structinfer.nn.Attention: {what} must be "
                    f"{'None or ' if optional else ''}a floating dtype (float32, float64, "
                    f"bfloat16, float16), got {dt!r}"
                )
        self.head_dim = self.qkv_features // self.num_heads
        self.mechanism = mechanism
        self.value_site = value
        self.backend = backend
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.dropout_rate = float(dropout_rate)
        self.deterministic = deterministic
        self.decode = decode
        self.normalize_qk = normalize_qk

        info = describe_mechanism(
            mechanism, self.num_heads, self.head_dim, value=value, dtype=param_dtype
        )
        self.causal = info.causal
        self.hyperparameter_constraints = tuple(
            (h.name, h.constraint) for h in info.hyperparameters.values()
        )
        self.hyper = nnx.Dict({
            h.name: nnx.Param(jnp.asarray(biject_to(h.constraint).inv(h.init), param_dtype))
            for h in info.hyperparameters.values()
        })
        self._bound = _bind(mechanism)
        self._attend_fn = attention(self._bound, value, backend, block_q=block_q,
                                    block_k=block_k, precision=precision)
        self._masked = _bind_masked(self._bound)
        self._masked_fn = attention(self._masked, value, backend, block_q=block_q,
                                    block_k=block_k, precision=precision)

        linear = functools.partial(
            nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
            bias_init=bias_init, use_bias=use_bias, precision=precision,
        )
        d = self.head_dim
        self.query = linear(self.in_features, (self.num_heads, d), rngs=rngs)
        self.key = linear(self.in_kv_features, (self.num_kv_heads, d), rngs=rngs)
        self.value = linear(self.in_kv_features, (self.num_kv_heads, d), rngs=rngs)
        if normalize_qk:
            ln = functools.partial(nnx.LayerNorm, d, use_bias=False, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
            self.query_ln = ln()
            self.key_ln = ln()
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = nnx.LinearGeneral(
            (self.num_heads, d), self.out_features, axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
            use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
            rngs=rngs,
        )
        # created last, as flax.nnx.MultiHeadAttention forks its dropout stream last: the
        # same Rngs gives both layers the same projection weights
        self.dropout = (nnx.Dropout(self.dropout_rate, deterministic=deterministic, rngs=rngs)
                        if self.dropout_rate > 0 else nnx.data(None))
        self.cached_query: nnx.Cache | None = nnx.data(None)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    # ------------------------------------------------------------------ hyperparameters
    def hyperparameters(self, dtype: Any = None) -> dict[str, jax.Array]:
        r"""The hyperparameters $\theta$ as the mechanism sees them (constrained), by site name.

        Args:
            dtype: compute $T(u)$ in this dtype, ``u`` cast to it first (as flax promotes
                its parameters to the computation dtype); default: the stored dtype.

        Returns:
            ``{site: value}``, $\theta = T(u)$ of each stored unconstrained $u$.
        """
        stored = {name: self.hyper[name][...] for name, _ in self.hyperparameter_constraints}
        return {
            name: biject_to(c)(stored[name] if dtype is None else stored[name].astype(dtype))
            for name, c in self.hyperparameter_constraints
        }

    def hyperprior(self, priors: Mapping[str, dist.Distribution]) -> dict[str, dist.Distribution]:
        r"""Priors over hyperparameters, keyed for ``numpyro.contrib.module.random_nnx_module``.

        A prior $p(\theta)$ on a site's constrained value becomes the distribution of the
        stored unconstrained value $u = T^{-1}(\theta)$,
        $p(u) = p(T(u))\,|\det \partial T / \partial u|$ (``TransformedDistribution``), keyed
        ``"hyper.<site>"``; the model then samples $\theta$ from exactly $p(\theta)$.

        Args:
            priors: site name -> NumPyro distribution on the constrained value (e.g.
                ``{"q": dist.Beta(2.0, 5.0)}``).

        Returns:
            ``{"hyper.<site>": distribution}``.

        Raises:
            KeyError: a name that is not a hyperparameter of the mechanism.
        """
        cons = dict(self.hyperparameter_constraints)
        out = {}
        for name, p in priors.items():
            if name not in cons:
                raise NotFoundError(
                    f"hyperprior: '{name}' is not a hyperparameter of the mechanism "
                    f"(it has {sorted(cons)})"
                )
            t = biject_to(cons[name])
            out[f"hyper.{name}"] = dist.TransformedDistribution(p, t.inv)
        return out

    def prior_tables(self, length: int) -> dict[str, jax.Array]:
        r"""The learned structural prior of every head, $\log p_\theta(\phi^h_i = j)$.

        The table of each edge site for self attention over ``length`` positions, read
        from the edge sites' priors with the current hyperparameters (one jitted trace
        of the mechanism on zero inputs; nothing is enumerated).

        Args:
            length: the sequence length.

        Returns:
            ``{edge site: (heads, length, length) log-prior table}``.
        """
        length = _check_int(length, "length")
        # in the dtype the heads add the prior in (float32 for bfloat16 parameters)
        dtype = accum_dtype(self.hyper[next(iter(self.hyper))][...].dtype if len(self.hyper)
                            else self.param_dtype)
        z = jnp.zeros((self.num_heads, length, self.head_dim), dtype)
        shape = (self.num_heads, length, length)

        def run(hyper):
            with handlers.block(), handlers.trace() as tr, handlers.seed(rng_seed=0), \
                    handlers.substitute(data=hyper):
                self.mechanism(z, z, z)
            out = {}
            for name, site in tr.items():
                info = (site.get("infer") or {}).get(EDGE_INFO_KEY) if is_enumerated(site) else None
                if info is not None:
                    out[name] = jnp.broadcast_to(info.prior.log_table(info.num_children), shape)
            return out

        return jax.jit(run)(self.hyperparameters(dtype))

    # ------------------------------------------------------------------ the forward pass
    def _per_head(self, query, key, value):
        """(..., len, H, d) projections -> the mechanism's inputs (..., H, len, d).

        In one dtype, key/value heads repeated for grouped-query attention, and the
        hyperparameters; checks the shapes the mechanism gives for this length."""
        _check_keys(query, key)
        H, Hkv = self.num_heads, self.num_kv_heads
        if Hkv != H:
            key = jnp.repeat(key, H // Hkv, axis=-2)
            value = jnp.repeat(value, H // Hkv, axis=-2)
        dtype = jnp.result_type(query, key, value)
        q, k, v = (jnp.moveaxis(a, -2, -3).astype(dtype) for a in (query, key, value))
        # the prior's terms are added to logits accumulated in float32: bfloat16 heads
        # keep float32 hyperparameters (which never promote the queries, keys, values)
        hyper_dtype = accum_dtype(dtype)
        # constrained in that dtype (a bfloat16 sigmoid would round the rate to 8 bits)
        hyper = self.hyperparameters(hyper_dtype)
        shape, params = _value_and_param_shapes(
            self.mechanism, self.value_site, q.shape[-3:], k.shape[-3:], v.shape[-3:],
            jnp.dtype(dtype))
        for name, a in hyper.items():
            if params.get(name) != a.shape:
                raise ValueError(
                    f"structinfer.nn.Attention: the mechanism's hyperparameter '{name}' has "
                    f"shape {params.get(name)} for {q.shape[-2]} queries and {k.shape[-2]} "
                    f"keys, but the layer stores {a.shape}: give hyperparameters a shape "
                    "that does not depend on the sequence length"
                )
        if shape != q.shape[-3:]:
            raise ValueError(
                f"structinfer.nn.Attention: value site '{self.value_site}' has shape {shape}, "
                f"expected (heads, queries, head_dim) = {q.shape[-3:]}"
            )
        return q, k, v, hyper

    def _heads(self, query, key, value, mask=None):
        """(..., len, H, d) projections -> the mechanism's output, (..., n, H, d)."""
        if query.size == 0:  # no queries (or an empty batch): nothing to attend, as flax
            _check_keys(query, key)
            return jnp.zeros(query.shape, jnp.result_type(query, key, value))
        q, k, v, hyper = self._per_head(query, key, value)
        batch = q.shape[:-3]
        fn, model, per_seq = self._attend_fn, self._bound, (q, k, v)
        if mask is not None:
            fn, model = self._masked_fn, self._masked
            per_seq += (self._mask_per_sequence(mask, q.shape, k.shape[-2]),)
        if not batch:
            try:
                o = fn(*per_seq[:3], hyper, *per_seq[3:])
            except ValueError as err:
                said = _name_heads(str(err))
                if said == str(err):
                    raise
                raise ValueError(f"structinfer.nn.Attention: {said}") from err
        else:
            flat = lambda a: a.reshape((-1,) + a.shape[len(batch):])  # noqa: E731
            per_seq = tuple(flat(a) for a in per_seq)
            axes = (0, 0, 0, None) + (0,) * (len(per_seq) - 3)
            o, lses = jax.vmap(lambda q, k, v, h, *m: fn.with_log_normalisers(q, k, v, h, *m),
                               in_axes=axes)(*per_seq[:3], hyper, *per_seq[3:])
            self._check_rows(model, o, lses, batch, per_seq, hyper)
            o = o.reshape(batch + o.shape[-3:])
        return jnp.moveaxis(o, -3, -2)

    def _mask_per_sequence(self, mask, q_shape, m: int) -> jax.Array:
        """``mask`` as booleans ``batch + (H | 1, n | 1, m)``: one per sequence, its head and
        query axes kept of size 1 where they broadcast (a key-padding mask stays one
        mask per key, which the kernels read without an (n, m) table)."""
        batch, (H, n) = q_shape[:-3], q_shape[-3:-1]
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            if not (jnp.issubdtype(mask.dtype, jnp.number) and mask.dtype.kind != "c"):
                raise TypeError(f"structinfer.nn.Attention: mask must be boolean or real (True "
                                f"or non-zero where a query may attend), got dtype {mask.dtype}")
            mask = mask != 0
        full = batch + (H, n, m)
        try:
            if mask.ndim > len(full):
                raise ValueError
            shape = (1,) * (len(full) - mask.ndim) + tuple(mask.shape)
            np.broadcast_shapes(shape, full)
        except ValueError:
            raise ValueError(
                f"structinfer.nn.Attention: mask of shape {tuple(mask.shape)} does not "
                f"broadcast to (batch..., heads, queries, keys) = {full}"
            ) from None
        keep = (H if shape[-3] != 1 else 1, n if shape[-2] != 1 else 1, m)
        mask = jnp.broadcast_to(mask.reshape(shape), batch + keep)
        # a query masked from every key is padding: left unrestricted (flax averages there)
        return mask | ~jnp.any(mask, axis=-1, keepdims=True)

    def _check_rows(self, model, o, lses, batch, per_seq, hyper):
        """Concrete inputs: the error of the unbatched call for the first batch element
        with a row whose log-normaliser is not finite (or, on the exact path, a NaN
        output), naming its batch index (and the head). Under a trace (jit) the rows stay
        NaN."""
        if not all(is_concrete(a) for a in (o, *lses.values())):
            return
        rows = [~np.isfinite(np.asarray(a)) for a in lses.values()] or [np.isnan(np.asarray(o))]
        bad = np.any([r.reshape(len(r), -1).any(-1) for r in rows], axis=0)
        if not bad.any():
            return
        b = int(np.argmax(bad))
        at = tuple(int(i) for i in np.unravel_index(b, batch))
        q, k, v, *rest = (a[b] for a in per_seq)
        try:
            check_rows(model, {s: a[b] for s, a in lses.items()}, q, k, v, hyper, *rest)
        except ValueError as err:
            said = _name_heads(str(err))
            raise ValueError(f"structinfer.nn.Attention: batch index {at}: {said}") from err

    def _project(self, inputs_q, inputs_k, inputs_v):
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(
                    "structinfer.nn.Attention: inputs_k cannot be None when inputs_v is given "
                    "(pass the same array as inputs_k and leave inputs_v None)"
                )
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        inputs_q, inputs_k, inputs_v = (
            _as_array(x, name) for x, name in ((inputs_q, "inputs_q"), (inputs_k, "inputs_k"),
                                               (inputs_v, "inputs_v")))
        for name, x, f in (("inputs_q", inputs_q, self.in_features),
                           ("inputs_k", inputs_k, self.in_kv_features),
                           ("inputs_v", inputs_v, self.in_kv_features)):
            if jnp.ndim(x) < 2 or jnp.shape(x)[-1] != f:
                raise ValueError(
                    f"structinfer.nn.Attention: {name} must be (..., length, {f}), got shape "
                    f"{tuple(jnp.shape(x))}"
                )
        if inputs_k.shape[:-2] != inputs_q.shape[:-2]:
            raise ValueError(
                f"structinfer.nn.Attention: inputs_k batch dims {inputs_k.shape[:-2]} must "
                f"match inputs_q's {inputs_q.shape[:-2]}"
            )
        if inputs_v.shape[:-1] != inputs_k.shape[:-1]:
            raise ValueError(
                f"structinfer.nn.Attention: inputs_v {tuple(inputs_v.shape)} must match "
                f"inputs_k {tuple(inputs_k.shape)} except in the features"
            )
        query = self.query(inputs_q)
        key = self.key(inputs_k)
        value = self.value(inputs_v)
        if self.normalize_qk:
            query = self.query_ln(query)
            key = self.key_ln(key)
        return query, key, value

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        decode: bool | None = None,
    ) -> jax.Array:
        """Apply the layer.

        Args:
            inputs_q: queries ``(..., n, in_features)``.
            inputs_k: keys ``(..., m, in_kv_features)`` (default ``inputs_q``).
            inputs_v: values ``(..., m, in_kv_features)`` (default ``inputs_k``).
            mask: which keys each query may attend to, as ``flax.nnx.MultiHeadAttention``'s:
                ``True`` (or non-zero) where allowed, broadcasting against ``(...,
                heads, n, m)`` (``flax.nnx.make_attention_mask`` builds one). It
                restricts every edge of the mechanism on top of its prior
                ([`mask_parents`][structinfer.handlers.mask_parents]): a key-padding
                mask ``(..., 1, 1, m)`` stays one mask per key for the kernels. A query
                whose mask allows no key at all (a padded query, as
                ``make_attention_mask(keep, keep)`` gives) is padding: it is left
                unrestricted (flax averages the values there; read neither). A query that
                the mask and the prior together leave no key (a window over padding keys
                only) raises on concrete inputs and is NaN under ``jit``: mask padded
                queries too. Not with ``decode``.
            deterministic: turn dropout off (default: the constructor's).
            rngs: dropout randomness (default: the layer's own stream).
            decode: one step of autoregressive decoding (see
                [`init_cache`][structinfer.nn.Attention.init_cache]).

        Returns:
            ``(..., n, out_features)``; empty (as ``flax.nnx.MultiHeadAttention``) when
                there are no queries.

        Raises:
            TypeError: a ``mask`` that is neither boolean nor real, or an input that
                is not an array (nested lists are converted).
            ValueError: a ``mask`` that does not broadcast (or with ``decode``), inputs
                of the wrong shape, keys of length 0 with
                some queries, or dropout without
                ``deterministic``; on concrete inputs, a query with no allowed key or a
                NaN/inf score: the error of [`attention`][structinfer.attention], naming
                the edge site, the row and (batched inputs) the batch index. Under
                ``jit`` such a row comes out NaN.
        """
        query, key, value = self._project(inputs_q, inputs_k, inputs_v)
        decode = self.decode if decode is None else decode
        if decode and mask is not None:
            raise ValueError(
                "structinfer.nn.Attention: mask is not supported with decode=True (the "
                "decode step reads its row of the causal pass over the cache); mask the "
                "full pass, or give the mechanism the restriction as its prior"
            )
        # the mechanism's own sites never reach a NumPyro model the layer is called in
        # (e.g. lifted with numpyro.contrib.module.nnx_module)
        with handlers.block():
            o = (self._decode_step(query, key, value) if decode
                 else self._heads(query, key, value, mask))
        if self.dropout_rate > 0:
            det = self.deterministic if deterministic is None else deterministic
            if det is None:
                raise ValueError(
                    "structinfer.nn.Attention: pass deterministic= (to __call__ or the "
                    "constructor) when dropout_rate > 0"
                )
            o = self.dropout(o, deterministic=det, rngs=rngs)
        return self.out(o)

    def explain(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
                inputs_v: jax.Array | None = None, *,
                mask: jax.Array | None = None) -> Explanation:
        """Which path (kernel, or the exact engine and why) the heads take on these inputs.

        [`explain`][structinfer.explain] for one sequence of the batch.

        Args:
            inputs_q: queries ``(..., n, in_features)``.
            inputs_k: keys ``(..., m, in_kv_features)`` (default ``inputs_q``).
            inputs_v: values ``(..., m, in_kv_features)`` (default ``inputs_k``).
            mask: the call's ``mask``, if any.

        Returns:
            The [`Explanation`][structinfer.lowering.Explanation] of the first sequence.
        """
        query, key, value = self._project(inputs_q, inputs_k, inputs_v)
        if query.size == 0:
            raise ValueError(
                "structinfer.nn.Attention.explain: inputs_q has no positions (or an empty "
                f"batch), shape {tuple(jnp.shape(inputs_q))}: there is no query to explain"
            )
        q, k, v, hyper = self._per_head(query, key, value)
        first = lambda a: a.reshape((-1,) + a.shape[-3:])[0]  # noqa: E731
        if mask is None:
            return self._attend_fn.explain(first(q), first(k), first(v), hyper)
        mask = self._mask_per_sequence(mask, q.shape, k.shape[-2])
        return self._masked_fn.explain(first(q), first(k), first(v), hyper, first(mask))

    # ------------------------------------------------------------------ decoding
    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        r"""Allocate the autoregressive cache for ``decode=True`` calls.

        Each decode call takes one new position ``(..., 1, in_features)``, writes its
        projected query, key and value at the cache index and returns what the full
        pass would return at that position: the mechanism is re-run over the cached
        prefix (keys past the index are zeros) and row ``index`` is read. This is exact
        when every edge's prior forbids later keys (checked here), since row $t$ then
        depends on positions $\le t$ only, and it keeps the queries too, so multi-hop
        mechanisms stay exact. The cost per step is one causal pass over the cache,
        $O(L^2 d)$ time and $O(L d)$ memory with the blocked kernel, not the $O(L d)$ of a
        single-row step (the priors' positions are static, so a row at a traced index
        cannot be lowered on its own).

        Args:
            input_shape: ``(..., max_length, in_features)``.
            dtype: dtype of the cache (what it stores; each step computes in the
                projections' dtype and answers in the full pass's).

        Raises:
            ValueError: the mechanism is not causal, or a bad shape.
        """
        if not self.causal:
            raise ValueError(
                f"structinfer.nn.Attention: decode needs a causal mechanism, but "
                f"'{model_name(self.mechanism)}' gives a key after the "
                "query non-zero prior probability (use a causal prior, e.g. "
                "structinfer.nn.causal())"
            )
        input_shape = tuple(input_shape)
        if len(input_shape) < 2 or input_shape[-1] != self.in_features:
            raise ValueError(
                f"structinfer.nn.Attention.init_cache: input_shape must be (..., max_length, "
                f"{self.in_features}), got {input_shape}"
            )
        lead = input_shape[:-1]
        self.cached_query = nnx.Cache(jnp.zeros(lead + (self.num_heads, self.head_dim), dtype))
        kv = lead + (self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(kv, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(kv, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def _decode_step(self, query, key, value):
        if self.cache_index is None:
            raise ValueError(
                "structinfer.nn.Attention: decode=True needs a cache; call init_cache first"
            )
        *batch, L, _, _ = self.cached_query.shape
        want = tuple(batch) + (1,)
        if query.shape[:-2] != want or key.shape[:-2] != want:
            raise ValueError(
                f"structinfer.nn.Attention: decode takes one position per call, inputs of shape "
                f"{tuple(batch) + (1, self.in_features)}; got inputs_q of shape "
                f"{query.shape[:-2] + (self.in_features,)} and inputs_k of shape "
                f"{key.shape[:-2] + (self.in_kv_features,)}"
            )
        i = self.cache_index[...]
        if is_concrete(i) and int(i) >= L:
            raise ValueError(f"structinfer.nn.Attention: the decode cache is full ({L} positions)")
        at = (0,) * len(batch) + (i, 0, 0)
        caches = (self.cached_query, self.cached_key, self.cached_value)
        # the heads run in the projections' dtype, as the full pass does (a float32 cache
        # of a bfloat16 layer would otherwise make the step float32, off its full pass)
        dtype = jnp.result_type(query, key, value)
        full = []
        for cache, new in zip(caches, (query, key, value)):
            cache[...] = lax.dynamic_update_slice(cache[...], new.astype(cache.dtype), at)
            full.append(cache[...].astype(dtype))
        self.cache_index[...] = i + 1
        o = self._heads(*full)  # (..., L, H, d): the causal pass over the cached prefix
        row = lax.dynamic_slice_in_dim(o, i, 1, axis=o.ndim - 3)
        # past a full cache (traced: the eager check above cannot raise) the slices clamp to
        # the last position, overwritten: NaN, not that finite row
        return jnp.where(i < L, row, jnp.nan).astype(row.dtype)

