"""HTTP to the engines' API and the index's API, as any router would speak it.

The index's answers are decoded with their contract, ``kvlog.answers`` (``ScoreResponse``,
``WorkersResponse``), the structs the index itself encodes. Of the engines' answers only the
fields the demo reads are declared; anything else in an answer is ignored, so the demo keeps
working while those APIs grow. Every call has a timeout: a stuck service must show up as an error
in the demo, never as a hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import aiohttp
import msgspec

from hmakv.kvlog.answers import ScoreResponse, WorkersResponse

T = TypeVar("T")

REQUEST_TIMEOUT_S = 10.0


class Lookup(msgspec.Struct, frozen=True):
    """An engine's real prefix hit for a prompt right now, and the last seq it published."""

    num_cached_tokens: int
    num_prompt_tokens: int
    seq: int


class Admission(msgspec.Struct, frozen=True):
    """The hit an engine granted a request it admitted, and its last seq after admission."""

    request_id: str
    num_cached_tokens: int
    num_prompt_tokens: int
    seq: int


class EngineGroup(msgspec.Struct, frozen=True):
    group_idx: int
    kind: str
    block_size: int
    sliding_window: int | None = None


class Speculation(msgspec.Struct, frozen=True):
    """The index's answer to ``POST /v1/routed``: the blocks it now holds speculatively."""

    worker: str
    speculated_blocks: int


class EngineStatus(msgspec.Struct, frozen=True):
    worker_name: str
    profile: str
    groups: list[EngineGroup]
    seq: int
    num_blocks: int
    blocks_cached: list[int]
    hash_fn: str
    hash_seed: str


class ServiceError(RuntimeError):
    """A service answered with an error status or something that is not its documented JSON."""


class Http:
    """One aiohttp session for the whole run (connections to each service are reused)."""

    def __init__(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=32),
        )

    async def close(self) -> None:
        await self._session.close()

    async def text(self, url: str) -> str:
        return (await self._request("GET", url, None)).decode("utf-8", "replace")

    async def status_code(self, url: str) -> int:
        """The status alone: an error status is an answer here, not a failure."""
        try:
            async with self._session.get(url) as response:
                await response.read()
                return response.status
        except aiohttp.ClientError as error:
            raise ServiceError(f"{url}: {error}") from error

    async def get(self, url: str, answer: type[T]) -> T:
        return _decode(url, await self._request("GET", url, None), answer)

    async def post(self, url: str, document: dict[str, Any], answer: type[T]) -> T:
        return _decode(url, await self._request("POST", url, msgspec.json.encode(document)), answer)

    async def _request(self, method: str, url: str, data: bytes | None) -> bytes:
        """The body of a successful answer; any client error becomes a ``ServiceError``."""
        try:
            headers = {"Content-Type": "application/json"} if data is not None else None
            async with self._session.request(method, url, data=data, headers=headers) as response:
                body = await response.read()
        except aiohttp.ClientError as error:
            raise ServiceError(f"{url}: {error or type(error).__name__}") from error
        _check(url, response.status, body)
        return body


def _check(url: str, status: int, body: bytes) -> None:
    if status >= 400:
        raise ServiceError(f"{url} answered {status}: {body.decode('utf-8', 'replace')[:300]}")


def _decode(url: str, body: bytes, answer: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=answer)
    except msgspec.DecodeError as error:
        raise ServiceError(f"{url} answered unexpected JSON: {error}") from error


class EngineClient:
    """One reference engine's HTTP API."""

    def __init__(self, http: Http, name: str, base_url: str) -> None:
        self.http = http
        self.name = name
        self.base_url = base_url

    async def lookup(self, token_ids: Sequence[int]) -> Lookup:
        return await self.http.post(
            f"{self.base_url}/v1/lookup", {"token_ids": list(token_ids)}, Lookup
        )

    async def request(self, token_ids: Sequence[int], max_tokens: int) -> Admission:
        return await self.http.post(
            f"{self.base_url}/v1/requests",
            {"token_ids": list(token_ids), "max_tokens": max_tokens},
            Admission,
        )

    async def status(self) -> EngineStatus:
        return await self.http.get(f"{self.base_url}/v1/status", EngineStatus)


class IndexClient:
    """The index's score API."""

    def __init__(self, http: Http, base_url: str) -> None:
        self.http = http
        self.base_url = base_url

    async def score(self, token_ids: Sequence[int]) -> ScoreResponse:
        return await self.http.post(
            f"{self.base_url}/v1/score", {"token_ids": list(token_ids)}, ScoreResponse
        )

    async def workers(self) -> WorkersResponse:
        return await self.http.get(f"{self.base_url}/v1/workers", WorkersResponse)

    async def routed(self, token_ids: Sequence[int], worker: str) -> Speculation:
        """Tell the index the prompt goes to ``worker``, as a router does when it decides."""
        document = {"token_ids": list(token_ids), "worker": worker}
        return await self.http.post(f"{self.base_url}/v1/routed", document, Speculation)


class Completion(msgspec.Struct, frozen=True):
    """vLLM's answer to a completion: its usage carries the real prefix hit."""

    usage: Usage


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class Served(msgspec.Struct, frozen=True):
    """What vLLM reported for a prompt it served: its real prefix hit and the prompt's length."""

    cached_tokens: int
    prompt_tokens: int


class VllmClient:
    """A real vLLM server's OpenAI API: prompts as token ids, one greedy token each."""

    def __init__(self, http: Http, name: str, base_url: str, model: str) -> None:
        self.http = http
        self.name = name
        self.base_url = base_url
        self.model = model

    async def healthy(self) -> bool:
        try:
            return await self.http.status_code(f"{self.base_url}/health") == 200
        except ServiceError:
            return False

    async def complete(self, token_ids: Sequence[int], max_tokens: int = 1) -> Served:
        """vLLM's real hit for the prompt (``cached_tokens``), which serving it also caches.

        Without ``--enable-prompt-tokens-details`` vLLM leaves the details out: an error, since
        nothing could be compared.
        """
        document = {
            "model": self.model,
            "prompt": list(token_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        answer = await self.http.post(f"{self.base_url}/v1/completions", document, Completion)
        details = answer.usage.prompt_tokens_details
        if details is None or details.cached_tokens is None:
            raise ServiceError(
                f"{self.base_url}: no usage.prompt_tokens_details.cached_tokens (start vLLM with "
                "--enable-prompt-tokens-details)"
            )
        return Served(details.cached_tokens, answer.usage.prompt_tokens)
