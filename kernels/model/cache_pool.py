"""Empty decoder caches kept for reuse by turns that keep nothing (a stateless request's turn):
:class:`CachePool`.

A fresh :class:`~kernels.model.cache.DecoderCache` allocates every layer's owned arrays, and its
first step builds its address tables (:meth:`~kernels.model.cache.DecoderCache.row_tables`) over
them: about a third of a millisecond of a lone 7-token request's engine time on glm-mini. A cache
given back is wiped (its length 0 and every owned array zeroed in place, over its whole capacity)
and handed to the next request as it is: the same arrays, so its tables stay valid and are not
built again. A wiped cache holds nothing of the request before: what a step reads of it is what
a fresh one gives (the tests compare logits and tokens bitwise).

The pool keeps at most ``keep`` caches, each of at most ``max_bytes`` of owned storage (a cache
that grew past it, a long prompt's, is dropped rather than held); it is used from one thread (the
engine loop's, whose jobs run the turns).
"""
from __future__ import annotations

from collections.abc import Callable

from kernels.model.cache import DecoderCache

KEEP = 16  # caches held (stateless turns at once, past which a new one is made)
MAX_BYTES = 8 << 20  # owned bytes past which a cache given back is dropped, not held


class CachePool:
    """Empty caches made by ``make`` (one model's, one kv dtype's, no base rows), taken and given back."""

    def __init__(self, make: Callable[[], DecoderCache], keep: int = KEEP, max_bytes: int = MAX_BYTES) -> None:
        self._make, self.keep, self.max_bytes = make, keep, max_bytes
        self._free: list[DecoderCache] = []

    def take(self) -> DecoderCache:
        """An empty cache: one given back (wiped), else a new one."""
        return self._free.pop() if self._free else self._make()

    def give_back(self, cache: object) -> None:
        """``cache`` is no longer used (nothing refers to it): wiped and held, or dropped when the
        pool is full, it grew past ``max_bytes``, it holds base rows or it is no
        :class:`DecoderCache` (not one of ``make``'s)."""
        if (not isinstance(cache, DecoderCache) or len(self._free) >= self.keep
                or cache.own_nbytes > self.max_bytes or cache.owned_storage()[2]):
            return
        cache.truncate(0, wipe=True)
        self._free.append(cache)

    def __len__(self) -> int:
        """The caches held now."""
        return len(self._free)


__all__ = ["CachePool"]
