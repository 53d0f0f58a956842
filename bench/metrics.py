"""The daemon's GET /metrics, as the benchmarks read it: a keep-alive scraper, and the event-loop
lag histogram (`engined_event_loop_lag_seconds`, `engined_event_loop_stalled_seconds_total`) with
how its readings are shown (bench.loop and bench.gateway report it).
"""

from __future__ import annotations

import http.client
import math
import re
import time
from dataclasses import dataclass

from bench.common import BenchError
from bench.report import DASH, ms_auto

TICK_S = 0.25  # supervisor/loop.py TICK_S: the ticker's period, so ~4 observations a second

_BUCKET_RE = re.compile(rb'^engined_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)
_SUM_RE = re.compile(rb"^engined_event_loop_lag_seconds_sum (\S+)$", re.M)
_COUNT_RE = re.compile(rb"^engined_event_loop_lag_seconds_count (\S+)$", re.M)
_STALLED_RE = re.compile(rb"^engined_event_loop_stalled_seconds_total (\S+)$", re.M)


# --- reading it ---------------------------------------------------------------------------------
class Scraper:
    """GET /metrics on one keep-alive connection to the daemon's `http:` port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def get(self) -> tuple[float, float, bytes]:
        """One GET /metrics on a keep-alive connection: (duration, receive time, body)."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        started = time.perf_counter()
        self.conn.request("GET", "/metrics")
        resp = self.conn.getresponse()
        body = resp.read()
        took, now = time.perf_counter() - started, time.time()
        if resp.status != 200:
            raise BenchError(f"GET /metrics: HTTP {resp.status}")
        return took, now, body

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class Snapshots(Scraper):
    """A Scraper for readings far apart (around bench.loop's phases): it reconnects once when the
    server has closed the idle keep-alive connection (the daemon's web server closes a connection
    idle for CLIENT_TIMEOUT_S, 10 s; an idle phase leaves this one alone for longer)."""

    def get(self) -> tuple[float, float, bytes]:
        try:
            return super().get()
        except (OSError, http.client.HTTPException):
            self.close()
            self.conn = None
            return super().get()


def read_lag(scraper: Scraper) -> Lag:
    _took, _recv, body = scraper.get()
    return Lag.parse(body, time.monotonic())


# --- the loop-lag histogram --------------------------------------------------------------------
@dataclass(frozen=True)
class Lag:
    """One reading of the loop metrics: cumulative buckets (le, count), +Inf last."""

    buckets: tuple[tuple[float, float], ...]
    total: float  # _sum
    count: float  # _count
    stalled: float  # engined_event_loop_stalled_seconds_total
    t: float = 0.0  # time.monotonic() of the reading

    @classmethod
    def parse(cls, body: bytes, t: float = 0.0) -> Lag:
        buckets = tuple((float(le), float(v)) for le, v in _BUCKET_RE.findall(body))
        found = [_SUM_RE.search(body), _COUNT_RE.search(body), _STALLED_RE.search(body)]
        if not buckets or buckets[-1][0] != math.inf or not all(found):
            raise BenchError("GET /metrics has no complete engined_event_loop_lag_seconds "
                             "histogram / engined_event_loop_stalled_seconds_total")
        total, count, stalled = (float(m.group(1)) for m in found)  # type: ignore[union-attr]
        return cls(buckets, total, count, stalled, t)

    def __sub__(self, before: Lag) -> Lag:
        if [le for le, _ in self.buckets] != [le for le, _ in before.buckets]:
            raise BenchError("the lag histogram's buckets changed between two scrapes")
        return Lag(tuple((le, a - b) for (le, a), (_, b) in zip(self.buckets, before.buckets)),
                   self.total - before.total, self.count - before.count,
                   self.stalled - before.stalled, self.t - before.t)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: the first bucket whose cumulative count reaches
        q * count, linear interpolation inside it (lower bound 0 for the first bucket); in the
        +Inf bucket, the highest finite bound."""
        n = self.buckets[-1][1]
        if n <= 0:
            return None
        rank = q * n
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if le == math.inf:
                    return prev_le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le

    def max_bucket(self) -> tuple[float, float] | None:
        """(lower, upper] of the highest bucket with an observation; None if there is none."""
        prev_le, prev_c, top = 0.0, 0.0, None
        for le, c in self.buckets:
            if c > prev_c:
                top = (prev_le, le)
            prev_le, prev_c = le, c
        return top

    def above(self, bound: float) -> float:
        """Observations above `bound` (which must be a bucket bound)."""
        cum = next(c for le, c in self.buckets if le == bound)
        return self.buckets[-1][1] - cum


def lag_ms(seconds: float | None) -> str:
    """How the loop-lag reports show a time: two decimals under 0.1 s, whole ms above."""
    return ms_auto(seconds, tenths=False)


def est(d: Lag, q: float) -> str:
    """A quantile estimate; † when it lies in the first bucket (interpolated within 0-1 ms)."""
    v = d.quantile(q)
    return DASH if v is None else lag_ms(v) + ("†" if v <= d.buckets[0][0] else "")


def bound(x: float) -> str:
    return f"{x * 1e3:g} ms" if x < 1 else f"{x:g} s"


def bucket(top: tuple[float, float] | None) -> str:
    if top is None:
        return DASH
    lo, hi = top
    return f"≤ {bound(hi)}" if lo == 0 else f"({bound(lo)}, {bound(hi)}]"
