"""The RESP2 wire layer on a socket pair: packing, parsing, bulk replies into caller buffers, deadlines."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvtier.tiers.redis.resp import (
    BIG_ARG,
    Packer,
    RespError,
    RespReader,
    WireClosed,
    WireProtocolError,
    WireTimeout,
    send_all,
)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_packer_joins_small_args_and_keeps_big_ones_as_views():
    big = memoryview(bytearray(os.urandom(BIG_ARG + 5)))
    packer = Packer()
    packer.add(b"SET", b"k", big, b"NX")
    packer.add(b"SET", b"k2", (b"head", big[:BIG_ARG]), b"NX")
    pieces = packer.finish()
    assert any(p is big for p in pieces)  # sent from the caller's memory, not copied
    wire = b"".join(bytes(p) for p in pieces)
    assert wire == (b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n$2\r\nNX\r\n" % (big.nbytes, bytes(big))
                    + b"*4\r\n$3\r\nSET\r\n$2\r\nk2\r\n$%d\r\nhead%s\r\n$2\r\nNX\r\n"
                    % (4 + BIG_ARG, bytes(big[:BIG_ARG])))
    assert packer.count == 2


def test_reader_parses_every_reply_type(pair):
    a, b = pair
    b.sendall(b"+OK\r\n-ERR bad thing\r\n:42\r\n$-1\r\n$5\r\nhello\r\n*3\r\n:1\r\n$0\r\n\r\n*-1\r\n*0\r\n")
    reader = RespReader(a, size=16)  # tiny buffer: lines and values straddle refills
    reader.arm(time.monotonic() + 5, 0)
    assert reader.read_reply() == b"OK"
    err = reader.read_reply()
    assert isinstance(err, RespError) and err.code == "ERR" and err.message == "ERR bad thing"
    assert reader.read_reply() == 42
    assert reader.read_reply() is None
    assert reader.read_reply() == b"hello"
    assert reader.read_reply() == [1, b"", None]
    assert reader.read_reply() == []
    assert reader.pending == 0


def test_bulk_reply_lands_in_the_callers_buffer(pair):
    a, b = pair
    value = os.urandom(3 << 20)
    target = memoryview(bytearray(len(value)))

    def into(n, reader):
        assert n == len(value)
        assert reader.peek(4) == value[:4]
        reader.read_into(target)
        return "done"

    sender = threading.Thread(target=lambda: b.sendall(b"$%d\r\n%s\r\n:7\r\n" % (len(value), value)))
    sender.start()
    reader = RespReader(a)
    reader.arm(time.monotonic() + 10, 0)
    assert reader.read_reply(into) == "done"
    assert reader.read_reply() == 7
    sender.join()
    assert bytes(target) == value


def test_stalled_reply_times_out_at_the_deadline(pair):
    a, b = pair
    b.sendall(b"$100\r\nonly part of it")
    reader = RespReader(a)
    reader.arm(time.monotonic() + 0.2, 0)
    start = time.monotonic()
    with pytest.raises(WireTimeout):
        reader.read_reply()
    assert 0.15 < time.monotonic() - start < 5.0  # not before the deadline; the upper bound only guards a hang


def test_big_reply_gets_a_transfer_allowance(pair):
    a, b = pair
    n = 1 << 20
    reader = RespReader(a)
    reader.arm(time.monotonic() + 0.05, rate=n / 1.0)  # 1 s of allowance for this value
    b.sendall(b"$%d\r\n" % n)

    def dribble():
        for i in range(4):
            time.sleep(0.05)
            b.sendall(bytes(n // 4))
        b.sendall(b"\r\n")

    sender = threading.Thread(target=dribble)
    sender.start()
    assert len(reader.read_reply()) == n  # 0.2 s: past the base deadline, within the allowance
    sender.join()


def test_closed_connection_and_garbage(pair):
    a, b = pair
    b.sendall(b"?what\r\n")
    reader = RespReader(a)
    reader.arm(time.monotonic() + 1, 0)
    with pytest.raises(WireProtocolError):
        reader.read_reply()
    b.close()
    with pytest.raises(WireClosed):
        reader.read_reply()


def test_send_respects_the_deadline(pair):
    a, _b = pair  # nobody reads _b: the socket buffers fill up and sendall blocks
    big = memoryview(bytearray(64 << 20))
    start = time.monotonic()
    with pytest.raises(WireTimeout):
        send_all(a, [big], time.monotonic() + 0.2)
    assert time.monotonic() - start < 5.0  # a hang guard, not a timing


def test_exists_replies_read_in_bulk_or_one_by_one(pair):
    a, b = pair
    b.sendall(b":1\r\n:0\r\n:1\r\n" + b":1\r\n-MOVED 12 127.0.0.1:7001\r\n:0\r\n" + b":1\r\n" * 6)
    reader = RespReader(a, size=40)  # the last batch (24 bytes) fits only after a compaction
    reader.arm(time.monotonic() + 5, 0)
    assert reader.read_ints(3) == [1, 0, 1]
    got = reader.read_ints(3)
    assert got[0] == 1 and isinstance(got[1], RespError) and got[1].code == "MOVED" and got[2] == 0
    assert reader.read_ints(6) == [1] * 6
    b.sendall(b":0\r\n" * 12)  # 48 bytes: more than the buffer holds, read one by one
    assert reader.read_ints(12) == [0] * 12
    assert reader.pending == 0
