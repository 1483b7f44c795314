"""OpenAI API request bodies (pydantic), their checks, and the JSON shapes of responses and errors.

Pydantic only checks types (a wrong type is HTTP 422); values are checked here
and by SamplingParams and answered with HTTP 400 naming the parameter.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict

from loraserve.outputs import CompletionOutput
from loraserve.sampling_params import SamplingParams

MAX_N = 128
_ERROR_TYPES = MappingProxyType({
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    409: "conflict_error", 422: "invalid_request_error", 500: "server_error", 503: "service_unavailable",
})


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.counted = False  # already in the server's request metrics (under the request's adapter)

    def body(self) -> dict:
        err_type = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}


# OpenAI fields loraserve does not implement, accepted only with the value that changes nothing.
_NEUTRAL_ONLY = MappingProxyType({"best_of": 1, "echo": False, "suffix": None})


class _Body(BaseModel):
    """A request body; unknown fields are refused with 400 like OpenAI does."""

    model_config = ConfigDict(extra="allow")

    def check_unknown_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name not in _NEUTRAL_ONLY:
                raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)
            if value is not None and value != _NEUTRAL_ONLY[name]:
                raise APIError(400, f"{name} is not supported (only {_NEUTRAL_ONLY[name]!r})", param=name)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI has it) -> bias in [-100, 100]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extensions, vLLM's (pass them with the openai client's extra_body):
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def make_sampling_params(self, max_tokens: int, logprobs: int | None) -> Callable[[int], SamplingParams]:
        """Check the values; return a factory of the SamplingParams of choice i (seed + i)."""
        self.check_unknown_fields()
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise APIError(400, f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        try:
            logit_bias = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {list(self.logit_bias)!r}",
                           param="logit_bias") from None

        def make(i: int) -> SamplingParams:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, min_p=self.min_p, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                seed=None if self.seed is None else self.seed + i,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, logit_bias=logit_bias, logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)

        try:
            make(0)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field in type(self).model_fields else None) from exc
        return make


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(p)


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served (template_messages refuses the others)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them; 400 for none, or for a part that is not text."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    for i, message in enumerate(messages):
        for part in message.content if isinstance(message.content, list) else ():
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}].content: {part.type!r} parts are not supported; this model "
                                    "takes text parts only", param=f"messages.{i}.content")
    return [m.as_template_message() for m in messages]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_messages(self) -> list[dict[str, str]]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return template_messages(self.messages)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True

    def check(self) -> None:
        self.check_unknown_fields()
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(out: CompletionOutput, start: int, k: int, token_text: Callable[[int], str],
                        text_offset: int) -> dict:
    """The `logprobs` object of /v1/completions for generated tokens [start:]."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        piece = token_text(tid)
        tokens.append(piece)
        token_logprobs.append(entry.get(tid))
        top.append({token_text(t): lp for t, lp in _top(entry, k)})
        offsets.append(text_offset)
        text_offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(out: CompletionOutput, start: int, k: int, token_text: Callable[[int], str]) -> dict:
    """The `logprobs` object of /v1/chat/completions for generated tokens [start:]."""
    def item(tid: int, lp: float | None) -> dict:
        piece = token_text(tid)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

    content = []
    for tid, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]})
    return {"content": content}


def streamable_length(text: str, stop_strings: list[str], finished: bool) -> int:
    """How much of a running sequence's text can be sent: hold back a tail that may start a stop string."""
    if finished:
        return len(text)
    held = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return len(text) - held


class ResponseBuilder:
    """Turns the engine outputs of one API call into OpenAI chunks or a full response.

    Choice i answers prompt i // n. Streaming sends each choice's new text
    (holding back a tail that may begin a stop string) and new logprobs.
    """

    def __init__(self, *, chat: bool, response_id: str, model: str, created: int, num_choices: int, n: int,
                 num_logprobs: int | None, stop_strings: list[str], token_text: Callable[[int], str]):
        self.chat = chat
        self._head = {"id": response_id, "object": "", "created": created, "model": model}
        self._n = n
        self._k = num_logprobs
        self._stops = stop_strings
        self._token_text = token_text
        self._sent_chars = [0] * num_choices
        self._sent_tokens = [0] * num_choices
        self._outputs: list[CompletionOutput | None] = [None] * num_choices
        self._prompt_tokens: dict[int, int] = {}

    def accept(self, index: int, prompt_token_ids: list[int], out: CompletionOutput, error: str | None) -> None:
        """Record choice `index`'s latest output; a failed or aborted one raises APIError(500)."""
        if error or out.finish_reason == "abort":
            raise APIError(500, f"generation failed: {error or 'the request was aborted'}", code="generation_failed")
        self._prompt_tokens[index // self._n] = len(prompt_token_ids)
        self._outputs[index] = out

    def usage(self) -> dict:
        completion = sum(len(o.token_ids) for o in self._outputs if o is not None)
        return usage(sum(self._prompt_tokens.values()), completion)

    def _logprobs(self, out: CompletionOutput, start: int, text_offset: int) -> dict | None:
        if self._k is None:
            return None
        if self.chat:
            return chat_logprobs(out, start, self._k, self._token_text)
        return completion_logprobs(out, start, self._k, self._token_text, text_offset)

    def role_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self._outputs))]

    def delta_chunk(self, index: int) -> dict | None:
        """The chunk with choice `index`'s news since the last chunk, or None if there is none to send."""
        out = self._outputs[index]
        end = streamable_length(out.text, self._stops, out.finish_reason is not None)
        start = self._sent_chars[index]
        text = out.text[start:end] if end > start else ""
        new_tokens = len(out.token_ids) > self._sent_tokens[index]
        if not text and out.finish_reason is None and not (new_tokens and self._k is not None):
            return None
        logprobs = self._logprobs(out, self._sent_tokens[index], start)
        self._sent_chars[index] = max(start, end)
        self._sent_tokens[index] = len(out.token_ids)
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": index, "text": text}
        return self._chunk({**choice, "logprobs": logprobs, "finish_reason": out.finish_reason})

    def usage_chunk(self) -> dict:
        return {**self._chunk(None), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: dict | None) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head, "object": kind, "choices": [choice] if choice else []}

    def response(self) -> dict:
        choices = []
        for i, out in enumerate(self._outputs):
            if self.chat:
                body = {"message": {"role": "assistant", "content": out.text}}
            else:
                body = {"text": out.text}
            choices.append({"index": i, **body, "logprobs": self._logprobs(out, 0, 0),
                            "finish_reason": out.finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head, "object": kind, "choices": choices, "usage": self.usage()}
