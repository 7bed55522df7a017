r"""Per-edge masks known at trace time: a NumPy ``(..., n, m)`` array or a `BlockMask`.

A lowered edge site's per-edge mask (``prob.const.pair_ok``, traced) may come with its
value at trace time (`Lowered.mask`), which the kernels read to skip the blocks it
forbids and to compute without a mask the blocks it allows whole. That value is either
a NumPy boolean array or, for a block-sparse prior, a `BlockMask`: the mask

$$
M_{ij} = B_{\lfloor i / b_c \rfloor,\, \lfloor j / b_p \rfloor}
$$

kept per block, so that nothing at trace time is $O(nm)$. `tile_grid` reduces either
over a kernel's tiles; `mask_and` intersects two; `mask_shape` and `mask_key` read
their shape and a content hash without expanding a block mask.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["BlockMask", "ConcreteMask", "tile_grid", "mask_and", "mask_shape", "mask_key"]


@dataclass(frozen=True, eq=False)
class BlockMask:
    r"""A concrete per-edge mask given per block, never expanded at trace time.

    $M_{ij} = B_{\lfloor i / b_c \rfloor, \lfloor j / b_p \rfloor}$, cut to ``size``.
    A prior rule gives it to
    [`TermBuilder.restrict_pairs`][structinfer.lowering.TermBuilder.restrict_pairs] as
    the value of its mask (as ``Restricted.block_sparse``'s does).

    Attributes:
        blocks: NumPy boolean ``(..., \lceil n / b_c \rceil, \lceil m / b_p \rceil)``
            block mask $B$.
        block_size: ``(b_c, b_p)``, children and parents per block.
        size: ``(n, m)``, within the last block of each axis (default: whole blocks).
    """

    blocks: np.ndarray
    block_size: tuple[int, int]
    size: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the mask, ``(..., n, m)``."""
        *batch, a, b = self.blocks.shape
        whole = (a * self.block_size[0], b * self.block_size[1])
        return tuple(batch) + tuple(self.size or whole)

    def dense(self) -> np.ndarray:
        """The ``(..., n, m)`` boolean mask (``O(nm)`` memory: for tests and mixing with a
        plain mask)."""
        bc, bp = self.block_size
        n, m = self.shape[-2:]
        return np.repeat(np.repeat(self.blocks, bc, axis=-2), bp, axis=-1)[..., :n, :m]


#: what `Lowered.mask` holds: a NumPy boolean ``(..., n, m)`` mask or a `BlockMask`
ConcreteMask = np.ndarray | BlockMask


def mask_shape(mask: ConcreteMask) -> tuple[int, ...]:
    """The ``(..., n, m)`` shape of a concrete mask."""
    return mask.shape if isinstance(mask, BlockMask) else np.shape(mask)


def mask_key(mask: ConcreteMask) -> tuple:
    """A hashable key of a concrete mask's contents (equal masks, equal keys)."""
    if isinstance(mask, BlockMask):
        return ("blocks", mask.block_size, mask.shape) + mask_key(mask.blocks)
    a = np.asarray(mask)
    data = a.tobytes() if a.dtype != bool else np.packbits(a)
    return (a.shape, a.dtype.str, hashlib.sha1(data).hexdigest())


def mask_and(a: ConcreteMask | None, b: ConcreteMask) -> ConcreteMask:
    """``a & b`` (``b`` when ``a`` is ``None``); two block masks of the same block size
    stay a block mask, any other pair becomes a NumPy mask."""
    if a is None:
        return b
    if (isinstance(a, BlockMask) and isinstance(b, BlockMask)
            and a.block_size == b.block_size and a.shape[-2:] == b.shape[-2:]):
        return BlockMask(a.blocks & b.blocks, a.block_size, a.size)

    def dense(x):
        return x.dense() if isinstance(x, BlockMask) else np.asarray(x, bool)

    return dense(a) & dense(b)


def tile_grid(mask: ConcreteMask, n: int, m: int, bq: int, bk: int, nqb: int, nkb: int, *,
              reduce: Callable, over_batch: Callable, fill: bool) -> np.ndarray:
    """A concrete ``(..., n, m)`` mask reduced over the ``(nqb, nkb)`` tiles of ``bq x bk``.

    The mask is first reduced over its batch dims with ``over_batch`` (``np.any`` or
    ``np.all``), then padded to ``nqb * bq x nkb * bk`` with ``fill``, and each tile is
    reduced with ``reduce`` (``np.any`` or ``np.all``). A `BlockMask` is reduced on cells
    of ``gcd(b_c, bq, n) x gcd(b_p, bk, m)`` edges, never expanded to ``(n, m)``.

    Returns:
        ``(nqb, nkb)`` boolean grid.
    """
    if isinstance(mask, BlockMask):
        bc, bp = mask.block_size
        x = np.asarray(mask.blocks, bool)
        # cells: divide the blocks, the tiles and the mask's extent
        cr, cc = math.gcd(bc, bq, n), math.gcd(bp, bk, m)
        x = x.reshape((-1,) + x.shape[-2:])
        x = x[0] if len(x) == 1 else over_batch(x, axis=0)
        rows, cols, tq, tk = n // cr, m // cc, bq // cr, bk // cc
        x = np.repeat(np.repeat(x, bc // cr, axis=0), bp // cc, axis=1)[:rows, :cols]
    else:
        x = np.asarray(mask, bool)
        x = x.reshape((-1,) + x.shape[-2:])
        x = x[0] if len(x) == 1 else over_batch(x, axis=0)
        x = np.broadcast_to(x, (n, m))
        rows, cols, tq, tk = n, m, bq, bk
    if (rows, cols) != (nqb * tq, nkb * tk):
        pad = np.full((nqb * tq, nkb * tk), fill)
        pad[:rows, :cols] = x
        x = pad
    return reduce(x.reshape(nqb, tq, nkb, tk), axis=(1, 3))
