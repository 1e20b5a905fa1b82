"""ExpRL judges: something that reads (question, hidden reference, answer or segment) and returns a score in [0, 1].

Two judges share one interface, `Judge.score(requests) -> results` (same order, same length):

- `HttpJudge`: any OpenAI-compatible `/v1/chat/completions` server (vLLM, SGLang). Standard library only, so a
  training host needs no client package. Requests run on a bounded thread pool; connection errors, timeouts, 429
  and 5xx are retried with exponential backoff; a request that still fails becomes a result with `score=None` and
  `error` set, so one slow judge reply cannot stall or kill a training step (`on_failure="error"` raises
  `JudgeError` naming the URL instead). Once one request of a batch has failed all its tries, the others get one try
  each: a server that is down costs a step one round of retries, not one per request. Configuration mistakes that no
  retry can fix (401, 403, 404: wrong key, URL or model name) raise `JudgeError` at once.
- `ModelJudge`: a model loaded by this package, decoded greedily by `jaxrlvr.rollout.generate`.

A result whose reply was received but states no verdict has `score=None, error=None` (a parse failure); the
dense-reward code removes such rollouts from the loss and counts them (`judge/parse_failures`).
"""
import abc
from collections.abc import Callable, Sequence
import concurrent.futures
import dataclasses
import http.client
import json
import threading
import time
from typing import Any
import urllib.error
import urllib.request

import numpy as np

from jaxrlvr.rewards import judge_prompts
from jaxrlvr.rewards.judge_prompts import JudgeRequest

__all__ = ["Judge", "JudgeError", "JudgeRequest", "JudgeResult", "HttpJudge", "ModelJudge", "judge_from_config"]


class JudgeError(RuntimeError):
  """A judge that cannot work at all (bad URL, key or model name); raised, never turned into a None score."""


@dataclasses.dataclass(frozen=True)
class JudgeResult:
  """The judge's answer to one request.

  score: (k - 1) / 4 for a verdict k in 1..5; None when no verdict could be read or the request failed.
  text: the judge's raw reply ("" when none arrived).
  latency_s: wall time of the request, retries and backoff included.
  tokens_sent: prompt tokens the judge consumed (server-reported for HTTP; None when the server did not say).
  error: why no reply arrived (timeout, connection, http 5xx, bad response); None when a reply was read.
  attempts: how many times the request was sent.
  """
  score: float | None
  text: str
  latency_s: float
  tokens_sent: int | None
  error: str | None = None
  attempts: int = 1

  @property
  def parse_failed(self) -> bool:
    """A reply arrived but stated no usable 1-5 verdict."""
    return self.score is None and self.error is None


class Judge(abc.ABC):
  """Scores a batch of requests; implementations decide how to batch or parallelise."""

  @abc.abstractmethod
  def score(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
    """One result per request, in the same order."""


# ---------------------------------------------------------------------------------------------------------------
# HTTP (OpenAI-compatible chat completions)
# ---------------------------------------------------------------------------------------------------------------

# Worth another try: the server may be restarting, overloaded or slow this once.
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# No retry can fix these; every request would fail the same way, so stop the run with the reason.
_FATAL_STATUS = frozenset({401, 403, 404})


class _Retryable(Exception):
  pass


class _Failed(Exception):
  pass


def chat_completions_url(base_url: str) -> str:
  """`http://host:8000`, `.../v1` or the full `.../v1/chat/completions` -> the chat-completions URL."""
  url = base_url.rstrip("/")
  if url.endswith("/chat/completions"):
    return url
  if url.endswith("/v1"):
    return url + "/chat/completions"
  return url + "/v1/chat/completions"


class HttpJudge(Judge):
  """A judge served over HTTP by vLLM, SGLang or any OpenAI-compatible chat-completions endpoint.

  Greedy (temperature 0) by default so the same answer gets the same score. `max_retries` counts the tries after
  the first; the wait before try i (1-based) is min(backoff_s * 2**(i-1), max_backoff_s). `timeout_s` bounds each
  socket operation of one try (connect, and each read), so a server that does not answer within it is a failed try.
  `on_failure`: what a request that failed every try becomes: "skip" (a result with `error`; ExpRL removes the
  rollout from the loss and counts it in judge/request_failures) or "error" (`score` raises JudgeError).
  """

  def __init__(self, base_url: str, model: str, *, timeout_s: float = 120.0, max_retries: int = 3,
               max_concurrency: int = 32, api_key: str | None = None, max_tokens: int = 1024,
               temperature: float = 0.0, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
               extra_body: dict[str, Any] | None = None, on_failure: str = "skip"):
    if not base_url.startswith(("http://", "https://")):
      raise ValueError(f"HttpJudge: base_url={base_url!r} must start with http:// or https://")
    if not model:
      raise ValueError("HttpJudge: model='' -- the served model name is required (the `model` field of the request)")
    if timeout_s <= 0:
      raise ValueError(f"HttpJudge: timeout_s={timeout_s} must be > 0")
    if max_retries < 0:
      raise ValueError(f"HttpJudge: max_retries={max_retries} must be >= 0")
    if max_concurrency < 1:
      raise ValueError(f"HttpJudge: max_concurrency={max_concurrency} must be >= 1")
    if on_failure not in ("skip", "error"):
      raise ValueError(f"HttpJudge: on_failure={on_failure!r} must be 'skip' or 'error'")
    self.on_failure = on_failure
    self.url = chat_completions_url(base_url)
    self.model = model
    self.timeout_s = float(timeout_s)
    self.max_retries = int(max_retries)
    self.max_concurrency = int(max_concurrency)
    self.max_tokens = int(max_tokens)
    self.temperature = float(temperature)
    self.backoff_s = float(backoff_s)
    self.max_backoff_s = float(max_backoff_s)
    self.extra_body = dict(extra_body or {})
    self._headers = {"Content-Type": "application/json"}
    if api_key:
      self._headers["Authorization"] = f"Bearer {api_key}"

  def score(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
    if not requests:
      return []
    workers = min(self.max_concurrency, len(requests))
    exhausted = threading.Event()  # set once a request of this batch failed all its tries: the others try once
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool:
      results = list(pool.map(lambda r: self._score_one(r, exhausted), requests))
    failed = [r for r in results if r.error is not None]
    if failed and self.on_failure == "error":
      raise JudgeError(f"HttpJudge: {self.url} failed {len(failed)} of {len(results)} requests after up to "
                       f"{self.max_retries} retries (last error: {failed[-1].error}); config "
                       "exprl.judge.on_failure='error' stops the run (set 'skip' to train on without those rollouts)")
    return results

  def _body(self, request: JudgeRequest) -> bytes:
    body = {"model": self.model, "messages": judge_prompts.build_messages(request),
            "max_tokens": self.max_tokens, "temperature": self.temperature}
    body.update(self.extra_body)
    return json.dumps(body).encode("utf-8")

  def _score_one(self, request: JudgeRequest, exhausted: threading.Event | None = None) -> JudgeResult:
    body = self._body(request)
    start = time.monotonic()
    error = None
    attempts = 0
    for attempt in range(self.max_retries + 1):
      if attempt:
        if exhausted is not None and exhausted.is_set():
          error += " (not retried: another request of the batch already failed every try)"
          break
        time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
      attempts += 1
      try:
        reply = self._post(body)
      except _Retryable as e:
        error = str(e)
        continue
      except _Failed as e:
        error = str(e)
        break
      text, tokens = reply
      return JudgeResult(score=judge_prompts.parse_score(text), text=text, latency_s=time.monotonic() - start,
                         tokens_sent=tokens, error=None, attempts=attempts)
    if exhausted is not None and attempts == self.max_retries + 1:
      exhausted.set()
    return JudgeResult(score=None, text="", latency_s=time.monotonic() - start, tokens_sent=None, error=error,
                       attempts=attempts)

  def _post(self, body: bytes) -> tuple[str, int | None]:
    """One try: (reply text, prompt tokens or None). Raises _Retryable, _Failed or JudgeError."""
    req = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
    try:
      with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
        raw = resp.read()
    except urllib.error.HTTPError as e:
      try:
        detail = e.read()[:200].decode("utf-8", "replace")
      except (OSError, AttributeError, TypeError):
        detail = ""
      if e.code in _FATAL_STATUS:
        raise JudgeError(f"HttpJudge: {self.url} answered HTTP {e.code} for model {self.model!r}: {detail}") from e
      if e.code in _RETRY_STATUS:
        raise _Retryable(f"http {e.code}") from e
      raise _Failed(f"http {e.code}: {detail}") from e
    except TimeoutError as e:  # socket.timeout is TimeoutError since Python 3.10
      raise _Retryable(f"timeout after {self.timeout_s}s") from e
    except urllib.error.URLError as e:
      if isinstance(e.reason, TimeoutError):
        raise _Retryable(f"timeout after {self.timeout_s}s") from e
      raise _Retryable(f"connection: {e.reason}") from e
    except (http.client.HTTPException, ConnectionError, OSError) as e:
      # RemoteDisconnected, IncompleteRead, reset connections: the server dropped us mid-request.
      raise _Retryable(f"connection: {type(e).__name__}: {e}") from e
    try:
      payload = json.loads(raw)
      text = payload["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
      raise _Failed(f"bad response: {raw[:200]!r}") from e
    if text is None:  # some servers send a null content with everything in a reasoning field
      text = payload["choices"][0]["message"].get("reasoning_content") or ""
    usage = payload.get("usage") or {}
    tokens = usage.get("prompt_tokens")
    return str(text), (int(tokens) if tokens is not None else None)


# ---------------------------------------------------------------------------------------------------------------
# A model of our own, decoded greedily by jaxrlvr.rollout.sampler
# ---------------------------------------------------------------------------------------------------------------


def _encode(tokenizer, text: str) -> list[int]:
  """Token ids of `text` for a transformers tokenizer or a bare `tokenizers.Tokenizer`."""
  out = tokenizer.encode(text, add_special_tokens=False)
  return list(out.ids) if hasattr(out, "ids") else list(out)


def _chat_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
  """The tokenizer's own chat template when it has one; else system and user text separated by blank lines."""
  if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  return "\n\n".join(m["content"] for m in messages) + "\n\n"


class ModelJudge(Judge):
  """A judge model held in this process and decoded greedily by this package's sampler.

  Prompts are generated `batch_size` at a time; the last batch is padded with copies of its first prompt so every
  call sees the same batch shape (no recompilation for a short tail). A prompt longer than `max_prompt_tokens`
  is not truncated -- cutting the reference or the answer would change what is judged -- it fails with `error`.
  With a sharded judge model pass its `mesh`; `batch_size` should then be a multiple of the mesh's batch shards.
  max_rows_per_device, prefill_rows_per_device and prefill_chunk_tokens bound the sampler's memory as in
  `rollout.generate` (0: off; config rollout.*); they reach `generate_fn` only when set. So do engine,
  decode_slots, decode_chunk_steps and decode_weights (config rollout.*), when engine is not "static".
  """

  def __init__(self, model, tokenizer, *, max_new_tokens: int = 512, batch_size: int = 8,
               eos_ids: Sequence[int] | None = None, pad_id: int | None = None,
               max_prompt_tokens: int | None = None, seed: int = 0, mesh: Any = None,
               generate_fn: Callable[..., Any] | None = None, max_rows_per_device: int = 0,
               prefill_rows_per_device: int = 0, prefill_chunk_tokens: int = 0, engine: str = "static",
               decode_slots: int = 0, decode_chunk_steps: int = 16, decode_weights: str = "replicated"):
    if max_new_tokens < 1:
      raise ValueError(f"ModelJudge: max_new_tokens={max_new_tokens} must be >= 1")
    if batch_size < 1:
      raise ValueError(f"ModelJudge: batch_size={batch_size} must be >= 1")
    if generate_fn is None:
      from jaxrlvr import rollout  # pylint: disable=g-import-not-at-top  (the sampler only for a model judge)
      generate_fn = rollout.generate
    if eos_ids is None:
      eos = getattr(tokenizer, "eos_token_id", None)
      eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    if pad_id is None:
      pad_id = getattr(tokenizer, "pad_token_id", None)
      pad_id = 0 if pad_id is None else pad_id
    self.model = model
    self.tokenizer = tokenizer
    self.max_new_tokens = int(max_new_tokens)
    self.batch_size = int(batch_size)
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    self.max_prompt_tokens = max_prompt_tokens
    self.seed = seed
    self._sampler_kwargs = {} if mesh is None else {"mesh": mesh}  # a judge model sharded over this mesh
    limits = {"max_rows_per_device": max_rows_per_device, "prefill_rows_per_device": prefill_rows_per_device,
              "prefill_chunk_tokens": prefill_chunk_tokens}
    for name, value in limits.items():
      if value < 0:
        raise ValueError(f"ModelJudge: {name}={value} must be >= 0 (0: no limit)")
    self._sampler_kwargs.update({name: int(value) for name, value in limits.items() if value})
    if engine not in ("static", "continuous"):
      raise ValueError(f"ModelJudge: engine={engine!r} must be 'static' or 'continuous'")
    if engine != "static":
      self._sampler_kwargs.update(engine=engine, decode_slots=int(decode_slots),
                                  decode_chunk_steps=int(decode_chunk_steps), decode_weights=decode_weights)
    self._generate = generate_fn

  def prompt_ids(self, request: JudgeRequest) -> list[int]:
    return _encode(self.tokenizer, _chat_prompt(self.tokenizer, judge_prompts.build_messages(request)))

  def score(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
    import jax  # pylint: disable=g-import-not-at-top

    results: list[JudgeResult | None] = [None] * len(requests)
    todo = []  # (index, prompt ids)
    for i, request in enumerate(requests):
      ids = self.prompt_ids(request)
      if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
        results[i] = JudgeResult(score=None, text="", latency_s=0.0, tokens_sent=0,
                                 error=f"prompt too long ({len(ids)} > max_prompt_tokens={self.max_prompt_tokens})")
      else:
        todo.append((i, ids))
    rng = jax.random.key(self.seed)  # greedy decoding ignores it; the sampler's signature asks for one
    for start in range(0, len(todo), self.batch_size):
      chunk = todo[start:start + self.batch_size]
      prompts = [ids for _, ids in chunk]
      prompts += [prompts[0]] * (self.batch_size - len(prompts))  # fixed batch shape
      t0 = time.monotonic()
      out = self._generate(self.model, prompts, max_new_tokens=self.max_new_tokens, rng=rng, temperature=0.0,
                           eos_ids=self.eos_ids, pad_id=self.pad_id, **self._sampler_kwargs)
      tokens = np.asarray(out.tokens)  # [batch_size, max_new_tokens]
      lengths = np.asarray(out.lengths)  # [batch_size]
      latency = time.monotonic() - t0
      for row, (i, ids) in enumerate(chunk):
        text = self.tokenizer.decode(tokens[row, :lengths[row]].tolist(), skip_special_tokens=True)
        results[i] = JudgeResult(score=judge_prompts.parse_score(text), text=text, latency_s=latency,
                                 tokens_sent=len(ids))
    return results


def judge_from_config(cfg, *, model=None, tokenizer=None, mesh=None, sampler_limits=None) -> Judge:
  """Builds the judge named by `cfg.kind` ("http" | "model") from the `exprl.judge` config block.

  http: base_url, model_name, timeout_s, max_retries, max_concurrency, max_tokens, on_failure ("skip" | "error"),
  api_key_env (the NAME of an environment variable holding the key, so keys never sit in configs or checkpoints).
  model: the caller loads the judge model and tokenizer (e.g. `models.load_pretrained(cfg.path)`) and passes them;
  max_new_tokens, batch_size, max_prompt_tokens (0: no limit); `sampler_limits` (the config's rollout.*
  max_rows_per_device, prefill_rows_per_device, prefill_chunk_tokens, and engine, decode_slots,
  decode_chunk_steps, decode_weights) bound its sampler's memory and choose how it decodes.
  """
  import os  # pylint: disable=g-import-not-at-top

  kind = cfg.kind
  if kind == "http":
    api_key = None
    if cfg.get("api_key_env", ""):
      api_key = os.environ.get(cfg.api_key_env)
      if not api_key:
        raise JudgeError(f"config exprl.judge.api_key_env={cfg.api_key_env!r}: that environment variable is not set")
    return HttpJudge(cfg.base_url, cfg.model_name, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                     max_concurrency=cfg.max_concurrency, api_key=api_key, max_tokens=cfg.max_tokens,
                     on_failure=cfg.get("on_failure", "skip"))
  if kind == "model":
    if model is None or tokenizer is None:
      raise JudgeError("config exprl.judge.kind='model': pass the loaded judge model and tokenizer to "
                       "judge_from_config(cfg, model=..., tokenizer=...)")
    max_prompt = cfg.get("max_prompt_tokens", 0) or None
    return ModelJudge(model, tokenizer, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                      max_prompt_tokens=max_prompt, mesh=mesh, **(sampler_limits or {}))
  raise JudgeError(f"config exprl.judge.kind={kind!r}: expected 'http' or 'model'")
