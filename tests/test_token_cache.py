"""Incremental tokenization (router/token_cache.py) equals whole-text encoding, for the cuts it
takes and the tokenizers it must refuse, on random texts and on growing conversations."""

from __future__ import annotations

import random
import weakref

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers

from router.token_cache import ChunkCache

SPECIALS = ["<s>", "<|start|>", "<|end|>"]
# The Llama 3 pre-tokenizer regex (a tiktoken-style Split before a regex-free ByteLevel).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PIECES = ["the", "cache", " ", "  ", "\n", "\n\n", " \n", "\t", "12", "3456", ".", ",", "'s",
          "(x)", "naïve", "東京", "é", "\u0301", "-", "!!", "a", "Z", *SPECIALS]


def _train(pre: pre_tokenizers.PreTokenizer, decoder_alphabet: bool = True) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None if decoder_alphabet else "<unk>"))
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS if decoder_alphabet else [*SPECIALS, "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if decoder_alphabet else [],
        show_progress=False,
    )
    rng = random.Random(1)
    corpus = ["".join(rng.choice(PIECES[:-3]) for _ in range(60)) for _ in range(300)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _bytelevel() -> Tokenizer:
    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False))


def _split_bytelevel() -> Tokenizer:
    return _train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]))


def _metaspace() -> Tokenizer:
    return _train(pre_tokenizers.Metaspace(), decoder_alphabet=False)


def _prefix_space() -> Tokenizer:
    return _train(pre_tokenizers.ByteLevel(add_prefix_space=True))


def _lstrip_token() -> Tokenizer:
    tok = _bytelevel()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return tok


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


@pytest.mark.parametrize(
    ("build", "mode"),
    [
        (_bytelevel, "special+newline"),
        (_split_bytelevel, "special+newline"),
        (_metaspace, "special"),
        (_prefix_space, "special"),
        (_lstrip_token, "off"),
    ],
    ids=["bytelevel", "split+bytelevel", "metaspace", "prefix-space", "lstrip-token"],
)
def test_chunked_encode_equals_whole_encode(build: object, mode: str) -> None:
    tok: Tokenizer = build()  # type: ignore[operator]
    cache = ChunkCache(tok, min_chunk_chars=4)  # many cuts: every newline boundary is one
    assert cache.mode == mode
    rng = random.Random(7)
    for _ in range(150):
        text = _text(rng, rng.randrange(1, 120))
        assert cache.encode(text).tolist() == tok.encode(text, add_special_tokens=False).ids, text


def test_growing_conversation_reuses_chunks() -> None:
    tok = _bytelevel()
    cache = ChunkCache(tok, min_chunk_chars=64)
    rng = random.Random(3)
    text = ""
    for turn in range(12):
        text += "<|start|>user\n" + _text(rng, 200) + "\nend of turn.\n<|end|>"
        before = cache.stats.hits
        assert cache.encode(text).tolist() == tok.encode(text, add_special_tokens=False).ids
        if turn:
            assert cache.stats.hits > before, "earlier turns' chunks were encoded again"


def test_cache_stays_within_its_byte_budget() -> None:
    tok = _bytelevel()
    cache = ChunkCache(tok, max_bytes=4096, min_chunk_chars=16)
    rng = random.Random(5)
    for _ in range(100):
        text = "line one.\n" + _text(rng, 80)
        assert cache.encode(text).tolist() == tok.encode(text, add_special_tokens=False).ids
        assert cache.stats.bytes <= 4096


def test_begin_then_rest_equals_whole_encode() -> None:
    tok = _bytelevel()
    cache = ChunkCache(tok, min_chunk_chars=16)
    rng = random.Random(9)
    left = 0
    for _ in range(100):
        text = "line one.\n" + _text(rng, rng.randrange(1, 200))
        want = tok.encode(text, add_special_tokens=False).ids
        part = cache.begin(text)
        head, had_rest = len(part.ids), bool(part.rest)
        whole = cache.finish(part).tolist()
        rest = whole[head:]
        assert whole == want, text
        assert len(rest) <= part.bound and (part.estimate > 0) == had_rest
        assert cache.finish(part).tolist() == whole and part.pending == 0  # finished in place
        left += had_rest
        assert not cache.begin(text).rest, "every chunk of a text seen before is cached"
    assert left > 20, "long texts leave a rest"


@pytest.mark.parametrize("build", [_bytelevel, _split_bytelevel, _metaspace])
def test_next_turns_reuse_remembered_texts_and_equal_whole_encodes(build: object) -> None:
    """Interleaved conversations sharing a system text, each turn starting like the last one
    (sometimes with an earlier message edited): ids equal whole encodes, and a next turn
    shares the previous turn's ids."""
    tok: Tokenizer = build()  # type: ignore[operator]
    cache = ChunkCache(tok, min_chunk_chars=16, min_level_chars=32)
    rng = random.Random(11)
    system = "<|start|>system\n" + _text(rng, 60) + "<|end|>"
    convs = [system] * 4
    reused = 0
    for step in range(80):
        c = step % 4
        if rng.random() < 0.1 and len(convs[c]) > 80:  # an edit inside the history
            at = rng.randrange(len(system), len(convs[c]))
            convs[c] = convs[c][:at] + rng.choice(PIECES) + convs[c][at:]
        convs[c] += "<|start|>user\n" + _text(rng, rng.randrange(5, 60)) + "<|end|>"
        text = convs[c] + "<|start|>assistant\n"
        want = tok.encode(text, add_special_tokens=False).ids
        part = cache.begin(text)
        assert cache.finish(part).tolist() == want, text
        assert part.lineage is not None and part.lineage.shared <= len(want)
        reused += part.lineage.shared > len(system) // 4
    assert reused > 40, "next turns reuse their history"
    assert cache.seen_bytes <= cache.max_seen_bytes


def test_remembered_texts_stay_within_their_budget() -> None:
    tok = _bytelevel()
    cache = ChunkCache(tok, max_bytes=1 << 16, min_chunk_chars=16, min_level_chars=32)
    rng = random.Random(13)
    for n in range(200):
        text = _text(rng, 20 * (n % 40) + 10)
        part = cache.begin(text)
        assert cache.finish(part).tolist() == tok.encode(text, add_special_tokens=False).ids
        assert cache.seen_bytes <= cache.max_seen_bytes
    assert cache.seen_bytes > cache.max_seen_bytes // 2, "texts are remembered up to the budget"


@pytest.mark.parametrize("build", [_bytelevel, _metaspace])
def test_a_budget_leaves_long_new_text_untouched(build: object) -> None:
    """`begin` with a budget: None, with nothing encoded or remembered, when more new text than
    that would be encoded (the router then tokenizes off its event loop); otherwise the same
    ids as without one."""
    tok: Tokenizer = build()  # type: ignore[operator]
    cache = ChunkCache(tok, min_chunk_chars=16, min_level_chars=32)
    rng = random.Random(17)
    history = "<|start|>system\n" + _text(rng, 200) + "<|end|>"
    assert cache.begin(history, budget=16) is None
    assert (cache.stats.misses, cache.stats.bytes, cache.seen_bytes) == (0, 0, 0)
    cache.finish(cache.begin(history))
    turn = history + "<|start|>user\n" + _text(rng, 3) + "<|end|>"
    part = cache.begin(turn, budget=len(turn) - len(history) + 16)
    assert part is not None and part.lineage is not None and part.lineage.shared > 0
    assert cache.finish(part).tolist() == tok.encode(turn, add_special_tokens=False).ids


def test_finished_ids_stay_as_they_were_after_later_turns() -> None:
    """A finished text's ids are the remembered text's own array (not copied): later turns
    that start from it must not change them."""
    tok = _bytelevel()
    cache = ChunkCache(tok, min_chunk_chars=16, min_level_chars=32)
    rng = random.Random(19)
    text = _text(rng, 150)
    earlier = cache.finish(cache.begin(text))
    kept = earlier.tolist()
    for _ in range(5):
        text += "\nuser: " + _text(rng, rng.randrange(5, 40))
        part = cache.begin(text)
        assert cache.finish(part).tolist() == tok.encode(text, add_special_tokens=False).ids
    assert earlier.tolist() == kept


def test_a_next_turn_takes_over_ids_nothing_else_holds() -> None:
    """Once nothing outside the cache holds a turn's ids, the next turn extends that array
    instead of copying the history (held ids are copied: the test above), and stays exact."""
    tok = _bytelevel()
    cache = ChunkCache(tok, min_chunk_chars=16, min_level_chars=32)
    rng = random.Random(23)
    text = _text(rng, 150)
    earlier = weakref.ref(cache.finish(cache.begin(text)))
    for _ in range(5):
        text += "\nuser: " + _text(rng, rng.randrange(5, 40))
        ids = cache.finish(cache.begin(text))
        assert ids is earlier()
        assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids
        earlier = weakref.ref(ids)
        del ids
