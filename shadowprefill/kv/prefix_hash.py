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


def page_key(parent: int, tokens: Sequence, page: int, block_size: int) -> PageKey:
    """Key of page `page` of `tokens` (tokens[page*bs:(page+1)*bs]) under `parent`."""
    start = page * block_size
    return (parent, tuple(tokens[start:start + block_size]))


def page_hashes(token_ids, block_size: int, *, model_id: str = "", tenant: str = "",
                num_pages: int | None = None) -> list[int]:
    """Chained hashes of the full pages of token_ids (at most num_pages), as the pool registers them."""
    tokens = as_token_sequence(token_ids)
    n = len(tokens) // block_size if num_pages is None else min(num_pages, len(tokens) // block_size)
    parent, out = root_hash(model_id, tenant), []
    for i in range(n):
        parent = hash(page_key(parent, tokens, i, block_size))
        out.append(parent)
    return out
