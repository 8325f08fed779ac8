"""Chained page hashes for prefix caching (DESIGN.md §5, paper §3.3).

A full page is identified by the key (parent hash, the page's tokens); its hash is hash(key) and becomes the
parent of the next page. The chain starts at a root hash of (model id, tenant), so identical tokens of two
tenants or two models never produce the same chain: caches never cross tenants or models. The cache stores
the key next to each page and compares it on a hit, so a 64-bit hash collision cannot return wrong bytes
(a false hit needs equal keys, i.e. equal tokens and equal parent hashes all the way up to the root).

Tokens are hashed per page as a tuple of ints: one C-level tuple hash per page, no per-token Python loop.
"""
from __future__ import annotations

from collections.abc import Sequence

PageKey = tuple  # (parent_hash: int, tokens: tuple[int, ...])


def root_hash(model_id: str, tenant: str) -> int:
    """Hash every chain of (model_id, tenant) starts from (the salt)."""
    return hash(("shadowprefill.kv.root", model_id, tenant))


def as_token_sequence(token_ids) -> Sequence:
    """token_ids as a list or tuple of Python ints (tensors and arrays converted once via tolist())."""
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if hasattr(token_ids, "tolist"):  # torch.Tensor, numpy array
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids: expected a sequence of ints, got {type(token_ids).__name__}")
    return list(token_ids)


def chain_pages(parent: int, tokens: Sequence, first: int, end: int, block_size: int) -> tuple[list, list]:
    """(hashes, keys) of pages first..end-1 of tokens, the chain continuing from `parent` (page first-1's hash)."""
    hashes, keys = [], []
    for start in range(first * block_size, end * block_size, block_size):
        key = (parent, tuple(tokens[start:start + block_size]))
        parent = hash(key)
        keys.append(key)
        hashes.append(parent)
    return hashes, keys


def page_hashes(token_ids, block_size: int, *, model_id: str = "", tenant: str = "",
                num_pages: int | None = None) -> list[int]:
    """Chained hashes of the full pages of token_ids (at most num_pages), as the pool registers them."""
    tokens = as_token_sequence(token_ids)
    n = len(tokens) // block_size if num_pages is None else min(num_pages, len(tokens) // block_size)
    chain = PageHashes(tokens, block_size, root_hash(model_id, tenant))
    chain.extend_to(n)
    return chain.hashes


class PageHashes:
    """The chained page keys and hashes of one append-only token sequence, each page hashed once.

    An engine keeps one per request / shadow job and passes it as `hashes=` to BlockPool.acquire_prefix,
    peek_prefix and commit, so a long session's prefix is not re-hashed on every lookup (O(new pages) per
    call instead of O(context)). `tokens` may grow (append) between calls; `retarget` moves the chain to a
    new list that shares a prefix. Build it with BlockPool.page_hash_chain (it knows model id and tenant).
    """

    __slots__ = ("tokens", "block_size", "root", "hashes", "keys")

    def __init__(self, tokens, block_size: int, root: int):
        self.tokens = as_token_sequence(tokens)
        self.block_size = block_size
        self.root = root
        self.hashes: list[int] = []     # hashes[i]: chained hash of page i
        self.keys: list[PageKey] = []   # keys[i]: (hashes[i-1] or root, page i's tokens)

    def __len__(self) -> int:
        return len(self.hashes)

    def extend_to(self, num_pages: int) -> int:
        """Hash pages up to num_pages (bounded by the full pages of tokens); returns how many are known.
        The token list must only grow; a list that shrank below the known pages or whose last known token
        changed (an O(1) check) drops the stale pages first."""
        tokens, bs, hashes = self.tokens, self.block_size, self.hashes
        known = len(hashes)
        if known and (len(tokens) < known * bs or tokens[known * bs - 1] != self.keys[-1][1][-1]):
            self.truncate(_common_pages(self, tokens))
            known = len(hashes)
        n = min(num_pages, len(tokens) // bs)
        if n > known:
            new_hashes, new_keys = chain_pages(hashes[-1] if known else self.root, tokens, known, n, bs)
            hashes += new_hashes
            self.keys += new_keys
        return len(hashes)

    def truncate(self, num_pages: int) -> None:
        """Forget pages from num_pages on."""
        del self.hashes[num_pages:], self.keys[num_pages:]

    def retarget(self, tokens, keep_pages: int) -> None:
        """Follow a new token list whose first keep_pages pages equal the old one's."""
        self.truncate(max(0, keep_pages))
        self.tokens = as_token_sequence(tokens)


def _common_pages(chain: PageHashes, tokens) -> int:
    """How many leading known pages of chain still match tokens."""
    bs, keys = chain.block_size, chain.keys
    n = min(len(keys), len(tokens) // bs)
    i = 0
    while i < n and keys[i][1] == tuple(tokens[i * bs:(i + 1) * bs]):
        i += 1
    return i
