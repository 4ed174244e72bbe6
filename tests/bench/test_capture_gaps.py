"""Reading a gateway's streams off a packet capture (bench/capture_gaps.py), on a pcap file
built here: Ethernet, IPv4, TCP, HTTP/1.1 chunked responses carrying SSE events."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from bench.capture_gaps import summary, wire_records

PORT, CLIENT_PORT = 8000, 50000


def _frame(payload: bytes, sequence: int = 0, source: int = PORT, destination: int = CLIENT_PORT) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", source, destination, sequence, 0, 5 << 4, 0x18, 65535, 0, 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0, b"\x7f\0\0\1", b"\x7f\0\0\1")
    return b"\0" * 12 + b"\x08\x00" + ip + tcp  # Ethernet: two zero addresses, IPv4


def _pcap(packets: list[tuple[float, bytes]]) -> bytes:
    data = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1)
    for at, frame in packets:
        seconds, micros = int(at), round((at - int(at)) * 1e6)
        data += struct.pack("<IIII", seconds, micros, len(frame), len(frame)) + frame
    return data


def _chunk(text: str) -> bytes:
    body = text.encode()
    return f"{len(body):x}\r\n".encode() + body + b"\r\n"


def _event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"


def _segments(start: float, pieces: list[tuple[float, bytes]], sequence: int = 2**32 - 10) -> list[tuple[float, bytes]]:
    """Frames of consecutive segments of one connection, ``pieces`` at ``start`` plus their offset
    (the sequence numbers wrap around 2**32 on the way)."""
    frames = []
    for at, payload in pieces:
        frames.append((start + at, _frame(payload, sequence % 2**32)))
        sequence += len(payload)
    return frames


def test_streams_are_timed_at_the_wire_and_paired_with_the_gateways_chunk_times(tmp_path: Path) -> None:
    models = b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{"data":[]}'
    headers = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    comment = ": splitserve-chunk-times-ms=0.000,10.000,30.500\n\n"
    pieces = [
        (0.000, models),  # a whole response first, on the same connection: skipped
        (0.200, headers),
        (0.2005, _chunk(_event(" a"))),
        (0.211, _chunk(_event(" b"))),
        # The last token and the rest in one segment, the terminating chunk split across two.
        (0.232, _chunk(_event(" c")) + _chunk(comment) + _chunk("data: [DONE]\n\n") + b"0\r"),
        (0.233, b"\n\r\n"),
    ]
    packets = _segments(100.0, pieces)
    packets.insert(1, (100.1, _frame(b"x", source=CLIENT_PORT, destination=PORT)))  # the client's side: not read
    retransmitted = packets[4]  # " b" again, after " c" went: its bytes count once, at their first capture
    packets.insert(6, (100.2321, retransmitted[1]))
    capture = tmp_path / "run.pcap"
    capture.write_bytes(_pcap(packets))
    (record,) = wire_records(capture, PORT)
    assert record.success and record.generated_text == " a b c"
    assert record.itl == pytest.approx([0.0105, 0.021], abs=2e-6)
    assert record.server_itl == pytest.approx([0.010, 0.0205])
    result = summary([record])
    assert (result["num_streams"], result["num_paired"], result["num_gaps"]) == (1, 1, 2)
    assert result["abs_difference_ms"]["max"] == pytest.approx(0.5, abs=0.01)
    assert wire_records(capture, PORT + 1) == []

    # " b" never captured (the kernel drops packets when the capture falls behind): the stream
    # is lost from there, not misread.
    capture.write_bytes(_pcap([packet for packet in packets if packet[1] != retransmitted[1]]))
    assert wire_records(capture, PORT) == []


def test_a_file_that_is_no_classic_pcap_is_refused(tmp_path: Path) -> None:
    pcapng = tmp_path / "run.pcapng"
    pcapng.write_bytes(b"\x0a\x0d\x0d\x0a" + b"\0" * 40)
    with pytest.raises(ValueError, match="not a classic pcap file"):
        wire_records(pcapng, PORT)
