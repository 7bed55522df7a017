r"""Monotone descent of an iterative algorithm's objective trace $F_0, F_1, \dots$

CCCP, EM and conjugate mean-field updates never increase the collapsed free energy
$F = -\log\sum_\phi p(x, \phi)$ (Singh & Buckley app. 7.1; Tschantz, log-sum-exp EM); an
increase is a bug or a numerical problem. `convergence_report` reads the trace from the
`info` the algorithms of `structinfer.infer` return, or from an SVI loss array.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._checks import check_tol

__all__ = ["ConvergenceReport", "convergence_report", "as_trace"]


class ConvergenceReport(NamedTuple):
    """Facts about an iterative algorithm's objective trace (free energy, loss).

    Attributes:
        num_iterations: length of the trace.
        initial: the first value.
        final: the last value (not finite when the run stopped on a non-finite energy).
        monotone: every value is finite and no step increased by more than the
            tolerance.
        max_increase: largest single-step increase, 0.0 when no step increased, inf
            when a step went into or out of a non-finite value.
        first_increase: index $t$ of the first step $F_t \\to F_{t+1}$ that increased
            by more than the tolerance or went into or out of a non-finite value (-1 if
            none).
    """

    num_iterations: int
    initial: float
    final: float
    monotone: bool
    max_increase: float
    first_increase: int


def as_trace(trace: Any) -> np.ndarray:
    """A 1-d objective trace from an array or an `info` NamedTuple.

    Args:
        trace: a 1-d array, or a NamedTuple with a `free_energy` / `energy` / `loss` /
            `losses` / `elbo` / `objective` field.

    Returns:
        The trace as a float NumPy array.

    Raises:
        ValueError: no such field, or not a non-empty 1-d array.
    """
    if hasattr(trace, "_fields"):
        for f in ("free_energy", "energy", "loss", "losses", "elbo", "objective"):
            if f in trace._fields:
                trace = getattr(trace, f)
                break
        else:
            raise ValueError(
                f"convergence trace: {type(trace).__name__} has no free_energy/energy/loss "
                f"field (fields: {trace._fields})"
            )
    t = np.asarray(trace, dtype=float)
    if t.ndim != 1 or t.size == 0:
        raise ValueError(f"convergence trace must be a non-empty 1-d array, got shape {t.shape}")
    return t


def _taken(trace: Any, t: np.ndarray) -> np.ndarray:
    """The values the algorithm produced: without the NaN padding after it stopped."""
    steps = getattr(trace, "num_steps", None) if hasattr(trace, "_fields") else None
    if steps is not None and np.ndim(steps) == 0:
        # an `info` of `structinfer.infer`: F_0 .. F_{num_steps}; the last one is the
        # non-finite energy the run stopped on, if it did
        return t[: min(int(steps), t.size - 1) + 1]
    nan = np.isnan(t)
    if nan.all():
        return t
    return t[: np.nonzero(~nan)[0][-1] + 1]


def convergence_report(trace: Any, tol: float = 1e-6) -> ConvergenceReport:
    r"""Check an objective trace $F_0, F_1, \dots$ (to be minimised) for monotone descent.

    For the `info` of an algorithm of `structinfer.infer` the trace is its first
    `num_steps + 1` entries: a run that stopped on a non-finite energy ends in that
    value, and is not monotone. For an array, trailing NaN (padding after an algorithm
    stopped) are dropped; a trailing $\pm\infty$ is kept. A non-finite value is a step
    the descent did not take: the steps into and out of it count as increases
    (``max_increase`` is then ``inf``).

    Args:
        trace: a 1-d array, or an `info` NamedTuple with a `free_energy` / `energy` /
            `loss` field (as returned by the iterative algorithms' `run`).
        tol: relative tolerance: a step counts as an increase when
            $F_{t+1} - F_t > \text{tol}\,(1 + |F_t|)$.

    Returns:
        A [`ConvergenceReport`][structinfer.diagnostics.ConvergenceReport].

    Raises:
        ValueError: the trace is not a non-empty 1-d array, or `tol` is not a
            non-negative number (a NaN one would call any trace monotone).
    """
    check_tol(tol, "convergence_report: tol", "the relative tolerance of an increase")
    t = _taken(trace, as_trace(trace))
    inc = np.diff(t)
    with np.errstate(invalid="ignore"):
        up = (inc > tol * (1 + np.abs(t[:-1]))) | ~np.isfinite(inc)
    bad = np.nonzero(up)[0]
    if not bad.size and not np.isfinite(t).all():  # a run that failed at its start
        bad = np.array([0])
    rise = np.where(np.isfinite(inc), inc, np.inf)
    return ConvergenceReport(
        num_iterations=int(t.size),
        initial=float(t[0]),
        final=float(t[-1]),
        monotone=bool(bad.size == 0 and np.isfinite(t).all()),
        max_increase=(float(max(0.0, rise.max())) if inc.size
                      else (0.0 if np.isfinite(t).all() else np.inf)),
        first_increase=int(bad[0]) if bad.size else -1,
    )
