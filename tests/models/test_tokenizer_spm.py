"""The SentencePiece (``tokenizer.ggml.model == "llama"``) tokenizer from GGUF metadata against
SentencePiece itself: a BPE model trained in the test, its pieces, scores and types as llama.cpp's
converter writes them."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.models import StreamDecoder, Tokenizer

spm = pytest.importorskip("sentencepiece")  # in the dev extra: CI has it

_UNKNOWN, _CONTROL, _UNUSED, _BYTE = 2, 3, 5, 6
WORDS = ("the a an of to in is it that for on with as was by be this are from at or have not "
         "model token cache page batch stream server request prompt decode prefill kernel memory time "
         "Llama Mistral GGUF KV CPU GPU tok/s x86-64 (2026) 8B 135M, llama.cpp's \"quoted\" end.").split()
CORPUS = [" ".join(random.Random(i).choices(WORDS, k=random.Random(-i).randint(3, 30))) for i in range(600)]
ALPHABET = [*"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()-_/\n\t",
            *"éßüñ中文😀\u2581", "  "]


def _model(vocab_size: int, add_dummy_prefix: bool = True):  # type: ignore[no-untyped-def]
    """A SentencePiece BPE model as Llama's are built (byte fallback, no normalization, digits split)."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        add_dummy_prefix=add_dummy_prefix, character_coverage=0.9995, minloglevel=2,
        user_defined_symbols=["<|user|>"])
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def _type(sp, i: int) -> int:  # type: ignore[no-untyped-def]
    if sp.is_unknown(i):
        return _UNKNOWN
    if sp.is_control(i):
        return _CONTROL
    if sp.is_byte(i):
        return _BYTE
    if sp.is_unused(i):
        return _UNUSED
    return 4 if sp.id_to_piece(i) == "<|user|>" else 1


def gguf_metadata(sp, add_space_prefix: bool = True) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The ``tokenizer.*`` keys llama.cpp's converter writes for a SentencePiece model."""
    n = sp.get_piece_size()
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [_type(sp, i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


@pytest.fixture(scope="module", params=[400, 560], ids=["vocab400", "vocab560"])
def pair(request):  # type: ignore[no-untyped-def]
    sp = _model(request.param)
    return sp, Tokenizer.from_gguf_metadata(gguf_metadata(sp))


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(st.lists(st.sampled_from(ALPHABET), max_size=60).map("".join),
                      st.sampled_from(CORPUS).map(lambda line: line[:200])))
def test_encode_and_decode_are_sentencepiece(pair, text: str) -> None:  # type: ignore[no-untyped-def]
    """Pieces, byte fallback (tabs, newlines, unseen characters), the space put first: SentencePiece's
    ids, BOS first by default; decoding SentencePiece's ids gives its text, streamed too."""
    sp, tok = pair
    ids = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.encode(text) == [sp.bos_id(), *ids]
    assert tok.decode(ids) == sp.decode(ids)
    stream = StreamDecoder(tok)
    assert "".join(stream.push([i]) for i in ids) + stream.finish() == sp.decode(ids)


@settings(max_examples=60, deadline=None)
@given(prompt=st.sampled_from(CORPUS), reply=st.sampled_from(CORPUS), cut=st.integers(1, 6))
def test_a_stream_after_a_context_adds_what_follows_it(pair, prompt, reply, cut):  # type: ignore[no-untyped-def]
    """Decoded after the prompt's last tokens, an output keeps the space its first piece starts with
    (SentencePiece's text of prompt + output, past the prompt's); alone, the space is dropped."""
    sp, tok = pair
    context, ids = sp.encode(prompt)[-cut:], sp.encode(reply)
    stream = StreamDecoder(tok, context=context)
    text = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert text == sp.decode(context + ids)[len(sp.decode(context)):] == " " + sp.decode(ids)
    alone = StreamDecoder(tok)
    assert "".join(alone.push([i]) for i in ids) + alone.finish() == sp.decode(ids)


def test_special_and_user_defined_tokens_split_out_with_a_space_after_them(pair):  # type: ignore[no-untyped-def]
    """Control and user-defined tokens written in the text are their ids; the text after one starts
    with a space, as llama.cpp tokenizes (a fragment after a special token gets the space prefix)."""
    sp, tok = pair
    user = sp.piece_to_id("<|user|>")
    got = tok.encode("<s>hello<|user|>world</s>", add_special_tokens=False)
    assert got == [sp.bos_id(), *sp.encode("hello"), user, *sp.encode("world"), sp.eos_id()]
    assert tok.decode(got, skip_special_tokens=True).replace(" ", "") == "hello<|user|>world"
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_ids == (sp.eos_id(),)
    # a text that starts with BOS (a rendered chat template) gets no second one
    with_bos = [sp.bos_id(), *sp.encode("hello")]
    assert tok.encode("<s>hello") == tok.encode("<s>hello", add_special_tokens=False) == with_bos
    assert tok.encode("hello<s>") == [sp.bos_id(), *sp.encode("hello"), sp.bos_id()]


def test_without_the_space_prefix() -> None:
    sp = _model(400, add_dummy_prefix=False)
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(sp, add_space_prefix=False))
    for text in ("hello world", " two  spaces", "tab\there"):
        ids = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids and tok.decode(ids) == sp.decode(ids)


def test_bad_metadata_is_a_clear_error() -> None:
    sp = _model(400)
    md = gguf_metadata(sp)
    with pytest.raises(ValueError, match="tokenizer.ggml.scores must hold one score per token"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.scores": [0.0]})
    with pytest.raises(ValueError, match="tokenizer.ggml.scores must hold one score per token"):
        Tokenizer.from_gguf_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.scores"})
    with pytest.raises(ValueError, match="tokenizer.ggml.token_type has 1 entries"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.token_type": [1]})
    with pytest.raises(ValueError, match=r"tokenizer.ggml.eos_token_id must lie in \[0, 400\)"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.eos_token_id": 400})
    with pytest.raises(ValueError, match="must be 'gpt2' .* or 'llama'"):
        Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="missing 'tokenizer.ggml.tokens'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})


LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_a_gguf_model_with_a_sentencepiece_vocabulary_generates_and_chats(tmp_path: Path) -> None:
    """End to end through ``LLM``: a (random-weight) Llama GGUF whose vocabulary is SentencePiece's
    loads, its prompts are SentencePiece's ids after BOS, its output text is the decoded ids, and its
    chat template renders with the file's BOS / EOS."""
    from treeserve import LLM, SamplingParams
    from treeserve.models.synthetic_gguf import SyntheticSpec, write_synthetic_gguf

    sp = _model(400)
    md = {**gguf_metadata(sp), "tokenizer.chat_template": LLAMA2_TEMPLATE}
    spec = SyntheticSpec("llama", 2, 128, 4, 2, 256, sp.get_piece_size(), False, False, 10000.0, 512)
    path = write_synthetic_gguf(tmp_path / "spm.gguf", spec, "Q8_0", seed=1, tokenizer=md)
    llm = LLM(str(path), speculative=None, num_threads=1)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    (out,) = llm.generate(["hello world"], params, use_tqdm=False)
    assert out.prompt_token_ids == [sp.bos_id(), *sp.encode("hello world")]
    context, got = out.prompt_token_ids[-4:], out.outputs[0].token_ids
    tok = llm.tokenizer
    assert len(got) == 6 and out.outputs[0].text == tok.decode(context + got, True)[len(tok.decode(context, True)):]
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    assert chat.prompt_token_ids == [sp.bos_id(), *sp.encode("[INST] hi [/INST]")]  # one BOS: the template's
    # structured output over this vocabulary (xgrammar reads it as byte fallback with the space prefix)
    regex = SamplingParams(structured={"regex": "[a-z]{3,6} [0-9]{2}"}, temperature=0.9, seed=2, max_new_tokens=24)
    (code,) = llm.generate(["code:"], regex, use_tqdm=False)
    assert code.outputs[0].finish_reason == "stop" and re.fullmatch("[a-z]{3,6} [0-9]{2}", code.outputs[0].text)
    with pytest.raises(ValueError, match="tokenizer must give tokenizer.ggml.model and 400"):
        write_synthetic_gguf(tmp_path / "bad.gguf", spec, "Q8_0", tokenizer={**md, "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="tokenizer keys must be among"):
        write_synthetic_gguf(tmp_path / "bad.gguf", spec, "Q8_0", tokenizer={**md, "tokenizer.ggml.other": 1})
    assert not (tmp_path / "bad.gguf").exists()
