"""Operator sequences as integer ids: signatures, similarity and fuzzy tensor keys.

Pure Python (no torch): the profiler turns each step's events into ids with an ``EventVocab``,
this module compares sequences and matches tensors across steps.

* An *event* is a module call or a saved tensor. Its id encodes what is stable across iterations
  of the same sequence (module kind, call ordinal, saved ordinal, dtype, size class) and nothing
  that is not (addresses, data).
* A *signature* is an exact hash of a step's id sequence: equal signatures, same plan.
* *Similarity* is what Chameleon (arXiv 2509.11076, section on online profiling) uses to decide
  that the sequence changed: the relative change of its length and the cosine similarity of the
  two sequences; the paper's thresholds are 5% and 0.95, the defaults here.
* A tensor *key* identifies a saved tensor across iterations without its address: module, call
  ordinal, saved ordinal within that call, dtype and shape; shapes match with varying dimensions
  tolerated (sequence length, batch, routed tokens).
"""
from __future__ import annotations

import hashlib
import math
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, NamedTuple, Optional, Sequence

DEFAULT_LENGTH_TOLERANCE = 0.05
DEFAULT_MIN_SIMILARITY = 0.95
SIZE_CLASS_BITS = 4        # mantissa bits kept: size classes about 6% apart


def size_class(nbytes: int) -> int:
    """Bucket a byte count so nearly equal sizes share a class (16 classes per power of two).

    Lengths that differ by a few percent give the same class, so their sequences are the same
    sequence; a real change of shape changes the class."""
    if nbytes <= 0:
        return 0
    e = nbytes.bit_length()
    if e <= SIZE_CLASS_BITS + 1:
        return nbytes
    top = nbytes >> (e - SIZE_CLASS_BITS - 1)          # the leading SIZE_CLASS_BITS+1 bits
    return (e << 8) | top


def step_size(first_input_bytes: int) -> int:
    """A step's size, as the block-mode plans are keyed: the byte bucket of the step's first block
    input (its batch x sequence). Not a tensor's size class, though it shares the bucketing."""
    return size_class(first_input_bytes)


class EventVocab:
    """Interns event descriptions (hashable tuples) as small ints, stable for the engine's life."""

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def id(self, event: Hashable) -> int:
        i = self._ids.get(event)
        if i is None:
            i = self._ids[event] = len(self._ids)
        return i


def signature(ids: Sequence[int]) -> str:
    """Exact, process-independent hash of an id sequence (hex)."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class Similarity:
    length_change: float      # |len(a) - len(b)| / max(len(a), len(b))
    cosine: float             # cosine similarity of the two sequences' id histograms

    def changed(self, length_tolerance: float = DEFAULT_LENGTH_TOLERANCE,
                min_similarity: float = DEFAULT_MIN_SIMILARITY) -> bool:
        return self.length_change > length_tolerance or self.cosine < min_similarity


def similarity(a: Sequence[int], b: Sequence[int]) -> Similarity:
    """How alike two id sequences are. The cosine is taken over id counts (a bag of events), so a
    sequence and a slightly longer or reordered one stay close, and different shapes (other size
    classes, other ids) are far apart."""
    n, m = len(a), len(b)
    if n == 0 and m == 0:
        return Similarity(0.0, 1.0)
    length_change = abs(n - m) / max(n, m)
    ca, cb = Counter(a), Counter(b)
    dot = sum(v * cb.get(k, 0) for k, v in ca.items())
    na = math.sqrt(sum(v * v for v in ca.values()))
    nb = math.sqrt(sum(v * v for v in cb.values()))
    cosine = dot / (na * nb) if na and nb else 0.0
    return Similarity(length_change, cosine)


# --------------------------------------------------------------------------- tensor keys
class TensorKey(NamedTuple):
    """What identifies a saved tensor across iterations (never its address). A named tuple:
    made for every saved storage, so it must be cheap."""

    module: int               # the innermost running module's stable id (-1: none)
    call: int                 # how many times that module was called before in this step
    ordinal: int              # saved-tensor ordinal within that call
    dtype: str
    shape: tuple[int, ...]

    @property
    def exact(self) -> tuple:
        """The part that must match exactly; the shape is compared by ``shape_matches``."""
        return (self.module, self.call, self.ordinal, self.dtype, len(self.shape))


MAX_VARYING_DIMS = 2      # (B, T, D) -> (B, T', D); attention scores (B, H, T', T') vary in two


def shape_matches(a: Sequence[int], b: Sequence[int], max_varying: int = MAX_VARYING_DIMS) -> bool:
    if len(a) != len(b):
        return False
    return sum(1 for x, y in zip(a, b) if x != y) <= max_varying


class KeyIndex:
    """Finds, for a tensor key of this step, the entry of a profiled step that stands for it."""

    def __init__(self, keys: Sequence[TensorKey]) -> None:
        self._by_exact: dict[tuple, list[int]] = {}
        for i, k in enumerate(keys):
            self._by_exact.setdefault(k.exact, []).append(i)
        self._keys = keys

    def find(self, key: TensorKey) -> Optional[int]:
        for i in self._by_exact.get(key.exact, ()):
            if shape_matches(self._keys[i].shape, key.shape):
                return i
        return None
