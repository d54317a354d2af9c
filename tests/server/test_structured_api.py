"""Structured output over HTTP (in process): ``response_format`` and the ``structured_outputs``
extension on both endpoints, streamed or not, equal to the engine's own ``generate`` with
``SamplingParams.structured`` (the engines are ``test_api``'s fixtures)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from treeserve import SamplingParams
from treeserve.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_params
from treeserve.sampling import StructuredOutput

from ._helpers import assert_engine_drained, sse_events
from .test_api import MSGS, chat_ids, engine, post, ref, run  # noqa: F401 (engine, ref: the fixtures)

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "ok": {"type": "boolean"},
                   "tag": {"type": "string", "enum": ["x", "y z"]}},
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}  # fmt: skip
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


def test_fields_map_onto_structured() -> None:
    chat = ChatCompletionRequest(messages=MSGS, response_format=JSON_SCHEMA_FORMAT)
    assert sampling_params(chat, 8, None).structured == StructuredOutput(json_schema=SCHEMA)
    chat = ChatCompletionRequest(messages=MSGS, response_format={"type": "json_object"})
    assert sampling_params(chat, 8, None).structured == StructuredOutput(json_object=True)
    assert sampling_params(ChatCompletionRequest(messages=MSGS, response_format={"type": "text"}), 8, None).structured is None
    for ext, expected in [({"json": SCHEMA}, StructuredOutput(json_schema=SCHEMA)),
                          ({"json_object": True}, StructuredOutput(json_object=True)),
                          ({"regex": "a+"}, StructuredOutput(regex="a+")),
                          ({"grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"')),
                          ({"choice": ["a", "b"]}, StructuredOutput(choice=("a", "b")))]:  # fmt: skip
        comp = CompletionRequest(prompt="hi", structured_outputs=ext)
        assert sampling_params(comp, 8, None).structured == expected


def test_chat_json_schema_matches_engine(engine, ref) -> None:
    body = dict(messages=MSGS, n=2, seed=4, temperature=1.0, max_tokens=60, response_format=JSON_SCHEMA_FORMAT)
    r = run(post(engine, "/v1/chat/completions", body))
    assert r.status_code == 200, r.text
    sp = SamplingParams(n=2, seed=4, temperature=1.0, max_new_tokens=60, structured={"json_schema": SCHEMA})
    (expect,) = ref.generate([chat_ids(ref)], sp, use_tqdm=False)
    for choice, exp in zip(r.json()["choices"], expect.outputs):
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] == exp.text
        jsonschema.validate(json.loads(exp.text), SCHEMA)
    assert_engine_drained(engine)


@pytest.mark.parametrize(
    ("ext", "ok"),
    [({"regex": r"[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t)),
     ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
     ({"grammar": 'root ::= "<" [xy]{1,4} ">"'}, lambda t: re.fullmatch(r"<[xy]{1,4}>", t))],
)  # fmt: skip
def test_completions_structured_outputs_streamed(engine, ext, ok) -> None:
    body = dict(prompt="Answer:", seed=2, temperature=1.0, max_tokens=40, structured_outputs=ext)
    full = run(post(engine, "/v1/completions", body)).json()["choices"][0]
    assert full["finish_reason"] == "stop" and ok(full["text"]), full
    events = sse_events(run(post(engine, "/v1/completions", {**body, "stream": True})).text)
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["text"]
    assert_engine_drained(engine)
