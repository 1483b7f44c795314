"""OpenAI API request bodies (pydantic), their checks, and the JSON shapes of responses and errors.

Pydantic only checks types (a wrong type is HTTP 422); values are checked here
and by SamplingParams and answered with HTTP 400 naming the parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict

from loraserve.outputs import CompletionOutput, RequestOutput
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


# OpenAI and vLLM fields loraserve does not implement, accepted only with the value that changes nothing.
# (`echo` is a field of completions; on chat only its neutral value is accepted.)
_NEUTRAL_ONLY = MappingProxyType({"best_of": 1, "suffix": None, "use_beam_search": False, "length_penalty": 1.0,
                                  "spaces_between_special_tokens": True, "echo": False})


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
    """`stream_options`: a last chunk with the usage; with continuous_usage_stats (vLLM's), usage in every chunk."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    prompt_logprobs: int | None = None  # per prompt token its logprob and the top k (not with stream=true)
    response_format: dict | None = None  # only {"type": "text"}: there is no structured output

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def make_sampling_params(self, max_tokens: int, logprobs: int | None,
                             prompt_logprobs: int | None = None) -> Callable[[int], SamplingParams]:
        """Check the values; return a factory of the SamplingParams of choice i (seed + i)."""
        self.check_unknown_fields()
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise APIError(400, f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs are not available with stream=true", param="prompt_logprobs")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, f"response_format {self.response_format!r} is not supported: there is no structured "
                                "output (JSON mode, JSON schema); only {'type': 'text'}", param="response_format")
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
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)

        try:
            make(0)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field in type(self).model_fields else None) from exc
        return make


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `echo`: each choice starts with its prompt (and, with logprobs, the prompt tokens'
    logprobs, the first null); with max_tokens 0 the prompt alone (scoring)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt is scored, nothing is generated (the engine makes one token,
        which is not returned)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> Callable[[int], SamplingParams]:
        """make_sampling_params for this request; echo with logprobs scores the prompt too (as vLLM does)."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self.make_sampling_params(1 if self.echo_only else max_tokens, self.logprobs, prompt_logprobs)

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

    model_config = ConfigDict(extra="allow")  # a message sent back as the client got it has more (null) fields

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template takes them; 400 for none, or for a part that is not text."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    for i, message in enumerate(messages):
        for field in ("tool_calls", "function_call"):
            if (message.model_extra or {}).get(field):
                raise APIError(400, f"messages[{i}].{field}: tool calls are not supported", param=f"messages.{i}")
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


def _finite(logprob: float) -> float:
    """JSON has no -inf: OpenAI and vLLM send -9999.0 for it."""
    return max(logprob, -9999.0)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], k: int,
                        token_text: Callable[[int], str], text_offset: int) -> dict:
    """The `logprobs` object of /v1/completions for these tokens; entries: each token's logprobs (its own and
    the top ones), None where there are none (an echoed prompt's first token)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        piece = token_text(tid)
        tokens.append(piece)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(_finite(entry[tid]) if tid in entry else None)
            top.append({token_text(t): _finite(lp) for t, lp in _top(entry, k)})
        offsets.append(text_offset)
        text_offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(out: CompletionOutput, start: int, k: int, token_text: Callable[[int], str]) -> dict:
    """The `logprobs` object of /v1/chat/completions for generated tokens [start:]."""
    def item(tid: int, lp: float | None) -> dict:
        piece = token_text(tid)
        return {"token": piece, "logprob": None if lp is None else _finite(lp), "bytes": list(piece.encode("utf-8"))}

    content = []
    for tid, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]})
    return {"content": content}


def prompt_logprobs_json(entries: list[dict[int, float] | None], k: int,
                         token_text: Callable[[int], str]) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first) token id -> {logprob, rank, decoded_token}
    for the token itself and the k most likely; rank counts from 1 among those k, null for the prompt's own token
    when it is not among them."""
    result = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        result.append({str(tid): {"logprob": _finite(lp), "rank": i + 1 if i < k else None,
                                  "decoded_token": token_text(tid)} for i, (tid, lp) in enumerate(ranked)})
    return result


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


@dataclass
class _Choice:
    """What one choice shows: its text, tokens and their logprob entries, echoed prompt first; `fixed`: the
    length of the echoed prompt's text (sent at once, never held back for a stop string)."""

    text: str
    token_ids: list[int]
    entries: list[dict[int, float] | None]
    fixed: int


class ResponseBuilder:
    """Turns the engine outputs of one API call into OpenAI chunks or a full response.

    Choice i answers prompt i // n. Streaming sends each choice's new text
    (holding back a tail that may begin a stop string) and new logprobs.
    Completions with `echo` show the prompt (text, tokens, logprobs) before the
    generated part, or alone with `echo_only`. `num_prompt_logprobs` (not
    streamed): the prompt logprobs are reported, in each completion choice or
    at the top of a chat response, as vLLM does. `continuous_usage`: every
    streamed chunk carries its choice's usage so far (vLLM's).
    """

    def __init__(self, *, chat: bool, response_id: str, model: str, created: int, num_choices: int, n: int,
                 num_logprobs: int | None, stop_strings: list[str], token_text: Callable[[int], str],
                 detokenize: Callable[[list[int]], str], echo: bool = False, echo_only: bool = False,
                 num_prompt_logprobs: int | None = None, continuous_usage: bool = False):
        self.chat = chat
        self._head = {"id": response_id, "object": "", "created": created, "model": model}
        self._n = n
        self._k = num_logprobs
        self._stops = stop_strings
        self._token_text = token_text
        self._detokenize = detokenize
        self._echo, self._echo_only = echo, echo_only
        self._prompt_k = num_prompt_logprobs
        self._continuous_usage = continuous_usage
        self._sent_chars = [0] * num_choices
        self._sent_tokens = [0] * num_choices
        self._outputs: list[RequestOutput | None] = [None] * num_choices

    def accept(self, index: int, output: RequestOutput) -> None:
        """Record choice `index`'s latest output; a failed or aborted one raises APIError(500)."""
        out = output.outputs[0]
        if output.error or out.finish_reason == "abort":
            reason = output.error or "the request was aborted"
            raise APIError(500, f"generation failed: {reason}", code="generation_failed")
        self._outputs[index] = output

    def _generated(self, output: RequestOutput) -> int:
        return 0 if self._echo_only else len(output.outputs[0].token_ids)

    def usage(self) -> dict:
        prompts = {i // self._n: len(o.prompt_token_ids) for i, o in enumerate(self._outputs) if o is not None}
        return usage(sum(prompts.values()), sum(self._generated(o) for o in self._outputs if o is not None))

    def _prompt_entries(self, index: int, own: bool) -> list[dict[int, float] | None] | None:
        """Choice `index`'s prompt logprobs: its own (streaming: sent as they come), or those of its prompt's
        first choice (a full response: every choice of a prompt shows the same)."""
        return self._outputs[index if own else index - index % self._n].prompt_logprobs

    def _choice(self, index: int, own: bool) -> _Choice:
        output = self._outputs[index]
        out = output.outputs[0]
        if self._echo_only:
            generated = _Choice("", [], [], 0)
        else:  # the output's own lists, not copies (a choice is only read): streaming builds one per token
            generated = _Choice(out.text, out.token_ids, out.logprobs or [None] * len(out.token_ids), 0)
        if not self._echo:
            return generated
        ids = output.prompt_token_ids
        text = output.prompt if output.prompt is not None else self._detokenize(ids)
        entries = self._prompt_entries(index, own) or [None] * len(ids)
        return _Choice(text + generated.text, ids + generated.token_ids, entries + generated.entries, len(text))

    def _logprobs(self, index: int, choice: _Choice, start: int, text_offset: int) -> dict | None:
        if self._k is None:
            return None
        if self.chat:
            return chat_logprobs(self._outputs[index].outputs[0], start, self._k, self._token_text)
        return completion_logprobs(choice.token_ids[start:], choice.entries[start:], self._k, self._token_text,
                                   text_offset)

    def role_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(len(self._outputs))]

    def delta_chunk(self, index: int) -> dict | None:
        """The chunk with choice `index`'s news since the last chunk, or None if there is none to send."""
        output = self._outputs[index]
        finish_reason = output.outputs[0].finish_reason
        choice = self._choice(index, own=True)
        end = choice.fixed + streamable_length(choice.text[choice.fixed:], self._stops, finish_reason is not None)
        start = self._sent_chars[index]
        text = choice.text[start:end] if end > start else ""
        new_tokens = len(choice.token_ids) > self._sent_tokens[index]
        if not text and finish_reason is None and not (new_tokens and self._k is not None):
            return None
        logprobs = self._logprobs(index, choice, self._sent_tokens[index], start)
        self._sent_chars[index] = max(start, end)
        self._sent_tokens[index] = len(choice.token_ids)
        if self.chat:
            body = {"index": index, "delta": {"content": text} if text else {}}
        else:
            body = {"index": index, "text": text}
        chunk = self._chunk({**body, "logprobs": logprobs, "finish_reason": finish_reason})
        if self._continuous_usage:
            chunk["usage"] = usage(len(output.prompt_token_ids), self._generated(output))
        return chunk

    def usage_chunk(self) -> dict:
        return {**self._chunk(None), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: dict | None) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head, "object": kind, "choices": [choice] if choice else []}

    def _prompt_logprobs(self, index: int) -> list | None:
        return prompt_logprobs_json(self._prompt_entries(index, own=False) or [], self._prompt_k, self._token_text)

    def response(self) -> dict:
        choices = []
        for i, output in enumerate(self._outputs):
            choice = self._choice(i, own=False)
            if self.chat:
                body = {"message": {"role": "assistant", "content": choice.text}}
            else:
                body = {"text": choice.text}
                if self._prompt_k is not None:
                    body["prompt_logprobs"] = self._prompt_logprobs(i)
            choices.append({"index": i, **body, "logprobs": self._logprobs(i, choice, 0, 0),
                            "finish_reason": output.outputs[0].finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        response = {**self._head, "object": kind, "choices": choices, "usage": self.usage()}
        if self.chat and self._prompt_k is not None:
            response["prompt_logprobs"] = self._prompt_logprobs(0)
        return response
