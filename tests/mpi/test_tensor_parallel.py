"""Tensor parallelism (Megatron-style column/row-parallel pairs) equals one process, alone and with dp or pp.

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py. tp = 2 needs an even world;
what is left over is dp (or pp = 2 at four ranks). The global batch grows with dp so every rank
gets the same share; the reference is each rank training the same config alone on COMM_SELF.
"""

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, gpt_config, train_params as train

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def layouts(comm):
    """(tp, pp) pairs this world runs with tp = 2."""
    if comm.size % 2:
        return []
    return [(2, 1)] + ([(2, 2)] if comm.size % 4 == 0 else [])


def split_sizes(cfg, comm):
    """(this rank's parameter count, the model's, how many tensors are sharded) at the config's layout."""
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    p = cfg.parallel
    mesh = Mesh(comm=comm, tp=p.tp, pp=p.pp)
    lines = []
    t = Trainer(cfg, mesh=mesh, log=lines.append)
    out = t.part.owned_size, t.model.layout.size, len(t.part.shards)
    split_sizes.lines = lines  # what start-up said
    t.close()
    mesh.free()
    return out


def alone(cfg):
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, stages=(), dp="auto"))
    return train(single, MPI.COMM_SELF)


def max_error(got, want) -> float:
    assert set(got) == set(want)
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


@pytest.mark.parametrize("micro", [1, 2])
def test_tensor_parallel_mlp_equals_one_process(comm, data, micro):
    """The helper MLP: Linear 0 (then tanh, layernorm) stays whole; Linear 4 → relu → Linear 6 is a pair."""
    if not layouts(comm):
        pytest.skip("tp = 2 needs an even number of ranks")
    for tp, pp in layouts(comm):
        dp = comm.size // (tp * pp)
        cfg = config(data, optim=SGD, train={"steps": 4, "batch_size": 8 * dp, "micro_batches": micro,
                                              "grad_clip": 0.5}, parallel={"tp": tp, "pp": pp})
        if pp == 1:  # layer 4's weight and bias, layer 6's weight: halved; the rest whole
            assert split_sizes(cfg, comm) == (171 - (8 * 8 + 8 + 3 * 8) // 2, 171, 3)
        assert max_error(train(cfg, comm), alone(cfg)) < 1e-6, (tp, pp)


@pytest.mark.parametrize("vocab", [12, 13], ids=["even-vocab", "uneven-vocab"])
def test_tensor_parallel_gpt_equals_one_process(comm, tokens, vocab):
    """Heads split across ranks (c_attn's q, k, v rows of each rank's heads), c_proj and the MLP split, and the
    token table by vocabulary (13 ids over 2 ranks: 7 and 6 rows), the logits never whole on one rank."""
    from hpctrain.shards import row_block

    if not layouts(comm):
        pytest.skip("tp = 2 needs an even number of ranks")
    for tp, pp in layouts(comm):
        dp = comm.size // (tp * pp)
        cfg = gpt_config(tokens, optim=SGD, model={"vocab_size": vocab},
                         train={"batch_size": 4 * dp, "micro_batches": 2, "grad_clip": 1.0},
                         parallel={"tp": tp, "pp": pp})
        if pp == 1:  # per block: c_attn, attn.c_proj.weight, c_fc, mlp.c_proj.weight halved; wte by vocabulary
            C, L = 8, 2
            total = 1920 + (vocab - 12) * C
            halved = L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) // 2
            kept = row_block(vocab, tp, comm.rank % tp)[1]  # parallel/mesh.py: tp_rank = rank % tp
            assert split_sizes(cfg, comm) == (total - halved - (vocab - kept) * C, total, 6 * L + 1)
            said = f"the token table, head and loss by vocabulary (ids 0..{row_block(vocab, tp, 0)[1] - 1} of {vocab} here)"
            assert comm.rank or any(said in line for line in split_sizes.lines), split_sizes.lines  # rank 0 logs
        assert max_error(train(cfg, comm), alone(cfg)) < 1e-6, (tp, pp)


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_tensor_parallel_gpt_with_dropout_equals_one_process(comm, tokens, attention):
    """model.dropout: each rank draws attention's mask for its own heads by their index in the whole model, and
    the residual branches' masks on the whole rows after the row-parallel sum, so tp trains as one process;
    flash attention (which draws the mask inside its own passes) against one process on the math attention."""
    if not layouts(comm):
        pytest.skip("tp = 2 needs an even number of ranks")
    for tp, pp in layouts(comm):
        dp = comm.size // (tp * pp)
        cfg = gpt_config(tokens, optim=SGD, model={"dropout": 0.2, "attention": attention},
                         train={"batch_size": 4 * dp, "micro_batches": 2, "grad_clip": 1.0},
                         parallel={"tp": tp, "pp": pp})
        want = alone(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="math")))
        assert max_error(train(cfg, comm), want) < 1e-6, (tp, pp)


def refused(cfg, comm, **mesh_args):
    """The error every rank leaves with (rank 0's message; QuietExit elsewhere), before any training."""
    from hpctrain.errors import HpctrainError
    from hpctrain.parallel.agree import QuietExit
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    mesh = Mesh(comm=comm, **mesh_args)
    try:
        with pytest.raises((HpctrainError, QuietExit)) as info:
            Trainer(cfg, mesh=mesh, log=lambda *a: None)
    finally:
        mesh.free()
    return str(info.value) if comm.rank == 0 else None


def test_tensor_parallel_gpt_under_the_zero_bubble_schedule(comm, tokens):
    """tp 2 x pp 2: each split Linear's W runs apart from its B, the column-parallel input gradient's Allreduce
    in B."""
    if comm.size % 4:
        pytest.skip("tp 2 x pp 2 needs four ranks")
    cfg = gpt_config(tokens, train={"batch_size": 4, "micro_batches": 4, "grad_clip": 1.0},
                     optim={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                     parallel={"tp": 2, "pp": 2, "schedule": "zero-bubble"})
    assert max_error(train(cfg, comm), alone(cfg)) < 1e-6


def test_bad_tensor_parallel_layouts_are_one_clear_error(comm, data, tokens):
    if comm.size % 2:
        pytest.skip("tp = 2 needs an even number of ranks")
    dp = comm.size // 2
    odd = config(data, hidden=7, train={"batch_size": 8 * dp}, parallel={"tp": 2})
    msg = refused(odd, comm, tp=2)
    assert msg is None or "model.layers[4] and [6] are a tensor-parallel pair" in msg and "7 is not divisible" in msg
    heads = gpt_config(tokens, model={"n_head": 1}, train={"batch_size": 4 * dp}, parallel={"tp": 2})
    msg = refused(heads, comm, tp=2)
    assert msg is None or "model.n_head = 1 is not divisible by it" in msg
    if comm.size == 4:
        cut = config(data, train={"batch_size": 8}, parallel={"tp": 2, "pp": 2, "stages": [[0, 4], [5, 6]]})
        msg = refused(cut, comm, tp=2, pp=2)
        assert msg is None or "parallel.stages[0] ends at layer 4, inside layers 4..6" in msg


@pytest.mark.parametrize("vocab", [12, 13], ids=["even-vocab", "uneven-vocab"])
@pytest.mark.parametrize("first_tp", [2, 1], ids=["tp2-then-tp1", "tp1-then-tp2"])
def test_checkpoints_move_between_tensor_parallel_sizes(comm, tokens, shared_dir, first_tp, vocab):
    """Two steps at one tp, a checkpoint (full tensors), two more at the other == four steps on one process;
    with 13 ids the vocab-parallel token table's blocks are 7 and 6 rows."""
    if comm.size % 2:
        pytest.skip("tp = 2 needs an even number of ranks")
    for tp, pp in layouts(comm):  # tp2 <-> tp1 at pp = 1, and tp2·pp2 <-> tp1·pp1 at four ranks
        base = gpt_config(tokens, optim={"name": "adamw", "lr": 0.01}, model={"vocab_size": vocab},
                          train={"batch_size": 4 * comm.size // (tp * pp), "steps": 2},
                          checkpoint={"dir": f"{shared_dir}/ck{pp}"})

        def at(tp_, pp_, steps, **changes):
            return dataclasses.replace(base, train=dataclasses.replace(base.train, steps=steps),
                                       parallel=dataclasses.replace(base.parallel, tp=tp_, pp=pp_), **changes)

        first, then = ((tp, pp), (1, 1)) if first_tp == 2 else ((1, 1), (tp, pp))
        train(at(*first, 2), comm)
        resumed = train(at(*then, 4), comm)
        straight = alone(at(1, 1, 4, checkpoint=dataclasses.replace(base.checkpoint, dir="")))
        assert max_error(resumed, straight) < 1e-4, pp  # AdamW: see tests/mpi/test_gpt_parallel.py, ADAMW_RTOL


def test_tensor_parallel_bytes_are_megatrons_count(comm, tokens, shared_dir):
    """Per micro-batch: an Allreduce of B·T·C floats after each pair forward and one before each pair's input
    gradient backward (4 a block), one after the vocab-parallel embedding's forward and one for the head's input
    gradient; and the vocab-parallel loss's three of one value per row: the max (float32), the sum of exps with
    the target's logit (2 float64) and the first argmax (int64), 28 bytes a row."""
    if comm.size % 2:
        pytest.skip("tp = 2 needs an even number of ranks")
    import json

    for tp, pp in layouts(comm):  # with pp = 2 each stage counts its block; the line sums them
        dp = comm.size // (tp * pp)
        metrics = f"{shared_dir}/m{pp}.jsonl"
        cfg = gpt_config(tokens, train={"batch_size": 4 * dp, "steps": 2, "micro_batches": 2, "metrics": metrics},
                         parallel={"tp": tp, "pp": pp})
        train(cfg, comm)
        seen = np.zeros(2, dtype=np.int64)
        if comm.rank == 0:  # every rank learns what rank 0 read: a failure on one rank alone could hang the next test
            seen[:] = [r["tp_bytes"] for r in map(json.loads, open(metrics)) if "loss" in r]
        comm.Bcast(seen, root=0)
        B, T, C, L = 4, 8, 8, 2  # this rank's batch share, context, width, blocks
        assert list(seen) == [(4 * L + 2) * B * T * C * 4 + 28 * B * T] * 2, pp


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_row_blocks_traded_for_column_blocks_give_each_rank_its_columns(comm, rows):
    """parallel/columns.py: rank r holds row block r of a tensor and ends with its column block, for rows that
    do not divide over the ranks and fewer rows than ranks (empty blocks send and receive nothing)."""
    from hpctrain.parallel.columns import row_bounds, trade_columns

    cols = 3 * comm.size
    full = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) * 0.5 - 7
    lo, hi = row_bounds(rows, comm.size)[comm.rank]
    out = np.full(rows * 3, np.nan, dtype=np.float32)
    trade_columns(comm, full[lo:hi].reshape(-1).copy(), out, (rows, cols))
    np.testing.assert_array_equal(out.reshape(rows, 3), full[:, 3 * comm.rank : 3 * comm.rank + 3])
    if rows >= comm.size:  # a check each rank makes before sending anything (one with an empty block has nothing)
        with pytest.raises(ValueError, match="overlap"):
            both = np.zeros(max(out.size, (hi - lo) * cols), dtype=np.float32)
            trade_columns(comm, both[: (hi - lo) * cols], both[: out.size], (rows, cols))
