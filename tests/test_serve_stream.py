"""The API process's side of the engine pipe: ``MessageReader`` batches whole messages."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading

import pytest

from mrv2.serve.engine_core import MessageReader


def test_message_reader_returns_every_whole_message_in_order_then_eof():
    a, b = multiprocessing.Pipe()
    small = [("step", i, [("req", None, [(0, [i], None)], False)]) for i in range(50)]
    for m in small:  # all sent before the first read: they come back as one batch
        b.send(m)
    reader = MessageReader(a)
    assert reader.recv_batch() == small
    # a message larger than the socket's buffer arrives in pieces (the sender blocks)
    big, last = list(range(300_000)), ("end",)
    assert len(pickle.dumps(big)) > 1 << 20
    sender = threading.Thread(target=lambda: (b.send(big), b.send(last)))
    sender.start()
    got = []
    while len(got) < 2:
        got += reader.recv_batch()
    sender.join(30)
    assert got == [big, last] and reader.buf == bytearray()
    b.close()
    with pytest.raises(EOFError):
        reader.recv_batch()


def test_message_reader_long_header_and_a_frame_split_at_every_byte():
    a, b = multiprocessing.Pipe()
    body = pickle.dumps({"x": [1, 2, 3]})
    frames = (struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body  # the >2 GiB form
              + struct.pack("!i", len(body)) + body)
    reader = MessageReader(a)
    out = []
    for i in range(len(frames)):  # one byte a read: only whole messages come out
        os.write(b.fileno(), frames[i:i + 1])
        if i == len(frames) - 1 or i == 12 + len(body) - 1:
            out += reader.recv_batch()
        else:
            reader.buf += os.read(a.fileno(), 1)
            assert reader._parse() == []
    assert out == [{"x": [1, 2, 3]}] * 2
