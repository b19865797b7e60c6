"""ZeRO-1/2 (``parallel.zero``) equals one process on every layout, holds 1/dp of the optimizer state, and its
checkpoints resume on any layout and any ``zero``.

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py: dp is the world size, or world / 2
with pp = 2 or tp = 2 (at 4 ranks: dp 2 x pp 2 and dp 2 x tp 2). The reference is each rank training the
same config alone on COMM_SELF (itself checked against PyTorch, tests/test_train.py and the golden tests).
Small buckets (50 floats) make every bucket boundary fall inside some slice.
"""

import dataclasses
import time

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, gpt_config, train_params as train
from hpctrain.parallel.mesh import Mesh
from hpctrain.parallel.data_parallel import make_buckets
from hpctrain.parallel.zero import ZeroShard, page_unit, reduce_choice
from hpctrain.train import Trainer

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}
SMALL_BUCKETS = {"bucket_mb": 0.0002}
# AdamW on the GPT: the key bias of c_attn gets only rounding noise as its gradient (softmax ignores a shift
# shared by a row's scores), which AdamW turns into lr-sized steps; every other tensor agrees to ~4e-7
# (the same bound as tests/mpi/test_gpt_parallel.py)
GPT_ADAMW_RTOL = 1e-4


def alone(cfg):
    p = dataclasses.replace(cfg.parallel, pp=1, tp=1, dp="auto", stages=(), zero=0)
    return train(dataclasses.replace(cfg, parallel=p), MPI.COMM_SELF)


def max_error(got, want) -> float:
    """The largest difference of any tensor relative to that tensor's largest value."""
    assert set(got) == set(want)
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


def layouts(comm):
    """(pp, tp) pairs this world size can run with dp >= 2 where it can."""
    out = [(1, 1)]
    if comm.size % 4 == 0:
        out += [(2, 1), (1, 2)]
    return out


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("optim", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("micro", [1, 2], ids=["1-micro", "2-micro"])
def test_zero_mlp_equals_one_process_on_every_layout(comm, data, zero, optim, micro):
    for pp, tp in layouts(comm):
        dp = comm.size // (pp * tp)
        cfg = config(data, optim=optim, train={"steps": 5, "batch_size": 8 * dp, "micro_batches": micro,
                                               "grad_clip": 0.5},
                     data={"shuffle": True}, parallel={"zero": zero, "pp": pp, "tp": tp, **SMALL_BUCKETS})
        worst = max_error(train(cfg, comm), alone(cfg))
        assert worst < (1e-5 if optim is ADAMW else 1e-6), (pp, tp, worst)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_gpt_equals_one_process_on_every_layout(comm, tokens, zero):
    """pp = 2 puts the tied embedding on both ends: its two ends are summed before the reduce-scatter."""
    for pp, tp in layouts(comm):
        dp = comm.size // (pp * tp)
        cfg = gpt_config(tokens, optim=SGD, train={"batch_size": 4 * dp, "micro_batches": 2, "grad_clip": 1.0},
                         parallel={"zero": zero, "pp": pp, "tp": tp, **SMALL_BUCKETS})
        worst = max_error(train(cfg, comm), alone(cfg))
        assert worst < 1e-6, (pp, tp, worst)


def test_zero_under_the_zero_bubble_schedule(comm, tokens):
    """The sync's "gradients final" events follow the step's last W; the tied embedding's two ends still
    sum before the scatter."""
    if comm.size % 4:
        pytest.skip("dp 2 x pp 2 needs four ranks")
    cfg = gpt_config(tokens, optim=SGD, train={"batch_size": 8, "micro_batches": 4, "grad_clip": 1.0},
                     parallel={"zero": 2, "pp": 2, "schedule": "zero-bubble", **SMALL_BUCKETS})
    assert max_error(train(cfg, comm), alone(cfg)) < 1e-6


def test_zero_equals_zero_0_on_the_same_layout(comm, tokens):
    """The same reductions in another shape: the two runs agree at the float32 noise floor."""
    cfg = gpt_config(tokens, optim=ADAMW, train={"batch_size": 4 * comm.size}, parallel=SMALL_BUCKETS)
    plain = train(cfg, comm)
    for zero in (1, 2):
        sharded = train(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=zero)), comm)
        assert max_error(sharded, plain) < GPT_ADAMW_RTOL


@pytest.mark.parametrize("zero", [1, 2])
def test_optimizer_state_is_one_slice_of_the_buffer(comm, data, zero):
    cfg = config(data, hidden=32, optim=ADAMW, train={"steps": 1, "batch_size": 8 * comm.size},
                 parallel={"zero": zero, "bucket_mb": 0.001})
    mesh = Mesh(comm=comm)
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        n = t.part.layout.size
        if comm.size == 1:
            assert t.optim.pieces == [(0, n)] and t.zero == 0 and t.shard is None  # nothing to shard over
            mine = n
        else:
            want = ZeroShard(make_buckets(n, cfg.parallel.bucket_mb * 1e6 / 4), comm.size, comm.rank)
            assert t.optim.pieces == want.pieces
            mine = t.shard.size
            assert mine <= n / comm.size + 16 * len(t.shard.buckets)  # one alignment pad per bucket at most
            assert sum(want.sizes()) == n  # every value owned by exactly one rank
        assert t.optim.slot_bytes == 8 * mine  # Adam: exp_avg and exp_avg_sq, float32
        t.run()
    finally:
        t.close()
        mesh.free()


def test_zero_2_hands_gradient_pages_back(comm, data):
    if comm.size < 2:
        pytest.skip("needs two ranks: with one there is nothing to shard")
    # 64 x 512 + 512 x 512 + ... floats: several 4 KiB pages outside every rank's slice
    cfg = config(data, hidden=512, optim=SGD, train={"steps": 2, "batch_size": 8 * comm.size},
                 parallel={"zero": 2, "bucket_mb": 0.5})
    mesh = Mesh(comm=comm)
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        t.run()
        outside = t.part.layout.size - t.shard.size
        kept = 2 * 1024 * 2 * len(t.sync.buckets)  # pages a bucket or chunk boundary cuts stay whole
        assert outside > 4 * kept  # the test means something
        assert t.sync.released_bytes >= 4 * (outside - kept)
        g = t.grads.data.copy()  # released pages read as zeros
        for a, b in t.shard.pieces:
            g[a:b] = 0
        assert np.count_nonzero(g) <= kept
    finally:
        t.close()
        mesh.free()


def _trained_with_moves(cfg, comm):
    """``train(cfg, comm)``'s parameters, and how many gradient units got released pages back on this rank."""
    moved = []
    params = train(cfg, comm, look=lambda t: moved.append(t.grad_memory.moved_in if t.grad_memory else 0))
    return params, moved[0]


def test_zero_2_writes_gradients_into_released_pages_and_trains_bitwise_as_zero_1(comm, data, tokens):
    """zero = 2 hands a layer about to write its gradients the pages released from buckets reduced before
    (parallel/grad_pages.py). Their stale values must never be read: below 32 MiB of gradients zero = 1 cuts the
    same chunks and runs the same reductions, so the two agree bit for bit. Buckets of many pages (whole pages
    outside every chunk), two micro-batches, the GPT's tied embedding; at four ranks also pp 2 (its two ends)
    and the zero-bubble schedule (B and W apart)."""
    if comm.size < 2:
        pytest.skip("needs two ranks: with one there is nothing to shard")
    runs = []
    for pp, tp in layouts(comm):
        dp = comm.size // (pp * tp)
        runs.append(config(data, hidden=512, optim=ADAMW, train={"steps": 4, "batch_size": 8 * dp,
                                                                 "micro_batches": 2, "grad_clip": 0.5},
                           data={"shuffle": True}, parallel={"pp": pp, "tp": tp, "bucket_mb": 0.5}))
        runs.append(gpt_config(tokens, model={"n_embd": 64}, train={"batch_size": 4 * dp, "micro_batches": 2},
                               parallel={"pp": pp, "tp": tp, "bucket_mb": 0.05}))
    if comm.size % 4 == 0:
        runs.append(gpt_config(tokens, model={"n_embd": 64}, train={"batch_size": 8, "micro_batches": 4},
                               parallel={"pp": 2, "schedule": "zero-bubble", "bucket_mb": 0.05}))
    for cfg in runs:
        with_zero = [dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=z)) for z in (1, 2)]
        (one, _), (two, moved) = (_trained_with_moves(c, comm) for c in with_zero)
        assert all(np.array_equal(one[n], two[n]) for n in one), cfg.parallel
        assert comm.allreduce(moved) > 0, cfg.parallel  # the released pages were used again


def test_zero_2_on_huge_pages_trains_bitwise_as_without_the_pool(comm, data, monkeypatch):
    """A gradient buffer of 32 MiB and more is cut on huge pages (parallel/zero.py: page_unit), which zero = 1 is
    not, so at dp >= 3 its sums may round otherwise; against zero = 2 with the pool off, pages released and used
    again must change nothing."""
    if comm.size < 2:
        pytest.skip("needs two ranks: with one there is nothing to shard")
    dp = comm.size
    cfg = config(data, hidden=3000, optim=ADAMW, train={"steps": 2, "batch_size": 4 * dp, "micro_batches": 2},
                 parallel={"zero": 2, "bucket_mb": 5})
    pooled, moved = _trained_with_moves(cfg, comm)
    assert page_unit(sum(v.size for v in pooled.values())) and comm.allreduce(moved) > 0
    monkeypatch.setattr(ZeroShard, "keep_bytes", lambda self: 0)
    plain, none = _trained_with_moves(cfg, comm)
    assert none == 0 and all(np.array_equal(pooled[n], plain[n]) for n in plain)


def test_zero_2_backward_waits_for_earlier_buckets_instead_of_holding_them_all(comm, data, monkeypatch):
    """A backward pass that outruns the reductions (slowed here) would hold every bucket's gradients at once; before
    a layer brings released memory back it waits until only the last bucket handed over is still being reduced,
    so at most about three buckets are live: that one, the one being written and the one it completes."""
    if comm.size < 2:
        pytest.skip("needs two ranks: with one there is nothing to shard")
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("no communication thread (MPI without MPI_THREAD_MULTIPLE): buckets reduce after backward")
    from hpctrain.parallel.data_parallel import GradSync
    from hpctrain.parallel.transport import CommThread

    layers = [{"type": "linear", "in": 6, "out": 256}, {"type": "relu"}]
    layers += [{"type": "linear", "in": 256, "out": 256}, {"type": "relu"}] * 12 + [
        {"type": "linear", "in": 256, "out": 3}]
    bucket_mb = 0.3  # about one 256 x 256 layer a bucket
    cfg = config(data, model={"layers": layers}, train={"steps": 3, "batch_size": 8 * comm.size},
                 parallel={"zero": 2, "bucket_mb": bucket_mb})
    reduce = GradSync._reduce
    monkeypatch.setattr(GradSync, "_reduce", lambda self, i: (time.sleep(0.03), reduce(self, i)))
    seen = []

    def look(t):
        seen.append((t.grad_memory.peak_live_bytes, t.grad_memory.unit, 4 * (t.part.layout.size - t.shard.size),
                     t.sync.backpressure_seconds))

    train(cfg, comm, look=look)
    peak, unit, outside, waited = seen[0]
    assert waited > 0  # the last step's backward waited (the step counts it as communication, not compute)
    bucket = bucket_mb * 1e6
    assert outside > 4 * bucket  # the test means something
    assert peak <= 3 * bucket + 2 * unit, (peak, bucket)
    monkeypatch.setattr(CommThread, "wait_done", lambda self, count: None)  # without the waits: all of it at once
    seen.clear()
    train(cfg, comm, look=look)
    assert seen[0][0] > outside - 2 * bucket, (seen[0][0], outside)


def test_zero_reduce_by_allreduce_trains_as_by_reduce_scatter(comm, data, tokens):
    """``parallel.zero_reduce = "allreduce"`` sums each bucket by Allreduce and keeps the rank's chunk of it: at
    dp 2 the same bits as Reduce_scatter (each value one addition), at other dp the same to the float32 noise
    floor; zero = 2 still releases the rest and writes the next gradients into those pages."""
    if comm.size < 2:
        pytest.skip("needs two ranks: with one there is nothing to shard")
    for pp, tp in layouts(comm):
        dp = comm.size // (pp * tp)
        runs = [config(data, hidden=512, optim=SGD, train={"steps": 3, "batch_size": 8 * dp, "micro_batches": 2,
                                                           "grad_clip": 0.5},
                       parallel={"pp": pp, "tp": tp, "zero": 2, "bucket_mb": 0.5}),
                gpt_config(tokens, model={"n_embd": 32}, optim=SGD, train={"batch_size": 4 * dp},
                           parallel={"pp": pp, "tp": tp, "zero": 1, **SMALL_BUCKETS})]
        for cfg in runs:
            (scattered, _), (summed, moved) = (_trained_with_moves(dataclasses.replace(
                cfg, parallel=dataclasses.replace(cfg.parallel, zero_reduce=how)), comm)
                for how in ("reduce_scatter", "allreduce"))
            if dp == 2:
                assert all(np.array_equal(scattered[n], summed[n]) for n in summed), (pp, tp)
            else:
                assert max_error(summed, scattered) < 1e-6, (pp, tp)
            if cfg.parallel.zero == 2:
                assert comm.allreduce(moved) > 0, (pp, tp)


def test_zero_reduce_auto_times_both_at_dp_2_and_every_rank_takes_the_same(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    how, timed = reduce_choice("auto", comm, 50_000, device=False)
    if comm.size == 2:  # the two give the same bits only here: timed, and the faster taken
        assert timed is not None and all(0 < s < 10 for s in timed)
        assert how == ("allreduce" if timed[0] < timed[1] else "reduce_scatter")
    else:
        assert (how, timed) == ("reduce_scatter", None)
    assert comm.allgather((how, timed)) == [(how, timed)] * comm.size
    assert reduce_choice("auto", comm, 50_000, device=True) == ("reduce_scatter", None)  # no collective
    if comm.size == 4:  # two data-parallel groups of 2, buckets of their own sizes: one choice for the world
        group = comm.Split(comm.rank % 2, comm.rank)
        try:
            chosen = reduce_choice("auto", group, 1000 * (1 + comm.rank % 2), device=False, agree=comm)
        finally:
            group.Free()
        assert chosen[1] is not None and comm.allgather(chosen) == [chosen] * comm.size
    assert reduce_choice("allreduce", comm, 50_000, device=False) == ("allreduce", None)


def test_zero_checkpoints_resume_across_zero_and_layouts(comm, tokens, shared_dir):
    """zero = 2 on the world -> zero = 0 on one process, and zero = 0 on one process -> zero = 1 on the world
    (dp 2 x tp 2 at four ranks): each equals four straight steps on one process."""
    ck = f"{shared_dir}/ck"
    base = gpt_config(tokens, optim=ADAMW, train={"batch_size": 4 * comm.size, "steps": 2},
                      checkpoint={"dir": ck}, parallel={"zero": 2, **SMALL_BUCKETS})
    train(base, comm)
    four = dataclasses.replace(base.train, steps=4)
    worst = np.zeros(1)
    if comm.rank == 0:  # every rank learns the outcome: one failing alone would leave the others in a collective
        resumed = train(dataclasses.replace(base, train=four, parallel=dataclasses.replace(base.parallel, zero=0)),
                        MPI.COMM_SELF)
        straight = alone(dataclasses.replace(base, train=four, checkpoint=dataclasses.replace(base.checkpoint,
                                                                                              dir="")))
        worst[0] = max_error(resumed, straight)
    comm.Bcast(worst, root=0)
    assert worst[0] < GPT_ADAMW_RTOL

    ck2 = f"{shared_dir}/ck2"
    if comm.rank == 0:
        alone(dataclasses.replace(base, checkpoint=dataclasses.replace(base.checkpoint, dir=ck2)))
    comm.Barrier()
    tp = 2 if comm.size % 4 == 0 else 1
    on_world = dataclasses.replace(base, train=four, checkpoint=dataclasses.replace(base.checkpoint, dir=ck2),
                                   parallel=dataclasses.replace(base.parallel, zero=1, tp=tp))
    resumed = train(on_world, comm)
    straight = alone(dataclasses.replace(base, train=four, checkpoint=dataclasses.replace(base.checkpoint, dir="")))
    assert max_error(resumed, straight) < GPT_ADAMW_RTOL


def test_recompute_on_every_layout_is_bitwise_the_same(comm, tokens):
    """train.recompute = "blocks" with zero 2, pp and tp: the same bits as storing every activation."""
    for pp, tp in layouts(comm):
        dp = comm.size // (pp * tp)
        cfg = gpt_config(tokens, optim=ADAMW, train={"batch_size": 4 * dp, "micro_batches": 2},
                         parallel={"zero": 2, "pp": pp, "tp": tp, **SMALL_BUCKETS})
        stored = train(cfg, comm)
        recomputed = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="blocks")), comm)
        assert all(np.array_equal(stored[n], recomputed[n]) for n in stored), (pp, tp)


def test_a_tied_replica_holds_no_optimizer_state(comm, tokens):
    """pp = 2: the last stage's copy of the GPT's wte is updated by its owner and keeps no Adam slots."""
    if comm.size % 2:
        pytest.skip("a two-stage pipeline needs an even number of ranks")
    for zero in (0, 1):
        cfg = gpt_config(tokens, optim=ADAMW, train={"batch_size": 2 * comm.size, "steps": 1},
                         parallel={"pp": 2, "zero": zero})
        mesh = Mesh(comm=comm, pp=2)
        t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        try:
            t.run()
            updated = np.array([t.optim.slot_bytes // 8], dtype=np.int64)
            if t.zero:  # each owned value's state on one data-parallel rank
                mesh.dp_comm.Allreduce(MPI.IN_PLACE, updated, op=MPI.SUM)
            assert updated[0] == t.part.owned_size  # the replica's values never have any
            if t.part.is_last:
                assert t.part.replicas == ["transformer.wte.weight"] and t.part.owned_size < t.part.layout.size
        finally:
            t.close()
            mesh.free()
