"""Where a request runs: pure admission and breaker, lanes, jobs, quarantine."""
