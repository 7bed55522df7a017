r"""Lower one edge site through rules registered per prior / score / pattern type.

An edge site's logits are the unnormalised log-posterior

$$\ell_{ij} = \psi(x_i, x_j) + \log \tilde p(\phi_i = j),$$

kept up to a per-child constant (the softmax over parents ignores it). A *rule* for a
prior or score type turns one instance into terms of $\ell$ that the kernels compute
blockwise, by calling the methods of a `TermBuilder`: a dot product
$q_i^\top k_j$, a per-parent bias, a per-edge table, an IDW term, a relative-position
bias or a geometric log-prior read off the distance grid $d_{ij} = i + \text{offset} - j$,
a distance band, a mask. Rules live in three tables keyed by type
(`register_prior_rule`, `register_score_rule`,
`register_pattern_rule`); lookup walks the type's MRO, so a subclass uses its
base's rule unless it registers its own (or overrides the methods that define its
numbers, see `RuleTable`). A type with no rule raises `NotLowered` naming
it, and `structinfer.attention` takes the exact engine.

```python
import jax.numpy as jnp
import structinfer as si
from structinfer.lowering import register_prior_rule

class Recency(si.priors.StructuralPrior):     # log p(phi_i = j) = -rate * |i - j| + const
    ...

@register_prior_rule(Recency)
def _(prior, terms):
    i = jnp.arange(terms.num_children)[:, None]
    j = jnp.arange(terms.num_parents)[None, :]
    terms.add_pair_logits(-prior.rate * jnp.abs(i - j))
    terms.note("prior Recency (distance table)")
```

The built-in rules are in `structinfer.lowering.rules` (registered when
`structinfer.lowering` is imported; read them as examples of the `register_*_rule`
decorators). `lower_edge` runs the rules of an edge's
``(prior, score)`` and packs what they added, with the value table, into a
`Terms` / `Problem` pair for the kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from .._checks import float32_at_least, is_concrete
from ..priors import RestrictionPattern, StructuralPrior, band_mask
from ..scores import Score
from ._masks import BlockMask, ConcreteMask, mask_and
from ._spec import (
    Cols,
    Consts,
    Globals,
    Pairs,
    Problem,
    RelPos,
    Rows,
    Terms,
    accum_dtype,
    logit_scale,
    logit_scale_array,
)

__all__ = [
    "NotLowered",
    "TermBuilder",
    "DistanceBand",
    "RuleTable",
    "PRIOR_RULES",
    "SCORE_RULES",
    "PATTERN_RULES",
    "register_prior_rule",
    "register_score_rule",
    "register_pattern_rule",
    "Lowered",
    "lower_edge",
]


class NotLowered(Exception):
    """A part of the model that no kernel implements (``part`` says which, ``reason`` why).

    Raised by `lower_edge` when a prior / score type has no rule, and by a rule that
    cannot lower a particular instance (e.g. a parameter that is traced but must be static);
    [`structinfer.attention`][structinfer.attention] then takes the exact engine and
    [`structinfer.explain`][structinfer.explain] reports
    ``"site '<edge>': <part>: <reason>"``.

    Args:
        part: what is not lowered, e.g. ``"prior MyPrior"`` or ``"score InvDist"``.
        reason: why, in words.
    """

    def __init__(self, part: str, reason: str):
        self.part = part
        self.reason = reason
        super().__init__(f"{part}: {reason}")


@dataclass(frozen=True)
class DistanceBand:
    r"""The distance band a pattern rule says a mask is: $d_{\min} \le d_{ij} \le d_{\max}$.

    Child $i$ may take parent $j$ when its distance $d_{ij} = i + \text{offset} - j$ lies
    in $[d_{\min}, d_{\max}]$ (and, with ``exclude_zero``, $d_{ij} \ne 0$). Returned by a
    rule registered with
    [`register_pattern_rule`][structinfer.lowering.register_pattern_rule]; the kernels
    then skip the blocks outside the band.

    Args:
        dmin: the smallest allowed distance $d_{\min}$ (``None``: unbounded below).
        dmax: the largest allowed distance $d_{\max}$ (``None``: unbounded above).
        exclude_zero: also forbid $d = 0$ (the self-edge).
        offset: child $i$ sits at parent position $i + \text{offset}$.
    """

    dmin: int | None = None
    dmax: int | None = None
    exclude_zero: bool = False
    offset: int = 0

    def mask(self, num_children: int, num_parents: int) -> np.ndarray:
        """The band as a NumPy boolean ``(children, parents)`` mask.

        Args:
            num_children: $n$, the number of children (rows).
            num_parents: $m$, the number of parents (columns).

        Returns:
            ``(n, m)`` boolean array, ``True`` on the allowed edges.
        """
        return band_mask(int(num_children), int(num_parents), dmin=self.dmin, dmax=self.dmax,
                         exclude_zero=self.exclude_zero, offset=self.offset, xp=np)


class TermBuilder:
    r"""The terms of one edge site's logits, collected from the rules of its prior and score.

    Child $i < n$, parent $j < m$; each ``add_*`` method adds one term to
    $\ell_{ij} = \psi_{ij} + \log\tilde p(\phi_i = j)$ (up to a per-child constant) and each
    ``restrict_*`` method forbids edges ($\ell_{ij} = -\infty$). Arrays may carry leading
    batch dims that broadcast against the plates around the edge (heads, batch). Dot-like
    terms share one matmul; nothing builds the ``(n, m)`` table unless a rule adds one.

    Attributes:
        num_children: $n$.
        num_parents: $m$.
    """

    def __init__(self, num_children: int, num_parents: int):
        self.num_children, self.num_parents = int(num_children), int(num_parents)
        self._dot_q: list[jax.Array] = []
        self._dot_k: list[jax.Array] = []
        # per dot term: the scale kept out of q (a 0-d scale that keeps q's dtype: a
        # float when static, else an array), multiplied once q is cast to the operands'
        # dtype, and the nominal dtypes of q and k (the features may come wider)
        self._dot_scale: list[float | jax.Array | None] = []
        self._dot_dtype: list[tuple[Any, Any]] = []
        self._idw: list[tuple[jax.Array, jax.Array, jax.Array, jax.Array]] = []
        self._col_bias: list[jax.Array] = []
        self._pair: list[jax.Array] = []
        self._kw: dict[str, Any] = {}
        self._geo: jax.Array | None = None
        self._relpos: jax.Array | None = None
        self._col_ok: jax.Array | None = None
        self._pair_ok: jax.Array | None = None
        self._mask: ConcreteMask | None = None
        self._pair_traced = False  # some per-edge mask came without its concrete value
        self._notes: list[str] = []

    # --- dispatch ------------------------------------------------------------------

    def add_prior(self, prior: StructuralPrior) -> None:
        """Add ``prior``'s terms through its registered rule.

        Raises:
            NotLowered: if no rule is registered for its type (or the rule declines).
        """
        PRIOR_RULES.lookup(prior)(prior, self)

    def add_score(self, score: Score) -> None:
        """Add ``score``'s terms through its registered rule (used by ``Sum``).

        Raises:
            NotLowered: if no rule is registered for its type (or the rule declines).
        """
        SCORE_RULES.lookup(score)(score, self)

    def note(self, text: str) -> None:
        """Record what was recognised (shown by [`structinfer.explain`][structinfer.explain])."""
        self._notes.append(str(text))

    # --- additive terms --------------------------------------------------------------

    def add_dot(self, q: jax.Array, k: jax.Array, scale: ArrayLike | None = None, *,
                dtype: DTypeLike | None = None) -> None:
        r"""$\ell_{ij} \mathrel{+}= s\, q_i^\top k_j$; ``q``: ``(..., n, f)``, ``k``:
        ``(..., m, f)``.

        ``scale``: $s$ (default 1), any scalar. The kernels multiply ``q`` by it, as
        ``q * scale`` does (its dtype included); a 0-d scale that keeps ``q``'s dtype
        (static or traced) is multiplied in once ``q`` is cast to the operands' dtype
        (the common dtype of every dot feature and the values), so a bfloat16 ``q``
        beside float32 operands is not scaled in bfloat16. When the scale is a number
        known at trace time that keeps ``q``'s dtype and the site has no other dot term,
        the cuDNN kernel takes it as its own scale instead, reading ``q`` where it is;
        with 16-bit operands every kernel then applies it to the float32 product
        $q_i^\top k_j$ (``Terms.dot_scale``), as the exact engine and FlashAttention do,
        instead of rounding $s\,q$ to 16 bits (which moves a logit by up to about
        $2^{-9}|s|\sum_f |q_{if} k_{jf}|$ in bfloat16: $1/\sqrt{128}$ is no power of two).
        So do they with a traced such scale (a model argument, a learned temperature:
        ``Globals.dot_scale``, kept in float32), which the cuDNN and Mosaic GPU kernels,
        taking a static scale, refuse.

        ``dtype``: the features' nominal dtype, when ``q`` and ``k`` come wider (a rule
        that normalises or centres features in float32 hands them over unrounded): they
        count as ``dtype`` operands and are cast once, to the operands' dtype. Default:
        their own dtypes.
        """
        q_dtype = q.dtype if dtype is None else jnp.dtype(dtype)
        k_dtype = k.dtype if dtype is None else jnp.dtype(dtype)
        kept = None
        if scale is not None:
            if np.ndim(scale) == 0 and jnp.result_type(q_dtype, scale) == q_dtype:
                kept = float(scale) if is_concrete(scale) else scale
            else:
                q = q * scale
                q_dtype = jnp.result_type(q_dtype, scale)
        self._dot_q.append(q)
        self._dot_k.append(k)
        self._dot_scale.append(kept)
        self._dot_dtype.append((q_dtype, k_dtype))

    def add_inverse_distance(self, q: jax.Array, k: jax.Array, p: ArrayLike,
                             eps: ArrayLike) -> None:
        r"""$\ell_{ij} \mathrel{+}= -\log(\epsilon + \|q_i - k_j\|^p)$ (IDW), computed per block.

        ``q``: ``(..., n, f)``, ``k``: ``(..., m, f)``; ``p``, ``eps`` may be traced.
        """
        self._idw.append((q, k, jnp.asarray(p), jnp.asarray(eps)))

    def add_column_bias(self, bias: jax.Array) -> None:
        r"""$\ell_{ij} \mathrel{+}= b_j$, one bias per parent; ``bias``: ``(..., m)``, finite."""
        self._col_bias.append(bias)

    def add_pair_logits(self, logits: jax.Array) -> None:
        r"""$\ell_{ij} \mathrel{+}= L_{ij}$, a per-edge table sliced per block.

        ``logits``: ``(..., n, m)`` (or ``(..., 1, m)``), finite (forbid edges with
        [`restrict_pairs`][structinfer.lowering.TermBuilder.restrict_pairs]).
        """
        self._pair.append(logits)

    def add_relative_position(self, bias: jax.Array, *, mode: str = "linear",
                              max_distance: int | None = None, period: int | None = None,
                              offset: int = 0) -> None:
        r"""$\ell_{ij} \mathrel{+}= b(d_{ij})$, a bias looked up from the distance $d_{ij}$.

        $b$ is looked up as
        [`RelativePosition.bias_index`][structinfer.priors.RelativePosition.bias_index]
        does, with $d_{ij} = i + \text{offset} - j$.

        Args:
            bias: ``(..., L)`` bias table.
            mode: ``"linear"`` or ``"circulant"`` (with ``period``).
            max_distance: $D$: distances are clipped to $[-D, D]$ (``None``: no
                clipping).
            period: the period of the ``"circulant"`` mode.
            offset: child $i$ sits at parent position $i + \text{offset}$.
        """
        self._set_offset(offset)
        self._relpos = bias
        self._kw["relpos"] = RelPos(mode, self.num_parents, max_distance, period,
                                    int(bias.shape[-1]))

    def add_geometric(self, q: jax.Array, min_distance: int, offset: int = 0) -> None:
        r"""$\ell_{ij} \mathrel{+}= \log q_i + (d_{ij} - d_0)\log(1 - q_i)$ on $d_{ij} \ge d_0$.

        The geometric (recency) log-prior; parents nearer than $d_0$ are forbidden.

        Args:
            q: success probability in $(0, 1)$, scalar or ``(..., n)``.
            min_distance: $d_0$.
            offset: child $i$ sits at parent position $i + \text{offset}$.
        """
        self.restrict_band(dmin=min_distance, offset=offset)
        n = self.num_children
        q = float32_at_least(q)  # a 16-bit q's logs are those of its exact value
        qc = q[..., None] if q.ndim else jnp.reshape(q, (1, 1))
        geo = jnp.concatenate([jnp.log(qc), jnp.log1p(-qc)], -1)  # (..., n|1, 2)
        self._geo = jnp.broadcast_to(geo, geo.shape[:-2] + (n, 2))
        self._kw["geometric"] = True
        self._kw["geo_d0"] = min_distance

    # --- restrictions ----------------------------------------------------------------

    def restrict_band(self, dmin: int | None = None, dmax: int | None = None, *,
                      exclude_zero: bool = False, offset: int = 0) -> None:
        r"""Allow only the edges with $d_{\min} \le d_{ij} \le d_{\max}$.

        $d_{ij} = i + \text{offset} - j$. Blocks outside the band are skipped, not masked.
        Several bands intersect.

        Args:
            dmin: $d_{\min}$ (``None``: unbounded below).
            dmax: $d_{\max}$ (``None``: unbounded above).
            exclude_zero: also forbid $d_{ij} = 0$ (the self-edge).
            offset: child $i$ sits at parent position $i + \text{offset}$.
        """
        kw = self._kw
        self._set_offset(offset)
        if dmin is not None:
            kw["dmin"] = int(dmin) if kw.get("dmin") is None else max(kw["dmin"], int(dmin))
        if dmax is not None:
            kw["dmax"] = int(dmax) if kw.get("dmax") is None else min(kw["dmax"], int(dmax))
        if exclude_zero:
            kw["exclude_zero"] = True

    def restrict_columns(self, ok: jax.Array) -> None:
        """Allow only parents ``j`` with ``ok[..., j]`` (``(..., m)`` boolean, may be traced)."""
        prev = self._col_ok
        self._col_ok = ok if prev is None else prev & ok
        self._kw["col_ok"] = True

    def restrict_pairs(self, ok: jax.Array, concrete: ConcreteMask | None = None) -> None:
        """Allow only edges with ``ok[..., i, j]`` (``(..., n | 1, m)`` boolean, may be traced).

        ``concrete``: the same mask known at trace time, a NumPy array or a
        [`BlockMask`][structinfer.lowering.BlockMask] (a block-sparse mask kept per
        block, expanded only when intersected with a NumPy mask or another block size);
        the kernels then skip blocks with no allowed edge, and the Pallas kernel computes
        blocks whose every edge is allowed without reading the mask. A one-row mask is a
        column mask. When some per-edge mask of the site comes without its concrete
        value, no concrete mask is kept (`Lowered.mask` is the whole per-edge mask or
        nothing).
        """
        if ok.shape[-2] == 1:
            self.restrict_columns(ok[..., 0, :])
        else:
            prev = self._pair_ok
            self._pair_ok = ok if prev is None else prev & ok
            self._kw["pair_ok"] = True
            self._pair_traced |= concrete is None
        if concrete is not None:
            if isinstance(concrete, BlockMask) and ok.shape[-2] == 1:
                concrete = concrete.dense()  # one row: a column mask, O(m)
            if not isinstance(concrete, BlockMask):
                concrete = np.asarray(concrete, bool)
            elif concrete.shape[-2:] != tuple(ok.shape[-2:]):
                raise ValueError(f"restrict_pairs: a BlockMask of shape {concrete.shape} "
                                 f"for a mask of shape {tuple(ok.shape)}")
            self._mask = mask_and(self._mask, concrete)

    def _set_offset(self, offset: int) -> None:
        offset = int(offset)
        if self._kw.get("offset", offset) != offset:
            raise NotLowered("offset", f"two terms disagree on the offset ({self._kw['offset']} "
                             f"and {offset})")
        self._kw["offset"] = offset


Rule = Callable[..., Any]


class RuleTable:
    """Rules keyed by type, found along the MRO of the object's type.

    A subclass uses its nearest registered base's rule, unless it (or a class between it
    and that base) overrides one of ``defining``: the methods that give the object its
    numbers (``log_table`` for priors, ``dense`` for scores). A rule written for the base
    would then lower different numbers, so lookup refuses with `NotLowered`.

    Args:
        what: ``"prior"``, ``"score"`` or ``"pattern"`` (for messages).
        base: the class every registered type must subclass.
        defining: method names whose override breaks inheritance of a rule.
    """

    def __init__(self, what: str, base: type, defining: tuple[str, ...] = ()):
        self.what, self.base, self.defining = what, base, tuple(defining)
        self._rules: dict[type, Rule] = {}

    def register(self, *types: type) -> Callable[[Rule], Rule]:
        """Decorator registering a rule for ``types`` (replacing any earlier rule)."""
        fn_name = f"register_{self.what}_rule"
        if not types:
            raise TypeError(f"{fn_name}: give at least one {self.what} type")
        for t in types:
            if not (isinstance(t, type) and issubclass(t, self.base)):
                raise TypeError(f"{fn_name}: {t!r} is not a subclass of "
                                f"{self.base.__module__}.{self.base.__qualname__}")

        def deco(rule: Rule) -> Rule:
            if not callable(rule):
                raise TypeError(f"{fn_name}: the rule must be callable, got {rule!r}")
            for t in types:
                self._rules[t] = rule
            return rule

        return deco

    def find(self, cls: type) -> tuple[type, Rule] | None:
        """``(registered type, rule)`` for the nearest registered class in ``cls``'s MRO."""
        for c in cls.__mro__:
            rule = self._rules.get(c)
            if rule is not None:
                return c, rule
        return None

    def lookup(self, obj: Any) -> Rule:
        """The rule for ``obj``'s type.

        Raises:
            NotLowered: naming the type when none is registered, or when the type
                overrides a method that defines its numbers and only a base has a rule.
        """
        cls = type(obj)
        part = f"{self.what} {cls.__name__}"
        found = self.find(cls)
        if found is None:
            known = sorted({t.__name__ for t in self._rules})
            raise NotLowered(part, f"no lowering rule is registered for {self.what} type "
                             f"{cls.__module__}.{cls.__qualname__} (rules exist for "
                             f"{', '.join(known)}); register one with "
                             f"structinfer.lowering.register_{self.what}_rule")
        owner, rule = found
        for c in cls.__mro__[: cls.__mro__.index(owner)]:
            over = [m for m in self.defining if m in vars(c)]
            if over:
                raise NotLowered(part, f"{c.__name__} overrides {over[0]}, so the rule of its "
                                 f"base {owner.__name__} does not describe it; register a rule "
                                 f"for {cls.__name__} with "
                                 f"structinfer.lowering.register_{self.what}_rule")
        return rule


#: rules ``rule(prior, terms)`` per structural prior type
PRIOR_RULES = RuleTable("prior", StructuralPrior, ("_log_weights", "log_table", "distribution"))
#: rules ``rule(score, terms)`` per score type
SCORE_RULES = RuleTable("score", Score, ("dense",))
#: rules ``rule(pattern) -> DistanceBand | None`` per restriction-pattern type
PATTERN_RULES = RuleTable("pattern", RestrictionPattern)


def register_prior_rule(*prior_types: type) -> Callable[[Rule], Rule]:
    r"""Register ``rule(prior, terms)`` as the lowering of these prior types (a decorator).

    The rule adds the prior's $\log\tilde p(\phi_i = j)$ (up to a per-child constant) to
    the [`TermBuilder`][structinfer.lowering.TermBuilder] ``terms``, and may raise
    [`NotLowered`][structinfer.lowering.NotLowered] for an instance it cannot lower.
    Subclasses use the rule too unless they register their own or override
    ``log_table`` / ``_log_weights`` / ``distribution``. Registering again replaces the
    rule. Check a new rule against the exact engine
    ([`structinfer.expectation`][structinfer.expectation]).

    Args:
        *prior_types: subclasses of
            [`StructuralPrior`][structinfer.priors.StructuralPrior].

    Returns:
        A decorator that registers the rule and returns it unchanged.

    Raises:
        TypeError: if a type is not a ``StructuralPrior`` subclass, or the rule is not
            callable.
    """
    return PRIOR_RULES.register(*prior_types)


def register_score_rule(*score_types: type) -> Callable[[Rule], Rule]:
    r"""Register ``rule(score, terms)`` as the lowering of these score types (a decorator).

    The rule adds the score's $\psi(x_i, x_j)$ (up to a per-child constant) to the
    [`TermBuilder`][structinfer.lowering.TermBuilder] ``terms``, and may raise
    [`NotLowered`][structinfer.lowering.NotLowered] for an instance it cannot lower.
    Subclasses use the rule too unless they register their own or override ``dense``.
    Registering again replaces the rule.

    Args:
        *score_types: subclasses of [`Score`][structinfer.scores.Score].

    Returns:
        A decorator that registers the rule and returns it unchanged.

    Raises:
        TypeError: if a type is not a ``Score`` subclass, or the rule is not callable.
    """
    return SCORE_RULES.register(*score_types)


def register_pattern_rule(*pattern_types: type) -> Callable[[Rule], Rule]:
    r"""Register ``rule(pattern) -> DistanceBand | None`` for these restriction patterns.

    A [`Restricted`][structinfer.priors.Restricted] prior is lowered from its mask; its
    pattern's rule may return the [`DistanceBand`][structinfer.lowering.DistanceBand]
    the mask is, so the kernels skip the blocks outside it. The claim is checked against
    the mask whenever the mask is known at trace time (the mask is used when they differ,
    or when it is traced), so a rule cannot make the result wrong. ``None``: use the mask
    (the rule of the base `RestrictionPattern`, inherited by patterns without one).

    Args:
        *pattern_types: subclasses of
            [`RestrictionPattern`][structinfer.priors.RestrictionPattern].

    Returns:
        A decorator that registers the rule and returns it unchanged.

    Raises:
        TypeError: if a type is not a ``RestrictionPattern`` subclass, or the rule is not
            callable.
    """
    return PATTERN_RULES.register(*pattern_types)


class Lowered:
    """A lowered edge site: static ``terms``, arrays ``problem``, and an optional
    concrete ``mask`` (a NumPy array or a [`BlockMask`][structinfer.lowering.BlockMask]):
    the value of the site's per-edge mask known at trace time (AND its column masks,
    where those are known). The kernels skip the blocks it
    forbids, and the Pallas kernel computes the blocks it allows whole without a mask
    (the contract: `structinfer.lowering.accel.pallas_forward`'s ``mask``); ``None``
    when some per-edge mask is traced. ``site``: the edge site's name (for error
    messages), where known."""

    def __init__(self, terms: Terms, problem: Problem, batch_shape, mask=None,
                 unscaled: tuple[jax.Array, float] | None = None, site: str | None = None):
        self.terms = terms
        self.problem = problem
        self.batch_shape = tuple(batch_shape)
        self.mask = mask
        self._unscaled = unscaled
        self.site = site

    def unscaled_dot(self, problem: Problem) -> tuple[jax.Array, float] | None:
        r"""``(q, s)`` when the site's dot product is $s\, q^\top k$ with a static scale $s$
        and ``problem`` reads this site's own ``q`` (``problem.row.q`` is ``s * q``, or
        ``q`` itself when ``terms.dot_scale`` is ``s``); else ``None`` (a shard's or
        another problem: its ``row.q`` is scaled, or its ``terms.dot_scale`` says so). A
        kernel that takes a scale of its own (cuDNN) reads ``q`` where it is instead of
        the scaled copy."""
        if self._unscaled is None or problem.row.q is not self.problem.row.q:
            return None
        return self._unscaled

    def __repr__(self) -> str:
        return f"Lowered({', '.join(self.terms.notes)}; batch={self.batch_shape})"


def _batch(x: jax.Array, core: int) -> tuple[int, ...]:
    return tuple(x.shape[: x.ndim - core])


def _named(group) -> list[tuple[str, jax.Array]]:
    """The arrays of a `Rows` / `Cols` as ``(name, array)``, the r-th IDW term's as
    ``idw<r>`` (for error messages)."""
    out = []
    for f in dataclasses.fields(group):
        x = getattr(group, f.name)
        if isinstance(x, tuple):
            out += [(f"{f.name}{r}", y) for r, y in enumerate(x)]
        elif x is not None:
            out.append((f.name, x))
    return out


def _bcast_cat(xs: list[jax.Array]) -> jax.Array:
    """Concatenate along the feature axis after broadcasting the other axes."""
    if len(xs) == 1:
        return xs[0]
    shape = jnp.broadcast_shapes(*(x.shape[:-1] for x in xs))
    return jnp.concatenate([jnp.broadcast_to(x, shape + x.shape[-1:]) for x in xs], -1)


def lower_edge(
    prior: StructuralPrior,
    score: Score | None,
    value_table: jax.Array,
    num_children: int,
    plate_batch: tuple[int, ...] = (),
    site: str | None = None,
) -> Lowered:
    r"""Lower one edge site: ``y_i = E[V_{\phi_i}]`` under ``prior`` and ``score``.

    Args:
        prior: the structural prior (``EdgeInfo.prior``).
        score: the score (``EdgeInfo.score``) or ``None``.
        value_table: ``(..., m, dv)`` values of the parents.
        num_children: ``n``.
        plate_batch: batch shape of the plates around the edge, without the
            children plate (heads, batch).
        site: the edge site's name, for error messages.

    Returns:
        The `Lowered` edge. The dot product's features
        and the value table are in their common dtype (the kernels' operands); every
        other array (the prior's parameters, biases, tables, IDW features) is in the
        dtype the kernels accumulate in: float32, or float64 for float64 operands.

    Raises:
        NotLowered: naming the part (``"prior ..."``/``"score ..."``) with no lowering.
    """
    n, m = int(num_children), int(prior.num_parents)
    acc = TermBuilder(n, m)
    acc.add_prior(prior)
    if score is not None:
        acc.add_score(score)
    kw = dict(acc._kw)
    q = k = bias = logits = None
    raw_q = scale = None
    v = jnp.asarray(value_table)
    # dtypes: the score's features and the values are the kernels' operands, in their
    # common dtype; the prior's parameters (and every other term) are added to logits
    # accumulated in float32 (float64 for float64 operands), so a float32 prior parameter
    # never promotes bfloat16 operands
    # (the dot features by their nominal dtypes: a rule may hand them over wider)
    inputs = [*(d for qk in acc._dot_dtype for d in qk), v.dtype]
    floats = [d for d in inputs if jnp.issubdtype(d, jnp.floating)]
    dtype = jnp.result_type(*floats) if floats else jnp.result_type(float)
    acc_dtype = accum_dtype(dtype)

    def operand(x):
        return None if x is None else x.astype(dtype)

    def term(x):
        return None if x is None else x.astype(acc_dtype)

    dot_scale = None  # a traced scale of 16-bit operands (Globals.dot_scale)
    if acc._dot_q:
        static = len(acc._dot_q) == 1 and isinstance(acc._dot_scale[0], float)
        s16 = logit_scale(acc._dot_scale[0], dtype) if static else None
        if len(acc._dot_q) == 1 and not static:
            dot_scale = logit_scale_array(acc._dot_scale[0], dtype)
        if s16 is not None or dot_scale is not None:
            # 16-bit operands: the kernels scale the float32 q.k (s * q rounded to 16
            # bits would move a logit by up to about 2^-9 |s| sum_f |q_f k_f|), by a
            # number (static) or by the array glob.dot_scale (traced)
            if s16 is not None:
                kw["dot_scale"] = s16
            scaled = [operand(acc._dot_q[0])]
        else:
            # cast once, then scaled in the operands' dtype: a bfloat16 q beside float32
            # keys is not rounded to bfloat16 once scaled
            scaled = [operand(x) if c is None else operand(x) * c
                      for x, c in zip(acc._dot_q, acc._dot_scale)]
        q, k = _bcast_cat(scaled), _bcast_cat([operand(x) for x in acc._dot_k])
        kw["dot"] = True
        if static:
            raw_q, scale = acc._dot_q[0], acc._dot_scale[0]
    kw["idw"] = len(acc._idw)
    if acc._col_bias:
        b = acc._col_bias[0]
        for x in acc._col_bias[1:]:
            b = b + x
        bias = b[..., None]
        kw["col_bias"] = True
    if acc._pair:
        t = acc._pair[0]
        for x in acc._pair[1:]:
            t = t + x
        logits = t
        kw["pair_logits"] = True
    def idw(part: int) -> tuple[jax.Array, ...]:  # x, y, p or eps of every IDW term
        return tuple(term(t[part]) for t in acc._idw)

    row = Rows(q=operand(q), geo=term(acc._geo), idw=idw(0))
    col = Cols(k=operand(k), bias=term(bias), idw=idw(1))
    glob = Globals(relpos=term(acc._relpos), idw_p=idw(2), idw_eps=idw(3),
                   dot_scale=dot_scale)
    v = v.astype(dtype)
    # shape checks and the batch shape
    arrays = []
    for name, x in _named(row):
        if x.shape[-2] != n:
            raise NotLowered(f"row array '{name}'", f"has {x.shape[-2]} children, expected {n}")
        arrays.append(_batch(x, 2))
    for name, x in _named(col):
        if x.shape[-2] != m:
            raise NotLowered(f"column array '{name}'",
                             f"has {x.shape[-2]} parents, expected {m}")
        arrays.append(_batch(x, 2))
    logits = term(logits)
    if logits is not None:
        if logits.shape[-1] != m or logits.shape[-2] not in (1, n):
            raise NotLowered("pair array 'logits'",
                             f"shape {logits.shape}, expected (..., {n}, {m})")
        arrays.append(_batch(logits, 2))
        logits = jnp.broadcast_to(logits, logits.shape[:-2] + (n, m))
    pair = Pairs(logits=logits)
    pair_ok, col_ok = acc._pair_ok, acc._col_ok
    if pair_ok is not None:
        arrays.append(_batch(pair_ok, 2))
        pair_ok = jnp.broadcast_to(pair_ok, pair_ok.shape[:-2] + (n, m))
    if col_ok is not None:
        arrays.append(_batch(col_ok, 1))
    const = Consts(pair_ok=pair_ok, col_ok=col_ok)
    for x in jax.tree.leaves(glob):
        arrays.append(_batch(x, 1))
    if v.ndim < 2 or v.shape[-2] != m:
        raise NotLowered("value", f"value table has shape {v.shape}, expected (..., {m}, dv)")
    arrays.append(_batch(v, 2))
    try:
        batch = jnp.broadcast_shapes(tuple(plate_batch), *arrays)
    except ValueError:
        raise NotLowered("batch dims", f"arrays' batch shapes {arrays} do not broadcast "
                         f"against the plates {tuple(plate_batch)}") from None
    if len(batch) > len(plate_batch):
        raise NotLowered(
            "batch dims",
            f"some array has more batch dims ({batch}) than the plates around the edge "
            f"({tuple(plate_batch)}): it depends on another edge or on an extra dim",
        )
    terms = Terms(n, m, notes=tuple(acc._notes), **kw)
    mask = None if acc._pair_traced else acc._mask
    unscaled = None if raw_q is None else (operand(raw_q), scale)
    return Lowered(terms, Problem(row, col, pair, glob, const, v), batch, mask, unscaled,
                   site)
