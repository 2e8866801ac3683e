"""A user-space packet forwarder over a TUN device: holds each packet for a one-way delay, with optional jitter
and loss, then hands it back to the kernel to be routed on. Runs inside the router namespace of
``cluster/netns/hosts.py``; this kernel has no netem, so this is how real packets between the test hosts are
delayed (docs/decisions/netns-delay.md).

    python -m cluster.netns.delay --device hsdelay --settings /tmp/hsn/delay.json

The kernel routes every packet that arrives from a host's link into the TUN device (policy rules made by
hosts.py); this program reads it, keeps it until its release time and writes it back, and the kernel then
routes it by destination to the other host. ``--settings`` is a JSON file ``{"one_way_ms": 2.5, "jitter_ms": 0,
"loss": 0.0}``, read again whenever it changes, so a running test can change the RTT (RTT = 2 x one_way_ms).
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import select
import socket
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65536
SETTINGS_POLL_S = 0.1


@dataclass(frozen=True)
class DelaySettings:
    one_way_ms: float = 0.0  # each packet is held this long (RTT between two hosts = 2 x this)
    jitter_ms: float = 0.0  # plus a uniform draw in [-jitter, +jitter] (packets may then be reordered)
    loss: float = 0.0  # probability that a packet is dropped

    @classmethod
    def read(cls, path: Path) -> "DelaySettings":
        values = json.loads(path.read_text() or "{}")
        settings = cls(**values)
        if settings.one_way_ms < 0 or settings.jitter_ms < 0 or not 0.0 <= settings.loss < 1.0:
            raise ValueError(f"bad delay settings {values}")
        return settings

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__))
        tmp.replace(path)  # atomic: the forwarder never reads half a file

    def release_after_s(self, rng: random.Random) -> float:
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.one_way_ms + jitter) / 1000.0


def open_tun(device: str) -> int:
    """Attach to the (persistent) TUN ``device``: raw IP packets, no packet-information header."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Forwarder:
    """Holds packets in a heap ordered by release time; ``counts`` says what it did (printed on exit)."""

    def __init__(self, fd: int, settings_path: Path, seed: int = 0, wire_path: Path | None = None):
        self.fd, self.settings_path, self.wire_path = fd, settings_path, wire_path
        self.rng = random.Random(seed)
        self.settings, self.settings_mtime = DelaySettings(), 0.0
        self.held: list[tuple[float, int, bytes]] = []  # (release time, arrival number, packet)
        self.arrivals = 0
        self.counts = {"forwarded": 0, "dropped": 0}
        self.wire: dict[str, list[int]] = {}  # "source>destination" -> [packets, IP bytes] offered to the wire

    def reload_settings(self) -> None:
        try:
            mtime = self.settings_path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime != self.settings_mtime:
            self.settings, self.settings_mtime = DelaySettings.read(self.settings_path), mtime

    def receive(self, now: float) -> None:
        while True:
            try:
                packet = os.read(self.fd, MAX_PACKET)
            except BlockingIOError:
                return
            self.count_on_wire(packet)
            if self.settings.loss and self.rng.random() < self.settings.loss:
                self.counts["dropped"] += 1
                continue
            self.arrivals += 1
            heapq.heappush(self.held, (now + self.settings.release_after_s(self.rng), self.arrivals, packet))

    def count_on_wire(self, packet: bytes) -> None:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return
        key = f"{socket.inet_ntoa(packet[12:16])}>{socket.inet_ntoa(packet[16:20])}"
        counted = self.wire.setdefault(key, [0, 0])
        counted[0] += 1
        counted[1] += len(packet)

    def write_wire(self) -> None:
        if self.wire_path is not None:
            tmp = self.wire_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.wire))
            tmp.replace(self.wire_path)

    def release(self, now: float) -> None:
        while self.held and self.held[0][0] <= now:
            _, _, packet = heapq.heappop(self.held)
            try:
                os.write(self.fd, packet)
                self.counts["forwarded"] += 1
            except OSError:  # a full queue or a link gone down: as a real wire would, drop it
                self.counts["dropped"] += 1

    def run(self) -> None:
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if now >= next_poll:
                self.reload_settings()
                self.write_wire()
                next_poll = now + SETTINGS_POLL_S
            wait = min(next_poll, self.held[0][0] if self.held else next_poll) - now
            readable, _, _ = select.select([self.fd], [], [], max(0.0, wait))
            now = time.monotonic()
            if readable:
                self.receive(now)
            self.release(now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True, help="the persistent TUN device to attach to")
    parser.add_argument("--settings", required=True, type=Path, help="JSON delay settings, re-read on change")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter and loss draws")
    parser.add_argument("--wire", type=Path, help="JSON file of packets and bytes per source>destination pair, "
                        "rewritten every 0.1 s")
    args = parser.parse_args()
    forwarder = Forwarder(open_tun(args.device), args.settings, args.seed, args.wire)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # teardown's SIGTERM: print the counts, exit
    try:
        forwarder.run()
    except KeyboardInterrupt:
        pass
    finally:
        print(json.dumps(forwarder.counts), flush=True)


if __name__ == "__main__":
    main()
