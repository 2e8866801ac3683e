"""The delay forwarder's logic (cluster/netns/delay.py) over a datagram socket pair instead of a TUN device:
what it holds, for how long, what it drops and what it counts. No root needed."""

from __future__ import annotations

import socket
import struct

import pytest

from cluster.netns.delay import DelaySettings, Forwarder


def ipv4_packet(source: str, destination: str, payload: bytes) -> bytes:
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 0, 0, 64, 17, 0,
                         socket.inet_aton(source), socket.inet_aton(destination))
    return header + payload


@pytest.fixture()
def wire(tmp_path):
    kernel_end, forwarder_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    forwarder_end.setblocking(False)
    settings_path = tmp_path / "delay.json"
    forwarder = Forwarder(forwarder_end.fileno(), settings_path, seed=3, wire_path=tmp_path / "wire.json")
    yield kernel_end, forwarder, settings_path
    kernel_end.close()
    forwarder_end.close()


def test_settings_out_of_range_are_refused(tmp_path):
    path = tmp_path / "delay.json"
    for bad in (DelaySettings(one_way_ms=-1), DelaySettings(loss=1.0), DelaySettings(jitter_ms=-0.5)):
        bad.write(path)
        with pytest.raises(ValueError):
            DelaySettings.read(path)


def test_a_packet_is_held_for_the_one_way_delay_then_written_back_unchanged(wire):
    kernel_end, forwarder, settings_path = wire
    DelaySettings(one_way_ms=50).write(settings_path)
    forwarder.reload_settings()
    packet = ipv4_packet("10.213.1.2", "10.213.3.2", b"hello")
    kernel_end.send(packet)
    forwarder.receive(now=100.0)
    forwarder.release(now=100.049)  # 1 ms early: still held
    assert forwarder.counts["forwarded"] == 0 and len(forwarder.held) == 1
    forwarder.release(now=100.050)
    assert kernel_end.recv(65536) == packet
    assert forwarder.counts == {"forwarded": 1, "dropped": 0}


def test_packets_leave_in_release_order_and_bytes_are_counted_per_pair(wire):
    kernel_end, forwarder, settings_path = wire
    first, second = ipv4_packet("10.213.1.2", "10.213.2.2", b"a"), ipv4_packet("10.213.2.2", "10.213.1.2", b"bb")
    for packet in (first, second):
        kernel_end.send(packet)
    forwarder.receive(now=0.0)  # no settings file: no delay
    forwarder.release(now=0.0)
    assert [kernel_end.recv(65536), kernel_end.recv(65536)] == [first, second]
    forwarder.write_wire()
    counted = forwarder.wire_path.read_text()
    assert '"10.213.1.2>10.213.2.2": [1, 21]' in counted and '"10.213.2.2>10.213.1.2": [1, 22]' in counted


def test_loss_drops_a_seeded_share_and_counts_it(wire):
    kernel_end, forwarder, settings_path = wire
    DelaySettings(loss=0.5).write(settings_path)
    forwarder.reload_settings()
    for i in range(200):
        kernel_end.send(ipv4_packet("10.213.1.2", "10.213.3.2", bytes([i % 256])))
        forwarder.receive(now=float(i))
    forwarder.release(now=1000.0)
    dropped = forwarder.counts["dropped"]
    assert forwarder.counts["forwarded"] + dropped == 200 and 60 < dropped < 140
