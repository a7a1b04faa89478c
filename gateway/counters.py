"""Shared counters behind rate limits and spend budgets.

One subject (a virtual key, or a tenant over all its keys) has four counters: requests and tokens
in the current minute, and USD spent in the current UTC day and month. `admit` checks every limit and, only if all pass,
counts the request, its prompt tokens and its *reservation* (the most output and USD it may cost),
atomically, in one round trip (a Lua script in Redis, so several gateway replicas share one limit).
A request of a tenant with its own limits is admitted against its key's and its tenant's counters in
the same script: both admit it and count it, or neither does, so concurrent requests on several keys
of one tenant overspend the tenant's budget by at most one reservation too.
Once the request is over `charge_many` settles it: it adds the difference between what was produced
and what was reserved (usually negative), for many requests in one round trip. So N concurrent
requests cannot overspend together: each one's worst case is counted before it runs, and a budget is
exceeded by at most the reservation of the request admitted last below it. Each settlement has an id,
marked applied by the script that applies it: one sent again (its reply was lost, its spool was
replayed twice) changes nothing.

Windows are fixed (the minute, the UTC day, the UTC month), so `Retry-After` is exact: the
seconds until the window that refused the request ends. An admission also says what it left of the
minute's request and token limits (`MinuteLeft`: the reply's `x-ratelimit-*` headers, as OpenAI sends).

When Redis cannot be reached the gateway either refuses requests (fail closed, the default) or,
with `redis.when_unavailable = "local"`, counts in this replica's memory until Redis answers again
(`LocalFallbackCounterStore`): every limit still holds per replica, none is shared meanwhile.
"""

from __future__ import annotations

import calendar
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.redis_client import MultiplexedRedis

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

LimitName = Literal["rpm", "tpm", "spend_per_day", "spend_per_month"]
_REASONS: tuple[LimitName, ...] = ("rpm", "tpm", "spend_per_day", "spend_per_month")
_WINDOW_TTL_S = 120  # a minute window outlives its minute a little, then expires
# A settlement's id is remembered this long after it was applied: a copy sent again later (a reply lost,
# then Redis out of reach, or this gateway stopped with it spooled, for longer than this) would apply
# again. One id per round trip of the charge batcher and minute (at most one per settled request; fewer
# when a round trip carries many), 104 bytes each in Redis 7 (`MEMORY USAGE`).
SETTLEMENT_ID_TTL_S = 2 * 86400
# Once its sender keeps a settlement no more (answered, and its spool segment deleted), its id is kept
# this long only: a copy still travelling (written on a connection that timed out, delivered late by
# TCP's retransmissions, which give up within ~15 minutes) still finds it. So ids held in Redis are
# about an hour of round trips, besides those of settlements whose answer was lost.
SETTLEMENT_ID_GRACE_S = 3600
# In process, where a settlement is never refused (so its sender never sends it again), memory is
# spent on the most recent ids only (the batcher's round trips to it come at most every
# CHARGE_COALESCE_S: that is over 20 minutes of them).
_IN_PROCESS_IDS_MAX = 1 << 16


class CountersUnavailable(Exception):
    """The shared counters cannot be read or written (Redis is down or unreachable)."""


@dataclass(frozen=True, slots=True)
class Charge:
    """What requests of one subject produced, to add to its counters."""

    completion_tokens: int = 0
    cost_usd: float = 0.0

    def __add__(self, other: Charge) -> Charge:
        return Charge(self.completion_tokens + other.completion_tokens, self.cost_usd + other.cost_usd)

    def __sub__(self, other: Charge) -> Charge:
        return Charge(self.completion_tokens - other.completion_tokens, self.cost_usd - other.cost_usd)


@dataclass(frozen=True, slots=True)
class Settlement:
    """Charges to subjects' counters, applied once: sent again under the same `id` it changes nothing."""

    id: str
    charges: Mapping[str, Charge]


@dataclass(frozen=True, slots=True)
class Limits:
    """None: unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    spend_per_day_usd: float | None = None
    spend_per_month_usd: float | None = None


@dataclass(frozen=True, slots=True)
class MinuteLeft:
    """What is left this minute under the tightest request and token limits of the subjects admitted
    together (None: no such limit), and the seconds until the minute ends."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_s: float = 0.0

    @classmethod
    def after(cls, limits: Sequence[Limits], used: Sequence[tuple[int, int]], reset_s: float) -> MinuteLeft:
        """From each subject's limits and its (requests, tokens) counted this minute, admission included."""
        requests = [(its.rpm, its.rpm - r) for its, (r, _) in zip(limits, used, strict=True) if its.rpm is not None]
        tokens = [(its.tpm, its.tpm - t) for its, (_, t) in zip(limits, used, strict=True) if its.tpm is not None]
        tightest_requests = min(requests, key=lambda pair: pair[1], default=(None, None))
        tightest_tokens = min(tokens, key=lambda pair: pair[1], default=(None, None))
        return cls(tightest_requests[0], _floor0(tightest_requests[1]), tightest_tokens[0],
                   _floor0(tightest_tokens[1]), reset_s)  # fmt: skip


def _floor0(value: int | None) -> int | None:
    return None if value is None else max(0, value)


@dataclass(frozen=True, slots=True)
class Admission:
    refused_by: LimitName | None  # None: admitted
    retry_after_s: int = 0
    refused_subject: int = 0  # which subject refused: 0 the first, 1 the first of `also`, ...
    local: bool = False  # counted in this replica's memory (Redis was down): its settlement goes there too
    minute: MinuteLeft = MinuteLeft()  # of an admitted request: what it left of the minute's limits

    @property
    def admitted(self) -> bool:
        return self.refused_by is None


@dataclass(frozen=True, slots=True)
class Windows:
    """The current window of each counter, and how long until each ends."""

    minute: int
    day: str
    month: str
    minute_left_s: float
    day_left_s: float
    month_left_s: float

    @classmethod
    def at(cls, now: float) -> Windows:
        day, month, day_start, month_end = _utc_day(int(now // 86400))
        return cls(
            minute=int(now // 60),
            day=day,
            month=month,
            minute_left_s=60 - now % 60,
            day_left_s=day_start + 86400 - now,
            month_left_s=month_end - now,
        )

    def retry_after(self, refused_by: LimitName) -> int:
        left = {
            "rpm": self.minute_left_s,
            "tpm": self.minute_left_s,
            "spend_per_day": self.day_left_s,
            "spend_per_month": self.month_left_s,
        }[refused_by]
        return max(1, math.ceil(left))


@functools.lru_cache(maxsize=4)
def _utc_day(day_number: int) -> tuple[str, str, int, int]:
    """The day's and month's counter names, the day's start and the month's end (epoch seconds)."""
    t = time.gmtime(day_number * 86400)
    next_month = (t.tm_year + t.tm_mon // 12, t.tm_mon % 12 + 1)
    month_end = calendar.timegm((*next_month, 1, 0, 0, 0))
    return (
        f"{t.tm_year:04d}{t.tm_mon:02d}{t.tm_mday:02d}",
        f"{t.tm_year:04d}{t.tm_mon:02d}",
        day_number * 86400,
        month_end,
    )


Subjects = Sequence[tuple[str, Limits]]  # further subjects admitted together with the first


class CounterStore(Protocol):
    async def admit(
        self,
        subject: str,
        limits: Limits,
        prompt_tokens: int,
        now: float,
        reserve: Charge = Charge(),
        also: Subjects = (),
    ) -> Admission:
        """Check every limit of `subject` and of each of `also`; only if all pass, count the request
        and reserve `reserve` for each of them, atomically."""
        ...

    async def charge_many(
        self, settlements: Sequence[Settlement], now: float, local: bool = False, forget: Sequence[str] = ()
    ) -> None:
        """Apply each of `settlements` whose id was not applied before, in one round trip: settlements of
        requests admitted with `Admission.local` (`local`), or not. `forget`: ids of settlements applied
        before that their sender keeps no more, kept only SETTLEMENT_ID_GRACE_S from now."""
        ...

    async def spent(self, subject: str, now: float) -> tuple[float, float]:
        """USD spent in the current day and month."""
        ...


def _limit_arg(value: float | None) -> str:
    return "-1" if value is None else repr(value)


# KEYS: per subject, requests-this-minute, tokens-this-minute, spend-today, spend-this-month.
# ARGV: prompt tokens, reserved output tokens, reserved USD, minute/day/month TTLs, then per subject
# rpm, tpm, day budget, month budget (< 0: unlimited).
# Returns {0, then per subject its requests and tokens this minute, this one counted} when admitted,
# else {4 × (0-based subject index) + the 1-based index of the refusing limit in _REASONS}. Every
# subject is checked before any is counted: all or nothing.
_ADMIT_LUA = """
local prompt, out, usd = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local subjects = #KEYS / 4
for s = 0, subjects - 1 do
  local k, a = s * 4, 6 + s * 4
  local rpm, tpm = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local day_budget, month_budget = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if rpm >= 0 and tonumber(redis.call('GET', KEYS[k + 1]) or '0') >= rpm then return {k + 1} end
  if tpm >= 0 and tonumber(redis.call('GET', KEYS[k + 2]) or '0') + prompt > tpm then return {k + 2} end
  if day_budget >= 0 and tonumber(redis.call('GET', KEYS[k + 3]) or '0') >= day_budget then return {k + 3} end
  if month_budget >= 0 and tonumber(redis.call('GET', KEYS[k + 4]) or '0') >= month_budget then return {k + 4} end
end
local used = {0}
for s = 0, subjects - 1 do
  local k = s * 4
  used[#used + 1] = redis.call('INCR', KEYS[k + 1])
  redis.call('EXPIRE', KEYS[k + 1], ARGV[4])
  if prompt + out > 0 then
    used[#used + 1] = redis.call('INCRBY', KEYS[k + 2], prompt + out)
    redis.call('EXPIRE', KEYS[k + 2], ARGV[4])
  else
    used[#used + 1] = tonumber(redis.call('GET', KEYS[k + 2]) or '0')
  end
  if usd > 0 then
    redis.call('INCRBYFLOAT', KEYS[k + 3], ARGV[3])
    redis.call('EXPIRE', KEYS[k + 3], ARGV[5])
    redis.call('INCRBYFLOAT', KEYS[k + 4], ARGV[3])
    redis.call('EXPIRE', KEYS[k + 4], ARGV[6])
  end
end
return used
"""

# KEYS: marks to forget (ARGV[1] of them), the settlement's mark, then per subject tokens-this-minute,
# spend-today, spend-this-month. ARGV: the number of marks to forget, their grace, the mark's TTL,
# minute/day/month TTLs, then per subject tokens, cost (usually negative: less was produced than
# reserved). Marking and applying in one script: a settlement is applied exactly when its mark is set.
# Returns 1 when applied, 0 when it had been already.
_CHARGE_LUA = """
local forget = tonumber(ARGV[1])
for i = 1, forget do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
if not redis.call('SET', KEYS[forget + 1], '1', 'NX', 'EX', ARGV[3]) then return 0 end
for s = 0, (#KEYS - forget - 1) / 3 - 1 do
  local k, a = forget + 1 + s * 3, 7 + s * 2
  if tonumber(ARGV[a]) ~= 0 then
    redis.call('INCRBY', KEYS[k + 1], ARGV[a])
    redis.call('EXPIRE', KEYS[k + 1], ARGV[4])
  end
  if tonumber(ARGV[a + 1]) ~= 0 then
    redis.call('INCRBYFLOAT', KEYS[k + 2], ARGV[a + 1])
    redis.call('EXPIRE', KEYS[k + 2], ARGV[5])
    redis.call('INCRBYFLOAT', KEYS[k + 3], ARGV[a + 1])
    redis.call('EXPIRE', KEYS[k + 3], ARGV[6])
  end
end
return 1
"""


class RedisCounterStore:
    """Counters in Redis, shared by every replica using the same `prefix`.

    Admission and charges go over one multiplexed connection (`gateway.redis_client`) opened with
    the settings of `redis` (a TLS client goes through redis-py instead): an admission is one write
    and one read, a batch of charges one write. Reads go through `redis`."""

    def __init__(self, redis: Redis, prefix: str = "sluice") -> None:
        self._redis = redis
        self._prefix = prefix
        self._admit = redis.register_script(_ADMIT_LUA)
        self._charge = redis.register_script(_CHARGE_LUA)
        self._multiplexed = MultiplexedRedis.of(redis)

    def _keys(self, subject: str, w: Windows) -> tuple[str, str, str, str]:
        # The hash tag keeps one subject's counters in one slot. (A key admitted with its tenant touches
        # two subjects in one script: on Redis Cluster that needs both in one slot, which this client,
        # a single Redis or a primary with replicas, does not arrange.)
        base = f"{self._prefix}:{{{subject}}}"
        return f"{base}:req:{w.minute}", f"{base}:tok:{w.minute}", f"{base}:usd:{w.day}", f"{base}:usd:{w.month}"

    async def _run_scripts(self, script: AsyncScript, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run `script` once per (keys, args): pipelined on the multiplexed connection, else through redis-py."""
        if self._multiplexed is None:
            return [await script(keys=keys, args=args) for keys, args in calls]
        return await self._multiplexed.run_scripts(script, calls)

    async def admit(
        self,
        subject: str,
        limits: Limits,
        prompt_tokens: int,
        now: float,
        reserve: Charge = Charge(),
        also: Subjects = (),
    ) -> Admission:
        w = Windows.at(now)
        keys: list[str] = []
        args: list[Any] = [prompt_tokens, reserve.completion_tokens, repr(reserve.cost_usd), _WINDOW_TTL_S,
                           *_spend_ttls(w)]  # fmt: skip
        subjects = ((subject, limits), *also)
        for name, its_limits in subjects:
            keys += self._keys(name, w)
            args += [_limit_arg(value) for value in (its_limits.rpm, its_limits.tpm, its_limits.spend_per_day_usd,
                                                     its_limits.spend_per_month_usd)]  # fmt: skip
        try:
            (reply,) = await self._run_scripts(self._admit, [(keys, args)])
            result, *counts = (int(value) for value in reply)
        except (RedisError, OSError) as exc:  # OSError: ConnectionError and TimeoutError too
            raise CountersUnavailable(str(exc) or type(exc).__name__) from exc
        if result == 0:
            used = list(zip(counts[::2], counts[1::2], strict=True))
            return Admission(None, minute=MinuteLeft.after([its for _, its in subjects], used, w.minute_left_s))
        refused_by = _REASONS[(result - 1) % 4]
        return Admission(refused_by, w.retry_after(refused_by), (result - 1) // 4)

    async def aclose(self) -> None:
        if self._multiplexed is not None:
            self._multiplexed.close()

    async def charge_many(
        self, settlements: Sequence[Settlement], now: float, local: bool = False, forget: Sequence[str] = ()
    ) -> None:
        w = Windows.at(now)
        ttls = [SETTLEMENT_ID_GRACE_S, SETTLEMENT_ID_TTL_S, _WINDOW_TTL_S, *_spend_ttls(w)]
        calls: list[tuple[list[str], list[Any]]] = []
        for settlement in settlements:
            keys = [self._mark(settlement_id) for settlement_id in forget] + [self._mark(settlement.id)]
            args, forget = [len(keys) - 1, *ttls], ()  # the first call forgets them
            for subject, charge in settlement.charges.items():
                keys += self._keys(subject, w)[1:]
                args += [charge.completion_tokens, repr(charge.cost_usd)]
            calls.append((keys, args))
        try:
            await self._run_scripts(self._charge, calls)
        except (RedisError, OSError) as exc:
            raise CountersUnavailable(str(exc) or type(exc).__name__) from exc

    def _mark(self, settlement_id: str) -> str:
        return f"{self._prefix}:applied:{settlement_id}"

    async def spent(self, subject: str, now: float) -> tuple[float, float]:
        _, _, day, month = self._keys(subject, Windows.at(now))
        try:
            values = await self._redis.mget([day, month])
        except (RedisError, OSError) as exc:
            raise CountersUnavailable(str(exc) or type(exc).__name__) from exc
        return float(values[0] or 0), float(values[1] or 0)


def _spend_ttls(w: Windows) -> list[int]:
    return [math.ceil(w.day_left_s) + 3600, math.ceil(w.month_left_s) + 3600]


class InProcessCounterStore:
    """The same semantics in this process's memory (one replica, no Redis). Atomic because the
    event loop runs one coroutine at a time and nothing here awaits."""

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}
        self._applied: dict[str, float] = {}  # settlement id → when it is forgotten (monotonic), oldest first

    def _keys(self, subject: str, w: Windows) -> tuple[str, str, str, str]:
        return (
            f"{subject}:req:{w.minute}",
            f"{subject}:tok:{w.minute}",
            f"{subject}:usd:{w.day}",
            f"{subject}:usd:{w.month}",
        )

    def _expire(self, w: Windows) -> None:
        # Drop counters of windows that have ended, so memory stays bounded by the number of keys.
        if len(self._counts) > 4096:
            current = {str(w.minute), w.day, w.month}
            self._counts = {k: v for k, v in self._counts.items() if k.rsplit(":", 1)[1] in current}

    async def admit(
        self,
        subject: str,
        limits: Limits,
        prompt_tokens: int,
        now: float,
        reserve: Charge = Charge(),
        also: Subjects = (),
    ) -> Admission:
        w = Windows.at(now)
        subjects = ((subject, limits), *also)
        for index, (name, its_limits) in enumerate(subjects):
            refused_by = self._refusal(self._keys(name, w), its_limits, prompt_tokens)
            if refused_by is not None:
                return Admission(refused_by, w.retry_after(refused_by), index)
        self._expire(w)
        get = self._counts.get
        used: list[tuple[int, int]] = []
        for name, _ in subjects:
            requests, tokens, day, month = self._keys(name, w)
            self._counts[requests] = get(requests, 0) + 1
            self._counts[tokens] = get(tokens, 0) + prompt_tokens + reserve.completion_tokens
            self._counts[day] = get(day, 0.0) + reserve.cost_usd
            self._counts[month] = get(month, 0.0) + reserve.cost_usd
            used.append((int(self._counts[requests]), int(self._counts[tokens])))
        return Admission(None, minute=MinuteLeft.after([its for _, its in subjects], used, w.minute_left_s))

    def _refusal(self, keys: tuple[str, str, str, str], limits: Limits, prompt_tokens: int) -> LimitName | None:
        requests, tokens, day, month = keys
        get = self._counts.get
        checks: tuple[tuple[LimitName, bool], ...] = (
            ("rpm", limits.rpm is not None and get(requests, 0) >= limits.rpm),
            ("tpm", limits.tpm is not None and get(tokens, 0) + prompt_tokens > limits.tpm),
            ("spend_per_day", limits.spend_per_day_usd is not None and get(day, 0.0) >= limits.spend_per_day_usd),
            (
                "spend_per_month",
                limits.spend_per_month_usd is not None and get(month, 0.0) >= limits.spend_per_month_usd,
            ),
        )
        return next((name for name, refused in checks if refused), None)

    async def charge_many(
        self, settlements: Sequence[Settlement], now: float, local: bool = False, forget: Sequence[str] = ()
    ) -> None:
        # `forget` is not needed: the ids kept here are bounded by number (_IN_PROCESS_IDS_MAX)
        w = Windows.at(now)
        get = self._counts.get
        for settlement in settlements:
            if not self._mark_applied(settlement.id):
                continue
            for subject, charge in settlement.charges.items():
                _, tokens, day, month = self._keys(subject, w)
                self._counts[tokens] = get(tokens, 0) + charge.completion_tokens
                self._counts[day] = get(day, 0.0) + charge.cost_usd
                self._counts[month] = get(month, 0.0) + charge.cost_usd

    def _mark_applied(self, settlement_id: str) -> bool:
        """Remember `settlement_id` for SETTLEMENT_ID_TTL_S; False when it is remembered already."""
        clock = time.monotonic()
        while self._applied:  # ids were added in time order, each for as long: the oldest go first
            oldest, until = next(iter(self._applied.items()))
            if until > clock and len(self._applied) < _IN_PROCESS_IDS_MAX:
                break
            del self._applied[oldest]
        if settlement_id in self._applied:
            return False
        self._applied[settlement_id] = clock + SETTLEMENT_ID_TTL_S
        return True

    async def spent(self, subject: str, now: float) -> tuple[float, float]:
        _, _, day, month = self._keys(subject, Windows.at(now))
        return self._counts.get(day, 0.0), self._counts.get(month, 0.0)


class LocalFallbackCounterStore:
    """`shared` (Redis) while it answers; this replica's own counters while it does not.

    After a failure Redis is asked again only every `retry_interval_s`, so an outage costs one
    connection timeout per interval, not one per request. Counts made locally stay local: when Redis
    is back its figures lack what was counted during the outage (budgets may be overrun by that much).
    A request is settled where it was reserved: one admitted locally in this replica's counters, one
    admitted by Redis in Redis only (refused while Redis is down, so the charge batcher keeps it until
    Redis is back), so neither store gets back a reservation it never counted.
    """

    def __init__(self, shared: CounterStore, retry_interval_s: float = 1.0) -> None:
        self.shared = shared
        self.local = InProcessCounterStore()
        self.retry_interval_s = retry_interval_s
        self._local_until = float("-inf")  # monotonic time before which Redis is not tried

    @property
    def using_local(self) -> bool:
        return time.monotonic() < self._local_until

    async def admit(
        self,
        subject: str,
        limits: Limits,
        prompt_tokens: int,
        now: float,
        reserve: Charge = Charge(),
        also: Subjects = (),
    ) -> Admission:
        if not self.using_local:
            try:
                return await self.shared.admit(subject, limits, prompt_tokens, now, reserve, also)
            except CountersUnavailable as exc:
                self._fall_back(exc)
        admission = await self.local.admit(subject, limits, prompt_tokens, now, reserve, also)
        return dataclasses.replace(admission, local=True)

    async def charge_many(
        self, settlements: Sequence[Settlement], now: float, local: bool = False, forget: Sequence[str] = ()
    ) -> None:
        if local:
            await self.local.charge_many(settlements, now)
        elif self.using_local:
            raise CountersUnavailable("Redis is down; the settlement waits for it")
        else:
            try:
                await self.shared.charge_many(settlements, now, forget=forget)
            except CountersUnavailable as exc:
                self._fall_back(exc)
                raise

    async def spent(self, subject: str, now: float) -> tuple[float, float]:
        return await self._either(lambda store: store.spent(subject, now))

    async def _either(self, call: Callable[[CounterStore], Awaitable[_T]]) -> _T:
        """`call` on Redis unless it is known down; on this replica's counters when Redis fails."""
        if not self.using_local:
            try:
                return await call(self.shared)
            except CountersUnavailable as exc:
                self._fall_back(exc)
        return await call(self.local)

    def _fall_back(self, exc: BaseException) -> None:
        if time.monotonic() >= self._local_until:
            logger.warning("Redis unreachable (%s): counting limits and budgets in this replica for now", exc)
        self._local_until = time.monotonic() + self.retry_interval_s


class CircuitBreakerCounterStore:
    """`shared` (Redis) behind a circuit breaker, for `when_unavailable = "refuse"`: after a failure
    every call is refused at once for `open_for_s` seconds, then one call probes Redis while the others
    keep being refused; a probe that succeeds closes the circuit. So while Redis is down or silent,
    requests get their 503 in microseconds instead of each waiting out a connect or read timeout."""

    def __init__(self, shared: CounterStore, open_for_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.shared = shared
        self.open_for_s = open_for_s
        self.clock = clock
        self._open_until = float("-inf")
        self._probing = False
        self._last_error = ""

    @property
    def is_open(self) -> bool:
        return self._probing or self.clock() < self._open_until

    async def admit(
        self,
        subject: str,
        limits: Limits,
        prompt_tokens: int,
        now: float,
        reserve: Charge = Charge(),
        also: Subjects = (),
    ) -> Admission:
        return await self._guarded(lambda: self.shared.admit(subject, limits, prompt_tokens, now, reserve, also))

    async def charge_many(
        self, settlements: Sequence[Settlement], now: float, local: bool = False, forget: Sequence[str] = ()
    ) -> None:
        await self._guarded(lambda: self.shared.charge_many(settlements, now, forget=forget))

    async def spent(self, subject: str, now: float) -> tuple[float, float]:
        return await self._guarded(lambda: self.shared.spent(subject, now))

    async def aclose(self) -> None:
        aclose = getattr(self.shared, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _guarded(self, call: Callable[[], Awaitable[_T]]) -> _T:
        if self.is_open:
            raise CountersUnavailable(f"circuit open after: {self._last_error}")
        probe = self.clock() >= self._open_until > float("-inf")  # the first call after the open window
        self._probing = probe
        try:
            result = await call()
        except CountersUnavailable as exc:
            if self.clock() >= self._open_until:
                logger.warning("Redis unreachable (%s): refusing for %.1f s before probing again", exc, self.open_for_s)
            self._last_error = str(exc)
            self._open_until = self.clock() + self.open_for_s
            raise
        finally:
            if probe:
                self._probing = False
        self._open_until = float("-inf")
        return result
