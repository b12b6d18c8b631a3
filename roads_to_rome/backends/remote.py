"""The backend contract (base.py) for an LLM on a serving engine the user already runs.

R2R's SLM and router run where `r2r` runs; the LLM is any llama.cpp or vLLM server the user points
`--llm` at: `--llm http://host:port` (`?model=NAME` picks a served model, `?engine=llamacpp|vllm`
skips detection). Nothing is patched: each row of a batch is one ordinary completion request whose
prompt is the row's token ids so far, asking for one token and its top log-probabilities, and the
server's prefix cache makes it read only what is new. The rows go out concurrently, so the server
batches them.

The cache is therefore only each row's token ids (what the server has been shown); the logits are
the server's top-`top_logprobs` log-probabilities, every other token at a floor far below them.
That is exact for greedy decoding and for verification's greedy and tolerance rules (the argmax,
and a token's own log-probability whenever it is among the top); sampling draws from those top
tokens with the engine's own seeded generator, and the speculative sampling test, which needs the
whole distribution, is refused (`full_logits`)."""

from __future__ import annotations

import multiprocessing.pool
import os
import re
import threading
import time
import urllib.parse
import weakref
from dataclasses import dataclass, field

import httpx
import torch

from roads_to_rome.errors import LLMUnavailable, R2RError, RemoteError

# Seconds a failing catch-up is retried before the requests that need it fail: a network blip or a llama.cpp
# server's restart (seconds, its weights mapped) fits; a vLLM restart (minutes: it compiles) does not, and a client
# is better told at once (503 with Retry-After) than held that long.
DEFAULT_LLM_RETRY = 30.0
RETRYABLE_STATUS = (500, 502, 503, 504)  # a server restarting, overloaded or behind a proxy that lost it
# A call unanswered this long (or calls failing this long) marks the server stalled in /health, well before the retry
# budget is spent; longer than one catch-up takes on a loaded CPU server.
STALLED_AFTER_S = 5.0
# The most tokens one request of a catch-up asks the server to write: where the row's tokens leave the server's way
# early, the rest of a longer request is thrown away (a row that waited long for the LLM has many unread tokens).
GREEDY_SPAN = 4
API_KEY_VARIABLE = "R2R_LLM_API_KEY"
FLOOR = -1e9  # the logit of tokens outside the server's top log-probabilities: finite, so no NaN downstream
PROBE = "Roads to Rome: 12 × 7 = 84, naïve café ☕ — ok?\n<|im_end|>"  # digits, accents, an emoji, a special


def is_remote(spec: str | None) -> bool:
    return spec is not None and spec.startswith(("http://", "https://"))


def without_credentials(address: str) -> str:
    """An address as it may be shown: any user:password@ left out."""
    parts = urllib.parse.urlsplit(address)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass
class RemoteCache:
    rows: list[list[int]] = field(default_factory=list)  # each row's real tokens sent so far (no padding)
    length: int = 0  # columns of the token streams already read
    salts: list[str | None] = field(default_factory=list)  # each row's cache_salt, as last tagged (`tag_rows`)

    def salt(self, row: int) -> str | None:
        return self.salts[row] if row < len(self.salts) else None


# a token the server chose greedily, and the top log-probabilities it chose from
ServerToken = tuple[int, dict[int, float]]


class ServerApi:
    """An engine's HTTP API as the backend needs it: the served model's card, `tokenize`, and `greedy` (up to n
    tokens the server chooses itself, each with the top log-probabilities it chose from)."""

    engine: str
    prefix_cache = "per token"  # how the server's prefix cache reuses a row's tokens, as `kernels` names it
    scores_prompts = False  # whether it gives a prompt's own log-probabilities (`prompt_logprobs`)

    def __init__(self, client: Client, model: str | None):
        self.client = client
        models = client.get("/v1/models")["data"]
        self.model = pick_model(models, model, client.url)
        self.card = next(m for m in models if m["id"] == self.model)


class LlamaServerApi(ServerApi):
    """llama.cpp's own server (`llama-server`, or xllamacpp's embedded one): /completion takes token ids."""

    engine = "llamacpp"

    def __init__(self, client: Client, model: str | None):
        super().__init__(client, model)
        meta, props = self.card.get("meta", {}), client.get("/props")
        self.max_context = int(props.get("default_generation_settings", {}).get("n_ctx") or meta.get("n_ctx") or 0)
        self.num_params = int(meta.get("n_params") or 0)
        self.slots = int(props.get("total_slots") or 1)

    def tokenize(self, text: str) -> list[int]:
        return self.client.post("/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]

    def greedy(self, ids: list[int], n: int, top: int, salt: str | None = None) -> list[ServerToken]:
        # (llama.cpp's server has no cache salt: its slots reuse any request's prompt; docs/serving.md says so)
        out = self.client.post("/completion", {"prompt": ids, "n_predict": n, "n_probs": top, "temperature": 0,
                                               "cache_prompt": True, "return_tokens": True})
        # The server drops the probabilities of a token that ends inside a UTF-8 character (its text is held
        # back), so they are a subsequence of `tokens`: matched in order by id. Such a token keeps only what
        # the server chose (its argmax).
        probs, steps = out.get("completion_probabilities") or [], []
        for token in map(int, out.get("tokens") or []):
            if probs and int(probs[0]["id"]) == token:
                steps.append((token, {int(p["id"]): float(p["logprob"]) for p in probs.pop(0)["top_logprobs"]}))
            else:
                steps.append((token, {token: 0.0}))
        return steps


class VllmApi(ServerApi):
    """vLLM's OpenAI-compatible server: /v1/completions takes token ids and returns them as "token_id:N"."""

    engine = "vllm"
    scores_prompts = True

    def __init__(self, client: Client, model: str | None):
        super().__init__(client, model)
        self.max_context = int(self.card.get("max_model_len") or 0)
        self.num_params = 0  # vLLM does not say; `?params=` in the address does
        self.slots = 64  # it schedules as many as fit; this many requests go out at once
        self.prefix_cache = vllm_prefix_cache(client)

    def tokenize(self, text: str) -> list[int]:
        return self.client.post("/tokenize", {"model": self.model, "prompt": text,
                                              "add_special_tokens": False})["tokens"]

    def greedy(self, ids: list[int], n: int, top: int, salt: str | None = None) -> list[ServerToken]:
        out = self.client.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": n,
                                                   "temperature": 0, "logprobs": top,
                                                   "return_tokens_as_token_ids": True, **salted(salt)})
        logprobs = out["choices"][0].get("logprobs") or {}
        steps = []
        for token, tops in zip(logprobs.get("tokens") or [], logprobs.get("top_logprobs") or []):
            steps.append((token_id(token), {token_id(k): float(v) for k, v in (tops or {token: 0.0}).items()}))
        return steps

    def prompt_logprobs(self, ids: list[int], top: int, salt: str | None = None
                        ) -> list[dict[int, tuple[float, int]]]:
        """vLLM's `prompt_logprobs`: for each token after the first, its log-probability and rank there, and the
        `top` most likely tokens' (by token id)."""
        out = self.client.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                                   "temperature": 0, "prompt_logprobs": top, **salted(salt)})
        entries = out["choices"][0].get("prompt_logprobs") or []
        if len(entries) != len(ids):
            raise RemoteError(f"the LLM server at {self.client.url} scored {len(entries)} positions of a "
                              f"{len(ids)}-token prompt")
        return [{int(token): (float(entry["logprob"]), int(entry["rank"])) for token, entry in position.items()}
                for position in entries[1:]]


def vllm_prefix_cache(client: Client) -> str:
    """How vLLM's prefix cache reuses a row, from its metrics: in whole KV blocks only, so each request re-reads
    up to a block's worth of tokens the server has seen (vLLM's CPU build defaults to 128-token blocks)."""
    try:
        metrics = client.text("/metrics")
    except RemoteError:
        return "unknown"  # metrics off (--disable-log-stats) or not served
    config = re.search(r"^vllm:cache_config_info\{(.*)\}", metrics, re.MULTILINE)
    if config is None:
        return "unknown"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', config.group(1)))
    if labels.get("enable_prefix_caching") == "False":
        return "off"
    return f"{labels['block_size']}-token blocks" if "block_size" in labels else "unknown"


def salted(salt: str | None) -> dict:
    """vLLM's `cache_salt` field, where a request has one: its prefix cache reuses only blocks read with it."""
    return {} if salt is None else {"cache_salt": salt}


def token_id(text: str) -> int:
    """vLLM's "token_id:N" (return_tokens_as_token_ids) as N."""
    return int(text.removeprefix("token_id:"))


ENGINES = {"llamacpp": LlamaServerApi, "vllm": VllmApi}


def pick_model(models: list[dict], asked: str | None, url: str) -> str:
    ids = [m["id"] for m in models]
    if asked is not None:
        if asked not in ids:
            raise R2RError(f"the LLM server at {url} does not serve {asked!r}; it serves {', '.join(map(repr, ids))}")
        return asked
    if len(ids) != 1:
        raise R2RError(f"the LLM server at {url} serves {len(ids)} models ({', '.join(map(repr, ids))}): name one "
                       "with ?model=NAME in the --llm address")
    return ids[0]


class Client:
    """JSON over HTTP with a timeout per call, the server's key (a Bearer token, or credentials in the URL: sent, never
    shown: `url` is the address without them), and retries with backoff for `retry` seconds while the server
    cannot be reached, drops the connection, times out or answers 5xx: every call the backend makes is a read of
    token ids with prefix caching, so repeating one changes nothing. Past the budget: `LLMUnavailable`, and the
    server counts as down (`down_since`) until a call or a probe (`reachable`) gets through."""

    def __init__(self, url: str, timeout: float, retry: float, api_key: str | None = None):
        # An OpenAI client's base URL (http://host:port/v1) names the same server: every call here adds /v1 itself,
        # and llama-server's /tokenize and vLLM's /metrics live at the root.
        url = url.rstrip("/").removesuffix("/v1")
        parts = urllib.parse.urlsplit(url)
        auth, headers = None, {}
        if parts.username is not None or parts.password is not None:
            if api_key is not None:
                raise R2RError("the --llm address holds credentials and an LLM API key was given too: give one")
            auth = httpx.BasicAuth(urllib.parse.unquote(parts.username or ""),
                                   urllib.parse.unquote(parts.password or ""))
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        self.url, self.retry = without_credentials(url), retry
        self.http = httpx.Client(base_url=self.url, timeout=timeout, limits=httpx.Limits(max_connections=64),
                                 auth=auth, headers=headers)
        self.down_since: float | None = None
        # Since when the server has refused connections (None: the last attempt connected). A refused connection
        # says at once that nothing listens there: /health says so before the retry budget is spent.
        self.refused_since: float | None = None
        self.last_probe = 0.0
        # The start times of the calls waiting for an answer, retries included: what tells a stalled or failing
        # server before the retry budget is spent (`waiting_for`).
        self.waiting: dict[int, float] = {}
        self.lock = threading.Lock()

    def waiting_for(self) -> float:
        """Seconds the oldest call still waiting (or retrying) has waited: 0 while answers come."""
        now = time.monotonic()
        with self.lock:
            return now - min(self.waiting.values(), default=now)

    def get(self, path: str) -> dict:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict) -> dict:
        return self._call("POST", path, body)

    def text(self, path: str) -> str:
        return self._call("GET", path, None, as_json=False)

    def reachable(self, every: float = 1.0) -> bool:
        """Whether the server is up: at once while no call has given up on it; once it has, a quick probe of
        `/v1/models` at most every `every` seconds, so that serving resumes by itself when it is back."""
        if self.down_since is None:
            return True
        if time.monotonic() - self.last_probe >= every:
            self.last_probe = time.monotonic()
            try:
                if self.http.get("/v1/models", timeout=2.0).status_code == 200:
                    self.down_since = self.refused_since = None
            except httpx.HTTPError:
                pass
        return self.down_since is None

    def _call(self, method: str, path: str, body: dict | None, as_json: bool = True) -> dict | str:
        if not self.reachable():  # known to be away: the probe says when it is back, no call waits out the budget
            raise LLMUnavailable(f"the LLM server at {self.url} is unavailable (down for "
                                 f"{time.monotonic() - self.down_since:.0f} s)", self.url)
        start, attempt, key = time.monotonic(), 0, object()
        with self.lock:
            self.waiting[id(key)] = start  # the whole call, its retries included: what a stalled server holds up
        try:
            while True:
                try:
                    response = self.http.request(method, path, json=body)
                    self.refused_since = None
                    if response.status_code not in RETRYABLE_STATUS:
                        break
                    why = f"it answered {response.status_code}"
                except httpx.TimeoutException:
                    why = f"no answer to {method} {path} within {self.http.timeout.read:.0f} s"
                except httpx.TransportError as e:  # refused, reset, closed mid-answer: whatever the socket says
                    why = f"{type(e).__name__}: {e}"
                    if isinstance(e, httpx.ConnectError) and self.refused_since is None:
                        self.refused_since = time.monotonic()
                pause = min(0.25 * 2**attempt, 4.0)
                if time.monotonic() - start + pause > self.retry:
                    if self.down_since is None:
                        self.down_since = time.monotonic()
                    raise LLMUnavailable(f"the LLM server at {self.url} is unavailable ({why}); tried for "
                                         f"{time.monotonic() - start:.0f} s (--llm-retry {self.retry:g})", self.url)
                time.sleep(pause)
                attempt += 1
        finally:
            with self.lock:
                self.waiting.pop(id(key), None)
        self.down_since = None
        if response.status_code in (401, 403):
            sent_key = self.http.auth is not None or "Authorization" in self.http.headers
            said = "refused the key" if sent_key else "needs an API key"
            raise RemoteError(f"the LLM server at {self.url} {said} (it answered {response.status_code}): give the "
                              "key it was started with (--api-key there) as --llm-api-key or $R2R_LLM_API_KEY")
        if response.status_code == 404:
            raise RemoteError(f"the LLM server at {self.url} has no {path} (it answered 404): give the address of a "
                              "vLLM or llama.cpp server, http://host:port")
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except Exception:
                message = response.text[:300]
            raise RemoteError(f"the LLM server at {self.url} refused {method} {path} ({response.status_code}): "
                              f"{message}")
        if not as_json:
            return response.text
        try:
            return response.json()
        except ValueError:
            raise RemoteError(f"the LLM server at {self.url} answered {method} {path} with something other than "
                              "JSON: is it an LLM server?") from None


class RemoteBackend:
    remote = True
    device = torch.device("cpu")
    kv_capacity = None  # the server manages its own memory
    max_rows = None  # rows beyond the server's slots wait there
    full_logits = False  # only the server's top log-probabilities: no exact speculative sampling test
    grouped_reads = False  # unknown from here: grouping is asked for with --defer continue
    hidden_size = 1  # the LLM's hidden state is never used (the router reads the SLM's)

    def __init__(self, address: str, tokenizer, eos_ids: set[int], timeout: float = 120.0,
                 retry: float = DEFAULT_LLM_RETRY, top_logprobs: int = 20, vocab_size: int | None = None,
                 api_key: str | None = None):
        """`address`: the server's URL, optionally with ?model=NAME, ?engine=llamacpp|vllm and ?params=N (the
        LLM's parameter count, for the average-parameters figure, where the server does not report it).
        `tokenizer`: the SLM's, which the server's model must share (checked here). `timeout`: seconds one call
        may take; `retry`: seconds a failing call is retried (`Client`). `api_key`: the server's key, sent as a Bearer
        token (None: $R2R_LLM_API_KEY, if set)."""
        if retry < 0:
            raise R2RError(f"--llm-retry is a number of seconds, at least 0, not {retry:g}")
        parts, shown = urllib.parse.urlsplit(address), without_credentials(address)
        query = dict(urllib.parse.parse_qsl(parts.query))
        unknown = set(query) - {"model", "engine", "params"}
        if unknown:
            raise R2RError(f"--llm {shown}: unknown setting(s) {', '.join(sorted(unknown))} (use model=, engine=, "
                           "params=)")
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        api_key = os.environ.get(API_KEY_VARIABLE) if api_key is None else api_key
        if api_key is not None and not api_key.strip():
            raise R2RError(f"the LLM API key is empty (--llm-api-key / ${API_KEY_VARIABLE}): give the key, or none")
        self.client = Client(url, timeout, retry, api_key)
        url = self.client.url  # without credentials, for every message from here on
        engine = query.get("engine") or self._detect()
        if engine not in ENGINES:
            raise R2RError(f"--llm {shown}: engine {engine!r} is not supported (use {', '.join(ENGINES)})")
        self.api = ENGINES[engine](self.client, query.get("model"))
        self.name = self.api.model
        self.kernels = f"{engine} server at {url} (prefix cache: {self.api.prefix_cache})"
        self.top_logprobs = top_logprobs
        self.vocab_size = vocab_size or len(tokenizer)
        self.eos_ids = set(eos_ids)
        self.max_context = self.api.max_context
        try:
            self.num_params = int(float(query.get("params", self.api.num_params)))
        except ValueError:
            raise R2RError(f"--llm {shown}: params= takes a number of parameters, e.g. params=1.5e9") from None
        # Daemon threads: a call waiting on a server that stopped answering must not keep the process from exiting.
        self.pool = multiprocessing.pool.ThreadPool(max(8, self.api.slots))
        # Closed with the backend or at exit, not left to the interpreter's teardown: there the pool's own finalizer
        # writes to a pipe already closed, a traceback printed after an error's message.
        weakref.finalize(self, self.pool.close)
        self._check_tokenizer(tokenizer)

    def health(self) -> dict | None:
        """None while the server answers; else what a health check reports of it (the server's `/health`):
        `unavailable` once a call has spent its retry budget (requests that need the LLM are refused until a probe
        gets through), `refusing` from the first refused connection while calls retry, `stalled` while a call has
        waited (or kept retrying) for `STALLED_AFTER_S`."""
        client = self.client
        if not client.reachable():
            return {"status": "unavailable", "url": client.url,
                    "down_for_s": round(time.monotonic() - (client.down_since or 0), 1)}
        if client.refused_since is not None:
            return {"status": "refusing", "url": client.url,
                    "refusing_for_s": round(time.monotonic() - client.refused_since, 1)}
        waited = client.waiting_for()
        if waited >= STALLED_AFTER_S:
            return {"status": "stalled", "url": client.url, "waiting_for_s": round(waited, 1)}
        return None

    def _detect(self) -> str:
        owners = {m.get("owned_by") for m in self.client.get("/v1/models").get("data", [])}
        for engine in ENGINES:
            if engine in owners:
                return engine
        raise RemoteError(f"cannot tell which engine serves {self.client.url} (/v1/models says owned_by "
                          f"{', '.join(map(str, owners)) or 'nothing'}): add ?engine=llamacpp or ?engine=vllm "
                          "to the --llm address")

    def _check_tokenizer(self, tokenizer) -> None:
        ours = tokenizer.encode(PROBE, add_special_tokens=False)
        theirs = self.api.tokenize(PROBE)
        if ours != theirs:
            raise R2RError(f"the LLM at {self.client.url} ({self.api.model}) does not share the SLM's tokenizer "
                           f"(a probe text gives {len(theirs)} tokens there, {len(ours)} here): R2R needs one "
                           "tokenizer for both models")

    def new_cache(self) -> RemoteCache:
        return RemoteCache()

    def read(self, cache: RemoteCache, new_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Only remembers the ids: the server reads them with the row's next request (its prefix cache keeps
        what it has read), so a request that never needs the LLM never reaches it."""
        n = new_ids.shape[1]
        if not cache.rows:
            cache.rows = [[] for _ in range(new_ids.shape[0])]
        new_mask = attention_mask[:, attention_mask.shape[1] - n :]
        for row, ids, keep in zip(cache.rows, new_ids.tolist(), new_mask.tolist()):
            row.extend(t for t, k in zip(ids, keep) if k)  # padding is never sent
        cache.length += n

    def forward(self, cache: RemoteCache, new_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.read(cache, new_ids, attention_mask)
        # the rows at once: the server batches them
        tops = list(self.pool.map(lambda i: self._greedy(cache.rows[i], 1, cache.salt(i))[0][1],
                                  range(len(cache.rows))))
        logits = torch.full((len(cache.rows), self.vocab_size), FLOOR)
        for i, top in enumerate(tops):
            self._fill(logits[i], top)
        return logits, torch.zeros(len(cache.rows), self.hidden_size)

    def forward_all(self, cache: RemoteCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                    keep_last: int | None = None, row_keep: list[int] | None = None) -> torch.Tensor:
        """The logits at the last `keep_last` columns of each row, by letting the server continue greedily from
        the first of them: while its tokens are the row's, one request gives every position's top
        log-probabilities (reading its prefix cache, which prompt log-probabilities would bypass); where it
        chose otherwise, the next positions come from a request that continues after the row's own token. A row
        that needs none of them (`row_keep`) is not sent."""
        self.read(cache, new_ids, attention_mask)
        keep = new_ids.shape[1] if keep_last is None else keep_last
        wanted = row_keep or [keep] * len(cache.rows)

        def row_tops(i: int) -> list[tuple[int, dict[int, float]]]:
            row = cache.rows[i]
            if not wanted[i]:
                return []
            first = len(row) - keep  # the row position of the first kept column (negative: padding)
            position, tops = max(first, len(row) - wanted[i], 0), []
            while position < len(row):
                for token, top in self._greedy(row[: position + 1], min(len(row) - position, GREEDY_SPAN),
                                               cache.salt(i)):
                    tops.append((position - first, top))
                    position += 1
                    if position == len(row) or token != row[position]:
                        break  # past the end, or the server went elsewhere: ask again after the row's token
            return tops

        # The pool's threads only talk to the server: a tensor operation there would give each of them a team of
        # intra-op threads of its own.
        out = torch.zeros(len(cache.rows), keep, self.vocab_size)  # padding columns: zeros
        for i, tops in enumerate(self.pool.map(row_tops, range(len(cache.rows)))):
            for column, top in tops:
                out[i, column].fill_(FLOOR)
                self._fill(out[i, column], top)
        return out

    def complete(self, cache: RemoteCache, new_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations the server writes itself, one request per row (at once), ending before an EOS:
        what the label pipeline asks of an LLM alone, without a request per token."""
        self.read(cache, new_ids, attention_mask)

        def one(ids: list[int]) -> list[int]:
            out = [token for token, _ in self.api.greedy(ids, max_new_tokens, 0)]
            ends = [i for i, token in enumerate(out) if token in self.eos_ids]
            return out[: ends[0]] if ends else out

        return list(self.pool.map(one, cache.rows))

    def _greedy(self, ids: list[int], n: int, salt: str | None = None) -> list[ServerToken]:
        """At least the first of the n tokens the server chooses after `ids`, with their top log-probabilities."""
        steps = self.api.greedy(ids, n, self.top_logprobs, salt)
        if not steps:
            raise RemoteError(f"the LLM server at {self.client.url} returned no token for a {len(ids)}-token prompt")
        return steps

    def _fill(self, logits: torch.Tensor, top: dict[int, float]) -> None:
        for token, logprob in top.items():
            if token < self.vocab_size:
                logits[token] = logprob

    def forward_sequence(self, ids: list[int], start: int = 0):
        raise R2RError("a remote LLM gives no hidden states: this step needs a local model")

    def score_sequence(self, ids: list[int], cache: RemoteCache, each_chunk) -> None:
        raise R2RError("a remote LLM's prompt log-probabilities come from its server (prompt_logprobs)")

    @property
    def scores_prompts(self) -> bool:
        return self.api.scores_prompts

    def prompt_logprobs(self, ids: list[int], top: int, salt: str | None = None
                        ) -> list[dict[int, tuple[float, int]]]:
        """For each of the sequence's tokens after the first: its log-probability and rank under the LLM, and the
        `top` most likely tokens' there (by token id), as the server computes them (vLLM's `prompt_logprobs`).
        The server reads the whole sequence for this, past its prefix cache."""
        if not self.scores_prompts:
            raise R2RError(f"the {self.api.engine} server at {self.client.url} gives no prompt log-probabilities")
        return self.api.prompt_logprobs(ids, top, salt)

    def tag_rows(self, cache: RemoteCache, salts: list[str | None]) -> None:
        cache.salts = list(salts)

    def select_rows(self, cache: RemoteCache, rows: torch.Tensor) -> None:
        if cache.rows:  # (nothing read yet: its rows come with its first read)
            cache.rows = [cache.rows[i] for i in rows.tolist()]

    def copy_rows(self, cache: RemoteCache, rows: list[int]) -> RemoteCache:
        return RemoteCache([list(cache.rows[row]) for row in rows], cache.length)

    def append_rows(self, cache: RemoteCache, other: RemoteCache) -> None:
        cache.rows += other.rows
        other.rows = []

    def pad_left(self, cache: RemoteCache, n: int) -> None:
        if cache.length:  # (padding is never sent)
            cache.length += n

    def truncate(self, cache: RemoteCache, length: int) -> None:
        drop = cache.length - length
        if drop > 0:  # the last columns are real tokens in every row (padding is on the left)
            cache.rows = [row[: max(0, len(row) - drop)] for row in cache.rows]
            cache.length = length

    def trim_left(self, cache: RemoteCache, n: int) -> None:
        if cache.length:  # (padding is never sent)
            cache.length -= n

    def shift_rows(self, cache: RemoteCache, shifts: list[int]) -> None:
        cache.rows = [row[: max(0, len(row) - s)] if s else row for row, s in zip(cache.rows, shifts)]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        raise R2RError("a remote LLM has no embedding table here: the router reads the SLM's")

    def embedding_table(self) -> torch.Tensor:
        raise R2RError("a remote LLM has no embedding table here: the router reads the SLM's")
