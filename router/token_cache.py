"""Incremental tokenization: encode only the parts of a prompt the router has not seen before.

A multi-turn request repeats the earlier turns' text, and encoding 8k tokens costs the
`tokenizers` library 10–30 ms on these CPUs, far above the routing budget. `ChunkCache` cuts
the text where the tokenizer's own splitting restarts, so that encoding the pieces one by one
gives exactly the ids of encoding the whole, and keeps the ids of recent pieces in an LRU cache
bounded in bytes. Two kinds of cut, each enabled only when the tokenizer allows it:

* at added (special) tokens: `tokenizers` splits them out before normalizing and
  pre-tokenizing, so the text between them is encoded independently anyway (needs every added
  token to be non-normalized and without lstrip / rstrip / single_word);
* after a newline that follows a non-space character and precedes a printable ASCII one, when
  the pre-tokenizer is a byte-level one driven by a GPT-2 / tiktoken-style regex (ByteLevel
  with `use_regex`, or a Split followed by ByteLevel, and no prefix space): those regexes never
  match across such a point. Newline cuts are grouped into chunks of at least `min_chunk_chars`
  (256 by default: `tokenizers` encodes a batch of such chunks about twice as fast as one long
  text, and a new prompt's first chunk stays cheap; see bench/router_decision.py).

Both are checked once at load time against whole-text encodes of a probe; a tokenizer that
disagrees gets the plain whole-text encode. Misses are encoded with `encode_batch_fast`, which
releases the GIL and spreads a batch over cores. `begin` / `finish` split one encode in
two, so the router can place a never-seen prompt from its leading part (router/placement.py).

A conversation's next turn repeats its whole history, so even cached chunks cost time in
proportion to it (cutting, looking up and joining 128k tokens' chunks: ~10 ms). Recently encoded
texts are therefore remembered whole (`_Seen`: the text, where its pieces end in characters and
in tokens, its ids), found again by hashes of their leading 1k, 4k, 16k, ... characters, and a
new text that starts like one of them reuses its ids up to the last piece end they share: only
the rest is cut and looked up. The reuse is reported (`Lineage`) so that key chains are also
extended rather than rehashed (router/placement.py). Remembered texts have their own byte budget.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from tokenizers import Tokenizer

# After a newline between a non-space character and a printable ASCII one: a cut after a run of
# whitespace would change how `\s+(?!\S)` splits that run at the end of the piece.
_NEWLINE_CUT = re.compile(r"(?<=\S)\n(?=[!-~])")
_PROBE = (
    "You are a helpful assistant.\n\nAnswer briefly.\n  indented line\nx = [1, 22, 333]\n"
    "trailing space \n\ttab\n\n\n(paren) 'quote' \"dq\"\n42 is the answer.\nnaïve café 東京\nend"
)


@dataclass(slots=True)
class ChunkStats:
    """Cache counters (chunks, not tokens) for metrics."""

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    texts_bytes: int = 0
    """Remembered whole texts (`_Seen`), on their own budget beside `bytes`."""


def _entry_bytes(chunk: str, ids: array[int]) -> int:
    """Memory of one cache entry: both objects plus the ordered dict's slot and link (~100 B)."""
    return sys.getsizeof(chunk) + sys.getsizeof(ids) + 100


def _pre_tokenizer_allows_newline_cuts(spec: object) -> bool:
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "ByteLevel":
        return bool(spec.get("use_regex")) and not spec.get("add_prefix_space")
    if spec.get("type") == "Sequence":
        parts = spec.get("pretokenizers") or []
        return (
            len(parts) == 2
            and parts[0].get("type") == "Split"
            and parts[1].get("type") == "ByteLevel"
            and not parts[1].get("use_regex")
            and not parts[1].get("add_prefix_space")
        )
    return False


@dataclass(frozen=True, slots=True)
class Lineage:
    """A text's ids in relation to a text encoded earlier: its first `shared` ids are that
    text's. `ident` names this text, `base` the earlier one (0: none)."""

    ident: int
    base: int = 0
    shared: int = 0


@dataclass(slots=True)
class _Seen:
    """A remembered text: the character and token offsets where each of its pieces ends."""

    lineage: Lineage
    text: str
    keys: list[tuple[int, int]]
    """Its text's level keys (`ChunkCache._level_keys`)."""
    cuts: array[int]
    marks: array[int]
    ids: array[int]
    levels: list[tuple[int, int]]
    """Those of its keys the level map still points to it by."""
    nbytes: int = 0


@dataclass(slots=True)
class Partial:
    """A text encoded up to a cut (`ChunkCache.begin`): leading ids, and what is left
    (`ChunkCache.finish` completes it in place)."""

    ids: array[int]
    rest: list[str | int]
    """Chunks not encoded yet, and special-token ids; empty when `ids` is the whole text."""
    estimate: int
    """Tokens the rest is expected to have (from the tokens per character encoded so far)."""
    bound: int
    """Tokens the rest has at most."""
    pending: int
    """Characters of the rest: what `ChunkCache.finish` has left to look up and encode."""
    lineage: Lineage | None = None
    """Its ids' relation to a text encoded earlier (None: nothing remembered)."""
    _seen: _Seen | None = None
    """What is remembered of it once its rest is encoded."""


class ChunkCache:
    """Token ids of a text (no special tokens added), reusing the ids of chunks seen before."""

    def __init__(
        self,
        tok: Tokenizer,
        max_bytes: int = 64 << 20,
        min_chunk_chars: int = 256,
        min_level_chars: int = 1024,
    ):
        self._tok = tok
        self.max_bytes = max_bytes
        self.min_chunk_chars = min_chunk_chars
        self.stats = ChunkStats()
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._seen: OrderedDict[int, _Seen] = OrderedDict()
        """Remembered texts by `Lineage.ident`, least recently used first."""
        self._levels: dict[tuple[int, int], _Seen] = {}
        """(length, hash of a text's first `length` characters) -> the latest such text."""
        self._level_sizes = [min_level_chars << 2 * i for i in range(8)]
        self._next_ident = 1
        self.max_seen_bytes = max_bytes // 2
        self._new_chars = self._new_tokens = 0
        """Text encoded so far and its tokens: the ratio estimates the length of a rest."""
        decoder = tok.get_added_tokens_decoder()
        added = list(decoder.values())
        self._special_ids = {t.content: i for i, t in decoder.items()}
        self._special_chars = {i: len(t.content) for i, t in decoder.items()}
        self._margin = max([1, *self._special_chars.values()])
        """Characters past a piece end that decide it (a special token starting there)."""
        plain = all(not (t.normalized or t.lstrip or t.rstrip or t.single_word) for t in added)
        contents = sorted(self._special_ids, key=len, reverse=True)
        self._special_split = (
            re.compile("(" + "|".join(map(re.escape, contents)) + ")") if plain and added else None
        )
        pre = json.loads(tok.to_str()).get("pre_tokenizer")
        # An lstrip / rstrip token may swallow the newline at a cut: no cuts for such tokenizers.
        newline_token = any("\n" in c for c in contents)
        self._newline_cuts = plain and not newline_token and _pre_tokenizer_allows_newline_cuts(pre)
        self.enabled = True
        probe = _PROBE + "".join(f"{c}{_PROBE}" for c in contents[:3])
        want = tok.encode(probe, add_special_tokens=False).ids
        if self._newline_cuts and self._ids(self._pieces(probe, 1)).tolist() != want:
            self._newline_cuts = False
        if self._ids(self._pieces(probe, 1)).tolist() != want:
            self.enabled = False
        self._cache.clear()
        self._seen.clear()
        self._levels.clear()
        self.stats = ChunkStats()

    @property
    def seen_bytes(self) -> int:
        """Bytes of the remembered texts (at most `max_seen_bytes`)."""
        return self.stats.texts_bytes

    @property
    def mode(self) -> str:
        """Which cuts are in use: "special+newline", "special", "newline" or "off"."""
        if not self.enabled:
            return "off"
        cuts = [n for n, on in (("special", self._special_split), ("newline", self._newline_cuts))
                if on]
        return "+".join(cuts) or "off"

    def encode(self, text: str) -> array[int]:
        """Ids of `text` without special tokens added, equal to a whole-text encode."""
        if not self.enabled:
            return array("I", self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        return self._ids(self._pieces(text, self.min_chunk_chars))

    @overload
    def begin(self, text: str) -> Partial: ...

    @overload
    def begin(self, text: str, budget: int | None) -> Partial | None: ...

    def begin(self, text: str, budget: int | None = None) -> Partial | None:
        """Ids of `text` up to its second chunk never seen before; the rest is left for
        `finish`. A cold prompt then costs one chunk's encode before the router can see
        whether any worker's cached prefix reaches past it (with newline cuts only: elsewhere
        the whole text is encoded). A text starting like one encoded before reuses its ids up
        to the last piece end they share (`lineage`). None, with nothing encoded, when that
        would encode more than `budget` characters (the caller then runs it off the loop)."""
        if not self.enabled:
            if budget is not None and len(text) > budget:
                return None
            return Partial(self.encode(text), [], 0, 0, 0)
        keys = self._level_keys(text)
        seen, start = self._recall(text, keys)
        offset = seen.cuts[start - 1] if seen is not None else 0
        pieces = self._pieces(text[offset:], self.min_chunk_chars)
        cache, cut = self._cache, len(pieces)
        if self._newline_cuts:
            first_new = True
            for i, p in enumerate(pieces):
                if isinstance(p, str) and p not in cache:
                    if not first_new:
                        cut = i
                        break
                    first_new = False
        if budget is not None and budget < sum(
            len(p) for p in pieces[:cut] if isinstance(p, str) and p not in cache
        ):
            return None
        ident = self._next_ident
        self._next_ident += 1
        if seen is None:
            lineage = Lineage(ident)
            cuts, marks, ids = array("Q"), array("Q"), array("I")
        else:
            lineage = Lineage(ident, seen.lineage.ident, seen.marks[start - 1])
            cuts, marks = seen.cuts[:start], seen.marks[:start]
            ids = self._take_ids(seen, lineage.shared)
        rest = pieces[cut:]
        chars = sum(len(p) for p in rest if isinstance(p, str))
        specials = len(rest) - sum(isinstance(p, str) for p in rest)
        ratio = self._new_tokens / max(1, self._new_chars)
        ids.extend(self._ids(pieces[:cut], cuts, marks))
        # Byte-level BPE: every token covers at least one UTF-8 byte of its piece.
        bound = specials + sum(len(p.encode()) for p in rest if isinstance(p, str))
        estimate = min(bound, specials + max(1, round(chars * ratio))) if rest else 0
        remembered = _Seen(lineage, text, keys, cuts, marks, ids, [])
        if not rest:
            self._remember(remembered)
        return Partial(ids, rest, estimate, bound, chars, lineage, remembered)

    def finish(self, partial: Partial) -> array[int]:
        """The whole text's ids: `partial.ids`, extended in place by those of what `begin` left
        (a long history is copied once, in `begin`, or not at all: `_take_ids`); the partial is
        whole afterwards, so a second call returns the same array. It is the remembered text's
        own: nothing changes it while anything outside the cache holds it."""
        if partial.rest:
            seen = partial._seen
            ends = () if seen is None else (seen.cuts, seen.marks)
            partial.ids.extend(self._ids(partial.rest, *ends))
            partial.rest, partial.pending = [], 0
            if seen is not None:
                self._remember(seen)
        return partial.ids

    def _take_ids(self, seen: _Seen, shared: int) -> array[int]:
        """The first `shared` of a remembered text's ids, for a new text to extend: the text's
        own array when nothing else holds it (the text is then forgotten: its ids stop being
        its own), else a copy. A 128k-token history's ids are 512 KB; under the router's fixed
        mmap threshold a copy is mapped fresh and faults in ~128 pages, the array kept does not."""
        ids = seen.ids
        # CPython's count: `seen.ids`, `ids` and getrefcount's own argument. More: a prompt
        # still in flight holds them, and its ids must not change under it.
        if sys.getrefcount(ids) > 3:
            return ids[:shared]
        self._forget(seen)
        del ids[shared:]
        return ids

    def _level_keys(self, text: str) -> list[tuple[int, int]]:
        """(length, hash) of the text's leading 1k, 4k, 16k, ... characters, shortest first;
        each hash chains the one before over the characters between, so the text is read once
        (whole-prefix hashes cost a 128k-token turn ~0.2 ms, twice: to look up, to remember)."""
        keys: list[tuple[int, int]] = []
        h = start = 0
        for size in self._level_sizes:
            if size > len(text):
                break
            h = hash((h, text[start:size]))
            keys.append((size, h))
            start = size
        return keys

    def _recall(self, text: str, keys: list[tuple[int, int]]) -> tuple[_Seen | None, int]:
        """The remembered text sharing the longest run of leading pieces with `text` (found by
        its level `keys`, longest level first), and how many pieces they share."""
        margin = self._margin
        for key in reversed(keys):
            seen = self._levels.get(key)
            if seen is None:
                continue
            # Binary search for the last piece end whose deciding characters both texts share;
            # each probe compares only what the last success has not already compared.
            lo, hi, agreed = 0, len(seen.cuts), 0
            limit = min(len(text), len(seen.text))
            while lo < hi:
                mid = (lo + hi + 1) // 2
                end = seen.cuts[mid - 1] + margin
                if end <= limit and text.startswith(seen.text[agreed:end], agreed):
                    lo, agreed = mid, end
                else:
                    hi = mid - 1
            if lo:
                self._seen.move_to_end(seen.lineage.ident)
                return seen, lo
        return None, 0

    def _remember(self, seen: _Seen) -> None:
        """Keep `seen` (least recently used texts go first past the byte budget); a text that
        every level key of an older one now points past is dropped at once."""
        text = seen.text
        if not seen.keys or seen.lineage.ident in self._seen:
            return
        seen.nbytes = (
            sys.getsizeof(text) + 4 * len(seen.ids) + 8 * (len(seen.cuts) + len(seen.marks)) + 300
        )
        if seen.nbytes > self.max_seen_bytes:
            return
        for key in seen.keys:
            old = self._levels.get(key)
            self._levels[key] = seen
            seen.levels.append(key)
            if old is not None and old is not seen and old.lineage.ident in self._seen:
                old.levels.remove(key)
                if not old.levels:
                    self._forget(old)
        self._seen[seen.lineage.ident] = seen
        self.stats.texts_bytes += seen.nbytes
        while self.seen_bytes > self.max_seen_bytes:
            self._forget(next(iter(self._seen.values())))

    def _forget(self, seen: _Seen) -> None:
        del self._seen[seen.lineage.ident]
        self.stats.texts_bytes -= seen.nbytes
        for key in seen.levels:
            if self._levels.get(key) is seen:
                del self._levels[key]

    def _pieces(self, text: str, min_chunk: int) -> list[str | int]:
        """The text cut into chunks and special-token ids."""
        pieces: list[str | int] = []
        if self._special_split is not None:
            for i, part in enumerate(self._special_split.split(text)):
                if i % 2:
                    pieces.append(self._special_ids[part])
                elif part:
                    pieces.extend(self._chunks(part, min_chunk))
        else:
            pieces.extend(self._chunks(text, min_chunk))
        return pieces

    def _ids(
        self,
        pieces: Sequence[str | int],
        cuts: array[int] | None = None,
        marks: array[int] | None = None,
    ) -> array[int]:
        """Ids of the pieces: cached chunks reused, the others encoded in one batch. `cuts` and
        `marks` get the character and token offset where each piece ends (continuing theirs).
        """
        cache = self._cache
        missing = list(dict.fromkeys(p for p in pieces if isinstance(p, str) and p not in cache))
        fresh: dict[str, array[int]] = {}
        if missing:
            encoded = self._tok.encode_batch_fast(missing, add_special_tokens=False)
            fresh = {c: array("I", enc.ids) for c, enc in zip(missing, encoded, strict=True)}
        out = array("I")
        ends = (cuts, marks) if cuts is not None and marks is not None else None
        char, base = (cuts[-1], marks[-1]) if cuts and marks else (0, 0)
        for p in pieces:
            if isinstance(p, int):
                out.append(p)
            elif p in fresh:
                out.extend(fresh[p])
            else:
                out.extend(cache[p])
                cache.move_to_end(p)
                self.stats.hits += 1
            if ends is not None:
                char += self._special_chars[p] if isinstance(p, int) else len(p)
                ends[0].append(char)
                ends[1].append(base + len(out))
        self.stats.misses += len(fresh)
        for chunk, ids in fresh.items():  # after the lookups: storing may evict older chunks
            self._store(chunk, ids)
            self._new_chars += len(chunk)
            self._new_tokens += len(ids)
        return out

    def _chunks(self, text: str, min_chunk: int) -> Sequence[str]:
        if not self._newline_cuts or len(text) <= min_chunk:
            return (text,)
        chunks = []
        start = 0
        while True:
            m = _NEWLINE_CUT.search(text, start + min_chunk - 1)
            if m is None:
                break
            chunks.append(text[start : m.end()])
            start = m.end()
        chunks.append(text[start:])
        return chunks

    def _store(self, chunk: str, ids: array[int]) -> None:
        cache = self._cache
        cache[chunk] = ids
        self.stats.bytes += _entry_bytes(chunk, ids)
        while self.stats.bytes > self.max_bytes and len(cache) > 1:
            old, old_ids = cache.popitem(last=False)
            self.stats.bytes -= _entry_bytes(old, old_ids)
