"""The communication thread (hpctrain/parallel/transport.py: CommThread): work runs in order, ``wait_done(n)``
returns once the first n pieces are finished, and a piece that fails ends the waits instead of hanging them."""

import threading

import pytest

from hpctrain.parallel.transport import CommThread


def test_wait_done_returns_once_the_first_pieces_are_finished_and_not_before():
    thread = CommThread("test-comm")
    gates = [threading.Event() for _ in range(3)]
    ran = []
    for i, gate in enumerate(gates):
        thread.submit(lambda i=i, gate=gate: (gate.wait(5), ran.append(i)))
    assert thread.submitted == 3
    waiter = threading.Thread(target=thread.wait_done, args=(2,))
    waiter.start()
    gates[0].set()
    waiter.join(0.2)
    assert waiter.is_alive()  # the second piece is not finished yet
    gates[1].set()
    waiter.join(5)
    assert not waiter.is_alive() and ran == [0, 1]
    thread.wait_done(0)  # nothing to wait for
    gates[2].set()
    thread.join()
    assert ran == [0, 1, 2]
    thread.close()


def test_a_failing_piece_ends_the_wait_and_join_raises_it():
    thread = CommThread("test-comm")
    thread.submit(lambda: 1 / 0)
    thread.submit(lambda: None)  # skipped after the error, still counted as finished
    thread.wait_done(2)
    with pytest.raises(ZeroDivisionError):
        thread.join()
    thread.close()
