"""BlockPool: reference-counted KV blocks with a prefix cache.

A block is a slot of ``block_size`` tokens in the KV region (kv_region.py). The pool only
hands out block ids; it never touches KV memory.

Lifecycle of one block::

    FREE (in the free queue, maybe still holding a cached hash)
      │ allocate()              → ref_count 1, its old hash (if any) evicted
      │ touch() on a cache hit  → ref_count += 1, leaves the free queue
      ▼
    IN USE (ref_count ≥ 1) ── cache_full_block() registers its hash once it is full
      │ free()                  → ref_count -= 1
      ▼
    ref_count 0 → back to the tail of the free queue. A block with a hash stays
    findable by that hash until allocate() takes it from the head of the queue
    (least recently freed first), so freed prompt prefixes are reused LRU-last.

Free blocks therefore include cached-but-unused blocks: ``num_free`` counts every block
with ref_count 0, which is the invariant tests check ("free count back at its start").

KV cache events (kvpush.kv_cache.events): with ``record_events`` on, every change of the
hash map is recorded — a hash newly registered (BlockStored), a hash leaving it because
its block was reused (BlockRemoved), a reset (AllBlocksCleared) — into a pending list
that the step loop takes once per step with :meth:`take_events` and hands to the
publisher. Recording is an append to a list: nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence

from kvpush.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      salt: str | None = None) -> BlockHash:
    """Hash of a full block, chained on its parent's hash so equal hashes mean equal
    prefixes (not just equal blocks). ``salt``: the request's ``cache_salt`` (vLLM's
    field), mixed into the first block's hash only (``parent`` None): requests with
    different salts share no cached block, with one salt all of them as usual."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    elif salt is not None:
        h.update(b"salt|" + salt.encode("utf-8", "surrogatepass") + b"\0")
    h.update(b"|")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int,
                       salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (``salt``: the request's cache_salt)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


def hash_prompt_chain(token_ids: Sequence[int], block_size: int,
                      full: Sequence[BlockHash] | None = None,
                      salt: str | None = None) -> list[BlockHash]:
    """The hash chain of every block of a prompt, its partial last block included:
    what prefill and decode compare before KV moves between them (equal chains, equal
    prompts and cache salts). ``full``: the full blocks' hashes when already known."""
    n_full = len(token_ids) // block_size
    if full is not None and len(full) >= n_full:
        chain = list(full[:n_full])
    else:
        chain = hash_prefix_blocks(token_ids, block_size, salt)
    if len(token_ids) % block_size:
        chain.append(hash_block_tokens(chain[-1] if chain else None,
                                       token_ids[n_full * block_size:], salt))
    return chain


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 shuffle_seed: int | None = None):
        """``shuffle_seed``: hand out the never-used blocks in a random order made from
        this seed instead of 0, 1, 2, ... (runs of consecutive ids become rare: the
        fragmented-KV case a long-running server reaches anyway)."""
        if num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Free queue in LRU order: head = evict first. OrderedDict gives O(1) removal
        # of a block that a cache hit takes back out of the middle.
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in order)
        self._cached: dict[BlockHash, int] = {}
        #: record cache changes for take_events() (off: nothing is kept, for engines
        #: whose events nobody takes)
        self.record_events = False
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Longest run of leading block hashes present in the cache → their block ids."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for h in block_hashes:
            bid = self._cached.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    # ---- mutation ------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (all or nothing)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            self._evict(bid)
            self.ref_counts[bid] = 1
            out.append(bid)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on blocks found by :meth:`lookup`."""
        for bid in block_ids:
            if self.ref_counts[bid] == 0:
                del self._free[bid]
            self.ref_counts[bid] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Blocks are released in reverse so the tail
        of a sequence (least likely to be shared) is evicted before its head."""
        for bid in reversed(block_ids):
            rc = self.ref_counts[bid]
            if rc <= 0:
                raise RuntimeError(f"double free of block {bid}")
            self.ref_counts[bid] = rc - 1
            if rc == 1:
                self._free[bid] = None

    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Register a block that now holds a full block of computed KV."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; keep the first one
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.record_events:
            self._record(BlockStored, block_hash)

    def _evict(self, bid: int) -> None:
        h = self.block_hash[bid]
        if h is not None:
            self.block_hash[bid] = None
            if self._cached.get(h) == bid:
                del self._cached[h]
                if self.record_events:
                    self._record(BlockRemoved, h)

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of every free block. Blocks in use keep theirs (their
        requests still hold them), so the events say: all cleared, then those stored."""
        for bid in list(self._free):
            h = self.block_hash[bid]
            self.block_hash[bid] = None
            if h is not None and self._cached.get(h) == bid:
                del self._cached[h]
        if self.record_events:
            self._events.append(AllBlocksCleared())
            if self._cached:
                self._events.append(BlockStored(list(self._cached)))

    # ---- events --------------------------------------------------------------------
    def _record(self, kind: type[BlockStored] | type[BlockRemoved], h: BlockHash) -> None:
        """Append ``h`` to the last pending event when it is of the same kind (one
        event per run of stores or removals, order kept), else start a new one."""
        events = self._events
        if events and type(events[-1]) is kind:
            events[-1].hashes.append(h)  # type: ignore[union-attr]
        else:
            events.append(kind([h]))

    def take_events(self) -> list[KVEvent]:
        """The cache changes since the last call, in order (empty when none)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events
