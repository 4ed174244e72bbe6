"""microbench.stream_receive at a smoke size: every transport receives every paced message of
every stream from the server process (its figures are the benchmark's, never a test's)."""

from __future__ import annotations

from microbench.stream_receive import TRANSPORTS, Pacing, run


def test_every_transport_receives_every_message_of_every_stream() -> None:
    pacing = Pacing(messages=5, interval_s=0.001, streams=3)
    measurements = run(pacing, list(TRANSPORTS), rounds=1)
    assert [(m.transport, m.messages) for m in measurements] == [(transport, 15) for transport in TRANSPORTS]
    assert all(m.cpu_us_per_message > 0 for m in measurements)
