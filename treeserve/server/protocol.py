"""OpenAI request/response models and the error shape.

Requests are validated by pydantic with unknown fields forbidden, so an unsupported OpenAI field
(``tools``, ...) is refused naming it rather than silently ignored. Value ranges the engine checks
(``SamplingParams``) are reported with the API's field names.

Structured output: OpenAI's ``response_format`` (``{"type": "text" | "json_object"}`` or
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``) and, as
an extension (vLLM's name and keys), ``structured_outputs`` with exactly one of ``json`` (a
schema), ``json_object``, ``regex``, ``grammar`` (EBNF / GBNF) or ``choice``; both map to
``SamplingParams.structured``. Giving both is a 400, as is an invalid schema / regex / grammar
(naming whichever field carried it).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from treeserve.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ErrorResponse",
    "Usage",
    "api_field_of",
    "sampling_params",
]


class APIError(Exception):
    """An error returned to the client in OpenAI's shape with HTTP ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers or {}


def _utf8(text: str) -> str:
    """``text`` if it is encodable as UTF-8 (JSON can carry lone surrogates, e.g. ``"\\udcff"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid UTF-8 text; lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody

    @classmethod
    def of(cls, err: APIError) -> ErrorResponse:
        return cls(error=ErrorBody(message=err.message, type=err.type, param=err.param, code=err.code))


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """The ``structured_outputs`` extension: exactly one of its fields (checked by the engine)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[Text] | None = None


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI's plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def structured_field(self) -> str:
        """The API field that carries this request's structured-output constraint."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured(self) -> StructuredOutput | dict[str, Any] | None:
        """``SamplingParams.structured`` for this request (None: free text); ``APIError`` naming
        the field when both fields are given or ``json_schema`` lacks its schema."""
        fmt, ext = self.response_format, self.structured_outputs
        if fmt is not None and ext is not None and fmt.type != "text":
            raise APIError("response_format and structured_outputs are exclusive: give one", param="structured_outputs")
        if ext is not None:
            spec = {"json_schema": ext.json_, "json_object": ext.json_object or False, "regex": ext.regex,
                    "grammar": ext.grammar, "choice": ext.choice}  # fmt: skip
            return {k: v for k, v in spec.items() if v not in (None, False)}
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutput(json_object=True)
        if fmt.json_schema is None:
            raise APIError("response_format of type json_schema needs a json_schema object", param="response_format")
        return {"json_schema": fmt.json_schema.json_schema}

    def api_field_of(self, message: str) -> str | None:
        """``api_field_of(message)``, with the structured-output field named as this request gave it."""
        param = api_field_of(message)
        return self.structured_field if param == "structured" else param

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk; ``APIError`` for ``stream_options``
        on a request that does not stream (as OpenAI and vLLM answer)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of several is refused, naming ``prompt``)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise APIError(f"prompt must be one prompt; got a batch of {len(p)} (send one request each)",
                           param="prompt")  # fmt: skip
        return p[0]  # type: ignore[return-value]

    def num_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            raise APIError("echo with logprobs needs prompt logprobs, which this server does not compute",
                           param="echo")  # fmt: skip
        return self.logprobs


_API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def api_field_of(message: str) -> str | None:
    """The API field an engine validation message is about (``SamplingParams.<x>``, the prompt
    or ``n``), or ``None``."""
    m = re.search(r"SamplingParams\.(\w+)", message)
    if m:
        return _API_NAMES.get(m.group(1), m.group(1))
    if re.search(r"\bn=\d+", message):
        return "n"
    if "prompt" in message:
        return "prompt"
    return None


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for ``req``; ``APIError`` (400, naming the field) when invalid."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    kwargs: dict[str, Any] = dict(
        n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=bias, seed=req.seed,
        stop=req.stop or (), stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        min_new_tokens=req.min_tokens, max_new_tokens=max_tokens, logprobs=logprobs,
        structured=req.structured(),
    )  # fmt: skip
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=req.api_field_of(str(exc))) from None
