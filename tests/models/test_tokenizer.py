"""Tokenizer built from GGUF metadata vs transformers' tokenizer from the same file; streaming decode."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.models import ChatTemplateError, StreamDecoder, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어",
    "emoji 🚀🔥👍🏽 and ZWJ 👨‍👩‍👧 sequences",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "code: def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inline <|endoftext|>text<repo_name>x<file_sep>",
    "whitespace runs:          end",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u3000ideographic space",
]


@pytest.fixture(scope="module")
def tok(smol) -> Tokenizer:
    return smol.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_smol_tokenizer, text):
    ours = tok.encode(text)
    assert ours == hf_smol_tokenizer.encode(text)
    for skip in (False, True):
        assert tok.decode(ours, skip_special_tokens=skip) == hf_smol_tokenizer.decode(
            ours, skip_special_tokens=skip
        )


@settings(max_examples=30)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_encode_matches_transformers_on_random_text(tok, hf_smol_tokenizer, text):
    ours = tok.encode(text)
    assert ours == hf_smol_tokenizer.encode(text)
    assert tok.decode(ours) == hf_smol_tokenizer.decode(ours)


def test_special_tokens_and_sizes(tok, hf_smol_tokenizer):
    assert tok.vocab_size == len(hf_smol_tokenizer) == 49152
    assert tok.eos_token_ids == (hf_smol_tokenizer.eos_token_id,)
    assert tok.bos_token_id == hf_smol_tokenizer.bos_token_id
    assert tok.encode("<|im_end|>") == [tok.eos_token_ids[0]]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is paged attention?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcode 🚀"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_smol_tokenizer, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    assert tok.encode(ours) == hf_smol_tokenizer.encode(theirs)


def test_chat_template_errors(tok):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    raising = Tokenizer(tok.backend, "{{ raise_exception('bad role') }}", None, None)
    with pytest.raises(ChatTemplateError, match="bad role"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(tok.backend, None, None, None).apply_chat_template([{"role": "user", "content": "x"}])


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(ValueError, match=r"token id must lie in \[0, 49152\)"):
        tok.decode([1, 49152])
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


@settings(max_examples=40)
@given(
    text=st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=30),
    cut=st.lists(st.integers(1, 4), min_size=1, max_size=30),
)
def test_stream_decoder_emits_complete_text(tok, text, cut):
    """Chunks never end inside a UTF-8 character and concatenate to the full decode."""
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces, start, i = [], 0, 0
    while start < len(ids):
        n = cut[i % len(cut)]
        pieces.append(dec.push(ids[start : start + n]))
        start, i = start + n, i + 1
    pieces.append(dec.finish())
    full = tok.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=40)
@given(ids=st.lists(st.integers(0, 49151), max_size=20))
def test_stream_decoder_on_arbitrary_ids(tok, ids):
    dec = StreamDecoder(tok, skip_special_tokens=True)
    out = "".join(dec.push([i]) for i in ids) + dec.finish()
    assert out == tok.decode(ids, skip_special_tokens=True)


def test_from_hf_dir(tok, hf_smol_tokenizer, tmp_path):
    """A HF tokenizer directory (tokenizer.json + tokenizer_config.json) gives the same tokenizer."""
    hf_smol_tokenizer.save_pretrained(str(tmp_path))
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if "chat_template" not in cfg and not (tmp_path / "chat_template.jinja").is_file():
        cfg["chat_template"] = tok.chat_template
        cfg_file.write_text(json.dumps(cfg))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    assert loaded.eos_token_ids == tok.eos_token_ids and loaded.bos_token_id == tok.bos_token_id


def test_stream_decoder_holds_partial_characters(tok):
    ids = tok.encode("a🚀")
    dec = StreamDecoder(tok)
    pieces = [dec.push([i]) for i in ids]
    assert len(ids) > 2 and pieces[0] == "a" and pieces[-1].endswith("🚀")
    assert all(p == "" for p in pieces[1:-1]) and dec.finish() == ""


def test_load_hf_dir_with_tokenizer(hf_smol_tokenizer, tmp_path):
    """``load`` on a HF dir pairs model and tokenizer and checks their vocabularies agree."""
    from treeserve.models import load, random_model, save_hf_dir, tiny_config

    hf_smol_tokenizer.save_pretrained(str(tmp_path))
    save_hf_dir(random_model(tiny_config("llama", vocab_size=256)), tmp_path)
    with pytest.raises(ValueError, match="tokenizer has 49152 tokens but the model's vocab_size is 256"):
        load(tmp_path)
    config = tiny_config("llama", vocab_size=49152, eos_token_ids=(0, 2))
    save_hf_dir(random_model(config), tmp_path)
    model, tokenizer = load(tmp_path)
    assert model.config == config
    assert tokenizer.eos_token_ids == (2, 0)  # the tokenizer's EOS first, then the config's others


def test_llama_cpp_names_of_a_split_load_an_unknown_one_is_refused_a_missing_one_falls_back(caplog):
    """``tokenizer.ggml.pre`` under any name llama.cpp gives a split (e.g. DeepSeek-R1's Qwen distills'
    ``deepseek-r1-qwen``) splits as that one; an unknown name is a ``ValueError`` naming the field (a
    wrong split would tokenize silently wrong); a file without the key splits as GPT-2 does, warned."""
    import logging

    from treeserve.models import open_gguf, resolve_model_path

    md = open_gguf(resolve_model_path("smollm2-135m-instruct")).metadata
    text = "numbers 1234567890, words\n\n  and spaces   "

    def ids(pre: str) -> list[int]:
        return Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": pre}).encode(text)

    from treeserve.models.tokenizer import _GGUF_SPLITS, _LLAMA3_SPLIT, _QWEN2_SPLIT

    assert all(_GGUF_SPLITS[n] is _QWEN2_SPLIT for n in ("qwen2", "deepseek-r1-qwen", "megrez"))
    assert all(_GGUF_SPLITS[n] is _LLAMA3_SPLIT for n in ("llama-bpe", "llama3", "falcon3", "pixtral"))
    assert _GGUF_SPLITS["gpt-2"] is _GGUF_SPLITS["default"] is None
    assert ids("deepseek-r1-qwen") == ids("qwen2") and ids("falcon3") == ids("llama-bpe")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre must be one of .* got 'viking'"):
        ids("viking")
    with caplog.at_level(logging.WARNING, logger="treeserve.models"):
        missing = Tokenizer.from_gguf_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.pre"})
    assert missing.encode(text) == ids("default") and "tokenizer.ggml.pre is missing" in caplog.text


def test_whole_word_vocabularies_and_the_tekken_split():
    """Under llama.cpp's llama3 and tekken splits a piece that is a whole token is that token, whatever
    the merges say (transformers' ``ignore_merges``); tekken splits words at case changes."""
    from treeserve.models.tokenizer import _byte_alphabet

    letters = list(_byte_alphabet().values())
    tokens = [*letters, "ab", "abc", "Hello", "World"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}

    def ids(pre: str, text: str) -> list[int]:
        return Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": pre}).encode(text)

    ab, abc, hello, world = (tokens.index(t) for t in ("ab", "abc", "Hello", "World"))
    assert ids("default", "abc") == [ab, letters.index("c")]  # merges only
    assert ids("llama-bpe", "abc") == ids("tekken", "abc") == [abc]  # the whole word
    assert ids("tekken", "HelloWorld") == [hello, world]
    assert ids("llama-bpe", "HelloWorld") == [letters.index(c) for c in "HelloWorld"]  # one piece, no merges
