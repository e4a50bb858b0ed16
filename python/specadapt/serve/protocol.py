"""Request bodies of ``specadapt serve``'s OpenAI-compatible API (pydantic models) and their errors.

Every field a request may carry is declared; an unknown field is refused (HTTP 400 naming it) instead of being
ignored, because an ignored field can change what the user expects of the output. Types are strict (a string is
not a number). Fields OpenAI defines that this server cannot honour (``n > 1``, ``logprobs``, ``echo``, ...) are
declared and refused when set to anything but their no-op value.

Extension fields (SGLang / vLLM names where they exist):

- ``top_k`` (0 or -1 = off), ``min_p``, ``ignore_eos``, ``stop_token_ids`` (ids that end the output, included),
  ``seed`` (the request's coin stream: the same seed and prompt give the same output whatever else runs);
- ``speculate`` (specadapt): ``false`` turns speculative decoding off for this request (it decodes by plain
  target steps inside the same batch);
- ``return_meta_info`` (SGLang): adds ``meta_info`` to each choice: ``completion_tokens``, ``spec_verify_ct``
  (rounds), ``spec_accept_length`` (tokens per round), ``spec_draft_tokens`` / ``spec_accepted_tokens`` and
  ``spec_round_emitted`` (tokens emitted by each round, in order: the acceptance-vs-position curve);
- ``return_token_ids`` (vLLM): adds ``token_ids`` (the output's ids) to each choice.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatCompletionRequest", "CompletionRequest", "APIError", "error_body"]


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` with OpenAI's error body naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, kind: str, param: str | None = None, code: int | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart]]
    name: str | None = None


class _Sampling(_Strict):
    """Fields shared by both endpoints (``None`` = the server's default)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, allow_inf_nan=False)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    top_k: int | None = None
    min_p: float | None = Field(default=None, allow_inf_nan=False)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculate: bool = True
    return_meta_info: bool = False
    return_token_ids: bool = False


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string or token ids (one prompt per request)."""

    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
