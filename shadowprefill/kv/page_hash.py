"""The page-hash chain: one identity per full KV page of a token sequence (paper §3.3, DESIGN.md §5).

    root       = BLAKE2b-128(b"shadowprefill.kv.root\\0" + UTF-8(salt))
    h_i        = BLAKE2b-128(le128(h_{i-1}) + le32(page i's tokens))       (h_{-1} = root)

Each page's hash depends on every earlier token and on the salt, so identical tokens under another salt
(the pool salts with model id + tenant, the gateway with tenant + model + version) never give the same
chain: caches never cross tenants or models. BLAKE2b (RFC 7693; `hashlib` in Python, `csrc/kv/blake2b.h`
in C++) makes the value the same in every process and on every machine, whatever PYTHONHASHSEED says.
Hashes are 128-bit ints (little-endian digests); tokens must be in [0, 2**32). With 128 bits a false
prefix hit needs a BLAKE2b collision, so pages are identified by their hash alone (no token keys kept).
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache
from hashlib import blake2b

__all__ = ["page_hashes", "salt_root", "pool_salt", "chain_pages", "PageHashes", "as_token_sequence"]

_ROOT_PREFIX = b"shadowprefill.kv.root\x00"
_BIG_ENDIAN = sys.byteorder == "big"


@lru_cache(maxsize=4096)
def salt_root(salt: str) -> int:
    """The hash every chain of `salt` starts from (h_{-1})."""
    if not isinstance(salt, str):
        raise TypeError(f"salt: expected a str, got {type(salt).__name__}")
    return int.from_bytes(blake2b(_ROOT_PREFIX + salt.encode("utf-8"), digest_size=16).digest(), "little")


def pool_salt(model_id: str, tenant: str) -> str:
    """The salt of a KV pool's chains: model id and tenant (a NUL between them)."""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant: expected a str, got {type(tenant).__name__}")
    return f"{model_id}\x00{tenant}"


def as_token_sequence(token_ids) -> Sequence:
    """token_ids as a list or tuple of Python ints (tensors and arrays converted once via tolist())."""
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if hasattr(token_ids, "tolist"):  # torch.Tensor, numpy array
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids: expected a sequence of ints, got {type(token_ids).__name__}")
    return list(token_ids)


def _token_bytes(tokens: Sequence, start: int, end: int) -> bytes:
    """tokens[start:end] as little-endian uint32 (one C-level conversion)."""
    try:
        arr = array("I", tokens[start:end])
    except OverflowError:
        raise ValueError("token_ids: token ids must be in [0, 2**32)") from None
    except TypeError:
        raise TypeError("token_ids: expected int token ids") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def chain_pages(parent: int, tokens: Sequence, first: int, end: int, block_size: int) -> list[int]:
    """Hashes of pages first..end-1 of tokens, the chain continuing from `parent` (page first-1's hash, or
    the root). The one implementation of the chain step in Python."""
    if end <= first:
        return []
    raw = _token_bytes(tokens, first * block_size, end * block_size)
    step = 4 * block_size
    digest = parent.to_bytes(16, "little")
    out = []
    append, from_bytes = out.append, int.from_bytes
    for off in range(0, len(raw), step):
        digest = blake2b(digest + raw[off:off + step], digest_size=16).digest()
        append(from_bytes(digest, "little"))
    return out


def page_hashes(token_ids, block_size: int, salt: str = "") -> list[int]:
    """Chained hashes of the full pages of token_ids (one per whole page of `block_size` tokens), each
    depending on every earlier token and on `salt`. Stable across processes and machines."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected an int > 0, got {block_size!r}")
    tokens = as_token_sequence(token_ids)
    return chain_pages(salt_root(salt), tokens, 0, len(tokens) // block_size, block_size)


class PageHashes:
    """The page hashes of one append-only token sequence, each page hashed once, and the device pages the
    last KV manager that used it found them on.

    An engine keeps one per long-lived sequence (a shadow job, a session) and passes it as `hashes=` to the
    KV manager's calls, so a long prefix is not re-hashed on every call (O(new pages), not O(context)), and
    its cached pages are revalidated by a generation check per page instead of a lookup (`pages`, `gens`:
    what manager `owner` resolved the first hashes to; core.py). `tokens` may grow (append) between calls;
    `retarget` moves the chain to a new list sharing a prefix. Build it with `KVCacheManager.hash_chain`.
    """

    __slots__ = ("tokens", "block_size", "root", "hashes", "_tail", "owner", "pages", "gens")

    def __init__(self, tokens, block_size: int, root: int):
        self.tokens = as_token_sequence(tokens)
        self.block_size = block_size
        self.root = root
        self.hashes: list[int] = []     # hashes[i]: page i's chained hash
        self._tail = None               # the last token of the last known page (an O(1) staleness check)
        self.owner = None               # the KV core whose pages `pages` are
        self.pages: list[int] = []      # pages[i]: the canonical device page of hashes[i] when last seen
        self.gens: list[int] = []       # gens[i]: that page's generation then (valid while unchanged)

    def __len__(self) -> int:
        return len(self.hashes)

    def extend_to(self, num_pages: int) -> int:
        """Hash pages up to num_pages (bounded by the full pages of tokens); returns how many are known.
        The token list must only grow; a list that shrank below the known pages or whose last known token
        changed (an O(1) check) drops the stale pages first."""
        tokens, bs, hashes = self.tokens, self.block_size, self.hashes
        known = len(hashes)
        if known and (len(tokens) < known * bs or tokens[known * bs - 1] != self._tail):
            self.truncate(self._common_pages())
            known = len(hashes)
        n = min(num_pages, len(tokens) // bs)
        if n > known:
            hashes += chain_pages(hashes[-1] if known else self.root, tokens, known, n, bs)
            self._tail = tokens[n * bs - 1]
        return len(hashes)

    def add(self, hashes: list[int]) -> None:
        """Append the hashes of the next pages (computed by the caller with chain_pages)."""
        self.hashes += hashes
        self._tail = self.tokens[len(self.hashes) * self.block_size - 1]

    def truncate(self, num_pages: int) -> None:
        """Forget pages from num_pages on."""
        n = max(0, min(num_pages, len(self.tokens) // self.block_size))
        del self.hashes[n:], self.pages[n:], self.gens[n:]
        n = len(self.hashes)
        self._tail = self.tokens[n * self.block_size - 1] if n else None

    def retarget(self, tokens, keep_pages: int) -> None:
        """Follow a new token list whose first keep_pages pages equal the old one's."""
        self.tokens = as_token_sequence(tokens)
        self.truncate(min(keep_pages, len(self.tokens) // self.block_size))

    def _common_pages(self) -> int:
        """How many leading known pages still match the tokens (re-hashed: a broken append-only contract)."""
        bs, hashes = self.block_size, self.hashes
        n = min(len(hashes), len(self.tokens) // bs)
        fresh = chain_pages(self.root, self.tokens, 0, n, bs)
        i = 0
        while i < n and fresh[i] == hashes[i]:
            i += 1
        return i
