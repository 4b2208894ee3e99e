"""How many times each request completed: the evidence that no request ran
twice, for /status, the drill and the soak."""

from __future__ import annotations

import collections
import logging

log = logging.getLogger(__name__)

EXECUTION_LEDGER_SIZE = 10_000


class ExecutionLedger:
    """Completed executions per request id, the latest EXECUTION_LEDGER_SIZE
    ids; the totals count every one."""

    def __init__(self, size: int = EXECUTION_LEDGER_SIZE) -> None:
        self._size = size
        self.counts: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.completed_total = 0
        self.duplicate_executions = 0

    def count(self, request_id: str) -> None:
        self.completed_total += 1
        count = self.counts.pop(request_id, 0) + 1
        self.counts[request_id] = count
        if count > 1:
            self.duplicate_executions += 1
            log.error("request %s completed %d executions", request_id, count)
        while len(self.counts) > self._size:
            self.counts.popitem(last=False)
