"""Structured output in ``treeserve.sampling``: specs, token bitmasks, the xgrammar compiler and
matchers, and ``sample`` under the mask.

The grammar tests use a small synthetic vocabulary (printable ASCII plus a few multi-character
tokens, an EOS and padding ids past the tokenizer) and random logits, so every output is drawn
by ``sample`` from the masked distribution, fast, without a model.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.sampling import (
    GrammarCompiler,
    SamplingBatch,
    SamplingParams,
    StructuredOutput,
    apply_token_bitmask,
    apply_token_bitmask_,
    bitmask_words,
    sample,
    stack_bitmasks,
    unpack_bitmask,
    verify,
)
from treeserve.sampling.bitmask import apply_token_bitmask_numpy_, load_bitmask_op, unpack_bitmask_torch

VOCAB = ["<eos>"] + [chr(c) for c in range(32, 127)] + ['{"', '":', '",', '": "', "true", "false", "null", "ab", "yes"]
V = len(VOCAB) + 7  # logits wider than the tokenizer: the padding ids must never be drawn
EOS = 0
MAX_STEPS = 400


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(VOCAB, V, [EOS], vocab_type="raw")


def generate(
    compiler: GrammarCompiler, spec: StructuredOutput, seed: int, temperature: float = 1.0, closing: float = 0.0
) -> str:
    """Draw tokens with ``sample`` from random logits under the grammar's mask until it ends;
    ``closing``: a logit bias on ``"``, ``}`` and ``]`` (unbounded grammars end sooner)."""
    state = compiler.new_state(spec)
    gen = torch.Generator().manual_seed(seed)
    bias = {VOCAB.index(c): closing for c in '"}]'} if closing else {}
    params = SamplingParams(temperature=temperature, seed=seed, logit_bias=bias)
    base = SamplingBatch.build([params], [seed], [[]], V)
    out: list[int] = []
    for pos in range(MAX_STEPS):
        batch = replace(base, token_bitmask=stack_bitmasks([state.bitmask], V, "cpu"))
        logits = torch.randn(1, V, generator=gen) * 3
        token = int(sample(logits, batch, torch.tensor([pos])).tokens[0])
        assert 0 <= token < len(VOCAB), f"drew padding / invalid id {token}"
        assert state.accept(token), f"sample drew {VOCAB[token]!r}, which the grammar refuses"
        out.append(token)
        if state.ended:
            return "".join(VOCAB[t] for t in out if t != EOS)
    raise AssertionError(f"grammar did not end within {MAX_STEPS} tokens: {''.join(VOCAB[t] for t in out)!r}")


# ---------------------------------------------------------------- specs
def test_spec_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of json_schema, json_object, regex, grammar, choice"):
        StructuredOutput()
    with pytest.raises(ValueError, match=r"got \['regex', 'choice'\]"):
        StructuredOutput(regex="a", choice=("a",))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ({"json_schema": "{not json"}, ValueError, "json_schema is not valid JSON"),
        ({"json_schema": [1]}, TypeError, "json_schema must be a JSON object"),
        ({"regex": 3}, TypeError, "regex must be a str, got int"),
        ({"grammar": ""}, ValueError, "grammar must be a non-empty str"),
        ({"choice": "yes"}, TypeError, "choice must be a sequence of strings"),
        ({"choice": []}, ValueError, "choice must list at least one string"),
        ({"choice": ["a", ""]}, ValueError, "choice entries must be non-empty strings"),
        ({"json_object": 1}, TypeError, "json_object must be a bool"),
        ({"jsonschema": {}}, ValueError, r"unknown keys \['jsonschema'\]"),
    ],
)
def test_spec_errors_name_the_field(value: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(structured=value)


def test_spec_key_is_canonical() -> None:
    a = StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput(json_schema='{"type":  "object", "properties": {"x": {"type": "integer"}}}')
    assert a.key == b.key and a.kind == "json_schema"
    c = StructuredOutput(json_schema={"type": "object", "properties": {"y": {"type": "null"}, "x": {"type": "null"}}})
    assert c.json_schema.index('"y"') < c.json_schema.index('"x"')  # property order is the output's order
    p = SamplingParams(structured={"choice": ["x", "y"]})
    assert isinstance(p.structured, StructuredOutput) and p.structured.choice == ("x", "y")
    assert p.structured.key != StructuredOutput(choice=("y", "x")).key


# ---------------------------------------------------------------- bitmasks
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 100), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_unpack_bitmask_matches_bits(vocab: int, rows: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # words of every kind: all allowed (-1), none (0), mixed
    density = torch.tensor([0.0, 0.5, 1.0])[torch.randint(0, 3, (rows, bitmask_words(vocab)), generator=gen)]
    allowed = torch.rand(rows, vocab, generator=gen) < density.repeat_interleave(32, 1)[:, :vocab]
    words = torch.zeros(rows, bitmask_words(vocab), dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)
    assert torch.equal(unpack_bitmask_torch(packed, vocab), allowed)  # the path of device masks
    x = torch.randn(rows, vocab, generator=gen)
    masked = apply_token_bitmask(x, packed)
    assert torch.equal(masked[allowed], x[allowed]) and bool(torch.isneginf(masked[~allowed]).all())
    for dtype in (torch.float32, torch.bfloat16):  # the in-place kernel of the sampling path
        y = x.to(dtype)
        assert apply_token_bitmask_(y, packed) is y and torch.equal(y, apply_token_bitmask(x.to(dtype), packed))
        z = x.to(dtype)  # the path of a CPU without the C++ operator
        assert apply_token_bitmask_numpy_(z, packed) is z and torch.equal(z, y)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask_(x.clone(), packed[:, :0])


def test_bitmask_operator_serves_the_cpu_path() -> None:
    """With a compiler (every CI host) the CPU path is the C++ operator (its bad input:
    tests/_cpp_bad_input.py); at the engine's size (rows in parallel) it writes what numpy does."""
    assert load_bitmask_op() is None, load_bitmask_op()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 49152, generator=gen)
    packed = torch.randint(-(2**31), 2**31, (64, bitmask_words(49152)), generator=gen, dtype=torch.int64)
    packed = packed.to(torch.int32)
    packed[::3] = -1  # whole rows allowed, and rows of structural masks (few tokens allowed)
    packed[1::3] &= torch.tensor(0x10001, dtype=torch.int32)
    y = torch.ops.treeserve.apply_token_bitmask_(x.clone(), packed)
    assert torch.equal(y, apply_token_bitmask_numpy_(x.clone(), packed))
    assert torch.equal(y, apply_token_bitmask(x, packed))


def test_stack_bitmasks() -> None:
    assert stack_bitmasks([None, None], 40, "cpu") is None
    row = torch.tensor([5, 0], dtype=torch.int32)
    out = stack_bitmasks([None, row], 40, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [[-1, -1], [5, 0]]
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[rows, 2\]"):
        unpack_bitmask(torch.zeros(1, 3, dtype=torch.int32), 40)


def test_verify_refuses_a_token_bitmask() -> None:
    batch = SamplingBatch.build([SamplingParams(temperature=0)], [0], [[]], 8)
    batch = replace(batch, token_bitmask=torch.full((1, 1), -1, dtype=torch.int32))
    z = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="give grammar masks per tree position as draft_bitmask"):
        verify(torch.zeros(2, 8), batch, z, z - 1, torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def test_verify_applies_a_mask_per_tree_position() -> None:
    """float32 logits (the engine's path): node 0's token is the root's masked argmax, and the
    bonus token after it is the argmax under node 0's own mask, not the raw one."""
    batch = SamplingBatch.build([SamplingParams(temperature=0)], [0], [[]], 8)
    logits = torch.tensor([[0.0, 1, 2, 3, 4, 5, 6, 9], [9.0, 1, 2, 3, 4, 5, 6, 7]])
    masks = torch.tensor([[[0b0100_0000]], [[0b0000_0110]]], dtype=torch.int32).reshape(1, 2, 1)
    tokens, parents = torch.tensor([[6]]), torch.tensor([[-1]])
    one, zero = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    out = verify(logits, batch, tokens, parents, one, zero, draft_bitmask=masks)
    assert out.tokens[0].tolist() == [6, 2]
    assert verify(logits, batch, tokens, parents, one, zero).tokens[0].tolist() == [7, -1]  # unmasked: 6 rejected
    for bad in (masks[:, :1], masks.to(torch.int64)):
        with pytest.raises(ValueError, match=r"draft_bitmask must be int32 \[1, 2, W\]"):
            verify(logits, batch, tokens, parents, one, zero, draft_bitmask=bad)


def test_mask_applies_before_temperature_and_logprobs_are_masked() -> None:
    mask = stack_bitmasks([torch.tensor([0b1010], dtype=torch.int32)], 4, "cpu")
    batch = replace(SamplingBatch.build([SamplingParams(temperature=0.5, logprobs=2)], [1], [[]], 4), token_bitmask=mask)
    logits = torch.tensor([[5.0, 1.0, 9.0, 2.0]])
    out = sample(logits, batch, torch.tensor([0]))
    assert int(out.tokens[0]) in (1, 3)
    expected = torch.log_softmax(torch.tensor([1.0, 2.0]) / 0.5, 0)  # only tokens 1 and 3 carry mass
    assert out.top_ids[0].tolist() == [3, 1]
    assert torch.allclose(out.top_logprobs[0].double(), expected.flip(0).double(), atol=1e-6)
    # the mask goes in place on the quotient, or on a copy at temperature 1 (greedy): never on the logits
    greedy = replace(SamplingBatch.build([SamplingParams(temperature=0)], [1], [[]], 4), token_bitmask=mask)
    assert int(sample(logits, greedy, torch.tensor([0])).tokens[0]) == 3
    assert logits.tolist() == [[5.0, 1.0, 9.0, 2.0]]


# ---------------------------------------------------------------- compiler and matchers
@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"json_schema": {"type": "objekt"}}, r"structured\.json_schema is invalid: .*objekt"),
        ({"regex": "a(b"}, r"structured\.regex is invalid: .*parenthesis"),
        ({"grammar": "root ::= foo"}, r"structured\.grammar is invalid: .*foo"),
        ({"grammar": 'root ::= ""'}, r"structured\.grammar admits no output token"),
        ({"regex": "é+"}, r"structured\.regex admits no output token"),  # no token spells it
    ],
)
def test_bad_specs_are_value_errors(compiler: GrammarCompiler, spec: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compiler.new_state(StructuredOutput.of(spec))


def test_compiled_grammars_are_cached_lru() -> None:
    c = GrammarCompiler(VOCAB, V, [EOS], vocab_type="raw", max_cached=2)
    a, b, d = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    first = c.compile(a)
    assert c.compile(StructuredOutput(regex="a+")) is first
    c.compile(b)
    c.compile(a)  # a is now the most recent
    c.compile(d)  # evicts b
    assert c.num_cached == 2 and c.compile(a) is first


def test_compiler_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_type must be one of byte_level, byte_fallback, raw"):
        GrammarCompiler(VOCAB, V, [EOS], vocab_type="bpe")
    with pytest.raises(ValueError, match="stop_token_ids must list at least one id"):
        GrammarCompiler(VOCAB, V, [])
    with pytest.raises(ValueError, match=rf"stop_token_ids outside \[0, {V}\)"):
        GrammarCompiler(VOCAB, V, [V])


def test_matcher_refuses_and_ends(compiler: GrammarCompiler) -> None:
    state = compiler.new_state(StructuredOutput(choice=("yes", "no")))
    assert not state.accept(VOCAB.index("x")) and not state.ended
    assert state.accept(VOCAB.index("yes")) and state.ended  # only EOS could follow


_NAMES = st.sampled_from(["a", "id", "name", "k2", "x_y"])


def _leaf() -> st.SearchStrategy[dict]:
    bounds = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1]))
    return st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        bounds.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        bounds.map(lambda b: {"type": "number", "minimum": b[0], "maximum": b[1]}),
        st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.sampled_from(["red", "green", "a b", 'q"t']), min_size=1, max_size=3, unique=True).map(
            lambda e: {"type": "string", "enum": e}
        ),
    )


def _objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    props = st.dictionaries(_NAMES, children, min_size=1, max_size=3)
    return props.flatmap(
        lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
            lambda req: {"type": "object", "properties": p, "required": req, "additionalProperties": False}
        )
    )


def _arrays(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    sizes = st.tuples(st.integers(0, 2), st.integers(0, 2)).map(lambda t: (t[0], t[0] + t[1] + 1))
    return st.tuples(children, sizes).map(lambda t: {"type": "array", "items": t[0], "minItems": t[1][0], "maxItems": t[1][1]})


SCHEMAS = st.recursive(_leaf(), lambda c: st.one_of(_objects(c), _arrays(c)), max_leaves=6).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]}
)


@settings(max_examples=40, deadline=None)
@given(SCHEMAS, st.integers(0, 2**31))
def test_random_schemas_give_valid_json(compiler: GrammarCompiler, schema: dict, seed: int) -> None:
    text = generate(compiler, StructuredOutput(json_schema=schema), seed)
    jsonschema.validate(json.loads(text), schema)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31))
def test_json_object_gives_an_object(compiler: GrammarCompiler, seed: int) -> None:
    # any object: keys and strings are unbounded, so a random walk is pushed to close them
    assert isinstance(json.loads(generate(compiler, StructuredOutput(json_object=True), seed, closing=5.0)), dict)


REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(ab|cd)+x?", r"-?[1-9][0-9]{0,3}", r"[A-Z][a-z]*( [A-Z][a-z]*){0,2}", r"\(\d\)"]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(REGEXES), st.integers(0, 2**31), st.sampled_from([0.0, 1.0]))
def test_regex_outputs_fullmatch(compiler: GrammarCompiler, regex: str, seed: int, temperature: float) -> None:
    assert re.fullmatch(regex, generate(compiler, StructuredOutput(regex=regex), seed, temperature))


GRAMMAR = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= [0-9]+ | "(" expr ")"
"""


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31))
def test_ebnf_grammar_outputs_parse(compiler: GrammarCompiler, seed: int) -> None:
    text = generate(compiler, StructuredOutput(grammar=GRAMMAR), seed)
    reduced = re.sub(r"[0-9]+", "n", text)
    while True:  # reduce (n) and n+n / n-n to n: a well-formed expression reduces to one n
        shorter = re.sub(r"\(n\)|n[+-]n", "n", reduced)
        if shorter == reduced:
            break
        reduced = shorter
    assert reduced == "n", text


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(["yes", "no", "maybe", 'a "q"', "ab"]), min_size=1, max_size=4, unique=True), st.integers(0, 2**31))
def test_choice_outputs_one_choice(compiler: GrammarCompiler, choices: list[str], seed: int) -> None:
    assert generate(compiler, StructuredOutput(choice=tuple(choices)), seed) in choices
