"""The lab's request folder (``lab.channel``): what a program on a lab host asks of the lab's
owner is answered once, in order, and the owner's error reaches the asker."""

import threading

import pytest

from lab.channel import Channel, ChannelClosed


def serve(root, handle, stop: threading.Event) -> threading.Thread:
    owner = Channel(root)

    def loop():
        while not stop.is_set():
            owner.serve_pending(handle)
            stop.wait(0.01)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_requests_are_answered_in_order_and_errors_come_back(tmp_path):
    seen, stop = [], threading.Event()

    def handle(req):
        seen.append(req)
        if req["op"] == "bad":
            raise ValueError("no such host 198.18.0.99")
        return {"n": req["n"] * 2}

    t = serve(tmp_path, handle, stop)
    host = Channel(tmp_path)
    try:
        assert [host.call("double", n=i)["n"] for i in range(5)] == [0, 2, 4, 6, 8]
        with pytest.raises(ChannelClosed, match="could not do 'bad': ValueError: no such host 198.18.0.99"):
            host.call("bad", n=0)
        assert host.call("double", n=7) == {"n": 14}
    finally:
        stop.set()
        t.join()
    assert [r["n"] for r in seen] == [0, 1, 2, 3, 4, 0, 7]
    assert not list(tmp_path.glob("*.json"))   # nothing left behind


def test_a_call_nobody_answers_says_so(tmp_path):
    with pytest.raises(ChannelClosed, match="no answer to 'top_up'"):
        Channel(tmp_path).call("top_up", timeout_s=0.2)
