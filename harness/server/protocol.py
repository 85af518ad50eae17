"""vLLM's JSON shapes, as the built-in server reads and writes them.

Who talks to it: the routes in `harness/server/app.py` turn request bodies into engine inputs with
`parse_completion_request` and engine outputs into response bodies with `completion_response` and
`models_response`; errors leave as `ProtocolError` and become `error_body` JSON with vLLM's status codes.
Pure functions of their inputs: the contract tests compare their output with fixtures of real vLLM
responses (tests/fixtures/vllm/).

What /v1/completions accepts: `prompt` as token ids (or one list of them, or text when the server has a
tokenizer), `max_tokens` (default 16), `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
`seed`, `logprobs` (at most max_logprobs), `stop_token_ids`, `ignore_eos`, `return_token_ids`,
`return_tokens_as_token_ids`, `n` = 1. Refused with 400: streaming, `echo`, string `stop` sequences,
`n` > 1, and a prompt whose length plus max_tokens exceeds max_model_len (vLLM's message wording).

What /inference/v1/generate (vLLM's token-in, token-out route) accepts: `token_ids`, `model`, `stream` =
false and `sampling_params` with the same fields as above; like vLLM, a turn that would run past
max_model_len stops there (finish_reason "length") instead of being refused. Each choice carries
`sampling_mask`, the candidate ids of every generated token when top-k, top-p or min-p truncate the
distribution (what vLLM's --return-sampling-mask records), else null.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.server.engine import GenerationOutput
from harness.server.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LOGPROB_FLOOR = -9999.0  # what vLLM writes for -inf, which JSON cannot carry


class ProtocolError(Exception):
    """A request the server answers with an error status (picklable: plain constructor arguments)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)
        self.status = status
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    500: "InternalServerError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON (>= 0.10): {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed /v1/completions request."""

    model: str | None
    prompt_ids: list[int]
    params: SamplingParams
    return_token_ids: bool
    return_tokens_as_token_ids: bool


def _number(body: dict[str, Any], key: str, default: float, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and not float(value).is_integer())
    ):
        raise ProtocolError(
            400, f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", key
        )
    return kind(value)


def parse_completion_request(
    body: Any,
    *,
    max_model_len: int,
    max_logprobs: int,
    vocab_size: int,
    tokenizer: PreTrainedTokenizerBase | None,
) -> CompletionRequest:
    """Check a /v1/completions body and turn it into a prompt and SamplingParams; ProtocolError if invalid."""
    if not isinstance(body, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError(400, "stream=true is not supported by the built-in server", "stream")
    if body.get("echo"):
        raise ProtocolError(400, "echo=true is not supported by the built-in server", "echo")
    if body.get("stop"):
        raise ProtocolError(400, "string stop sequences are not supported; use stop_token_ids", "stop")
    if _number(body, "n", 1, int) != 1:
        raise ProtocolError(400, "only n=1 is supported", "n")
    prompt_ids = _prompt_ids(body.get("prompt"), tokenizer, vocab_size)
    max_tokens = _number(body, "max_tokens", 16, int)
    if max_tokens < 1:
        raise ProtocolError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if len(prompt_ids) >= max_model_len:
        raise ProtocolError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{len(prompt_ids)} input tokens. Please reduce the length of the input messages.",
            "prompt",
        )
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ProtocolError(
            400,
            f"'max_tokens' is too large: {max_tokens}. "
            f"This model's maximum context length is {max_model_len} "
            f"tokens and your request has {len(prompt_ids)} input tokens "
            f"({max_tokens} > {max_model_len} - {len(prompt_ids)}).",
            "max_tokens",
        )
    params = _sampling_params(body, max_tokens, max_logprobs)
    model = body.get("model")
    return CompletionRequest(
        model=model if isinstance(model, str) else None,
        prompt_ids=prompt_ids,
        params=params,
        return_token_ids=bool(body.get("return_token_ids", False)),
        return_tokens_as_token_ids=bool(body.get("return_tokens_as_token_ids", False)),
    )


def _sampling_params(
    body: dict[str, Any], max_tokens: int, max_logprobs: int, *, return_sampling_mask: bool = False
) -> SamplingParams:
    """The sampling fields both routes share (top level in /v1/completions, `sampling_params` in
    /inference/v1/generate) as SamplingParams; ProtocolError if invalid."""
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", 0, int)
        if not 0 <= logprobs <= max_logprobs:
            raise ProtocolError(
                400, f"logprobs must be in [0, {max_logprobs}] (max_logprobs), got {logprobs}"
            )
    top_k = _number(body, "top_k", 0, int)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ProtocolError(400, f"seed must be an integer, got {seed!r}", "seed")
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) for t in stop_token_ids):
        raise ProtocolError(400, "stop_token_ids must be a list of token ids", "stop_token_ids")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, float),
            top_p=_number(body, "top_p", 1.0, float),
            top_k=0 if top_k == -1 else top_k,
            min_p=_number(body, "min_p", 0.0, float),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, float),
            seed=seed,
            num_logprobs=logprobs,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=bool(body.get("ignore_eos", False)),
            return_sampling_mask=return_sampling_mask,
        )
    except ValueError as exc:
        raise ProtocolError(400, str(exc)) from exc
    return params


def _prompt_ids(prompt: Any, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> list[int]:
    # One prompt per request: unwrap a batch of one, as a client sending [[ids]] or ["text"] means.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ProtocolError(400, "this server has no tokenizer: send the prompt as token ids", "prompt")
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, list) or not prompt:
        raise ProtocolError(400, "prompt must be a non-empty list of token ids (or a string)", "prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ProtocolError(
            400, "only one prompt per request: prompt must be a flat list of token ids", "prompt"
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(400, f"token id {bad[0]} is out of vocabulary (size {vocab_size})", "prompt")
    return list(prompt)


_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def _token_namer(as_token_ids: bool, tokenizer: PreTrainedTokenizerBase | None) -> Callable[[int], str]:
    """The function naming a token in log-prob listings: its text, or "token_id:N"."""
    if as_token_ids or tokenizer is None:
        return "token_id:{}".format
    # Each token's text is decoded once per tokenizer: responses are built on the server's event loop, which
    # shares the process (and the GIL) with the engine, and a 128-token completion with top-1 log-probs
    # names ~3 tokens per position.
    texts = _TOKEN_TEXTS.setdefault(tokenizer, {})

    def name(token_id: int) -> str:
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = tokenizer.decode([token_id])
        return text

    return name


def completion_response(
    request: CompletionRequest,
    output: GenerationOutput,
    *,
    model_name: str,
    tokenizer: PreTrainedTokenizerBase | None,
) -> dict[str, Any]:
    """The /v1/completions response for one finished request, as vLLM shapes it."""
    logprobs_body = None
    if output.logprobs is not None and output.top_logprobs is not None:
        name = _token_namer(request.return_tokens_as_token_ids, tokenizer)
        floor = LOGPROB_FLOOR
        tokens = [name(t) for t in output.output_ids]
        offsets, position = [], 0
        for token in tokens:
            offsets.append(position)
            position += len(token)
        # max(x, floor), without a call per value: a 128-token response lists ~400 of them.
        token_logprobs = [floor if floor > lp else lp for lp in output.logprobs]
        top_logprobs = []
        for token, logprob, top in zip(tokens, token_logprobs, output.top_logprobs, strict=True):
            # vLLM lists the sampled token first, then the top k in rank order (the sampled one once).
            entry = {token: logprob}
            for candidate, candidate_logprob in top:
                text = name(candidate)
                if text not in entry:
                    entry[text] = floor if floor > candidate_logprob else candidate_logprob
            top_logprobs.append(entry)
        logprobs_body = {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }
    text = tokenizer.decode(output.output_ids, skip_special_tokens=True) if tokenizer is not None else ""
    num_prompt, num_output = len(output.prompt_ids), len(output.output_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": logprobs_body,
                "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason,
                "prompt_logprobs": None,
                "prompt_token_ids": output.prompt_ids if request.return_token_ids else None,
                "token_ids": output.output_ids if request.return_token_ids else None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": num_prompt,
            "total_tokens": num_prompt + num_output,
            "completion_tokens": num_output,
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
    }


def model_card(
    model_id: str, *, root: str, parent: str | None, max_model_len: int, created: int
) -> dict[str, Any]:
    """One entry of /v1/models' data, as vLLM writes it."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def models_response(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}


def parse_generate_request(
    body: Any, *, max_model_len: int, max_logprobs: int, vocab_size: int
) -> CompletionRequest:
    """Check an /inference/v1/generate body (vLLM's token route); ProtocolError if invalid."""
    if not isinstance(body, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError(400, "stream=true is not supported by the built-in server", "stream")
    fields = body.get("sampling_params")
    if not isinstance(fields, dict):
        raise ProtocolError(400, "sampling_params must be an object", "sampling_params")
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise ProtocolError(400, "token_ids must be a non-empty list of token ids", "token_ids")
    prompt_ids = _prompt_ids(token_ids, None, vocab_size)
    if len(prompt_ids) > max_model_len:
        raise ProtocolError(
            400,
            f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model length of "
            f"{max_model_len}.",
            "token_ids",
        )
    if _number(fields, "n", 1, int) != 1:
        raise ProtocolError(400, "only n=1 is supported", "n")
    max_tokens = _number(fields, "max_tokens", 16, int)
    if max_tokens < 1:
        raise ProtocolError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if len(prompt_ids) >= max_model_len:
        raise ProtocolError(400, f"the prompt leaves no room to generate (max_model_len {max_model_len})")
    max_tokens = min(max_tokens, max_model_len - len(prompt_ids))  # vLLM's route stops at max_model_len
    model = body.get("model")
    return CompletionRequest(
        model=model if isinstance(model, str) else None,
        prompt_ids=prompt_ids,
        params=_sampling_params(fields, max_tokens, max_logprobs, return_sampling_mask=True),
        return_token_ids=True,
        return_tokens_as_token_ids=True,
    )


def generate_response(
    request: CompletionRequest, output: GenerationOutput, *, model_name: str
) -> dict[str, Any]:
    """The /inference/v1/generate response (output_mode "tokens") for one finished request, as vLLM shapes
    it: per token its id and log-prob, then the sampled token and the top k in rank order."""
    content = None
    if output.logprobs is not None and output.top_logprobs is not None:
        content = []
        for token_id, logprob, top in zip(
            output.output_ids, output.logprobs, output.top_logprobs, strict=True
        ):
            listed = {token_id: max(logprob, LOGPROB_FLOOR)}
            for candidate, candidate_logprob in top:
                listed.setdefault(candidate, max(candidate_logprob, LOGPROB_FLOOR))
            content.append(
                {
                    "token_id": token_id,
                    "logprob": listed[token_id],
                    "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in listed.items()],
                }
            )
    num_prompt, num_output = len(output.prompt_ids), len(output.output_ids)
    return {
        "request_id": f"generate-tokens-{uuid.uuid4().hex}",
        "model": model_name,
        "created": int(time.time()),
        "usage": {
            "prompt_tokens": num_prompt,
            "total_tokens": num_prompt + num_output,
            "completion_tokens": num_output,
            "prompt_tokens_details": None,
        },
        "prompt_token_ids": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason,
                "token_ids": output.output_ids,
                "sampling_mask": output.sampling_mask,
                "logprobs": {"content": content},
            }
        ],
    }
