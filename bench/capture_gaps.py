"""Token gaps as the loopback interface saw them, beside the gateway's own chunk times: a check
that what the gateway says about its writes (gateway/chunk_times.py) is what went on the wire.

A packet capture of the gateway's port (server to client only) is read as a client that reads
each byte the instant its packet crossed the interface: per TCP connection the HTTP responses
are de-chunked and fed to the benchmark client's own SSE decoder and stream accounting
(bench/client.py), with the packet's capture time as the read time. Each stream's gaps between
content chunks (the wire's) are paired with the gateway's gaps for the same chunks, from the
chunk-times comment the stream carries (the benchmark asked for it)::

    tcpdump -i lo -w run.pcap 'tcp src port 8000' &
    splitserve bench serve --base-url http://127.0.0.1:8000 ...
    kill -INT %1
    python -m bench.capture_gaps run.pcap --port 8000

Reads classic pcap files (tcpdump's ``-w``), IPv4 over Ethernet, Linux cooked or raw links.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.client import RequestRecord, StreamAccumulator
from bench.sse import SSEDecoder
from bench.token_gaps import compare_gaps

# Bytes before the IP header, by pcap link type: Ethernet, Linux cooked v1 and v2, raw IP.
_LINK_HEADER_BYTES = {1: 14, 113: 16, 276: 20, 101: 0}
_PCAP_MAGIC = {0xA1B2C3D4: 1e-6, 0xA1B23C4D: 1e-9}  # micro- or nanosecond timestamps


def packets(path: Path, port: int) -> Iterator[tuple[float, int, int, bytes]]:
    """(capture time in seconds, client port, TCP sequence number, payload) of each non-empty
    segment sent from ``port``, in capture order (retransmissions included)."""
    data = path.read_bytes()
    for order in ("<", ">"):
        (magic,) = struct.unpack(order + "I", data[:4])
        if magic in _PCAP_MAGIC:
            break
    else:
        raise ValueError(f"{path} is not a classic pcap file (tcpdump -w writes one; convert pcapng with editcap)")
    tick = _PCAP_MAGIC[magic]
    (link_type,) = struct.unpack(order + "I", data[20:24])
    if link_type not in _LINK_HEADER_BYTES:
        raise ValueError(f"{path}: link type {link_type} is not read here; capture on lo (tcpdump -i lo)")
    offset = 24
    while offset + 16 <= len(data):
        seconds, fraction, captured, _ = struct.unpack(order + "IIII", data[offset : offset + 16])
        frame = data[offset + 16 : offset + 16 + captured]
        offset += 16 + captured
        ip = frame[_LINK_HEADER_BYTES[link_type] :]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue  # IPv4 TCP only: the gateway listens on 127.0.0.1
        tcp = ip[(ip[0] & 0x0F) * 4 :]
        source, destination, sequence = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if source == port and payload:
            yield seconds + fraction * tick, destination, sequence, payload


class _Connection:
    """One connection's responses, de-chunked (HTTP/1.1 chunked transfer) into SSE streams. Bytes
    count once, at their first capture: a retransmitted segment (loopback retransmits too) adds
    only what is new, and a connection with bytes missing from the capture is read no further."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self._first_sequence: int | None = None
        self._num_bytes = 0  # read so far, from the first segment captured
        self._buffer = b""
        self._state = "headers"  # headers | skip | size | data | data-end | lost
        self._remaining = 0
        self._stream: StreamAccumulator | None = None
        self._decoder: SSEDecoder | None = None

    def feed(self, sequence: int, payload: bytes, now: float) -> None:
        if self._first_sequence is None:
            self._first_sequence = sequence
        start = (sequence - self._first_sequence) % 2**32
        if start > self._num_bytes:  # a segment the capture dropped: the stream cannot be read on
            self._state, self._stream, self._decoder = "lost", None, None
        if self._state == "lost" or start + len(payload) <= self._num_bytes:
            return
        new = payload[self._num_bytes - start :]
        self._num_bytes += len(new)
        self._buffer += new
        while self._step(now):
            pass

    def _step(self, now: float) -> bool:
        if self._state == "headers":
            head, sep, rest = self._buffer.partition(b"\r\n\r\n")
            if not sep:
                return False
            self._buffer = rest
            fields = dict(line.split(b":", 1) for line in head.lower().split(b"\r\n")[1:] if b":" in line)
            if fields.get(b"transfer-encoding", b"").strip() != b"chunked":  # not a stream (/v1/models)
                self._state, self._remaining = "skip", int(fields.get(b"content-length", b"0"))
                return True
            self._state = "size"
            self._stream = StreamAccumulator(RequestRecord(prompt_len=0, output_len=0), sent_at=now)
            self._decoder = SSEDecoder(on_comment=self._stream.on_comment)
            return True
        if self._state == "skip":
            skipped = min(self._remaining, len(self._buffer))
            self._buffer, self._remaining = self._buffer[skipped:], self._remaining - skipped
            if self._remaining:
                return False
            self._state = "headers"
            return True
        if self._state in ("size", "data-end"):
            line, sep, rest = self._buffer.partition(b"\r\n")
            if not sep:
                return False
            self._buffer = rest
            if self._state == "data-end":
                self._state = "size"
                return True
            self._remaining = int(line.split(b";")[0], 16)
            self._state = "data" if self._remaining else "headers"
            if not self._remaining:
                self._buffer = self._buffer.partition(b"\r\n")[2]  # the empty trailer section
                self._end(now)
            return True
        body, self._buffer = self._buffer[: self._remaining], self._buffer[self._remaining :]
        self._remaining -= len(body)
        if self._stream is not None and self._decoder is not None:
            for event in self._decoder.feed(body):
                self._stream.on_event(event, now)
        if self._remaining:
            return False
        self._state = "data-end"
        return True

    def _end(self, now: float) -> None:
        if self._stream is not None and self._decoder is not None:
            for event in self._decoder.close():
                self._stream.on_event(event, now)
            self.records.append(self._stream.finish())
        self._stream = self._decoder = None


def wire_records(path: Path, port: int) -> list[RequestRecord]:
    """Every streamed response in the capture, timed at the wire, in the order they ended."""
    connections: dict[int, _Connection] = {}
    for now, client_port, sequence, payload in packets(path, port):
        connections.setdefault(client_port, _Connection()).feed(sequence, payload, now)
    return [record for connection in connections.values() for record in connection.records]


def summary(records: list[RequestRecord]) -> dict[str, Any]:
    """The wire's token gaps beside the gateway's (ms), and how far apart each pair is."""
    paired = [r for r in records if r.success and r.server_itl is not None]
    gaps = compare_gaps([(r.itl, r.server_itl) for r in paired if r.server_itl is not None])
    if gaps is None:
        return {"num_streams": len(records), "num_paired": 0}
    differences = np.abs([1000 * (w - s) for r in paired for w, s in zip(r.itl, r.server_itl or [])])
    return {
        "num_streams": len(records),
        "num_paired": len(paired),
        "num_gaps": gaps.num_gaps,
        "wire_ms": gaps.client_ms,
        "server_ms": gaps.server_ms,
        "abs_difference_ms": {
            "p50": float(np.percentile(differences, 50)),
            "p99": float(np.percentile(differences, 99)),
            "max": float(differences.max()),
        }
        if differences.size
        else {},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", type=Path, help="a pcap file of the gateway's port (tcpdump -w)")
    parser.add_argument("--port", type=int, required=True, help="the gateway's HTTP port")
    args = parser.parse_args(argv)
    print(json.dumps(summary(wire_records(args.capture, args.port)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
