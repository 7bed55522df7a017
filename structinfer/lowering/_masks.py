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

from .._checks import is_concrete

__all__ = ["BlockMask", "ConcreteMask", "tile_grid", "mask_and", "mask_shape", "mask_key"]


@dataclass(frozen=True, eq=False)
class BlockMask:
    r"""A concrete per-edge mask given per block, never expanded at trace time.

    $M_{ij} = B_{\lfloor i / b_c \rfloor, \lfloor j / b_p \rfloor}$, cut to ``size``.
    A prior rule gives it to
    [`TermBuilder.restrict_pairs`][structinfer.lowering.TermBuilder.restrict_pairs] as
    the value of its mask (as ``Restricted.block_sparse``'s does).

    The block-level mask of block-sparse attention (Zaheer et al., "Big Bird", 2020;
    FlexAttention's ``BlockMask``, Dong et al. 2024), read at trace time to skip blocks.
    It is not an array: NumPy conversion raises (``dense()`` expands it), so code
    written for a NumPy mask fails loudly rather than reading it as one ``True``.

    Attributes:
        blocks: boolean ``(..., \lceil n / b_c \rceil, \lceil m / b_p \rceil)`` block
            mask $B$, known at trace time (kept as a NumPy array).
        block_size: ``(b_c, b_p)``, children and parents per block (one int: square).
        size: ``(n, m)``, within the last block of each axis (default: whole blocks).

    Raises:
        ValueError: if ``blocks`` has fewer than two dims, a block size is not a positive
            int, or ``size`` does not end in the last block of its axis.
        TypeError: if ``blocks`` is traced.
    """

    blocks: np.ndarray
    block_size: tuple[int, int]
    size: tuple[int, int] | None = None

    def __post_init__(self):
        if not is_concrete(self.blocks):
            raise TypeError("BlockMask: blocks must be known at trace time, got a traced "
                            "array")
        blocks = np.array(self.blocks, dtype=bool)
        if blocks.ndim < 2:
            raise ValueError(f"BlockMask: blocks must have at least two dims, got shape "
                             f"{blocks.shape}")
        bs = self.block_size
        sizes = (bs, bs) if isinstance(bs, (int, np.integer)) else tuple(bs)
        if len(sizes) != 2 or not all(isinstance(b, (int, np.integer)) and b > 0
                                      for b in sizes):
            raise ValueError(f"BlockMask: block_size must be two positive ints, got "
                             f"{self.block_size!r}")
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "block_size", tuple(int(b) for b in sizes))
        if self.size is not None:
            size = tuple(int(x) for x in self.size)
            for name, x, nb, b in zip(("n", "m"), size, blocks.shape[-2:], self.block_size):
                if not (nb - 1) * b < x <= nb * b:
                    raise ValueError(f"BlockMask: size {name}={x} does not end in the last "
                                     f"of {nb} blocks of {b}")
            object.__setattr__(self, "size", size)

    def __array__(self, *args, **kwargs):
        raise TypeError("a BlockMask is not an array: call its .dense() for the (n, m) mask, "
                        "or read .blocks")

    def __bool__(self):
        raise TypeError("the truth value of a BlockMask is ambiguous (test `is None`)")

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
              reduce: Callable, over_batch: Callable) -> np.ndarray:
    """A concrete ``(..., n, m)`` mask reduced over the ``(nqb, nkb)`` tiles of ``bq x bk``.

    The mask is first reduced over its batch dims with ``over_batch`` (``np.any`` or
    ``np.all``), then each tile's edges before ``n`` and ``m`` are reduced with ``reduce``
    (``np.any`` or ``np.all``; the padding does not count: a tile wholly in it gives
    ``reduce``'s value on nothing, False for any and True for all). A `BlockMask` is
    reduced on cells of ``gcd(b_c, bq) x gcd(b_p, bk)`` edges, never expanded to
    ``(n, m)``.

    Returns:
        ``(nqb, nkb)`` boolean grid.
    """
    if reduce not in (np.any, np.all):
        raise ValueError(f"tile_grid: reduce must be np.any or np.all, got {reduce!r}")
    if isinstance(mask, BlockMask):
        if mask.shape[-2:] != (n, m):
            raise ValueError(f"tile_grid: a BlockMask of shape {mask.shape}, expected "
                             f"(..., {n}, {m})")
        bc, bp = mask.block_size
        x = mask.blocks
        # cells divide both the blocks and the tiles; a cell past n (m) lies in the last
        # block, whose value its edges before n (m) have (the padding does not count)
        cr, cc = math.gcd(bc, bq), math.gcd(bp, bk)
        x = x.reshape((-1,) + x.shape[-2:])
        x = x[0] if len(x) == 1 else over_batch(x, axis=0)
        rows, cols, tq, tk = -(-n // cr), -(-m // cc), bq // cr, bk // cc
        x = np.repeat(np.repeat(x, bc // cr, axis=0), bp // cc, axis=1)[:rows, :cols]
    else:
        x = np.asarray(mask, bool)
        x = x.reshape((-1,) + x.shape[-2:])
        x = x[0] if len(x) == 1 else over_batch(x, axis=0)
        x = np.broadcast_to(x, (n, m))
        rows, cols, tq, tk = n, m, bq, bk
    if (rows, cols) != (nqb * tq, nkb * tk):
        pad = np.full((nqb * tq, nkb * tk), reduce is np.all)  # the identity of reduce
        pad[:rows, :cols] = x
        x = pad
    return reduce(x.reshape(nqb, tq, nkb, tk), axis=(1, 3))
