"""The container side: the helpers shipped into a container per call, and the one way they are shipped
and answered.

Shipped (standard library only, Python >= 3.8, run by the container's own interpreter):
`prelude.py` (sent ahead of every helper: `Refused`, `serve`, the bounded readers, the run
primitives), `runs.py`, `facts.py`, `fetch.py`, `history.py`, `release.py`. Local: `ship.py` (the
loader, the host lines, `answer()` that reads every reply) and `readings.py` (what the facts say).
"""
