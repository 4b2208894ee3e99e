"""`tray-app drill`: the deliberate memory and failover test, as a command.

A client of the service (HTTP only, no Qt): it starts its own service or
checks a running one, drives eleven phases of traffic and faults, and writes
a report. Pure arithmetic lives in `stats` and `report`; I/O in `client`,
`monitor`, `target`, `pressure`, `session` and the phases (`runner`
runs them in order; each is in `phases/`).
"""
