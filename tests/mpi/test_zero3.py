"""ZeRO-3 (``parallel.zero = 3``): the parameters sharded over dp too, each unit gathered around its use.

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py: dp is the world size (pp = tp = 1),
or world / 2 with tp = 2 or pp = 2 at four ranks (every schedule, the interleaved one too). zero 3 runs zero 2's reductions and optimizer on the same chunks and gathers the very
values zero 2's Allgatherv would have, so the two agree bit for bit at any dp; against one process they agree
to float32 rounding. Buckets of many pages put bucket and chunk cuts inside units and leave whole pages outside
every chunk, which zero 3 releases (``train_releasing`` checks it did).
"""

import ctypes
import dataclasses
import mmap

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, gpt_config, train_params as train
from hpctrain.errors import ConfigError
from hpctrain.parallel.zero3 import ParamGather, unit_ranges, without

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}
# buckets of many pages: whole pages outside every chunk, which zero 3 releases and gathers again (buckets of a
# few floats would leave every page holding part of a chunk, nothing released, and the tests blind to it)
MLP_BUCKETS = {"bucket_mb": 0.1}
GPT_BUCKETS = {"bucket_mb": 0.05}
GPT_WIDE = {"n_embd": 64}
GPT_ADAMW_RTOL = 1e-4  # AdamW turns a near-zero gradient's rounding noise into lr-sized steps (tests/mpi/test_zero.py)


def with_zero(cfg, zero, **parallel):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=zero, **parallel))


def alone(cfg):
    return train(with_zero(cfg, 0, dp="auto"), MPI.COMM_SELF)


def max_error(got, want) -> float:
    assert set(got) == set(want)
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


def same_bits(a, b) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)


def train_releasing(cfg, comm):
    """``train``, checking that the run released parameter pages (with dp >= 2) and gathered them back."""
    seen = []
    got = train(cfg, comm, look=lambda t: seen.append(t.state.gather.released_bytes if t.state.gather else 0))
    if comm.size > 1:
        assert comm.allreduce(seen[0]) > 0, "zero 3 released no parameter page: the test would not see a stale one"
    return got


@pytest.mark.parametrize("optim", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("micro", [1, 2], ids=["1-micro", "2-micro"])
def test_zero_3_mlp_trains_as_zero_2_bitwise_and_as_one_process(comm, data, optim, micro):
    dp = comm.size
    cfg = config(data, hidden=512, optim=optim, train={"steps": 5, "batch_size": 8 * dp, "micro_batches": micro,
                                                       "grad_clip": 0.5, "eval_every": 2},
                 data={"shuffle": True}, parallel=MLP_BUCKETS)
    three = train_releasing(with_zero(cfg, 3), comm)
    assert same_bits(three, train(with_zero(cfg, 2), comm))
    if optim is SGD:  # AdamW amplifies the rounding of near-zero gradients (zero 2 differs from one process by
        assert max_error(three, alone(cfg)) < 1e-5  # 4e-4 here at dp 4); zero 3's bits are zero 2's all the same


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_zero_3_gpt_with_its_tied_head_and_dropout_trains_as_zero_2_bitwise(comm, tokens, recompute):
    """The head's unit gathers the embedding's wte too; the recomputed forward gathers again."""
    dp = comm.size
    cfg = gpt_config(tokens, model={"dropout": 0.1, **GPT_WIDE}, train={"batch_size": 4 * dp, "micro_batches": 2,
                                                                        "grad_clip": 1.0, "recompute": recompute},
                     parallel=GPT_BUCKETS)
    three = train_releasing(with_zero(cfg, 3), comm)
    assert same_bits(three, train(with_zero(cfg, 2), comm))
    # against one process: without dropout (its masks are drawn per rank's rows), with SGD (AdamW amplifies the
    # rounding of near-zero gradients: zero 2 differs from one process by 1e-3 there, and zero 3 is its bits)
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0),
                                optim=dataclasses.replace(cfg.optim, name="sgd", lr=0.1, momentum=0.9,
                                                          weight_decay=0.0))
    assert max_error(train(with_zero(plain, 3), comm), alone(plain)) < 1e-5


def test_zero_3_under_tensor_parallelism_trains_as_zero_2_bitwise_and_as_one_process(comm, data, tokens):
    """tp 2 x dp 2: each rank's tp shard of the parameters is what dp shards further and gathers back."""
    if comm.size % 4:
        pytest.skip("tp 2 x dp 2 needs four ranks")
    dp = comm.size // 2
    mlp = config(data, hidden=512, optim=SGD, train={"steps": 5, "batch_size": 8 * dp, "micro_batches": 2,
                                                     "grad_clip": 0.5}, parallel={"tp": 2, **MLP_BUCKETS})
    gpt = gpt_config(tokens, model=GPT_WIDE, optim=SGD, train={"batch_size": 4 * dp, "micro_batches": 2,
                                                              "grad_clip": 1.0}, parallel={"tp": 2, **GPT_BUCKETS})
    for cfg in (mlp, gpt):
        three = train_releasing(with_zero(cfg, 3), comm)
        assert same_bits(three, train(with_zero(cfg, 2), comm))
        assert max_error(three, alone(with_zero(cfg, 0, tp=1))) < 1e-6


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble", "interleaved-1f1b"])
def test_zero_3_on_a_pipeline_trains_as_zero_2_bitwise_and_as_one_process(comm, data, tokens, schedule):
    """pp 2 x dp 2: each stage gathers its own units over its dp group; the tied embedding's two ends are whole
    for the owner's copy to the replica after a step (ParamGather.tied); the zero-bubble B gathers, W does not."""
    if comm.size % 4:
        pytest.skip("pp 2 x dp 2 needs four ranks")
    dp = comm.size // 2
    pipe = {"pp": 2, "schedule": schedule, "virtual_stages": 2 if schedule == "interleaved-1f1b" else 1}
    mlp = config(data, hidden=512, optim=SGD, train={"steps": 5, "batch_size": 8 * dp, "micro_batches": 4,
                                                     "grad_clip": 0.5}, parallel={**pipe, **MLP_BUCKETS})
    gpt = gpt_config(tokens, model=GPT_WIDE, optim=SGD, train={"batch_size": 4 * dp, "micro_batches": 4,
                                                              "grad_clip": 1.0}, parallel={**pipe, **GPT_BUCKETS})
    for cfg in (mlp, gpt):
        three = train_releasing(with_zero(cfg, 3), comm)
        assert same_bits(three, train(with_zero(cfg, 2), comm))
        assert max_error(three, alone(with_zero(cfg, 0, pp=1, schedule="1f1b"))) < 1e-6


@pytest.mark.parametrize("pp, schedule", [(1, "1f1b"), (2, "1f1b"), (2, "gpipe"), (2, "zero-bubble"),
                                          (2, "interleaved-1f1b")])
def test_the_gathers_follow_the_schedule_two_units_at_most(comm, tokens, monkeypatch, pp, schedule):
    """Each step's units in the order its instructions use them (``unit_uses``): every use is the one expected,
    and at most two units are gathered or in flight at once (the pool ``hpctrain plan`` counts), whatever the
    schedule interleaves (micro-batches, a pipeline's chunks, zero-bubble's B passes, recompute)."""
    if comm.size % pp or comm.size // pp < 2:
        pytest.skip(f"pp {pp} x dp 2 needs {2 * pp} ranks")  # zero 3 shards over dp >= 2
    dp = comm.size // pp
    cfg = gpt_config(tokens, model={**GPT_WIDE, "n_layer": 4},
                     train={"batch_size": 4 * dp, "micro_batches": 4, "recompute": "blocks"},
                     parallel={"zero": 3, "pp": pp, "schedule": schedule, **GPT_BUCKETS,
                               "virtual_stages": 2 if schedule == "interleaved-1f1b" else 1})
    most, gathers = [0], []
    use = ParamGather.use

    def counted(self, u):
        use(self, u)
        most[0] = max(most[0], len(self._held | set(self._posted)))
        if self not in gathers:
            gathers.append(self)
    monkeypatch.setattr(ParamGather, "use", counted)
    train(cfg, comm)
    assert most[0] <= 2 and [g.unplanned for g in gathers] == [0]


def test_zero_3_without_prefetch_trains_the_same_bits(comm, tokens, monkeypatch):
    cfg = gpt_config(tokens, model=GPT_WIDE, train={"batch_size": 4 * comm.size},
                     parallel={"zero": 3, **GPT_BUCKETS})
    prefetched = train_releasing(cfg, comm)
    init = ParamGather.__init__

    def blocking(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "prefetch": False})
    monkeypatch.setattr(ParamGather, "__init__", blocking)
    assert same_bits(prefetched, train(cfg, comm))


def _resident_bytes(array) -> int:
    """Bytes of ``array``'s pages in memory (Linux ``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    length = array.ctypes.data + array.nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        pytest.skip("mincore is not available here")
    return sum(v & 1 for v in vec) * page


def test_a_rank_holds_its_chunks_of_the_parameters_and_at_most_two_units_more(comm, data):
    """Between steps a rank's parameter buffer holds its chunks (1/dp of the model) in memory and nothing
    else (the rest reads as zeros); during a step at most the pool of two units' pages beyond them."""
    if comm.size < 2:
        pytest.skip("needs two ranks: with one there is nothing to shard")
    cfg = config(data, features=6, hidden=512, optim=ADAMW,
                 train={"steps": 3, "batch_size": 8 * comm.size, "micro_batches": 2},
                 parallel={"zero": 3, "bucket_mb": 0.5})
    seen = {}

    def look(t):
        params, shard, gather = t.params.data, t.shard, t.state.gather
        seen["resident"] = _resident_bytes(params)  # first: reading a released page maps the zero page
        own = [parts[shard.rank] for parts in shard.parts]
        outside = without([(0, params.size)], own)
        seen["outside_nonzero"] = sum(int(np.count_nonzero(params[a:b])) for a, b in outside)
        seen["own"] = sum(b - a for a, b in own)
        seen["n"] = params.size
        seen["peak_live"] = gather.memory.peak_live_bytes
        seen["pool"] = ParamGather.pool_bytes(t.part)
        seen["units"] = len(unit_ranges(t.part))
        seen["cuts"] = len(own)
    train(cfg, comm, look=look)
    assert abs(seen["own"] - seen["n"] / comm.size) <= 16 * seen["cuts"] * comm.size  # aligned cuts
    page = mmap.PAGESIZE
    # the chunks' pages, plus a page shared with a neighbour at each end of every chunk and unit
    slack = 2 * page * (seen["cuts"] + seen["units"])
    assert seen["resident"] <= 4 * seen["own"] + slack, seen
    assert 4 * seen["outside_nonzero"] <= slack, seen
    assert seen["peak_live"] <= seen["pool"], seen


def test_zero_3_checkpoints_resume_across_zero_0_2_3(comm, tokens, shared_dir):
    """zero 3 on the world -> zero 0 on one process; zero 0 on one process -> zero 3 on the world; zero 2 on
    the world -> zero 3 on the world (bitwise: the same chunks): each as four straight steps. SGD with momentum
    (a slot to resume): AdamW's amplified rounding would hide a small error."""
    ck = f"{shared_dir}/ck3"
    base = gpt_config(tokens, model=GPT_WIDE, optim=SGD, train={"batch_size": 4 * comm.size, "steps": 2},
                      checkpoint={"dir": ck}, parallel={"zero": 3, **GPT_BUCKETS})
    train_releasing(base, comm)
    four = dataclasses.replace(base.train, steps=4)
    no_dir = dataclasses.replace(base.checkpoint, dir="")
    straight = alone(dataclasses.replace(base, train=four, checkpoint=no_dir))
    worst = np.zeros(1)
    if comm.rank == 0:
        resumed = train(with_zero(dataclasses.replace(base, train=four), 0), MPI.COMM_SELF)
        worst[0] = max_error(resumed, straight)
    comm.Bcast(worst, root=0)
    assert worst[0] < 1e-5

    ck0 = f"{shared_dir}/ck0"
    if comm.rank == 0:
        alone(dataclasses.replace(base, checkpoint=dataclasses.replace(base.checkpoint, dir=ck0)))
    comm.Barrier()
    resumed = train(dataclasses.replace(base, train=four, checkpoint=dataclasses.replace(base.checkpoint, dir=ck0)),
                    comm)
    assert max_error(resumed, straight) < 1e-5

    ck2, ck2b = f"{shared_dir}/ck2", f"{shared_dir}/ck2b"
    two = with_zero(dataclasses.replace(base, checkpoint=dataclasses.replace(base.checkpoint, dir=ck2)), 2)
    train(two, comm)
    if comm.rank == 0:
        import shutil
        shutil.copytree(ck2, ck2b)
    comm.Barrier()
    as_three = train(with_zero(dataclasses.replace(two, train=four), 3), comm)
    as_two = train(dataclasses.replace(two, train=four, checkpoint=dataclasses.replace(two.checkpoint, dir=ck2b)),
                   comm)
    assert same_bits(as_three, as_two)


@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2)], ids=["pp-2", "tp-2"])
def test_a_zero_3_checkpoint_of_a_pipeline_or_tensor_layout_resumes_on_one_process(comm, tokens, shared_dir, pp, tp):
    """Each stage's (or tp shard's) dp ranks write their own chunks; one process reads them back whole."""
    if comm.size % 4:
        pytest.skip("pp 2 x dp 2 and tp 2 x dp 2 need four ranks")
    ck = f"{shared_dir}/ck-{pp}-{tp}"
    dp = comm.size // (pp * tp)
    base = gpt_config(tokens, model=GPT_WIDE, optim=SGD, train={"batch_size": 4 * dp, "micro_batches": 2, "steps": 2},
                      checkpoint={"dir": ck}, parallel={"zero": 3, "pp": pp, "tp": tp, **GPT_BUCKETS})
    train_releasing(base, comm)
    four = dataclasses.replace(base.train, steps=4)
    one = dataclasses.replace(base.parallel, zero=0, pp=1, tp=1, dp="auto")
    straight = train(dataclasses.replace(base, train=four, parallel=one,
                                         checkpoint=dataclasses.replace(base.checkpoint, dir="")), MPI.COMM_SELF)
    worst = np.zeros(1)
    if comm.rank == 0:
        resumed = train(dataclasses.replace(base, train=four, parallel=one), MPI.COMM_SELF)
        worst[0] = max_error(resumed, straight)
    comm.Bcast(worst, root=0)
    assert worst[0] < 1e-5


def test_zero_3_refuses_the_deterministic_mode(data):
    with pytest.raises(ConfigError, match="train.deterministic"):
        config(data, train={"deterministic": True}, parallel={"zero": 3})


def test_the_memory_lines_of_a_zero_3_run_are_its_plan(comm, tokens, shared_dir):
    """Every rank's parameter, gradient and optimizer bytes in the metrics file are ``hpctrain plan``'s."""
    import json

    from hpctrain.plan import plan

    metrics = f"{shared_dir}/m3.jsonl"
    cfg = gpt_config(tokens, model={"n_layer": 4, **GPT_WIDE}, train={"batch_size": 4 * comm.size, "steps": 2,
                                                                      "metrics": metrics},
                     parallel={"zero": 3, **GPT_BUCKETS})
    train(cfg, comm)
    if comm.rank == 0:
        with open(metrics) as f:
            got = [json.loads(line) for line in f if '"memory"' in line][-1]["memory"]
        want = plan(cfg, comm.size)
        for g, w in zip(got, want):
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert g[key] == getattr(w, key), (key, g, w)
