"""The vocab-parallel embedding and cross-entropy on the CPU backend: blocks of the vocabulary, combined over a
tensor-parallel group, give the single-process values.

The group's ranks are threads here (``ThreadGroup``: an in-process Allreduce), so one process checks every
block count, uneven blocks included; tests/mpi/test_tensor_parallel.py trains the GPT with them under mpiexec.
"""

import threading

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.backend.cpu import CpuBackend
from hpctrain.errors import BackendError
from hpctrain.nn.loss import CrossEntropyLoss, VocabParallelCrossEntropy
from hpctrain.shards import row_block

be = CpuBackend()
rng = np.random.default_rng(7)
REDUCE = ((MPI.SUM, np.add), (MPI.MAX, np.maximum), (MPI.MIN, np.minimum))  # MPI.Op is not hashable


class ThreadGroup:
    """``size`` threads as the ranks of a tensor-parallel group: ``member(r)`` has what the layers and the loss
    use of parallel/tensor.py's ``TensorParallel`` (rank, size, bytes, ``allreduce_``, ``allreduce_host``)."""

    def __init__(self, size):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=30), [None] * size

    def member(self, rank):
        group = self

        class Member:
            size, bytes = group.size, 0

            def allreduce_host(self, arr, op):
                group.slots[rank] = arr.copy()
                group.barrier.wait()
                combine = next(f for o, f in REDUCE if o == op)
                total = group.slots[0].copy()
                for other in group.slots[1:]:  # rank order, as every rank sees it
                    total = combine(total, other)
                group.barrier.wait()  # every rank has read the slots before any writes the next
                arr[...] = total
                self.bytes += arr.nbytes
                return arr

            def allreduce_(self, arr):
                self.allreduce_host(arr, MPI.SUM)

        m = Member()
        m.rank = rank
        return m

    def run(self, fn):
        """[fn(member r) for every r], each in its own thread; an exception on any rank is raised here."""
        out, errors = [None] * self.size, []

        def body(r):
            try:
                out[r] = fn(self.member(r))
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_block_rows_cover_the_vocabulary_once_as_array_split(tp):
    for rows in (tp, 7, 12, 13, 50257):
        blocks = [row_block(rows, tp, r) for r in range(tp)]
        assert [n for _, n in blocks] == [len(a) for a in np.array_split(np.arange(rows), tp)]
        assert [lo for lo, _ in blocks] == [0] + list(np.cumsum([n for _, n in blocks])[:-1])


@pytest.mark.parametrize("tp,V", [(2, 12), (2, 13), (3, 10), (4, 5)])
def test_vocab_blocks_of_the_embedding_are_the_whole_table_bit_for_bit(tp, V):
    B, T, C = 3, 5, 6
    idx = rng.integers(0, V, (B, T)).astype(np.int64)
    idx[0, :] = V - 1
    wte, wpe = rng.standard_normal((V, C)).astype(np.float32), rng.standard_normal((T, C)).astype(np.float32)
    dout = rng.standard_normal((B * T, C)).astype(np.float32)
    want, want_dwte, want_dwpe = be.empty((B * T, C)), be.empty((V, C)), be.empty((T, C))
    be.embedding_forward(idx, wte, wpe, want)
    be.embedding_backward(dout, idx, want_dwte, want_dwpe)
    total = np.zeros((B * T, C), np.float32)
    dwte = []
    for r in range(tp):
        lo, n = row_block(V, tp, r)
        out, g, gp = be.empty((B * T, C)), be.empty((n, C)), be.empty((T, C))
        be.embedding_forward(idx, wte[lo : lo + n].copy(), wpe, out, vocab_start=lo, vocab=V, add_positions=r == 0)
        total += out  # every row is one rank's (and rank 0's positions): adding zeros is exact
        be.embedding_backward(dout, idx, g, gp, vocab_start=lo, vocab=V)
        dwte.append(g)
        np.testing.assert_array_equal(gp, want_dwpe)  # every rank of the group computes wpe's whole gradient
    np.testing.assert_array_equal(total, want)
    np.testing.assert_array_equal(np.concatenate(dwte), want_dwte)


def test_an_id_outside_the_vocabulary_is_refused_by_every_block():
    idx = np.array([[0, 5, 13]], np.int64)
    wte, wpe, out = np.zeros((6, 2), np.float32), np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(BackendError, match=r"embedding_forward: token id 13 at position 2 .* outside \[0, 13\)"):
        be.embedding_forward(idx, wte, wpe, out, vocab_start=7, vocab=13)
    with pytest.raises(BackendError, match=r"wte holds ids \[10, 16\), outside a vocabulary of 13"):
        be.embedding_forward(idx, wte, wpe, out, vocab_start=10, vocab=13)


def vocab_parallel(logits, targets, tp, scale):
    """(loss sums, correct counts, dlogits blocks joined) of VocabParallelCrossEntropy on ``tp`` thread ranks."""
    V = logits.shape[1]

    def rank(member):
        lo, n = row_block(V, tp, member.rank)
        loss = VocabParallelCrossEntropy(member, lo, V)
        return loss(be, np.ascontiguousarray(logits[:, lo : lo + n]), targets, scale)

    results = ThreadGroup(tp).run(rank)
    return ([r[0] for r in results], [r[1] for r in results], np.concatenate([r[2] for r in results], axis=1))


@pytest.mark.parametrize("tp,V", [(1, 7), (2, 12), (2, 13), (3, 10), (4, 6)])
def test_vocab_parallel_cross_entropy_is_the_whole_rows(tp, V):
    N = 40
    logits = (rng.standard_normal((N, V)) * 4).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int64)
    logits[:5] = 1.5  # ties everywhere: the first column is the argmax, as numpy's
    logits[5:10, V - 1] = 50.0  # a max in the last block
    targets[:10:2] = np.array([0, V - 1, 0, V - 1, 0])
    want_total, want_correct, want_d = CrossEntropyLoss()(be, logits, targets, 1 / N)
    totals, corrects, d = vocab_parallel(logits, targets, tp, 1 / N)
    assert len(set(totals)) == 1 and len(set(corrects)) == 1  # the same on every rank of the group
    assert corrects[0] == want_correct
    np.testing.assert_allclose(totals[0], want_total, rtol=1e-12)
    np.testing.assert_allclose(d, want_d, rtol=1e-6, atol=1e-9)


def test_a_target_outside_the_vocabulary_stops_every_rank_with_one_error():
    logits = np.zeros((3, 8), np.float32)
    with pytest.raises(BackendError, match=r"cross_entropy: target 8 in row 1 is outside \[0, 8\)"):
        vocab_parallel(logits, np.array([0, 8, 1], np.int64), 2, 1.0)
