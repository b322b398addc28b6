"""On call: what watches a run for a person who is not looking at it.

`status --check` (the monitoring-plugin verdict: monitoring.py), `status --prometheus`
(prometheus.py), `status --watch` (the view refreshed in place: watch.py) and `invoke watch` (events
between polls: events.py, sent to webhooks and commands: notify.py); alerting.py gathers the facts
for all of them. Everything here reads a run through `status.gather` (one round trip per container)
and never acts on the container.
"""
