"""A run's verdict folded one trace at a time: ``RunAggregate``.

``add`` (or ``replace``: a re-analysed or late trace) puts one trace's ``TraceSummary`` in; ``verdict``
gives ``run_verdict.verdict_of`` over every summary held, in run order (``TraceSummary.key``), so the
result is the same whatever order the traces arrived in and equals ``run_verdict.run_verdict`` over
their reports.

Cost: a change re-summarises only the rank it touches (``ranks.summarise_rank`` over that rank's
windows); ``verdict`` then judges the ranks (one sort per figure, ``ranks.judge_ranks``) and sums the
job's figures over the held summaries, never a report. A verdict asked for twice without a change in
between is computed once.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

import msgspec

from .ranks import RankSummary, judge_ranks, sorted_groups, summarise_rank
from .timeline import Memory as SeriesMemory
from .trace_summary import TraceSummary
from .verdict import RunVerdict, verdict_of

Who = tuple[int | None, str | None]  # (rank, worker): one rank's windows share it


class RunAggregate:
    """The run's traces as summaries, its ranks summarised, its verdict cached until a change."""

    def __init__(self, summaries: Iterable[TraceSummary] = ()) -> None:
        self._by_key: dict[int, TraceSummary] = {}
        self._keys: list[int] = []  # sorted
        self._members: dict[Who, dict[int, TraceSummary]] = {}
        self._rows: dict[Who, RankSummary] = {}
        self._stale_ranks: set[Who] = set()
        self._verdict: RunVerdict | None = None
        self._counts: tuple[int, int, int] | None = None
        self._series: SeriesMemory | None = None
        for s in summaries:
            self.add(s)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def get(self, key: int) -> TraceSummary | None:
        return self._by_key.get(key)

    def add(self, summary: TraceSummary) -> None:
        """Fold in a trace; one already held under the same key is replaced (a re-analysis)."""
        if summary.key in self._by_key:
            self.remove(summary.key)
        self._by_key[summary.key] = summary
        insort(self._keys, summary.key)
        who = (summary.rank, summary.worker)
        self._members.setdefault(who, {})[summary.key] = summary
        self._stale_ranks.add(who)
        self._verdict = None

    replace = add

    def remove(self, key: int) -> None:
        """Take a trace out (deleted, or its report no longer readable)."""
        old = self._by_key.pop(key, None)
        if old is None:
            return
        del self._keys[bisect_left(self._keys, key)]
        who = (old.rank, old.worker)
        members = self._members[who]
        del members[key]
        if not members:
            del self._members[who]
            self._rows.pop(who, None)
            self._stale_ranks.discard(who)
        else:
            self._stale_ranks.add(who)
        self._verdict = None

    def summaries(self) -> list[TraceSummary]:
        """Every summary held, in run order."""
        return [self._by_key[k] for k in self._keys]

    def rank_rows(self) -> list[RankSummary]:
        """One row per rank (worker), in rank order; only ranks changed since the last call recomputed."""
        for who in self._stale_ranks:
            members = self._members[who]
            self._rows[who] = summarise_rank(who[0], who[1], [members[k] for k in sorted(members)])
        self._stale_ranks.clear()
        return [row for _, row in sorted_groups(self._rows)]

    def verdict(
        self, *, failed: int = 0, pending: int = 0, outdated: int = 0, series: SeriesMemory | None = None
    ) -> RunVerdict:
        """The run's verdict (``run_verdict.verdict_of``); a copy, so a caller may stamp it. ``series``:
        the run's step-series memory (its leak over every step), as ``stepdoctor analyze RUN_DIR``
        passes it; another series redoes the verdict."""
        counts = (failed, pending, outdated)
        if self._verdict is None or self._counts != counts or self._series != series:
            ranks = judge_ranks(self.rank_rows(), windows=len(self._keys)) if self._keys else None
            self._verdict = verdict_of(
                self.summaries(),
                ranks=ranks,
                failed=failed,
                pending=pending,
                outdated=outdated,
                series=series,
            )
            self._counts, self._series = counts, series
        return msgspec.structs.replace(self._verdict)
