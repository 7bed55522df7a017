r"""Structural priors: distributions over which parent each child node takes.

An edge site $\phi_i$ takes values in the parents $\{0,\dots,m-1\}$
of child $i$. A structural prior is a table
$\log p(\phi_i = j)$ of shape ``(..., children, parents)``, normalised over
parents. It enters attention as an additive bias inside the softmax
(Singh & Buckley, "Attention as implicit structural inference", sec. 3 and
appendix 8.2):

$$
p(\phi_i = j \mid x) = \mathrm{softmax}_j\big(\psi(x_i, x_j) + \log p(\phi_i = j)\big).
$$

The priors are *structured objects*: besides the dense table (``log_table``)
they keep the parameters that describe them (a window size, a relative-position
bias, the geometric ``q``) so that the lowered engine can recognise them and
never materialise the table.

Every prior exposes:

* ``num_parents`` — the size of the edge support;
* ``offset`` — the positional convention below (0 unless given);
* ``log_table(num_children)`` — the normalised log-prior, ``(..., children, parents)``;
* ``distribution(num_children)`` — the NumPyro ``Categorical`` carrying it.

Positions: child ``i`` sits at parent position ``i + offset`` (``offset=0`` by
default, i.e. self attention; for a cross setting where the queries are the
last ``n`` of ``m`` keys, use ``offset=m - n``). The *distance* from child ``i``
to parent ``j`` is ``d = i + offset - j`` (positive for earlier parents).

A parameter out of its range (a geometric ``q`` outside (0, 1), a NaN logit) raises a
``ValueError`` naming it; traced (under ``jax.jit``), where it cannot raise, it is NaN,
and so is everything computed from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax.typing import ArrayLike

from ._checks import (
    ROWS_CHECKED,
    as_float_array,
    check_int,
    check_static_int,
    first_empty_row,
    float32_at_least,
    is_concrete,
    normalise_log_weights,
    require,
)

__all__ = [
    "StructuralPrior",
    "Uniform",
    "Restricted",
    "RestrictionPattern",
    "Mask",
    "Causal",
    "Window",
    "Graph",
    "BlockSparse",
    "band_mask",
    "Categorical",
    "RelativePosition",
    "Geometric",
    "Markov",
    "Masked",
    "NoParentError",
]


class NoParentError(ValueError):
    r"""A child is left no parent: its row of $\log p(\phi_i = j)$ is all $-\infty$.

    The row is a structural prior's, or at an edge site the prior plus the score's
    ``-inf`` entries, so $p(\phi_i \mid x)$ cannot be normalised (Singh & Buckley,
    sec. 3: each child takes exactly one parent). A subclass of ``ValueError``, raised
    on concrete values (under ``jit`` such a child's answers are NaN). A child that
    ``numpyro.handlers.mask`` masks out (padding) may have no parent: it is not there."""


def _distance_grid(num_children: int, num_parents: int, offset: int) -> jax.Array:
    """``d[i, j] = i + offset - j`` as an int32 ``(children, parents)`` grid."""
    i = jnp.arange(num_children)[:, None]
    j = jnp.arange(num_parents)[None, :]
    return i + offset - j


#: why a prior's child may have no parent, and what to do (the empty-row error's hint)
_NO_PARENT_HINT = (
    "a causal prior without a self-edge leaves its first child no earlier "
    "parent: use include_self=True or drop that child; one with more children "
    "than parents, the children ending with the parents, leaves its first "
    "children none: give at least as many parents as children"
)


def _check_rows_nonempty(log_table: jax.Array, prior_name: str,
                         hint: str = _NO_PARENT_HINT) -> None:
    if not is_concrete(log_table):
        return
    _check_allowed_rows(np.isfinite(np.asarray(log_table)), prior_name, hint=hint)


def _check_allowed_rows(allowed: np.ndarray, prior_name: str, rows_per_entry: int = 1,
                        hint: str = _NO_PARENT_HINT) -> None:
    """Raise unless every child (row of the boolean ``allowed``) has an allowed parent.

    ``rows_per_entry``: children per row of ``allowed`` (a block mask's block height).
    ``hint``: the error's explanation of the cause and the remedy.
    Not while `ROWS_CHECKED` is ``False`` (an edge checks its kept children then)."""
    if not ROWS_CHECKED.get():
        return
    where = first_empty_row(allowed, rows_per_entry)
    if where is not None:
        raise NoParentError(
            f"{prior_name} prior allows no parent for {where}: every child needs at "
            f"least one parent with non-zero prior probability ({hint})"
        )


class StructuralPrior:
    r"""Base class of structural priors $p(\phi_i = j)$ over each child's parents.

    Subclasses implement ``_log_weights(num_children)`` (unnormalised log-weights,
    ``-inf`` for forbidden edges); the base class normalises and validates them.
    """

    #: size of the edge support (number of candidate parents)
    num_parents: int
    #: child ``i`` sits at parent position ``i + offset``: the distance to parent ``j`` is
    #: ``d = i + offset - j``. The one source of the positional convention (the lowered
    #: engine's distance bands, ``structinfer.diagnostics`` distances); 0 = self attention
    offset: int = 0
    #: short name used by ``structinfer.explain`` and error messages
    kind: str = "prior"
    #: the no-parent error's explanation of the cause and the remedy
    _no_parent_hint: str = _NO_PARENT_HINT

    def _log_weights(self, num_children: int) -> jax.Array:  # pragma: no cover
        raise NotImplementedError

    def _log_weights_in(self, num_children: int, dtype: Any) -> jax.Array:
        """`_log_weights`, for a table to be normalised in ``dtype`` (``None``: the
        parameters' own). A prior built on another overrides it to have that one
        normalised in ``dtype`` too."""
        return self._log_weights(num_children)

    @property
    def parameter_dtype(self) -> Any:
        """The floating dtype of the prior's array parameters (a bias table, an array
        $q$), or ``None`` when its table has no dtype of its own: a parameter-free prior
        (uniform, a mask), or one whose parameters are Python numbers (``Geometric(0.3)``,
        weakly typed as in JAX). [`edge`][structinfer.edge] then gives the table the
        score's dtype, so a float32 model stays float32 when float64 is enabled."""
        floats = [
            leaf for leaf in jax.tree.leaves(vars(self))
            if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
        ]
        if not floats:
            return None
        dtype, weak = jax.dtypes.result_type(*floats, return_weak_type_flag=True)
        return None if weak else dtype

    def log_table(self, num_children: int, dtype: Any = None) -> jax.Array:
        r"""Normalised log-prior $\log p(\phi_i=j)$, shape ``(..., children, parents)``.

        Args:
            num_children: number of children ``n`` (the size of the children plate).
            dtype: a dtype to promote the log-weights to before normalising (a float64
                model's, so that a float32 parameter's table is normalised in float64
                from the parameter's exact value); ``None``: the parameters' own.

        Returns:
            The table $\log p(\phi_i = j)$, normalised over parents (``-inf`` marks a
                forbidden edge); in float32 for 16-bit parameters (normalised in it).

        Raises:
            NoParentError: if some child has no allowed parent (checked on concrete
                values; a ``ValueError``).
        """
        num_children = int(num_children)
        w = self._log_weights_in(num_children, dtype)
        if w.shape[-1] != self.num_parents:
            raise ValueError(
                f"{type(self).__name__} prior: table has {w.shape[-1]} parents, "
                f"expected num_parents={self.num_parents}"
            )
        if w.ndim >= 2 and w.shape[-2] not in (1, num_children):
            raise ValueError(
                f"{type(self).__name__} prior has {w.shape[-2]} children (shape "
                f"{tuple(w.shape)}), but the children plate has size {num_children}"
            )
        w = jnp.broadcast_to(w, w.shape[:-2] + (num_children, self.num_parents))
        w = float32_at_least(w)  # 16 bits: in float32
        if dtype is not None:
            w = w.astype(jnp.result_type(w, dtype))
        table, _ = normalise_log_weights(w)
        _check_rows_nonempty(table, type(self).__name__, self._no_parent_hint)
        return table

    def distribution(self, num_children: int) -> dist.Categorical:
        """The NumPyro distribution over parents, batch shape ``(..., children)``.

        Args:
            num_children: number of children ``n`` (the size of the children plate).

        Returns:
            A ``Categorical`` with logits [`log_table(num_children)`][structinfer.priors.StructuralPrior.log_table].
        """
        return dist.Categorical(logits=self.log_table(num_children), validate_args=False)

    def describe(self) -> dict[str, Any]:
        """Structured description of the prior (read by the lowering and ``si.explain``).

        Returns:
            ``{"kind": ..., "num_parents": ..., "offset": ..., ...}``; subclasses add their
                parameters.
        """
        return {"kind": self.kind, "num_parents": self.num_parents, "offset": self.offset}

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "kind")
        return f"{type(self).__name__}({items})"


def _check_num_parents(num_parents) -> int:
    check_static_int(num_parents, "num_parents", "prior")
    if isinstance(num_parents, bool) or not isinstance(num_parents, (int, np.integer)):
        raise TypeError(f"num_parents must be a positive int, got {num_parents!r}")
    if num_parents < 1:
        raise ValueError(f"num_parents must be >= 1, got {num_parents}")
    return int(num_parents)


class Uniform(StructuralPrior):
    r"""Uniform prior over all parents: $p(\phi_i = j) = 1/m$.

    The prior of cross and self attention (Singh & Buckley Table 1, rows 1-2).

    Args:
        num_parents: number of candidate parents ``m``.
        offset: child ``i`` sits at parent position ``i + offset`` (only distances
            depend on it, e.g. ``offset=m - n`` when the queries are the last ``n`` keys).
    """

    kind = "uniform"

    def __init__(self, num_parents: int, offset: int = 0):
        self.num_parents = _check_num_parents(num_parents)
        self.offset = check_int(offset, "Uniform prior: offset")

    def _log_weights(self, num_children: int) -> jax.Array:
        return jnp.zeros((1, self.num_parents), dtype=jnp.result_type(float))


# --- typed restriction patterns ---------------------------------------------------------


def _check_flag(value, name: str, who: str) -> bool:
    """``value`` as a Python bool (bools and the ints 0 / 1 only)."""
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, (int, np.integer)) and value in (0, 1)
    ):
        return bool(value)
    raise TypeError(f"{who}: {name} must be a bool, got {value!r}")


def _check_positive_int(value, name: str, who: str) -> int:
    """``value`` as a Python int >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{who}: {name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{who}: {name} must be >= 1, got {value}")
    return int(value)


@dataclass(frozen=True)
class RestrictionPattern:
    r"""What a [`Restricted`][structinfer.priors.Restricted] prior's mask is known to be (a base class).

    A pattern never changes the prior: the mask $M$ alone defines
    $p(\phi_i = j) \propto M_{ij}$. It tells the lowered engine the structure behind the
    mask (a distance band, a block layout) so that a kernel can skip excluded blocks
    instead of reading the mask; the engine checks the claim against the mask whenever
    the mask is known at trace time and uses the mask otherwise. The lowering dispatches
    on the pattern's type (``structinfer.lowering.register_pattern_rule``); a subclass
    without its own rule is lowered as a plain mask.

    ``describe()`` lists ``type`` (the class's ``kind``) and the fields; a pattern with an
    ``offset`` field fixes the prior's offset.
    """

    #: the ``type`` entry of ``describe()``
    kind: ClassVar[str] = "pattern"

    def describe(self) -> dict[str, Any]:
        """The pattern as a dict, read by [`Restricted.describe`][structinfer.priors.Restricted.describe].

        Returns:
            ``{"type": kind, field: value, ...}`` over the dataclass fields.
        """
        return {"type": self.kind, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class Mask(RestrictionPattern):
    """An arbitrary mask with no further structure (the default pattern).

    Args:
        label: optional name of what the mask means (``"no_self"``, ``"receptive_field"``),
            shown by ``describe()`` and ``structinfer.explain``.
    """

    label: str | None = None
    kind: ClassVar[str] = "mask"

    def __post_init__(self):
        if self.label is not None and not isinstance(self.label, str):
            raise TypeError(f"Mask pattern: label must be a str or None, got {self.label!r}")

    def describe(self) -> dict[str, Any]:
        """The pattern as a dict: ``{"type": "mask"}``, plus ``"label"`` when one is given."""
        return {"type": self.kind} if self.label is None else {"type": self.kind,
                                                                "label": self.label}


@dataclass(frozen=True)
class Causal(RestrictionPattern):
    r"""Causal mask: $M_{ij} = [d_{ij} \ge d_0]$, parents at or before the child.

    Here $d_{ij} = i + \text{offset} - j$, and $d_0 = 0$ with the self-edge and 1 without.
    Set by [`Restricted.causal`][structinfer.priors.Restricted.causal].

    Args:
        include_self: allow the self-edge (distance 0).
        offset: child ``i`` sits at parent position ``i + offset``.
    """

    include_self: bool = True
    offset: int = 0
    kind: ClassVar[str] = "causal"

    def __post_init__(self):
        object.__setattr__(self, "include_self",
                           _check_flag(self.include_self, "include_self", "Causal pattern"))
        object.__setattr__(self, "offset", check_int(self.offset, "Causal pattern: offset"))


@dataclass(frozen=True)
class Window(RestrictionPattern):
    r"""Sliding window of ``size`` parents around (or before) the child.

    Causal: $d_0 \le d_{ij} < d_0 + \text{size}$ ($d_0 = 0$, or 1 without the self-edge);
    not causal: $|d_{ij}| < \text{size}$ (and $d_{ij} \ne 0$ without the self-edge), with
    $d_{ij} = i + \text{offset} - j$. Set by
    [`Restricted.window`][structinfer.priors.Restricted.window].

    Args:
        size: the window size (a positive int).
        causal: only earlier parents (and the self-edge).
        include_self: allow the self-edge.
        offset: child ``i`` sits at parent position ``i + offset``.
    """

    size: int
    causal: bool = True
    include_self: bool = True
    offset: int = 0
    kind: ClassVar[str] = "window"

    def __post_init__(self):
        object.__setattr__(self, "size", _check_positive_int(self.size, "size", "Window pattern"))
        object.__setattr__(self, "causal", _check_flag(self.causal, "causal", "Window pattern"))
        object.__setattr__(self, "include_self",
                           _check_flag(self.include_self, "include_self", "Window pattern"))
        object.__setattr__(self, "offset", check_int(self.offset, "Window pattern: offset"))


@dataclass(frozen=True)
class Graph(RestrictionPattern):
    """The adjacency of a graph: parents are a node's in-neighbours.

    Set by [`Restricted.from_graph`][structinfer.priors.Restricted.from_graph]; lowered as
    its mask.
    """

    kind: ClassVar[str] = "graph"


@dataclass(frozen=True)
class BlockSparse(RestrictionPattern):
    r"""Whole blocks of ``block_size = (children, parents)`` allowed or not.

    $M_{ij} = B_{\lfloor i / b_c \rfloor, \lfloor j / b_p \rfloor}$ for a block mask $B$ and
    blocks of $b_c$ children by $b_p$ parents. Set by
    [`Restricted.block_sparse`][structinfer.priors.Restricted.block_sparse]; lowered as its
    mask, with the empty blocks skipped.

    Args:
        block_size: ``(children, parents)`` per block, or one int for square blocks.
    """

    block_size: tuple[int, int]
    kind: ClassVar[str] = "block_sparse"

    def __post_init__(self):
        bs = self.block_size
        pair = (bs, bs) if isinstance(bs, (int, np.integer)) else tuple(bs)
        if len(pair) != 2:
            raise ValueError(f"BlockSparse pattern: block_size must be an int or a pair of "
                             f"ints, got {bs!r}")
        object.__setattr__(self, "block_size", tuple(
            _check_positive_int(b, "block_size", "BlockSparse pattern") for b in pair))


#: what each string ``type`` of the old dict patterns is now (for the error message)
_PATTERN_NAMES = {"mask": Mask, "causal": Causal, "window": Window, "graph": Graph,
                  "block_sparse": BlockSparse}


def _as_pattern(pattern) -> RestrictionPattern:
    if pattern is None:
        return Mask()
    if isinstance(pattern, RestrictionPattern):
        return pattern
    if isinstance(pattern, dict):
        rest = {k: v for k, v in pattern.items() if k != "type"}
        cls = _PATTERN_NAMES.get(pattern.get("type"))
        if cls is None:
            hint = f"Mask(label={pattern.get('type')!r})"
        else:
            hint = f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in rest.items())})"
        raise TypeError(
            f"Restricted prior: pattern must be a typed pattern from structinfer.priors "
            f"(Mask, Causal, Window, Graph, BlockSparse), not a dict; for {pattern!r} pass "
            f"pattern=structinfer.priors.{hint}, or build the prior with Restricted.causal / "
            "window / from_graph / block_sparse"
        )
    raise TypeError(
        "Restricted prior: pattern must be a structinfer.priors.RestrictionPattern (Mask, "
        f"Causal, Window, Graph, BlockSparse) or None, got {type(pattern).__name__}"
    )


def band_mask(
    num_children: int,
    num_parents: int,
    *,
    dmin: int | None = None,
    dmax: int | None = None,
    exclude_zero: bool = False,
    offset: int = 0,
    xp: Any = jnp,
) -> Any:
    r"""The edges of a distance band: $M_{ij} = [d_{\min} \le d_{ij} \le d_{\max}]$.

    $d_{ij} = i + \text{offset} - j$ is the distance from child $i$ to parent $j$;
    with ``exclude_zero`` the self-edge $d_{ij} = 0$ is left out too. A causal mask is
    the band $d_{ij} \ge d_0$ ($d_0 = 0$ with the self-edge, 1 without), a causal window
    of ``size`` parents $d_0 \le d_{ij} \le d_0 + \text{size} - 1$, a two-sided one
    $|d_{ij}| \le \text{size} - 1$. This is the one place such masks are built: the
    [`Restricted`][structinfer.priors.Restricted] constructors, the prior's table and the
    lowered engine's distance bands all call it.

    Args:
        num_children: $n$, the number of children (rows).
        num_parents: $m$, the number of parents (columns).
        dmin: the smallest allowed distance (``None``: unbounded below).
        dmax: the largest allowed distance (``None``: unbounded above).
        exclude_zero: also forbid the self-edge, $d_{ij} = 0$.
        offset: child $i$ sits at parent position $i + \text{offset}$.
        xp: ``jax.numpy`` (the mask built from ``iota`` inside a trace, never an
            ``(n, m)`` constant) or ``numpy`` (a concrete mask).

    Returns:
        ``(n, m)`` boolean array, ``True`` on the allowed edges.
    """
    d = (xp.arange(num_children)[:, None] + offset) - xp.arange(num_parents)[None, :]
    ok = None
    for bound in (None if dmin is None else d >= dmin, None if dmax is None else d <= dmax,
                  d != 0 if exclude_zero else None):
        if bound is not None:
            ok = bound if ok is None else ok & bound
    return xp.ones(d.shape, bool) if ok is None else ok


def _pattern_mask(pattern: RestrictionPattern, num_children: int, num_parents: int,
                  xp: Any = jnp) -> Any:
    r"""The ``(children, parents)`` mask a distance pattern defines, or ``None``.

    [`Causal`][structinfer.priors.Causal] and [`Window`][structinfer.priors.Window] masks
    are distance bands (`band_mask`); ``xp`` is ``jax.numpy`` (built from ``iota`` inside
    a trace) or ``numpy``.
    """
    if not isinstance(pattern, (Causal, Window)):
        return None
    lo = 0 if pattern.include_self else 1
    if isinstance(pattern, Causal):
        band = dict(dmin=lo)
    elif pattern.causal:
        band = dict(dmin=lo, dmax=lo + pattern.size - 1)
    else:
        band = dict(dmin=1 - pattern.size, dmax=pattern.size - 1,
                    exclude_zero=not pattern.include_self)
    return band_mask(num_children, num_parents, offset=pattern.offset, xp=xp, **band)


def _expand_blocks(blocks: Any, block_size: tuple[int, int], size: tuple[int, int],
                   xp: Any) -> Any:
    """The ``(..., n, m)`` mask of a ``(..., nbc, nbp)`` block mask (expanded to
    ``(nbc * bc, nbp * bp)``, cut to ``size = (n, m)``)."""
    bc, bp = block_size
    n, m = size
    return xp.repeat(xp.repeat(blocks, bc, axis=-2), bp, axis=-1)[..., :n, :m]


def _check_mask(mask: ArrayLike, who: str, *, num_parents: int | None = None,
                min_ndim: int = 1) -> tuple[jax.Array, np.ndarray | None]:
    """A prior's boolean mask of allowed parents, checked: ``(mask, concrete)``.

    Args:
        mask: the mask, ``True`` where a parent is allowed.
        who: the prior, for the messages (``"Restricted prior"``).
        num_parents: the parents its last axis must have (``None``: any).
        min_ndim: the fewest dims it may have.

    Returns:
        The mask as a JAX array, and as a NumPy array when it is known at trace time
        (else ``None``).

    Raises:
        TypeError: the mask is not boolean.
        ValueError: it has fewer than ``min_ndim`` dims, or not ``num_parents`` parents.
    """
    concrete = np.asarray(mask) if is_concrete(mask) else None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{who}: mask must be a boolean array (True where a parent is "
                        f"allowed), got dtype {mask.dtype}")
    if mask.ndim < min_ndim or (num_parents is not None and mask.shape[-1] != num_parents):
        parents = "" if num_parents is None else f" with {num_parents} parents"
        raise ValueError(f"{who}: mask must have shape (..., children, parents){parents}, "
                         f"got shape {tuple(mask.shape)}")
    return mask, concrete


def _band_of(mask: np.ndarray | None) -> dict[str, Any] | None:
    """The `band_mask` arguments whose ``(n, m)`` mask is exactly ``mask``, or ``None``.

    A prior whose concrete mask is a distance band (causal, a window, all but the
    self-edge) builds it from ``iota`` in its table: an ``(n, m)`` constant would be
    folded by XLA at compile time (tens of seconds for ``n`` in the thousands). Only a
    2-D mask of several rows, each with an allowed parent, is read as a band.
    """
    if mask is None or mask.ndim != 2 or mask.shape[0] < 2 or not mask.any(-1).all():
        return None
    # one pass over the mask per vector, no (n, m) temporary but a reversed bool copy
    n, m = mask.shape
    rows = np.arange(n)
    first = mask.argmax(-1)
    last = m - 1 - mask[:, ::-1].argmax(-1)
    count = np.count_nonzero(mask, axis=-1)
    # d = i - j: the band's extremes are the rows' first and last allowed parents
    band = dict(dmin=int((rows - last).min()), dmax=int((rows - first).max()))
    # row i of the band: parents lo..hi (and, without the self-edge, not i)
    lo = np.maximum(rows - band["dmax"], 0)
    hi = np.minimum(rows - band["dmin"], m - 1)
    if np.array_equal(first, lo) and np.array_equal(last, hi) and np.array_equal(
            count, hi - lo + 1):
        return {**band, "exclude_zero": False}
    self_in = (lo <= rows) & (rows <= hi)
    inside = np.flatnonzero((lo < rows) & (rows < hi))
    if (np.array_equal(first, lo + (lo == rows)) and np.array_equal(last, hi - (hi == rows))
            and np.array_equal(count, hi - lo + 1 - self_in)
            and not mask[inside, inside].any()):
        return {**band, "exclude_zero": True}
    return None


class Restricted(StructuralPrior):
    r"""Uniform prior restricted to a set of allowed edges (graph / sparse attention).

    $$
    p(\phi_i = j) = \frac{M_{ij}}{\sum_{j'} M_{ij'}}
    $$

    (Singh & Buckley Table 1, row 3: "Uniform (restricted)".)

    Args:
        mask: boolean array ``(..., children, parents)``; ``mask[i, j]`` is True
            when ``j`` is an allowed parent of ``i``.
        pattern: what the mask is known to be, a
            [`RestrictionPattern`][structinfer.priors.RestrictionPattern]
            ([`Causal`][structinfer.priors.Causal], [`Window`][structinfer.priors.Window],
            [`Graph`][structinfer.priors.Graph],
            [`BlockSparse`][structinfer.priors.BlockSparse],
            [`Mask`][structinfer.priors.Mask]; set by the constructors below); the lowered
            engine uses it to skip excluded blocks. Default ``Mask()``.
        offset: child ``i`` sits at parent position ``i + offset``; default the
            pattern's offset (``Causal`` / ``Window``), else 0.

    Raises:
        TypeError: if ``pattern`` is not a
            [`RestrictionPattern`][structinfer.priors.RestrictionPattern] (e.g. a dict).
        ValueError: if some child has no allowed parent (checked on concrete masks
            where an edge site uses the prior, and named after that site).

    Use the constructors [`causal`][structinfer.priors.Restricted.causal],
    [`window`][structinfer.priors.Restricted.window],
    [`from_graph`][structinfer.priors.Restricted.from_graph] and
    [`block_sparse`][structinfer.priors.Restricted.block_sparse] for the common patterns.
    """

    kind = "restricted"

    def __init__(
        self, mask: ArrayLike, pattern: RestrictionPattern | None = None, offset: int | None = None
    ):
        mask, self._concrete = _check_mask(mask, "Restricted prior", min_ndim=2)
        self._mask = mask
        #: the block mask $B$ of a prior built by `block_sparse` (``None`` otherwise): the
        #: mask is kept per block, and expanded only where an ``(n, m)`` mask is asked for
        self.blocks: jax.Array | None = None
        #: ``blocks`` as a NumPy array when known at trace time, else ``None``
        self.concrete_blocks: np.ndarray | None = None
        #: ``(n, m)``: the numbers of children and parents the mask covers
        self.size = tuple(int(x) for x in mask.shape[-2:])
        self._setup(int(mask.shape[-1]), pattern, offset)

    def _setup(self, num_parents: int, pattern, offset) -> None:
        self.num_parents = num_parents
        #: the ``RestrictionPattern`` the mask is known to follow
        self.pattern = _as_pattern(pattern)
        own = getattr(self.pattern, "offset", None)
        self.offset = check_int((own or 0) if offset is None else offset,
                                "Restricted prior: offset")
        if own is not None and own != self.offset:
            raise ValueError(
                f"Restricted prior: offset={offset} contradicts the pattern's offset {own}"
            )
        # a known mask that is a distance band (Restricted.causal / window, or any such
        # mask) is rebuilt from iota in the table (`_band_of`)
        self._band = _band_of(self._concrete if self.blocks is None else None)

    @property
    def mask(self) -> jax.Array:
        """The boolean ``(..., children, parents)`` mask $M$ (a block-sparse prior's is
        expanded from its ``blocks`` on each read, inside a trace as broadcasts of the
        small block mask)."""
        if self.blocks is None:
            return self._mask
        return _expand_blocks(self.blocks, self.pattern.block_size, self.size, jnp)

    @property
    def concrete_mask(self) -> np.ndarray | None:
        """The mask as a NumPy array when known at trace time (lets the lowered engine
        verify ``pattern`` and skip empty blocks under ``jit``), else ``None``. A
        block-sparse prior expands ``concrete_blocks`` on each read: the lowered engine
        reads the blocks instead."""
        if self.blocks is None:
            return self._concrete
        c = self.concrete_blocks
        return None if c is None else _expand_blocks(c, self.pattern.block_size, self.size, np)

    def _log_weights(self, num_children: int) -> jax.Array:
        # checked here, not when the prior is built, so that the edge site using the
        # prior names itself in the error; numpy: jnp would stage the mask in a trace
        if self.blocks is not None:
            if self.concrete_blocks is not None:
                _check_allowed_rows(self.concrete_blocks, "Restricted",
                                    rows_per_entry=self.pattern.block_size[0])
        elif self._concrete is not None:
            _check_allowed_rows(self._concrete.astype(bool, copy=False), "Restricted")
        mask = self.mask
        if self._band is not None:
            mask = band_mask(mask.shape[0], mask.shape[1], **self._band)
        return jnp.where(mask, 0.0, -jnp.inf).astype(jnp.result_type(float))

    def describe(self) -> dict[str, Any]:
        """The prior's description with its pattern's entries (``type`` and fields)."""
        return {"kind": self.kind, "num_parents": self.num_parents, **self.pattern.describe(),
                "offset": self.offset}

    @classmethod
    def causal(
        cls,
        num_children: int,
        num_parents: int | None = None,
        include_self: bool = True,
        offset: int = 0,
    ) -> Restricted:
        r"""Causal mask: child $i$ may take the parents at distance $d_{ij} \ge d_0$.

        $d_{ij} = i + \text{offset} - j$; $d_0 = 0$ with the self-edge, 1 without. The
        pattern is [`Causal(include_self, offset)`][structinfer.priors.Causal].

        Args:
            num_children: number of children ``n``.
            num_parents: number of parents ``m`` (default ``n``).
            include_self: allow the self-edge (distance 0).
            offset: child ``i`` sits at parent position ``i + offset``.

        Returns:
            The prior, uniform over the allowed parents.
        """
        check_static_int(num_children, "num_children", "Restricted.causal")
        check_static_int(num_parents, "num_parents", "Restricted.causal")
        check_static_int(offset, "offset", "Restricted.causal")
        m = num_children if num_parents is None else num_parents
        pattern = Causal(include_self=include_self, offset=offset)
        return cls(_pattern_mask(pattern, num_children, m, xp=np), pattern=pattern)

    @classmethod
    def window(
        cls,
        num_children: int,
        size: int,
        num_parents: int | None = None,
        causal: bool = True,
        include_self: bool = True,
        offset: int = 0,
    ) -> Restricted:
        r"""Sliding window of ``size`` parents around (or before) each child.

        Causal: $d_0 \le d_{ij} < d_0 + \text{size}$ with $d_0 = 0$ (1 without the
        self-edge); not causal: $|d_{ij}| < \text{size}$. The pattern is
        [`Window(size, causal, include_self, offset)`][structinfer.priors.Window].

        Args:
            num_children: number of children ``n``.
            size: the window size (>= 1).
            num_parents: number of parents ``m`` (default ``n``).
            causal: only parents at or before the child.
            include_self: allow the self-edge (distance 0).
            offset: child ``i`` sits at parent position ``i + offset``.

        Returns:
            The prior, uniform over the parents in the window.

        Raises:
            ValueError: if ``size < 1``.
        """
        check_static_int(num_children, "num_children", "Restricted.window")
        check_static_int(size, "size", "Restricted.window")
        check_static_int(num_parents, "num_parents", "Restricted.window")
        check_static_int(offset, "offset", "Restricted.window")
        if size < 1:
            raise ValueError(f"Restricted.window: size must be >= 1, got {size}")
        m = num_children if num_parents is None else num_parents
        pattern = Window(size=size, causal=causal, include_self=include_self, offset=offset)
        return cls(_pattern_mask(pattern, num_children, m, xp=np), pattern=pattern)

    @classmethod
    def from_graph(cls, adjacency: ArrayLike, self_loops: bool = False) -> Restricted:
        r"""Graph attention: $p(\phi_i = j) \propto [A_{ij} \ne 0]$ for an adjacency $A$.

        The pattern is [`Graph()`][structinfer.priors.Graph].

        Args:
            adjacency: ``(children, parents)`` array (bool or 0/1 weights);
                ``adjacency[i, j]`` is nonzero when ``j`` is a parent of ``i``.
            self_loops: also allow ``j = i`` (square graphs only).

        Returns:
            The prior, uniform over each node's in-neighbours.

        Raises:
            ValueError: if ``self_loops`` is asked of a non-square adjacency.
        """
        xp = np if is_concrete(adjacency) else jnp  # a traced graph (under jit) stays traced
        adj = xp.asarray(adjacency) != 0
        if adj.ndim < 2:
            raise ValueError("Restricted.from_graph: adjacency must be (children, parents), "
                             f"got shape {tuple(adj.shape)}")
        if self_loops:
            if adj.shape[-1] != adj.shape[-2]:
                raise ValueError("Restricted.from_graph: self_loops needs a square adjacency")
            adj = adj | xp.eye(adj.shape[-1], dtype=bool)
        return cls(adj, pattern=Graph())

    @classmethod
    def block_sparse(cls, block_mask: ArrayLike, block_size: int | tuple[int, int],
                     num_children: int | None = None, num_parents: int | None = None
                     ) -> Restricted:
        r"""Block-sparse attention: $M_{ij} = B_{\lfloor i / b_c \rfloor, \lfloor j / b_p \rfloor}$.

        ``block_mask[a, b]`` allows the whole block of children ``a*bc:(a+1)*bc`` and
        parents ``b*bp:(b+1)*bp``; the pattern is
        [`BlockSparse((bc, bp))`][structinfer.priors.BlockSparse]. The last block of
        each axis may be cut short (``num_children`` / ``num_parents``), as for a
        sequence whose length is not a multiple of the block size.

        The prior keeps $B$, not the ``(n, m)`` mask: the lowered engine skips the
        empty blocks and reads no per-edge mask where its tiles line up with the blocks
        (memory $O(n)$ beside the block mask, like FlexAttention's ``BlockMask``); the
        exact engine expands it.

        Args:
            block_mask: boolean (or 0/1) ``(..., children / bc, parents / bp)`` block
                pattern $B$; leading dims (heads, batch) broadcast against the plates. May
                be traced (then no block is skipped).
            block_size: ``(bc, bp)``, or one int for square blocks.
            num_children: $n$, within the last block row (default: ``bc`` times the
                number of block rows).
            num_parents: $m$, within the last block column (default: ``bp`` times the
                number of block columns).

        Returns:
            The prior, uniform over the parents in the allowed blocks.

        Raises:
            ValueError: if ``block_mask`` has fewer than two dims, ``block_size`` is not
                one or two positive ints, or ``num_children`` / ``num_parents`` does not
                end in the last block.
        """
        check_static_int(num_children, "num_children", "Restricted.block_sparse")
        check_static_int(num_parents, "num_parents", "Restricted.block_sparse")
        pattern = BlockSparse(block_size=block_size)
        concrete = None
        if is_concrete(block_mask):
            concrete = np.array(block_mask, dtype=bool)  # a copy: the user's may change
            blocks = jnp.asarray(concrete)
        else:
            blocks = jnp.asarray(block_mask).astype(bool)
        if blocks.ndim < 2:
            raise ValueError("Restricted.block_sparse: block_mask must have shape (..., "
                             f"children / bc, parents / bp), got shape {tuple(blocks.shape)}")
        size = []
        for ax, (name, given, b) in enumerate(zip(("num_children", "num_parents"),
                                                  (num_children, num_parents),
                                                  pattern.block_size)):
            nb = int(blocks.shape[ax - 2])
            if given is None:
                given = nb * b
            elif not (nb - 1) * b < given <= nb * b:
                raise ValueError(
                    f"Restricted.block_sparse: {name}={given} does not end in the last of "
                    f"the {nb} blocks of {b} (expected {(nb - 1) * b + 1} to {nb * b})")
            size.append(int(given))
        self = cls.__new__(cls)
        self._mask = self._concrete = None
        self.blocks, self.concrete_blocks, self.size = blocks, concrete, tuple(size)
        self._setup(size[1], pattern, None)
        return self


class Categorical(StructuralPrior):
    r"""Free categorical prior, one row of log-probabilities per child.

    $$
    p(\phi_i = j) = \mathrm{softmax}_j(\ell_{ij})
    $$

    (Singh & Buckley appendix 8.2: "if the prior over edges is categorical ... it
    can be fully specified by the matrix P".)

    Args:
        logits: ``(..., children, parents)`` (or ``(parents,)`` shared by every child);
            ``-inf`` forbids an edge. Normalised over parents.
        offset: child ``i`` sits at parent position ``i + offset`` (only distances
            depend on it): 0 for self attention over the same ``n = m`` nodes; e.g. 1
            when child ``c`` is node ``c + 1`` and its parents are nodes ``0 .. c``.

    Raises:
        ValueError: if the logits have no parent axis, or contain NaN or ``+inf``.
    """

    kind = "categorical"

    def __init__(self, logits: ArrayLike, offset: int = 0):
        logits = as_float_array(logits, "Categorical prior logits")
        if logits.ndim < 1:
            raise ValueError("Categorical prior: logits must have a parent axis")
        self.logits = require(lambda xp, lg: ~(xp.isnan(lg) | (lg == xp.inf)),
                              "Categorical prior: logits contain NaN or +inf", logits)
        self.num_parents = int(logits.shape[-1])
        self.offset = check_int(offset, "Categorical prior: offset")

    def _log_weights(self, num_children: int) -> jax.Array:
        lg = self.logits
        return lg if lg.ndim >= 2 else lg[None, :]


class RelativePosition(StructuralPrior):
    r"""Relative-position prior: the log-prior depends on the distance $d_{ij}$ only.

    $$
    p(\phi_i = j) \propto \exp\big(b(d_{ij})\big)\, M_{ij}, \qquad d_{ij} = i + \text{offset} - j
    $$

    This is the probabilistic reading of relative positional encodings
    (Singh & Buckley appendix 8.2, Table 1 row 4). Three parameterisations:

    * ``RelativePosition(bias, num_parents)`` — one learnable bias per distance,
      ``bias[..., d + num_parents - 1]`` for ``d`` from ``-(m-1)`` to ``n-1+offset``
      (length ``num_children + offset + num_parents - 1``); with ``max_distance=D``
      the bias has ``2D + 1`` entries, ``bias[..., clip(d, -D, D) + D]``, and
      distances beyond ``D`` share the edge buckets.
    * [`circulant`][structinfer.priors.RelativePosition.circulant] — $P = \mathrm{circ}(p)$:
      $p(\phi_i=j) \propto p_{(i-j) \bmod n}$.
    * [`hartley`][structinfer.priors.RelativePosition.hartley] — the circulant log-prior
      written in the Hartley basis,
      $\ln p_{ij} = \sum_k \beta_k\,\mathrm{cas}(2\pi k (i-j)/n)$ with
      $\mathrm{cas} = \cos + \sin$. (The paper prints the angle as
      $(i-j)/(2\pi n)$; we use the standard Hartley angle $2\pi (i-j)/n$,
      which is what makes the table circulant.)

    Args:
        bias: relative-position log-weights over distances (see above).
        num_parents: number of parents ``m``.
        offset: child ``i`` sits at parent position ``i + offset``.
        max_distance: clip ``|d|`` to this value before looking up the bias.
        causal: also forbid parents after the child ($d_{ij} < 0$).
    """

    kind = "relative_position"

    def __init__(
        self,
        bias: ArrayLike,
        num_parents: int,
        offset: int = 0,
        max_distance: int | None = None,
        causal: bool = False,
        _mode: str = "linear",
        _period: int | None = None,
    ):
        self.bias = as_float_array(bias, "RelativePosition bias")
        if self.bias.ndim < 1:
            raise ValueError("RelativePosition: bias must have a distance axis")
        self.num_parents = _check_num_parents(num_parents)
        check_static_int(offset, "offset", "RelativePosition prior")
        check_static_int(max_distance, "max_distance", "RelativePosition prior")
        if max_distance is not None and int(max_distance) < 0:
            raise ValueError(f"RelativePosition: max_distance must be >= 0 (or None), got "
                             f"{max_distance}")
        self.offset = check_int(offset, "RelativePosition prior: offset")
        self.max_distance = max_distance
        self.causal = bool(causal)
        self.mode = _mode
        self.period = _period

    @classmethod
    def circulant(cls, logits: ArrayLike, causal: bool = False) -> RelativePosition:
        r"""Circulant prior $P = \mathrm{circ}(p)$: $p(\phi_i = j) \propto p_{(i-j) \bmod n}$.

        Args:
            logits: the log-weights $\ln p$, ``(n,)``: one per distance modulo ``n``.
            causal: also forbid parents after the child.

        Returns:
            The prior on ``n = len(logits)`` nodes.
        """
        logits = as_float_array(logits, "RelativePosition.circulant logits")
        n = int(logits.shape[-1])
        return cls(logits, n, causal=causal, _mode="circulant", _period=n)

    @classmethod
    def hartley(cls, beta: ArrayLike, num_nodes: int, causal: bool = False) -> RelativePosition:
        r"""Hartley-parameterised circulant prior: $\ln p_{ij} = \beta\cdot b^{(i,j)}$.

        $b_k^{(i,j)} = \cos(2\pi k (i-j)/n) + \sin(2\pi k (i-j)/n)$ for $k = 0..K-1$.

        Args:
            beta: the Hartley coefficients $\beta$, ``(..., K)`` (16-bit ones give
                float32 log-weights, those of their exact values).
            num_nodes: number of nodes ``n``.
            causal: also forbid parents after the child.

        Returns:
            The circulant prior on ``n`` nodes.
        """
        beta = as_float_array(beta, "RelativePosition.hartley beta")
        n = int(check_static_int(num_nodes, "num_nodes", "RelativePosition.hartley"))
        # 16-bit coefficients: the basis and the sum in float32 (the table of their exact
        # values, as every prior's), not rounded to 16 bits
        beta = float32_at_least(beta)
        r = jnp.arange(n)
        k = jnp.arange(beta.shape[-1])
        ang = 2.0 * math.pi * k[:, None] * r[None, :] / n
        basis = (jnp.cos(ang) + jnp.sin(ang)).astype(beta.dtype)  # (K, n)
        logits = jnp.einsum("...k,kr->...r", beta, basis)
        return cls(logits, n, causal=causal, _mode="circulant", _period=n)

    def bias_index(self, d: jax.Array) -> jax.Array:
        """Index into ``bias`` for an integer distance grid ``d``.

        * circulant: ``d mod n``;
        * linear, no clipping: ``d + num_parents - 1`` (distances ``-(m-1) .. n-1+offset``);
        * linear with ``max_distance = D``: ``clip(d, -D, D) + D`` (a bias of ``2D + 1``).

        Args:
            d: integer distances $d_{ij}$, any shape.

        Returns:
            Indices into the last axis of ``bias``, shaped like ``d``.
        """
        if self.mode == "circulant":
            return jnp.mod(d, self.period)
        if self.max_distance is not None:
            D = self.max_distance
            return jnp.clip(d, -D, D) + D
        return d + self.num_parents - 1

    def check_bias_length(self, num_children: int) -> None:
        """Raise if the bias does not cover every distance of an ``n x m`` grid (static shapes).

        Args:
            num_children: number of children ``n``.

        Raises:
            ValueError: if the bias has the wrong length, or the offset puts distances below
                ``-(m - 1)`` without a ``max_distance``.
        """
        if self.mode == "circulant":
            return
        L = self.bias.shape[-1]
        if self.max_distance is not None:
            need, lo = 2 * self.max_distance + 1, 0
            how = f"max_distance={self.max_distance} needs 2*max_distance+1 = {need}"
        else:
            lo = self.offset  # smallest index: d = offset - (m - 1)
            need = num_children + self.offset + self.num_parents - 1
            how = (
                f"{num_children} children and {self.num_parents} parents at offset "
                f"{self.offset} need {need}"
            )
        if lo < 0:
            raise ValueError(
                f"RelativePosition: offset {self.offset} puts distances below -(m-1) = "
                f"{-(self.num_parents - 1)}; pass max_distance to clip them"
            )
        if L != need and (self.max_distance is not None or L < need):
            raise ValueError(
                f"RelativePosition: bias has {L} distances but {how} (or pass max_distance to clip)"
            )

    def distance_log_weights(self, d: jax.Array) -> jax.Array:
        """Log-weight $b(d)$ for an integer distance grid ``d`` (any shape).

        Args:
            d: integer distances $d_{ij}$, any shape.

        Returns:
            $b(d)$, with ``-inf`` after the child when ``causal``.
        """
        w = jnp.take(self.bias, self.bias_index(d), axis=-1)
        if self.causal:
            w = jnp.where(d >= 0, w, -jnp.inf)
        return w

    def _log_weights(self, num_children: int) -> jax.Array:
        self.check_bias_length(num_children)
        d = _distance_grid(num_children, self.num_parents, self.offset)
        return self.distance_log_weights(d)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_parents": self.num_parents,
            "mode": self.mode,
            "offset": self.offset,
            "causal": self.causal,
            "max_distance": self.max_distance,
        }


class Geometric(StructuralPrior):
    r"""Geometric (recency) prior over the distance to an earlier parent.

    $$
    p(\phi_i = j \mid q) \propto q\,(1-q)^{d_{ij} - d_0}, \qquad
    d_{ij} = i + \text{offset} - j \in \{d_0, \dots, d_{\max}\},
    $$

    truncated to the available parents and renormalised; ``d_0 = 0`` with the
    self-edge, 1 without. This is the prior of expanding attention (Singh &
    Buckley sec. 5.2, Table 1 row 12); with ``q ~ Beta(α, β)`` sampled in the
    model it is conjugate: the posterior of $q$ given a distance $d$ is
    $\mathrm{Beta}(\alpha + 1, \beta + d - d_0)$.

    Args:
        q: success probability in (0, 1); any batch shape broadcasting against
            ``(..., children)`` — may be a NumPyro sample site value.
        num_parents: number of parents ``m``.
        include_self: allow the self-edge (distance 0).
        offset: child ``i`` sits at parent position ``i + offset``.
        max_distance: optional hard truncation (the window of the windowed kernel); may be
            traced (a window inferred under jit), then `si.attention` uses the exact engine.

    Raises:
        ValueError: if a concrete ``q`` lies outside (0, 1); (building the table) if
            ``q``'s last axis is neither 1 nor the number of children.
    """

    kind = "geometric"

    def __init__(
        self,
        q: ArrayLike,
        num_parents: int,
        include_self: bool = True,
        offset: int = 0,
        max_distance: int | None = None,
    ):
        self.q = require(lambda xp, q: (q > 0) & (q < 1),
                         "Geometric prior: q must lie in (0, 1), got {}",
                         as_float_array(q, "Geometric prior q"))
        self.num_parents = _check_num_parents(num_parents)
        self.include_self = bool(include_self)
        check_static_int(offset, "offset", "Geometric prior")
        self.offset = check_int(offset, "Geometric prior: offset")
        # a truncation only masks the table, so it may be traced (e.g. a window inferred
        # under jit); the lowered engine then falls back to the exact one
        if max_distance is not None and is_concrete(max_distance):
            max_distance = int(max_distance)
        self.max_distance = max_distance

    @property
    def min_distance(self) -> int:
        """$d_0$: the smallest allowed distance (0 with the self-edge, 1 without)."""
        return 0 if self.include_self else 1

    def _log_weights(self, num_children: int) -> jax.Array:
        d = _distance_grid(num_children, self.num_parents, self.offset)
        # a scalar q, or one per child: (..., children) -> (..., children, 1)
        # in float32 at least: a 16-bit q's log-weights are those of its exact value, and
        # distances above 256 are not integers in bfloat16
        q = float32_at_least(self.q)
        if q.ndim and q.shape[-1] not in (1, num_children):
            raise ValueError(f"Geometric prior: q of shape {tuple(q.shape)} does not broadcast "
                             f"against (..., children) = (..., {num_children}): give a scalar, "
                             "one per child (..., children) or one per head (..., 1)")
        q = q[..., None] if q.ndim else q
        steps = (d - self.min_distance).astype(q.dtype)
        logw = jnp.log(q) + steps * jnp.log1p(-q)
        allowed = d >= self.min_distance
        if self.max_distance is not None:
            allowed = allowed & (d <= self.max_distance)
        return jnp.where(allowed, logw, -jnp.inf)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_parents": self.num_parents,
            "include_self": self.include_self,
            "offset": self.offset,
            "max_distance": self.max_distance,
        }


class Markov(StructuralPrior):
    r"""Markov prior: the row of an edge's prior is chosen by the previous edge's value.

    $$
    p(\phi_1 = j) = \mathrm{softmax}_j(\lambda_j), \qquad
    p(\phi_t = j \mid \phi_{t-1} = i) = \mathrm{softmax}_j(L_{ij}),
    $$

    a first-order hidden Markov chain over the edges of consecutive children (time
    steps). Used with [`edge`][structinfer.edge]'s ``previous=`` inside a
    ``numpyro.contrib.control_flow.scan`` over time: the scan's carry holds the previous
    edge, ``-1`` at the start of the chain (the row is then the initial distribution).
    Collapsing the chain is the forward algorithm, $O(T K^2)$; its marginals are the
    forward-backward smoother, its MAP the Viterbi path.

    This is the prior over the active mode of a switching linear dynamical system
    (Tschantz, "log-sum-exp energies" v2 sec. 7: "the active mode ... evolves as a
    hidden Markov chain") and the prior of monotonic alignments (each child keeps or
    advances its parent; Singh & Buckley's priors over edges, sec. 3, coupling
    consecutive children).

    A ``-inf`` entry forbids a move (a left-to-right chain, a banded or monotone
    matrix). Values, marginals, expectations, MAP, draws and the gradients of
    $\log Z$ are exact with any pattern of forbidden moves, as long as some path is
    allowed; with none ($\log Z = -\infty$) the exact engine raises on concrete inputs
    and answers NaN under ``jit``.

    Args:
        log_transition: ``(K, K)`` unnormalised log-weights $L$, rows = the previous
            edge, columns = the next; ``-inf`` forbids a move. Each row is normalised.
        log_initial: ``(K,)`` unnormalised log-weights $\lambda$ of the first edge, or
            ``None`` when every edge of the chain has a previous one.

    Raises:
        ValueError: ``log_transition`` is not square ``(K, K)``, ``log_initial`` is not
            ``(K,)``, a concrete row allows no move, or a value is NaN or ``+inf``.
    """

    kind = "markov"

    def __init__(self, log_transition: ArrayLike, log_initial: ArrayLike | None = None):
        lt = as_float_array(log_transition, "Markov prior log_transition")
        if lt.ndim != 2 or lt.shape[0] != lt.shape[1]:
            raise ValueError(
                "Markov prior: log_transition must be a square (K, K) matrix (rows: the "
                f"previous edge, columns: the next), got shape {tuple(lt.shape)}"
            )
        k = int(lt.shape[-1])
        li = None
        if log_initial is not None:
            li = as_float_array(log_initial, "Markov prior log_initial")
            if li.shape != (k,):
                raise ValueError(
                    f"Markov prior: log_initial must have shape ({k},) to match "
                    f"log_transition {tuple(lt.shape)}, got {tuple(li.shape)}"
                )
        def checked(x, what):
            x = require(lambda xp, x: ~(xp.isnan(x) | (x == xp.inf)),
                        f"Markov prior: {what} contains NaN or +inf", x)
            return require(lambda xp, x: xp.isfinite(x).any(axis=-1),
                           f"Markov prior: a row of {what} allows no edge", x)

        self.log_transition = checked(lt, "log_transition")
        self.log_initial = None if li is None else checked(li, "log_initial")
        self.num_parents = k

    def _log_weights(self, num_children: int) -> jax.Array:
        raise ValueError(
            "a Markov prior has no table of its own: its row is chosen by the previous "
            "edge (pass previous= to structinfer.edge inside a scan over time)"
        )

    def row(self, previous: ArrayLike) -> jax.Array:
        r"""The normalised prior row $\log p(\phi_t = \cdot \mid \phi_{t-1} = \text{previous})$.

        Args:
            previous: the previous edge's value (any shape, an enumerated value
                included); ``-1`` for the first edge of the chain.

        Returns:
            ``previous.shape + (K,)`` log-probabilities; the initial distribution where
                ``previous < 0`` (NaN there when the prior has no ``log_initial``); NaN
                where ``previous >= K`` (no such state: never another state's row).
        """
        previous = jnp.asarray(previous)
        # 16-bit tables normalised in float32, where the engine sums them
        lt, _ = normalise_log_weights(float32_at_least(self.log_transition))
        start = (
            jnp.full((self.num_parents,), jnp.nan, lt.dtype)
            if self.log_initial is None
            else normalise_log_weights(float32_at_least(self.log_initial))[0].astype(lt.dtype)
        )
        rows = jnp.take(lt, jnp.clip(previous, 0, self.num_parents - 1), axis=0)
        rows = jnp.where((previous >= self.num_parents)[..., None], jnp.nan, rows)
        return jnp.where((previous < 0)[..., None], start, rows)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_parents": self.num_parents,
            "offset": self.offset,
            "initial": self.log_initial is not None,
        }


class Masked(StructuralPrior):
    r"""A prior restricted to the parents a boolean mask allows (padding, any pattern).

    $$
    p(\phi_i = j) = \frac{M_{ij}\, p_0(\phi_i = j)}{\sum_{j'} M_{ij'}\, p_0(\phi_i = j')}
    $$

    ``Masked(RelativePosition(...), keep)`` is the relative-position prior over the kept
    keys (a key-padding mask ``keep`` of shape ``(..., 1, parents)``), as a boolean mask
    restricts the softmax of transformer attention (Vaswani et al. 2017, sec. 3.2.3).
    With a uniform base it is [`Restricted`][structinfer.priors.Restricted]; the base
    keeps its own restriction (a causal band, a window), intersected with the mask.
    [`structinfer.handlers.mask_parents`][structinfer.handlers.mask_parents] applies it
    to every edge site of a model.

    Args:
        prior: the base prior $p_0$ (any structural prior but a Markov one).
        mask: boolean, ``True`` where a parent is allowed, broadcasting against
            ``(..., children, parents)``: ``(..., children, parents)``, ``(..., 1,
            parents)`` (one mask per parent) or ``(parents,)``. May be traced.

    Raises:
        TypeError: ``prior`` is not a structural prior, or is a Markov prior; ``mask``
            is not boolean.
        ValueError: ``mask``'s last axis is not the prior's parents; some child has
            no allowed parent (on concrete values, named after the edge site).
    """

    kind = "masked"
    _no_parent_hint = (
        "the mask allows it none of the parents its base prior allows: a key-padding "
        "mask over a causal or windowed prior leaves a padded child only padded "
        "parents; mask those children too (in structinfer.nn.Attention, a query masked "
        "from every key is padding, left unrestricted: "
        "flax.nnx.make_attention_mask(keep, keep))"
    )

    def __init__(self, prior: StructuralPrior, mask: ArrayLike):
        if not isinstance(prior, StructuralPrior) or isinstance(prior, Markov):
            raise TypeError("Masked prior: prior must be a structinfer.priors prior (not a "
                            f"Markov one), got {type(prior).__name__}")
        mask, self._concrete = _check_mask(mask, "Masked prior",
                                           num_parents=prior.num_parents)
        #: the base prior $p_0$
        self.prior = prior
        #: the boolean mask $M$, at least ``(1, parents)``
        self.mask = mask if mask.ndim >= 2 else mask[None, :]
        self.num_parents = prior.num_parents
        self.offset = prior.offset
        # a known mask that is a distance band is rebuilt from iota in the table, as
        # Restricted's (`_band_of`)
        self._band = _band_of(self._concrete)

    @property
    def concrete_mask(self) -> np.ndarray | None:
        """The mask (at least ``(1, parents)``) as a NumPy array when known at trace time,
        else ``None``."""
        c = self._concrete
        return None if c is None else c.reshape(self.mask.shape)

    @property
    def parameter_dtype(self) -> Any:
        """The base prior's parameter dtype."""
        return self.prior.parameter_dtype

    def _log_weights(self, num_children: int) -> jax.Array:
        return self._log_weights_in(num_children, None)

    def _log_weights_in(self, num_children: int, dtype: Any) -> jax.Array:
        # the base normalised in `dtype` too (a float32 parameter in a float64 model: from
        # its exact value), as the unmasked prior is
        mask = self.mask
        if self._band is not None:
            mask = band_mask(mask.shape[-2], mask.shape[-1], **self._band)
        return jnp.where(mask, self.prior.log_table(num_children, dtype), -jnp.inf)

    def describe(self) -> dict[str, Any]:
        """The base prior's description under ``"prior"``, and the mask's shape."""
        return {"kind": self.kind, "num_parents": self.num_parents, "offset": self.offset,
                "prior": self.prior.describe(), "mask_shape": tuple(self.mask.shape)}


def as_prior(prior: Any, site: str) -> StructuralPrior:
    """Coerce ``prior`` to a [`StructuralPrior`][structinfer.priors.StructuralPrior] or raise a clear error."""
    if isinstance(prior, StructuralPrior):
        return prior
    if isinstance(prior, (dist.CategoricalLogits, dist.CategoricalProbs)):
        return Categorical(prior.logits)
    raise TypeError(
        f"edge site '{site}': prior must be a structinfer.priors prior (Uniform, "
        f"Restricted, Categorical, RelativePosition, Geometric) or a numpyro "
        f"Categorical, got {type(prior).__name__}"
    )
