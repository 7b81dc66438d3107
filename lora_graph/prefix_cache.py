"""Automatic prefix caching keyed by adapter identity: a full KV cache page computed for
one request is reused by a later request whose tokens start the same way *under the same
weights*, never across two.

A page's K and V depend on every token up to its end and on the weights that computed
them: the base model's, or the base model's with one adapter version's deltas (an adapter
that touches q, k, v or anything before them changes K and V; one that does not would too
through its embedding or earlier layers). So a full page is identified by a key chained
over the *identity* that computed it, its parent page's key and its own token ids::

    root(base)       = sha256("lora_graph/prefix/base")
    root(version v)  = sha256("lora_graph/prefix/lora/" + v)
    salted root      = sha256("lora_graph/prefix/salt/" || root || cache_salt)
    key(page 0)      = sha256(root || tokens[0:P] as int64)
    key(page i)      = sha256(key(page i-1) || tokens[iP:(i+1)P] as int64)

as vLLM's and SGLang's prefix caches chain their block hashes, with the adapter's
identity a typed component of the chain's root (vLLM puts the adapter's *name* in its
extra keys, so a reload under the same name reused pages of the old weights, vLLM #42125;
SGLang's ``extra_key`` was a string a base request could set to an adapter's namespace,
SGLang #24638). Here the identity is the adapter version's serial
(:attr:`lora_graph.registry.LoadedAdapter.version`): new on every load of other weights
and after every unload, so a reload can never hit its predecessor's pages, and unloading a
version drops its pages (:meth:`lora_graph.paging.PagePool.forget`). Every key's input
starts with a 32-byte digest and continues in 8-byte tokens, so no token sequence or
request field can reach another identity's keys short of a sha256 collision.

A request's ``cache_salt`` (vLLM's field) salts its root: it shares pages only with
requests of the same identity *and* salt, so a tenant's secret salt keeps other tenants
from learning its prompts by timing their own. A page's *owner* is its identity's
unsalted root, so unloading an adapter version drops its salted pages too.

Policy (vLLM's): a request reuses the longest chain of cached pages under its identity,
but always computes at least its last prompt token (its logits are needed), so at most
``(len - 1) // page_size`` pages; a partly filled page is never keyed nor shared. A
request asking for prompt logprobs reuses nothing (it must compute the positions whose
logprobs it returns); its pages are keyed for others all the same. A page is keyed once
the step that computes it has been queued (:meth:`PrefixCache.commit`): a later step,
queued after it on the same stream, reads it.

Sliding-window layers: pages leaving a layer's window are not freed (every layer shares
one block table, and full-attention layers still read them), so a cached page holds every
layer's K and V and a reusing request's windowed layers read exactly what a cold run's
would.
"""

from __future__ import annotations

import hashlib
from array import array

from lora_graph.paging import PagePool
from lora_graph.requests import RequestState

BASE_ROOT = hashlib.sha256(b"lora_graph/prefix/base").digest()


def identity_root(version: int | None, salt: str | None = None) -> bytes:
    """The chain root of the base model (``version`` None) or of an adapter version, salted
    by a request's ``cache_salt`` if it has one."""
    if version is None:
        root = BASE_ROOT
    else:
        root = hashlib.sha256(b"lora_graph/prefix/lora/" + str(version).encode()).digest()
    if salt is None:
        return root
    return hashlib.sha256(b"lora_graph/prefix/salt/" + root + salt.encode()).digest()


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    """A full page's key from its parent's key (or the identity root) and its token ids."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    """The scheduler's side of prefix caching over a :class:`~lora_graph.paging.PagePool`:
    what a request being admitted can reuse (:meth:`match`), and keying the full pages a
    queued step computed (:meth:`commit`). Off (``enabled=False``), :meth:`match` finds
    nothing and :meth:`commit` keys nothing.

    ``counts``: prompt tokens ``[cached, computed]`` per adapter name (``"base"`` for the
    base model), counted at each request's first admission.
    """

    def __init__(self, pool: PagePool, *, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.counts: dict[str, list[int]] = {}

    @staticmethod
    def roots(seq: RequestState) -> tuple[bytes, bytes]:
        """``seq``'s chain root (salted) and owner (its identity's unsalted root), computed
        once."""
        if seq.root is None:
            version = seq.hold.version if seq.hold is not None else None
            seq.owner = identity_root(version)
            seq.root = identity_root(version, seq.request.cache_salt)
        return seq.root, seq.owner

    def _keys(self, seq: RequestState, pages: int) -> list[bytes]:
        """``seq``'s first ``pages`` page keys (extending the ones it has; its tokens up to
        there must be known)."""
        keys, size = seq.page_keys, self.pool.page_size
        parent = keys[-1] if keys else self.roots(seq)[0]
        for i in range(len(keys), pages):
            parent = page_key(parent, seq.tokens[i * size : (i + 1) * size])
            keys.append(parent)
        return keys

    def match(self, seq: RequestState) -> list[int]:
        """The cached pages ``seq`` can reuse from its first token: the longest chain of
        its keys present in the pool, at most ``(len(tokens) - 1) // page_size`` pages
        (none if it asks for prompt logprobs, or when caching is off). Nothing is held."""
        if not self.enabled or seq.request.sampling.prompt_logprobs is not None:
            return []
        hits: list[int] = []
        for key in self._keys(seq, (len(seq.tokens) - 1) // self.pool.page_size):
            page = self.pool.lookup(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def count(self, seq: RequestState, cached: int) -> None:
        """Record a request's first admission: ``cached`` of its prompt tokens reused."""
        seq.cached_tokens = cached
        count = self.counts.setdefault(seq.request.adapter or "base", [0, 0])
        count[0] += cached
        count[1] += len(seq.request.prompt_token_ids) - cached

    def commit(self, seq: RequestState) -> None:
        """Key ``seq``'s full pages whose K and V are computed (or queued) and whose tokens
        the host knows, from the first it has not keyed yet."""
        if not self.enabled:
            return
        size = self.pool.page_size
        full = min(seq.computed, len(seq.tokens)) // size
        if full <= seq.keyed:
            return
        keys = self._keys(seq, full)
        _, owner = self.roots(seq)
        for i in range(seq.keyed, full):
            self.pool.cache(seq.pages[i], keys[i], owner)
        seq.keyed = full
