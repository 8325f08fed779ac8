"""PrefixIndex: which device page holds each cached page hash (paper §3.3, DESIGN.md §5).

A page that a sequence committed carries its chained hash (page_hash.py). The first page registered under a
hash is its canonical page: the one a prefix lookup returns and that stays cached (evictable) at ref 0. A
later page with the same content gets the hash too (its sequence continues the chain from it) but stays
private and is freed on release. A page's generation changes whenever it stops being canonical (evicted or
freed), so "page b was canonical for h at generation g and still has g" proves it still is, without a lookup
(kept chains use it). Reference implementation; `csrc/kv/` holds the native one.
"""
from __future__ import annotations


class PrefixIndex:
    """hash -> canonical device page, and page -> hash."""

    def __init__(self, num_blocks: int):
        self.page_hash: list[int | None] = [None] * num_blocks
        self.pages: dict[int, int] = {}
        self.gen = [0] * num_blocks

    def __len__(self) -> int:
        return len(self.pages)

    def get(self, page_hash: int) -> int | None:
        """The canonical page of a hash (None if not on the device)."""
        return self.pages.get(page_hash)

    def is_canonical(self, b: int) -> bool:
        h = self.page_hash[b]
        return h is not None and self.pages.get(h) == b

    def split_canonical(self, pages) -> tuple[list[int], list[int]]:
        """(canonical pages, the others), each in the given order."""
        page_hash, get = self.page_hash, self.pages.get
        keep, other = [], []
        for b in pages:
            h = page_hash[b]
            (keep if h is not None and get(h) == b else other).append(b)
        return keep, other

    def valid_prefix(self, pages: list[int], gens: list[int], limit: int) -> int:
        """How many leading (page, generation) pairs (at most limit) still hold: the pages are still canonical."""
        gen, n = self.gen, min(limit, len(pages))
        if list(map(gen.__getitem__, pages[:n])) == gens[:n]:
            return n
        i = 0
        while gen[pages[i]] == gens[i]:
            i += 1
        return i

    def first_unhashed(self, pages, end: int) -> int:
        """The smallest i <= end such that pages[i:end] carry no hash (the pages after the last hashed one)."""
        page_hash, n = self.page_hash, len(self.page_hash)
        while end > 0:
            b = pages[end - 1]
            if not 0 <= b < n:
                raise ValueError(f"block_ids: page {b} is out of range")
            if page_hash[b] is not None:
                break
            end -= 1
        return end

    def register(self, pages, hashes) -> list[int]:
        """Give each page its hash; a hash not on the device yet makes the page canonical. Returns the
        hashes that became device entries."""
        page_hash, entries, new = self.page_hash, self.pages, []
        for b, h in zip(pages, hashes):
            page_hash[b] = h
            if h not in entries:
                entries[h] = b
                new.append(h)
        return new

    def set(self, b: int, h: int) -> None:
        """A page filled with the content of hash h (a host reload): canonical unless h is on the device."""
        self.page_hash[b] = h
        if h not in self.pages:
            self.pages[h] = b

    def restore(self, h: int, b: int) -> None:
        """Page b (still carrying hash h) is h's canonical page again (a cancelled spill)."""
        self.pages[h] = b

    def remove(self, pages) -> list[int]:
        """Drop the entries of canonical pages (evicted; the pages keep their hash until freed)."""
        page_hash, entries, gen = self.page_hash, self.pages, self.gen
        hashes = [page_hash[b] for b in pages]
        for h in hashes:
            del entries[h]
        for b in pages:
            gen[b] += 1
        return hashes

    def clear(self, pages) -> None:
        """Pages freed: they carry no hash any more (none of them is canonical)."""
        page_hash, gen = self.page_hash, self.gen
        for b in pages:
            page_hash[b] = None
            gen[b] += 1
