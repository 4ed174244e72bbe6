"""Reading per-connection TCP byte counters out of ``ss -tinpH`` (bench/socket_bytes.py)."""

from __future__ import annotations

from bench.socket_bytes import SocketBytes, bytes_by_peer, parse_ss

SS_OUTPUT = """\
0      0               127.0.0.1:47907          127.0.0.1:55414 users:(("python",pid=11,fd=28))
\t bbr wscale:10,10 rto:204 cwnd:11 bytes_sent:62 bytes_acked:62 bytes_received:78 segs_out:3
0      0               [::1]:6379          [::1]:40036 users:(("redis-server",pid=22,fd=9))
\t bbr wscale:10,10 rto:208 bytes_received:3559 segs_out:2
0      0               127.0.0.1:5000          127.0.0.1:40040 users:(("python",pid=99,fd=3))
\t bbr bytes_sent:1 bytes_received:1
"""


def test_sockets_of_the_given_pids_with_their_counters() -> None:
    sockets = parse_ss(SS_OUTPUT, {11, 22})
    assert sockets == {
        (11, 28, "127.0.0.1:47907", "127.0.0.1:55414"): SocketBytes(47907, 55414, 62, 78),
        (22, 9, "[::1]:6379", "[::1]:40036"): SocketBytes(6379, 40036, 0, 3559),
    }


def test_bytes_between_two_readings_by_peer_count_a_new_socket_whole() -> None:
    before = {(11, 28, "a:1", "b:2"): SocketBytes(1, 2, 100, 10)}
    after = {
        (11, 28, "a:1", "b:2"): SocketBytes(1, 2, 150, 30),
        (11, 29, "a:1", "c:6379"): SocketBytes(1, 6379, 7, 5),  # opened in between
        (33, 4, "d:1", "e:2"): SocketBytes(1, 2, 1000, 1000),  # not ours
    }
    by_peer = bytes_by_peer(before, after, {11}, lambda s: "redis" if s.peer_port == 6379 else "other")
    assert by_peer == {"other": {"sent": 50, "received": 20}, "redis": {"sent": 7, "received": 5}}
