"""Sharded checkpoints on the world: every rank writes what it alone holds, the index reads as full tensors,
and a failure on one rank (its writer, its shard) is one agreed outcome on every rank.

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py; the layouts and the ranks
expected to write are computed from the world size. Resuming on other layouts is checked by
tests/mpi/test_zero.py, test_tensor_parallel.py, test_pipeline.py and test_checkpoint_resharding.py.
"""

import dataclasses
import errno
import glob
import os

import h5py
import numpy as np
import pytest

from helpers import config
from hpctrain.checkpoint import list_checkpoints
from hpctrain.errors import CheckpointError
from hpctrain.parallel.agree import QuietExit
from hpctrain.train import Trainer

ADAMW = {"name": "adamw", "lr": 0.01}


def layouts(comm):
    out = [(1, 1, 0), (1, 1, 1)]
    if comm.size % 4 == 0:
        out += [(2, 1, 1), (1, 2, 0), (1, 2, 1)]
    return out


def job(data, ck, comm, *, pp=1, tp=1, zero=0, steps=2, every=2):
    dp = comm.size // (pp * tp)
    return config(data, optim=ADAMW, hidden=16, train={"steps": steps, "batch_size": 8 * dp},
                  parallel={"pp": pp, "tp": tp, "zero": zero, "bucket_mb": 0.0002},
                  checkpoint={"dir": ck, "every": every})


@pytest.mark.parametrize("pp,tp,zero", [(1, 1, 0), (1, 1, 1), (2, 1, 1), (1, 2, 0), (1, 2, 1)])
def test_every_rank_writes_only_what_it_alone_holds_and_the_index_reads_as_full_tensors(comm, data, shared_dir,
                                                                                         pp, tp, zero):
    if (pp, tp, zero) not in layouts(comm):
        pytest.skip(f"pp {pp} x tp {tp} needs 4 ranks")
    ck = f"{shared_dir}/ck"
    t = Trainer(job(data, ck, comm, pp=pp, tp=tp, zero=zero), log=lambda *a: None)
    try:
        t.run()
        gathered = t.state_dict()  # the full tensors on rank 0, gathered the old way
        writes = np.array([1 if (t.mesh.dp_rank == 0 or (zero and t.mesh.dp > 1)) else 0], dtype=np.int32)
        everyone = np.zeros(comm.size, dtype=np.int32)
        comm.Allgather(writes, everyone)
    finally:
        t.close()
    if comm.rank == 0:
        (folder,) = glob.glob(f"{ck}/ckpt-00000002.*.shards")
        expected = [f"rank-{r:05d}.h5" for r in range(comm.size) if everyone[r]]
        assert sorted(os.listdir(folder)) == expected
        params, slots = gathered
        with h5py.File(f"{ck}/ckpt-00000002.h5", "r") as f:
            lay = {k: int(f.attrs[k]) for k in ("world_size", "dp", "pp", "tp")}
            assert lay == {"world_size": comm.size, "dp": comm.size // (pp * tp), "pp": pp, "tp": tp}
            for name, arr in params.items():
                np.testing.assert_array_equal(f["params"][name][...], arr, err_msg=name)
            for slot, tensors in slots.items():
                for name, arr in tensors.items():
                    np.testing.assert_array_equal(f["optim"][slot][name][...], arr, err_msg=f"{slot}/{name}")
    comm.Barrier()


def test_a_failing_writer_on_one_rank_ends_the_run_everywhere_and_keeps_the_previous_checkpoint(comm, data,
                                                                                                  shared_dir,
                                                                                                  monkeypatch):
    from hpctrain.checkpoint import sharded

    last = comm.size - 1
    write = sharded.write_shard

    def full_disk(path, **kw):
        if kw["step"] == 4 and kw["rank"] == last:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, **kw)

    monkeypatch.setattr(sharded, "write_shard", full_disk)
    ck = f"{shared_dir}/ck"
    t = Trainer(job(data, ck, comm, zero=1, steps=6), log=lambda *a: None)
    try:
        if comm.rank == last:
            with pytest.raises(CheckpointError, match=rf"^rank {last}: cannot write checkpoint shard .*"
                                                      rf"rank-{last:05d}.h5: \[Errno 28\] No space left on device"):
                t.run()
        else:
            with pytest.raises(QuietExit):
                t.run()
    finally:
        t.close()
    assert [s for s, _ in list_checkpoints(ck)] == [2]
    comm.Barrier()


def test_a_damaged_shard_of_one_rank_makes_every_rank_fall_back_to_the_previous_set(comm, data, shared_dir):
    ck = f"{shared_dir}/ck"
    t = Trainer(job(data, ck, comm, zero=1, steps=4), log=lambda *a: None)
    t.run()
    t.close()
    if comm.rank == 0:
        (shard,) = glob.glob(f"{ck}/ckpt-00000004.*.shards/rank-{comm.size - 1:05d}.h5")
        os.truncate(shard, os.path.getsize(shard) // 2)
    comm.Barrier()
    lines = []
    t = Trainer(job(data, ck, comm, zero=1, steps=4), log=lines.append)
    try:
        assert t.step == 2  # every rank resumed the step-2 set, whichever rank's shard was damaged
    finally:
        t.close()
    if comm.rank == 0:
        assert any(line.startswith("resume: skipping ckpt-00000004.h5:") and "truncated" in line for line in lines)
        assert os.path.exists(f"{ck}/ckpt-00000004.h5.skipped")
    comm.Barrier()



def test_a_change_of_tensor_parallel_size_reads_column_splits_by_rows_and_trades_them(comm, data, shared_dir,
                                                                                         monkeypatch):
    """A checkpoint of whole tensors read at tp = world: the row-parallel weights (split by columns) are read a
    block of rows per rank and traded (parallel/columns.py), and every tensor comes back exact."""
    if comm.size < 2:
        pytest.skip("needs tp >= 2")
    import hpctrain.train.checkpointing as checkpointing

    ck = f"{shared_dir}/ck"
    a = Trainer(job(data, ck, comm, zero=0), log=lambda *x: None)
    a.run()
    want = a.state_dict()
    a.close()
    used = []
    real = checkpointing._column_splits

    def spy(*args):
        out = real(*args)
        used.extend(w.name for w, _ in out)
        return out

    monkeypatch.setattr(checkpointing, "_column_splits", spy)
    cfg = job(data, f"{shared_dir}/other", comm, tp=comm.size, steps=2)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=f"{ck}/ckpt-00000002.h5"))
    b = Trainer(cfg, log=lambda *x: None)
    got = b.state_dict()
    b.close()
    assert used  # the row-parallel Linear's weight took the exchange
    if comm.rank == 0:
        (params, slots), (got_params, got_slots) = want, got
        for name, arr in params.items():
            np.testing.assert_array_equal(got_params[name], arr, err_msg=name)
        for slot, tensors in slots.items():
            for name, arr in tensors.items():
                np.testing.assert_array_equal(got_slots[slot][name], arr, err_msg=f"{slot}/{name}")
    comm.Barrier()


def test_a_column_split_that_fails_verification_on_one_rank_falls_back_to_the_previous_set(comm, data, shared_dir,
                                                                                           monkeypatch):
    """The column splits are read after the other pieces agreed (each traded as soon as it is read): a block of
    one that fails on one rank alone still makes every rank fall back to the previous set, none left waiting in
    a trade."""
    if comm.size < 2:
        pytest.skip("needs tp >= 2")
    import hpctrain.train.checkpointing as checkpointing

    ck = f"{shared_dir}/ck"
    a = Trainer(job(data, ck, comm, zero=0, steps=4), log=lambda *x: None)
    a.run()
    a.close()
    moved, real_splits, real_read = [], checkpointing._column_splits, checkpointing.ckpt_read.read_set

    def splits(*args):
        out = real_splits(*args)
        moved.extend(rows for _, rows in out)
        return out

    def read_set(index, label, wanted, out, **kw):
        if comm.rank == comm.size - 1 and "00000004" in index.path and any(w is m for w in wanted for m in moved):
            raise CheckpointError(f"checkpoint {index.path} failed verification: /params/x: a block's digest differs")
        return real_read(index, label, wanted, out, **kw)

    monkeypatch.setattr(checkpointing, "_column_splits", splits)
    monkeypatch.setattr(checkpointing.ckpt_read, "read_set", read_set)
    cfg = job(data, ck, comm, tp=comm.size, steps=4)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=8 * comm.size))
    lines = []
    b = Trainer(cfg, log=lines.append)
    try:
        assert moved and b.step == 2
    finally:
        b.close()
    if comm.rank == 0:
        assert any(line.startswith("resume: skipping ckpt-00000004.h5:") and "digest differs" in line for line in lines)
    comm.Barrier()


def test_pruning_on_the_world_leaves_a_renamed_copy_and_the_shards_it_names(comm, data, shared_dir):
    """Issue 52: a copy of step 4's index saved as ckpt-00000001.h5 made pruning "step 1" remove step 4's
    shards; now it is left in place with one line, and every set hpctrain owns is pruned whole."""
    import shutil

    ck = f"{shared_dir}/ck"
    t = Trainer(job(data, ck, comm, zero=1, steps=4), log=lambda *a: None)
    t.run()
    t.close()
    if comm.rank == 0:
        shutil.copy(f"{ck}/ckpt-00000004.h5", f"{ck}/ckpt-00000001.h5")
    comm.Barrier()
    lines = []
    t = Trainer(job(data, ck, comm, zero=1, steps=6), log=lines.append)
    try:
        t.run()
        layout = t.model.layout
    finally:
        t.close()
    if comm.rank == 0:
        assert any(line.startswith(f"checkpoint: left {ck}/ckpt-00000001.h5 in place, not removed: its step "
                                   "attribute is 4, not the 1 of its name") for line in lines), lines
        from hpctrain.checkpoint import load_checkpoint

        # the copy is no checkpoint of hpctrain's: keep = 3 counts steps 2, 4 and 6, and the copy still reads
        assert [s for s, _ in list_checkpoints(ck)] == [1, 2, 4, 6]
        assert load_checkpoint(f"{ck}/ckpt-00000001.h5", layout).step == 4
    comm.Barrier()


def test_a_fifo_at_the_index_name_is_never_replaced(comm, data, shared_dir):
    """A FIFO where rank 0 commits an index: one agreed error on every rank, the FIFO left as it was."""
    import stat

    ck = f"{shared_dir}/ck"
    t = Trainer(job(data, ck, comm, steps=2), log=lambda *a: None)
    try:
        if comm.rank == 0:
            os.mkfifo(f"{ck}/ckpt-00000002.h5")
        comm.Barrier()
        with pytest.raises((CheckpointError, QuietExit)) as e:
            t.run()
        if comm.rank == 0:
            assert "ckpt-00000002.h5: it is a FIFO (named pipe), not a regular file" in str(e.value)
    finally:
        t.close()
    assert stat.S_ISFIFO(os.lstat(f"{ck}/ckpt-00000002.h5").st_mode)
    comm.Barrier()
