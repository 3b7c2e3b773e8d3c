"""OpenAI wire schemas for requests (pydantic) and small builders for responses.

Unknown request fields are accepted and ignored: agents send ``user``, ``store``,
``metadata`` and more. Ranges are checked here so a bad value is a 400 naming its ``param``.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

try:
    import jsonschema
except ImportError:  # pragma: no cover - a dependency; without it schemas go unchecked
    jsonschema = None


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_model(name: str | None, served: list[str]) -> None:
    """A 404 as OpenAI sends it for a model this server does not serve (None: the default)."""
    if name is not None and name not in served:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")  # fmt: skip


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaSpec(Lenient):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _need_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema field")
        return self


def response_schema(rf: ResponseFormat | None) -> Any:
    """The JSON schema a response format asks for; None for free text."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "object"}
    return rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}


class StreamOptions(Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(Lenient):
    """Fields shared by chat and completions."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # NOTE: logits are divided by it: below 0.01 they overflow to inf and sampling fails.
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    n: int | None = 1
    response_format: ResponseFormat | None = None
    # token id (a decimal string, as JSON keys are) -> bias; checked against the vocabulary
    logit_bias: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # Reasoning tokens before </think> is forced (two names in use; None: the server's)
    thinking_budget: int | None = Field(default=None, ge=0)
    max_thinking_tokens: int | None = Field(default=None, ge=0)

    @property
    def reasoning_budget(self) -> int | None:
        """The request's reasoning budget, under whichever name it came."""
        if self.thinking_budget is not None:
            return self.thinking_budget
        return self.max_thinking_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(Lenient):
    """vLLM's ``/tokenize``: a ``prompt``, or ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True  # accepted; this tokenizer adds no special tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 256


def check_content(messages: list[ChatMessage]) -> None:
    """Only text parts: this is a text-only model, and an image must not be read as text."""
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            kind = part.get("type")
            where = f"messages[{i}].content[{j}]"
            if isinstance(kind, str) and ("image" in kind or kind in ("video_url", "video")):
                raise bad_request(
                    f"{where}: image and video inputs are not supported: this server runs a "
                    "text-only model; send text parts only",
                    "messages",
                    code="unsupported_content",
                )
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"{where}: only parts of type 'text' with a string 'text' are supported, "
                    f"got type {str(kind)[:40]!r}",
                    "messages",
                    code="unsupported_content",
                )


def check_schema(schema: Any, where: str, param: str) -> None:
    """A 400 unless ``schema`` is a valid JSON Schema (checked against its metaschema,
    draft 2020-12 unless it names another in ``$schema``)."""
    if jsonschema is None or isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: a JSON schema must be an object", param)
    default = jsonschema.Draft202012Validator
    with warnings.catch_warnings():  # an unknown "$schema" falls back to the default
        warnings.simplefilter("ignore")
        cls = jsonschema.validators.validator_for(schema, default=default)
    # NOTE: no format checks: "pattern" is an ECMA-262 regex (\p{L} and friends) that
    # Python's re would wrongly refuse; the grammar engine compiles the ones it uses.
    err = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if err is not None:
        at = "".join(f"[{p!r}]" for p in err.absolute_path)
        raise bad_request(f"{where}: invalid JSON schema: {err.message[:300]}"
                          + (f" (at {at})" if at else ""), param)  # fmt: skip


def check_tools(tools: list[Tool] | None) -> None:
    """Each tool's ``parameters`` must be a valid JSON schema (a 400 naming the tool)."""
    for i, t in enumerate(tools or []):
        fn = t.function
        if fn.parameters is not None:
            check_schema(fn.parameters, f"tools[{i}].function.parameters ({fn.name})", "tools")


def check_request(req: SamplingFields) -> None:
    """Checks pydantic's field types cannot express; each error names its param."""
    if req.n not in (None, 1):
        raise bad_request("n: only n=1 is supported", "n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} stop strings", "stop")
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        raise bad_request(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters",
                          "stop")  # fmt: skip
    if len(req.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    if isinstance(req, ChatCompletionRequest):
        check_content(req.messages)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
        check_tools(req.tools)
        if req.tool_choice is not None and not req.tools:
            raise bad_request("tool_choice: only allowed when tools are given", "tool_choice")
        if isinstance(req.tool_choice, NamedToolChoice):
            names = [t.function.name for t in req.tools or []]
            if req.tool_choice.function.name not in names:
                raise bad_request(
                    f"tool_choice: function {req.tool_choice.function.name!r} is not in tools",
                    "tool_choice",
                )
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema.schema_ is not None:
        check_schema(rf.json_schema.schema_, "response_format.json_schema.schema",
                     "response_format")  # fmt: skip
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise bad_request("best_of: only best_of=1 is supported", "best_of")
        if req.suffix:
            raise bad_request("suffix: not supported by this model", "suffix")


def usage_dict(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_message(errs: Any) -> tuple[str, str | None]:
    """A 400's message and param from pydantic's errors: the first one, its field path."""
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('msg', '')}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # Union members add their type names to the location; keep the field path.
    path = []
    for x in loc:
        if x.isdigit() or x.isidentifier() and not x[:1].isupper() and x not in _TYPE_NAMES:
            path.append(x)
    param = ".".join(path) or None
    msg = e.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param
