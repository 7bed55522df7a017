r"""The loop every iterative algorithm in `structinfer.infer` runs on (not user API).

Each algorithm's `run` supplies a pure `step(state) -> (state, energy, converged)`;
`run_loop` runs it with `jax.lax.while_loop`, records the free energy after every
step in a fixed-size buffer, and stops

* when every batch element has converged (status `CONVERGED`),
* at `max_iters` (status `MAX_ITERS`: reported, never hidden), or
* when an element's energy is not finite (status `NONFINITE`): that element keeps
  its last finite state, and `check` raises `NonFiniteEnergyError` naming the step
  (and, when the algorithm can tell, the site) once the result is concrete.

Batched problems (leading `batch_shape` on the state and the energy) converge per
element: an element that has converged is frozen while the others go on.

Users read the outcome from `LoopInfo` (`converged`, `max_iters_reached`,
`nonfinite`, `raise_on_nonfinite()`); the integer status codes stay here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_count, is_concrete

__all__ = [
    "LoopInfo",
    "NonFiniteEnergyError",
    "RUNNING",
    "CONVERGED",
    "MAX_ITERS",
    "NONFINITE",
    "check",
    "iterate",
    "neg_log_likelihood",
    "run_loop",
]

#: status codes (``LoopInfo.status``)
RUNNING, CONVERGED, MAX_ITERS, NONFINITE = 0, 1, 2, 3
_STATUS_NAMES = {RUNNING: "running", CONVERGED: "converged", MAX_ITERS: "max_iters",
                 NONFINITE: "non-finite energy"}


class LoopInfo(NamedTuple):
    r"""What an iterative algorithm reports besides its result: the energy trace $F(\mu^t)$.

    Every element stops for exactly one reason: `converged`, `max_iters_reached` or
    `nonfinite` (the properties below) is True for it.

    Attributes:
        energy: `(*batch, max_iters + 1)` free energy $F(\mu^t)$ before the first step
            (index 0) and after each step; entries after an element stopped are NaN.
        num_steps: `(*batch,)` int32, steps taken by each element.
        converged: `(*batch,)` bool, True where the tolerance was met.
        status: `(*batch,)` int32: 1 converged, 2 stopped at `max_iters`,
            3 stopped on a non-finite energy (read it through the properties).
    """

    energy: jax.Array
    num_steps: jax.Array
    converged: jax.Array
    status: jax.Array

    @property
    def max_iters_reached(self) -> jax.Array:
        """`(*batch,)` bool: stopped at `max_iters` without meeting the tolerance."""
        return jnp.asarray(self.status) == MAX_ITERS

    @property
    def nonfinite(self) -> jax.Array:
        """`(*batch,)` bool: stopped on a NaN or infinite energy.

        The state returned is the element's last one with a finite energy.
        """
        return jnp.asarray(self.status) == NONFINITE

    def final_energy(self) -> jax.Array:
        """The energy after the last step taken.

        Returns:
            `(*batch,)`, `energy[..., num_steps]`.
        """
        idx = jnp.asarray(self.num_steps)[..., None]
        return jnp.take_along_axis(self.energy, idx, axis=-1)[..., 0]

    def raise_on_nonfinite(self, algorithm: str = "iterative inference") -> None:
        """Raise if some element stopped on a non-finite energy.

        The [`NonFiniteEnergyError`][structinfer.infer.NonFiniteEnergyError] names the
        step and the batch element. Every algorithm does this itself on a concrete result; under `jax.jit` it
        returns the status instead, so call this on the concrete `info` afterwards.
        Does nothing while traced.

        Args:
            algorithm: the name used in the message.

        Raises:
            NonFiniteEnergyError: when `nonfinite` is True somewhere.
        """
        check(self, algorithm)


class NonFiniteEnergyError(FloatingPointError):
    """An iterative algorithm met a NaN or infinite free energy.

    Attributes:
        step: the step whose energy was not finite (the iterative loops count from 1;
            `structinfer.infer.svi` gives the number of updates made before the
            non-finite loss, 0 at the initial parameters; `structinfer.infer.nuts` 0).
        site: the model site or term responsible, when it could be found.
        index: the batch index of the first failing element (``()`` if unbatched).
    """

    def __init__(self, message: str, step: int, site: str | None, index: tuple):
        super().__init__(message)
        self.step, self.site, self.index = step, site, index


def _where_tree(mask: jax.Array, new: Any, old: Any, batch_ndim: int) -> Any:
    def sel(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        m = jnp.reshape(mask, mask.shape + (1,) * (a.ndim - batch_ndim)) if batch_ndim else mask
        return jnp.where(m, a, b)

    return jax.tree.map(sel, new, old)


def run_loop(
    step: Callable[[Any], tuple[Any, jax.Array, jax.Array]],
    state: Any,
    energy0: jax.Array,
    max_iters: int,
    who: str = "run_loop",
) -> tuple[Any, LoopInfo]:
    """Iterate ``step`` under `jax.lax.while_loop` with per-element stopping.

    Args:
        step: ``state -> (new_state, energy, converged)``; ``energy`` and
            ``converged`` have the batch shape; every state leaf starts with it.
        state: initial state.
        energy0: energy of the initial state, ``(*batch,)``.
        max_iters: the most steps (a Python int; fixes the trace length).
        who: the algorithm, for the error message.

    Returns:
        ``(state, info)``: the final state (each element's last finite one) and a
            `LoopInfo`.

    Raises:
        ValueError: ``max_iters`` is not a positive int (naming ``who``).
    """
    max_iters = check_count(max_iters, f"{who}: max_iters")
    energy0 = jnp.asarray(energy0)
    batch = energy0.shape
    nb = len(batch)
    trace = jnp.full(batch + (max_iters + 1,), jnp.nan, energy0.dtype).at[..., 0].set(energy0)
    status0 = jnp.where(jnp.isfinite(energy0), RUNNING, NONFINITE).astype(jnp.int32)
    carry = (jnp.int32(0), state, trace, status0, jnp.zeros(batch, jnp.int32))

    def cond(c):
        k, _, _, status, _ = c
        return (k < max_iters) & jnp.any(status == RUNNING)

    def body(c):
        k, st, tr, status, nsteps = c
        new, e, conv = step(st)
        e = jnp.broadcast_to(jnp.asarray(e, tr.dtype), batch)
        conv = jnp.broadcast_to(conv, batch)
        active = status == RUNNING
        finite = jnp.isfinite(e)
        keep = active & finite
        st = _where_tree(keep, new, st, nb)
        new_status = jnp.where(~finite, NONFINITE, jnp.where(conv, CONVERGED, RUNNING))
        status = jnp.where(active, new_status, status).astype(jnp.int32)
        tr = tr.at[..., k + 1].set(jnp.where(active, e, jnp.nan))
        nsteps = jnp.where(active, k + 1, nsteps)
        return k + 1, st, tr, status, nsteps

    _, state, trace, status, nsteps = jax.lax.while_loop(cond, body, carry)
    status = jnp.where(status == RUNNING, MAX_ITERS, status).astype(jnp.int32)
    return state, LoopInfo(trace, nsteps, status == CONVERGED, status)


def neg_log_likelihood(state: Any) -> jax.Array:
    """The energy of an EM state: minus its ``log_likelihood`` (for `iterate`)."""
    return -state.log_likelihood


def iterate(
    init: Callable[..., Any],
    step: Callable[..., tuple[Any, jax.Array]],
    energy: Callable[[Any], jax.Array],
    init_args: tuple,
    step_args: tuple,
    options: dict[str, Any],
    max_iters: int,
    who: str,
    static_options: dict[str, Any] | None = None,
) -> tuple[Any, LoopInfo]:
    """``state = init(*init_args, **static_options)``, then `run_loop` over
    ``step(*step_args, state, **options, **static_options) -> (state, converged)``,
    compiled once.

    The whole run is one `jax.jit` whose static arguments are the module-level
    functions ``init``, ``step`` and ``energy`` and ``max_iters``: a second call with
    arrays of the same shapes and dtypes reuses the compiled loop (a fresh closure per
    call would retrace and recompile it every time, and an eager first E-step would run
    op by op). ``options`` (``reg``, ``tol``, ...) are traced: the caller checks their
    values before, where they are concrete.

    Args:
        init: ``(*init_args, **static_options) -> state``, the first E-step.
        step: ``(*step_args, state, **options) -> (new_state, converged)``.
        energy: ``state -> energy`` (e.g. `neg_log_likelihood`).
        init_args: arrays (a pytree) for ``init``.
        step_args: arrays (a pytree) for ``step``.
        options: keyword arrays or numbers for ``step`` (traced).
        max_iters: the most steps (a positive Python int).
        who: the algorithm, for error messages.
        static_options: keyword arguments for ``init`` and ``step`` that fix their trace (Python ints,
            bools, floats: part of the compile cache key).

    Returns:
        `run_loop`'s ``(state, info)``.
    """
    max_iters = check_count(max_iters, f"{who}: max_iters")
    fixed = tuple(sorted((static_options or {}).items()))
    return _iterate(init, step, energy, init_args, step_args, options, max_iters, who, fixed)


@functools.partial(jax.jit,
                   static_argnames=("init", "step", "energy", "max_iters", "who", "fixed"))
def _iterate(init, step, energy, init_args, step_args, options, max_iters, who, fixed):
    state = init(*init_args, **dict(fixed))

    def body(st):
        new, conv = step(*step_args, st, **options, **dict(fixed))
        return new, energy(new), conv

    return run_loop(body, state, energy(state), max_iters, who)


def check(
    info: LoopInfo,
    algorithm: str = "iterative inference",
    site: str | Callable[[tuple], str | None] | None = None,
) -> None:
    """Raise `NonFiniteEnergyError` if some element stopped on a non-finite energy.

    Call it on a concrete result (after ``jax.jit`` returns); under tracing it does
    nothing. Every ``run`` in `structinfer.infer` calls it itself when its
    result is concrete (``raise_on_nonfinite=True``).

    Args:
        info: the loop's `LoopInfo`.
        algorithm: name used in the message.
        site: the responsible site, or a function of the failing batch index that
            finds it (evaluated only on failure).

    Raises:
        NonFiniteEnergyError: naming the step, the batch element and the site.
    """
    status = info.status
    if not is_concrete(status):
        return
    bad = np.asarray(status) == NONFINITE
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
    step = int(np.asarray(info.num_steps)[idx]) if bad.ndim else int(info.num_steps)
    # num_steps counts the failing step; 0 means the initial state was already bad
    where = "at the initial state" if step == 0 else f"at step {step}"
    name = site(idx) if callable(site) else site
    at = f" in batch element {idx}" if idx else ""
    msg = f"{algorithm}: the free energy became non-finite {where}{at}"
    if name:
        msg += f"; responsible site: {name}"
    msg += (
        ". The state returned is the last one with a finite energy; lower the step size, "
        "check the data for NaN/inf, or give forbidden edges a Restricted prior instead of "
        "-inf scores."
    )
    raise NonFiniteEnergyError(msg, step, name, idx)
