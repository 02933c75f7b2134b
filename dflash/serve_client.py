"""A client of an OpenAI-compatible server (vLLM, SGLang, `transformers serve`): the two requests
`dflash regenerate --server` sends, `/chat/completions` for `messages` rows and `/completions` for text rows,
over httpx (async, one connection per request in flight).

A request that fails in a way that may pass (HTTP 5xx, 408, 429, a timeout, a dropped connection) is retried
after 1, 2, 4, ... s (at most 30 s), `retries` times; then it is a DflashError, one line naming the server and
the row. A refusal (another 4xx) and an answer that is not what the API says (the row named) stop at once. The
API key is read from an environment variable and only ever sent, in the Authorization header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from dflash.errors import DflashError

log = logging.getLogger(__name__)

BACKOFF_S = 1.0  # the first wait before a retry; it doubles with each one, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
RETRYABLE = {408, 429}  # and every 5xx
# where servers put an answer's reasoning: vLLM < 0.11 and SGLang `reasoning_content` (as transformers serve),
# vLLM >= 0.11 `reasoning`, some others `thinking`
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True)
class Answer:
    """One generated turn: its text, its reasoning (or None), its tool calls (or None), why it stopped."""

    content: str
    reasoning: str | None
    tool_calls: list | None
    finish_reason: str | None
    tokens: int  # the server's usage.completion_tokens (0 when it does not say)


def base_url(url: str) -> str:
    """The API's base: the URL as given, or with /v1 when it has no path (http://host:8000)."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def shown(url: str) -> str:
    """The URL without any user:password@ in it, for messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def api_key(env: str | None) -> str | None:
    if env is None:
        return None
    key = os.environ.get(env)
    if not key:
        raise DflashError(f"--api-key-env {env}: that environment variable is not set")
    return key


class ServerClient:
    """Async client of one server; `async with ServerClient(...)` opens its connections."""

    def __init__(self, url: str, *, key: str | None, timeout: float, retries: int, concurrency: int):
        self.url, self.where = base_url(url), f"--server {shown(base_url(url))}"
        self.retries = retries
        self.requests = self.retried = 0
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(base_url=self.url, headers=headers, limits=limits,
                                      timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)))
        self._warned = False

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    # -- the start: is it there, what does it serve ---------------------------------------------------------

    async def model(self, wanted: str | None) -> str:
        """The served model to ask: `wanted`, or the server's only one. The first request of a run: a server
        that is not there is one line naming its URL."""
        try:
            r = await self.http.get("/models")
        except httpx.TransportError as e:
            raise DflashError(f"{self.where}: cannot connect ({_reason(e)}); is the server running?") from None
        if r.status_code in (401, 403):
            raise DflashError(f"{self.where}: the server refused the API key (HTTP {r.status_code}): "
                              f"set the variable --api-key-env names")
        ids = _model_ids(r)
        if ids is None:  # no usable /models: take --model on trust
            if wanted is None:
                raise DflashError(f"{self.where}: GET /models answered HTTP {r.status_code}, not a list of models: "
                                  f"pass --model, and check that this is the API's base URL (e.g. http://HOST:8000/v1)")
            return wanted
        if wanted is None:
            if len(ids) != 1:
                raise DflashError(f"{self.where} serves {len(ids)} models ({', '.join(ids) or 'none'}): pass --model")
            return ids[0]
        if wanted not in ids:  # some servers list other models than the one they serve (transformers 5.17's cache)
            log.warning(f"--model {wanted}: not among the models {shown(self.url)} lists "
                        f"({', '.join(ids) or 'none'}); asking for it all the same")
        return wanted

    # -- the two requests ------------------------------------------------------------------------------------

    async def chat(self, body: dict, where: str) -> Answer:
        data = await self._post("/chat/completions", body, where)
        choice = _choice(data, where, self.where)
        msg = choice.get("message")
        if not isinstance(msg, dict):
            raise _malformed(where, self.where, "choices[0].message is missing")
        content, tool_calls = msg.get("content"), msg.get("tool_calls") or None
        if content is not None and not isinstance(content, str):
            raise _malformed(where, self.where, f"message.content is a {type(content).__name__}, not text")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise _malformed(where, self.where, "message.tool_calls is not a list")
        reasoning = next((msg[k] for k in REASONING_KEYS if isinstance(msg.get(k), str) and msg[k]), None)
        return Answer(content or "", reasoning, tool_calls, _finish(choice, where, self.where), _tokens(data))

    async def complete(self, body: dict, where: str) -> Answer:
        data = await self._post("/completions", body, where)
        choice = _choice(data, where, self.where)
        text = choice.get("text")
        if not isinstance(text, str):
            raise _malformed(where, self.where, "choices[0].text is missing")
        return Answer(text, None, None, _finish(choice, where, self.where), _tokens(data))

    async def _post(self, path: str, body: dict, where: str) -> dict:
        for attempt in range(self.retries + 1):
            self.requests += 1
            try:
                r = await self.http.post(path, json=body)
            except httpx.TimeoutException:
                reason = f"no answer within --timeout {self.http.timeout.read:g} s"
            except httpx.TransportError as e:
                reason = _reason(e)
            else:
                if r.status_code < 400:
                    return _json(r, where, self.where)
                if r.status_code < 500 and r.status_code not in RETRYABLE:
                    raise DflashError(f"{where}: {self.where} refused the request "
                                      f"(HTTP {r.status_code}: {_detail(r)})")
                reason = f"HTTP {r.status_code}: {_detail(r)}"
            if attempt == self.retries:
                break
            wait = min(BACKOFF_S * 2**attempt, BACKOFF_MAX_S)
            if not self._warned:  # once a run: the failure that ends it is the line that counts
                self._warned = True
                log.warning(f"{self.where}: {reason} ({where}); retrying (up to {self.retries} times a request, "
                            f"waiting {BACKOFF_S:g} s doubling)")
            self.retried += 1
            await asyncio.sleep(wait)
        raise DflashError(f"{self.where}: {reason} ({where}), {self.retries + 1} tries")


def _reason(e: Exception) -> str:
    """A transport error in words: the system's own (`Connection refused`) where one lies under it."""
    cause, seen = e, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
        cause = cause.__cause__ or cause.__context__
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _model_ids(r: httpx.Response) -> list[str] | None:
    try:
        data = r.json()["data"] if r.status_code == 200 else None
        return [m["id"] for m in data] if isinstance(data, list) else None
    except (ValueError, KeyError, TypeError):
        return None


def _detail(r: httpx.Response) -> str:
    """What an error answer says, on one line (FastAPI's `detail`, OpenAI's `error.message`, or its text)."""
    try:
        data = r.json()
        text = data.get("detail") or (data.get("error") or {}).get("message") or data.get("message") or data
    except (ValueError, AttributeError):
        text = r.text
    text = " ".join(str(text).split())
    return text[:200] + ("..." if len(text) > 200 else "") or r.reason_phrase


def _malformed(where: str, server: str, what: str) -> DflashError:
    return DflashError(f"{where}: malformed response from {server} ({what})")


def _json(r: httpx.Response, where: str, server: str) -> dict:
    try:
        data = r.json()
    except (ValueError, UnicodeDecodeError):
        raise _malformed(where, server, f"not JSON: {r.text[:60]!r}") from None
    if not isinstance(data, dict):
        raise _malformed(where, server, f"a JSON {type(data).__name__}, not an object")
    return data


def _choice(data: dict, where: str, server: str) -> dict:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        if "error" in data:
            raise DflashError(f"{where}: {server} answered with an error ({json.dumps(data['error'])[:200]})")
        raise _malformed(where, server, "no choices")
    return choices[0]


def _finish(choice: dict, where: str, server: str) -> str | None:
    reason = choice.get("finish_reason")
    if reason is not None and not isinstance(reason, str):
        raise _malformed(where, server, f"finish_reason {reason!r}")
    return reason


def _tokens(data: dict) -> int:
    usage = data.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) else 0
