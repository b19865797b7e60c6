"""Sharded checkpoints of a synchronous run: every rank writes what it alone holds, any layout reads them back.

    saver = Checkpointer(rank)            # rank: train/startup.py's Rank (what the rank runs and holds)
    saver.save(state, background=True)    # collective: snapshot, then a thread writes this rank's shard
    saver.poll()                          # collective, each step: commits the set once every shard is written
    saver.finish()                        # collective: wait for a save in flight and commit it
    state, whole = resume(rank, paths, auto=True)      # collective: the first checkpoint that verifies everywhere,
                                                       # each rank's pieces of it in its buffers

What a rank writes is its pieces (checkpoint/pieces.py): data-parallel rank 0 of each pipeline
stage and tensor-parallel rank writes the parameters it owns (a replicated tensor: tensor-parallel
rank 0 only); the optimizer slots are written by whoever updates them (every data-parallel rank's
ZeRO chunk, else data-parallel rank 0). World rank 0 gathers the manifest (buffer calls, JSON
text) and commits the set by renaming its index into place once every rank reports its shard
fsynced (checkpoint/sharded.py). At most one save is in flight; any rank's failure ends the run
with one message, at the commit, on every rank alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import numpy as np

from .. import checkpoint as ckpt
from ..checkpoint import format as fmt
from ..checkpoint import read as ckpt_read
from ..checkpoint import sets, sharded
from ..checkpoint.pieces import held, written
from ..checkpoint.state import value_problem
from ..checkpoint.write import retain, write_root_attrs
from ..errors import CheckpointError, HpctrainError, ModelMismatchError, NewerFormatError, OptimizerMismatchError
from ..parallel.agree import agree_error, bcast_text, gather_text, raise_agreed, run_everywhere
from ..parallel.columns import row_bounds, start_trade
from ..parallel.tied import broadcast_tied
from ..parallel.zero import split_range
from ..parallel.zero3 import param_pieces

__all__ = ["Checkpointer", "resume", "save_pieces"]


class Checkpointer:
    """A rank's sharded saves (``t``: train/startup.py's Rank): what this rank writes, a reused snapshot for saves
    in the background."""

    def __init__(self, t):
        self.t, self.mesh = t, t.mesh
        self.items = written(t.part, t.optim.pieces, dp_rank=t.mesh.dp_rank, sharded_optimizer=bool(t.shard),
                             slots=list(t.optim.slots))
        if getattr(t.state, "gather", None) is not None:  # zero = 3: every rank its chunks of the parameters
            self.items = [("params", p) for p in param_pieces(t.part, t.shard)] + [
                (label, p) for label, p in self.items if label != "params"]
        self.nbytes = 4 * sum(p.size for _, p in self.items)
        self._snapshot = None  # reused host copy of what this rank writes, for saves in the background
        self._pending = None  # the save in flight: (state, set id, manifest, outcome, t0, snapshot s, thread)
        self.last_path = ""  # on world rank 0: the index of the newest committed checkpoint

    # ------------------------------------------------------------------ saving

    def _values(self, label, p, host):
        return host[label][p.at : p.at + p.size]

    def save(self, state, *, background: bool) -> str:
        """Write this rank's shard of a checkpoint of ``state`` (root attributes only; collective). In the
        background the shard is written by a thread and committed by a later ``poll``/``finish``; else now.
        Returns the index path on world rank 0 once committed, else ""."""
        self.finish()
        t, mesh, world = self.t, self.mesh, self.mesh.world
        t0 = time.perf_counter()
        set_id, folder = start_set(world, t.cfg.checkpoint.dir, state.step)
        host = {label: t.be.to_host(buf.data) for label, buf in [("params", t.params)] + list(t.optim.slots.items())} \
            if self.items else {}  # a rank that writes nothing copies nothing off a device
        run_everywhere(world, lambda: check_values(state.step, [(label, p, self._values(label, p, host))
                                                                for label, p in self.items]))
        if background:  # the snapshot: training may change the buffers as soon as this returns
            if self._snapshot is None:
                self._snapshot = np.empty(self.nbytes // 4, dtype=np.float32)
            at, items = 0, []
            for label, p in self.items:
                view = self._snapshot[at : at + p.size]
                view[...] = self._values(label, p, host)
                items.append((label, p, view))
                at += p.size
        else:
            items = [(label, p, self._values(label, p, host)) for label, p in self.items]
        host = None
        manifest = gather_text(world, json.dumps(sharded.shard_entries(self.items)))
        outcome = {}

        def write():
            _write_shard(folder, mesh.rank, state.step, set_id, items, background, outcome)

        snap = time.perf_counter() - t0
        if background:
            thread = threading.Thread(target=write, name="hpctrain-checkpoint", daemon=True)
            thread.start()
            self._pending = (state, set_id, manifest, outcome, t0, snap, thread)
            return ""
        write()
        return self._commit((state, set_id, manifest, outcome, t0, snap, None))

    def poll(self) -> None:
        """Collective, once a step: commit the save in flight once every rank's shard is written."""
        if self._pending is None:
            return
        from mpi4py import MPI

        done = np.array([1 if self._pending[3].get("done") else 0], dtype=np.int32)
        self.mesh.world.Allreduce(MPI.IN_PLACE, done, op=MPI.MIN)
        if done[0]:
            self.finish()

    def finish(self) -> str:
        """Collective: wait for the save in flight, if any, and commit it; its index path on rank 0."""
        if self._pending is None:
            return ""
        pending, self._pending = self._pending, None
        return self._commit(pending)

    def abandon(self) -> None:
        """Drop the save in flight without a collective (this rank failed alone; the job is ending): its
        writer thread may still be writing the shard, under the set's temporary name, which no resume reads."""
        self._pending = None

    def _commit(self, pending) -> str:
        state, set_id, manifest, outcome, t0, snap, thread = pending
        if thread is not None:
            thread.join()
        t = self.t
        path = commit_set(self.mesh.world, t.cfg.checkpoint.dir, state, set_id=set_id, manifest=manifest,
                          error=outcome.get("error"), layout=t.model.layout, keep=t.cfg.checkpoint.keep,
                          log=t.log)
        self.last_path = path
        total = time.perf_counter() - t0
        t.log(f"checkpoint {path} written in {total:.2f} s" + (f" (training went on after a {snap:.2f} s snapshot)"
                                                                 if thread is not None else ""))
        return path


# --------------------------------------------------------------------------- a set, whoever writes it


def save_pieces(world, state, items, *, directory: str, layout, keep: int, log=None) -> str:
    """Collective over ``world``: a sharded checkpoint of ``state`` (root attributes) in which each rank writes
    its ``items`` ``(label, Piece, values)`` (none: no shard), in the foreground; its index path on rank 0.
    What the parameter server's servers save (their ranges); a Trainer's ``Checkpointer`` uses the same steps."""
    set_id, folder = start_set(world, directory, state.step)
    run_everywhere(world, lambda: check_values(state.step, items))
    manifest = gather_text(world, json.dumps(sharded.shard_entries([(label, p) for label, p, _ in items])))
    outcome = {}
    _write_shard(folder, world.Get_rank(), state.step, set_id, items, False, outcome)
    return commit_set(world, directory, state, set_id=set_id, manifest=manifest, error=outcome.get("error"),
                      layout=layout, keep=keep, log=log)


def start_set(world, directory: str, step: int) -> tuple[str, str]:
    """Collective: a new set's id (world rank 0's) and its folder, which world rank 0 makes (after clearing
    what killed writers left)."""
    set_id = bcast_text(world, sets.new_set_id() if world.Get_rank() == 0 else None, 0)
    folder = os.path.join(directory, sets.set_dir_name(step, set_id))

    def prepare():
        try:
            os.makedirs(directory, exist_ok=True)
            fmt.clean_stale_temps(directory)
            sets.clean_orphans(directory)
            os.mkdir(folder)
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint {fmt.checkpoint_name(step)} in {directory}: "
                                  f"{' '.join(str(e).split())}") from None

    run_everywhere(world, prepare if world.Get_rank() == 0 else lambda: None)
    return set_id, folder


def check_values(step: int, items) -> None:
    """CheckpointError for the first value the loaders would refuse: never write one over good checkpoints."""
    for label, p, values in items:
        problem = value_problem(label, values)
        if problem:
            what = "parameter" if label == "params" else f"optimizer slot {label} of"
            raise CheckpointError(f"step {step}: {what} {p.name} has {problem}; no checkpoint written"
                                  + (" (the run diverged: lower optim.lr or set train.grad_clip)"
                                     if label == "params" else ""))


def _write_shard(folder, rank, step, set_id, items, background, outcome) -> None:
    """This rank's shard (nothing when it writes no items); a failure goes into ``outcome`` for the commit."""
    path = os.path.join(folder, sets.shard_name(rank))
    try:
        if items:
            sharded.write_shard(path, set_id=set_id, rank=rank, step=step, items=items, background=background)
    except CheckpointError as e:  # h5_output's line: the shard's layout could not be written (a full disk)
        outcome["error"] = CheckpointError(f"rank {rank}: {e}")
    except OSError as e:  # one line, whatever the library's text holds (HDF5's can hold newlines)
        outcome["error"] = CheckpointError(f"rank {rank}: cannot write checkpoint shard {path}: "
                                           f"{' '.join(str(e).split())}")
    except BaseException as e:  # noqa: BLE001 - reported at the commit, on every rank alike
        outcome["error"] = CheckpointError(f"rank {rank}: writing checkpoint shard {path} failed: "
                                           f"{type(e).__name__}: {' '.join(str(e).split())}")
    outcome["done"] = True


def commit_set(world, directory: str, state, *, set_id: str, manifest, error, layout, keep: int, log=None) -> str:
    """Collective: once every rank's ``error`` is known (any one ends the save on all ranks alike), world rank 0
    writes the index over the ranks' ``manifest`` entries, renames it into place and applies retention."""
    bad, error = agree_error(world, error)
    if error is not None:
        raise_agreed(world, bad, error)
    path = ""

    def commit():
        nonlocal path
        shards, entries = [], []
        for rank, text in enumerate(manifest):
            mine = json.loads(text)
            if mine:
                entries += [e + [len(shards)] for e in mine]
                shards.append(sets.shard_name(rank))
        try:
            final = os.path.join(directory, fmt.checkpoint_name(state.step))
            replaced = sets.owned_set_dir(final)  # a set of the same step, replaced: its folder, if ours
            path = sharded.write_index(directory, state, set_id=set_id, shards=shards, entries=entries,
                                       layout=layout, write_attrs=write_root_attrs)
            if replaced and os.path.basename(replaced) != sets.set_dir_name(state.step, set_id):
                import shutil

                shutil.rmtree(replaced, ignore_errors=True)
            retain(directory, keep, path, log=log)
        except HpctrainError:
            raise
        except Exception as e:  # OSError, or anything else: one message on every rank, none left waiting
            raise CheckpointError(f"cannot commit checkpoint {fmt.checkpoint_name(state.step)} in {directory}: "
                                  f"{type(e).__name__ + ': ' if not isinstance(e, OSError) else ''}"
                                  f"{' '.join(str(e).split())}") from None

    run_everywhere(world, commit if world.Get_rank() == 0 else lambda: None)
    return path


# --------------------------------------------------------------------------- loading


def resume(t, candidates: list[str], *, auto: bool, load=None, place=None):
    """Collective: the first of ``candidates`` (checkpoint paths, given on world rank 0) that verifies
    everywhere, loaded. ``load(path)`` reads this rank's pieces of a sharded set and returns its root state
    (default: a Rank's, ``_load_here``), ``place()`` finishes once every rank loaded (default ``_place``)
    and returns ``agree_error``'s ``(bad, error)`` for what it read (a failure makes the candidate fail as a
    failed ``load`` does); the parameter server passes its servers' range reads. Returns ``(state, whole)``: a sharded set is read into this rank's buffers and
    ``state`` holds its root attributes (``whole`` False); a single-file checkpoint (version 2) is read
    whole on world rank 0, ``state`` with its tensors there, for train/startup.py to scatter (``whole``
    True); ``(None, False)`` when there is no candidate. With ``auto`` a failing one is logged, set aside
    once an older one loads, and the next tried; one of a newer hpctrain or another model stops the search."""
    mesh, world = t.mesh, t.mesh.world
    reading = {}  # what ``_load_here`` read for ``_place``: this rank's pieces, the column splits, the index
    load = load or (lambda path: _load_here(t, path, reading))
    place = place or (lambda: _place(t, reading))
    listing = bcast_text(world, "\n".join(candidates) if mesh.rank == 0 else None, 0)
    skipped = []
    for path in filter(None, listing.split("\n")):
        state, error, whole = None, None, False
        try:
            version = np.array([ckpt.read_meta(path).version if mesh.rank == 0 else 0], dtype=np.int64)
        except HpctrainError as e:
            error, version = e, np.zeros(1, dtype=np.int64)
        world.Bcast(version, root=0)
        try:
            if error is None and version[0] < sharded.VERSION:  # a single file: rank 0 reads it whole
                whole = True
                state = ckpt.load_checkpoint(path, t.model.layout) if mesh.rank == 0 else None
                if state is not None:
                    check_optimizer(t, path, state.optim_name, set(state.slots))
            elif error is None:
                state = load(path)
        except HpctrainError as e:
            error = e
        bad, error = agree_error(world, error)
        if error is None and not whole:
            bad, error = place()  # the reads that wait for every rank's (column splits), agreed the same way
        if error is None:
            if skipped:
                t.log(f"resume: using {os.path.basename(path)} (step {state.step if state else '?'}) instead of the newer "
                      f"{', '.join(map(os.path.basename, skipped))}, which failed verification; they are kept as "
                      "<name>.skipped")
                run_everywhere(world, (lambda: ckpt_read.set_aside(skipped)) if mesh.rank == 0 else lambda: None)
            return state, whole
        if not auto or isinstance(error, (NewerFormatError, ModelMismatchError)):
            if auto and isinstance(error, NewerFormatError):
                error = NewerFormatError(f"{error}; resume = \"auto\" does not fall back past it to an older "
                                         "checkpoint")
            elif auto and type(error) is ModelMismatchError:
                error = ModelMismatchError(f"{error}; it was written for a different model (hpctrain inspect shows "
                                           "its config): use a new checkpoint.dir for this model")
            raise_agreed(world, bad, error)
        t.log(f"resume: skipping {os.path.basename(path)}: {error}")
        skipped.append(path)
    if skipped:
        raise CheckpointError(f"no checkpoint in {t.cfg.checkpoint.dir} verifies "
                              f"({', '.join(map(os.path.basename, skipped))}; see the log); move them away or set "
                              'checkpoint.resume = "never" to start afresh')
    return None, False


ZERO_START_SLOTS = frozenset({"momentum_buffer"})  # torch.optim.SGD makes it at its first step: buf = grad,
# which is what a zero buffer gives (dampening 0); Adam's moments are not (its bias correction counts the steps)


def check_optimizer(t, path, name, slots) -> None:
    """OptimizerMismatchError unless a checkpoint of optimizer ``name`` with ``slots`` can continue this run's
    optimizer: the same one, holding every slot it keeps, or SGD whose momentum buffer starts at zero (the
    checkpoint's run had no momentum; resume_check decides whether the momentum may change)."""
    missing = set(t.optim.slots) - set(slots)
    if name != t.optim.name or not missing <= ZERO_START_SLOTS:
        raise OptimizerMismatchError(f"{path}: written with optimizer {name!r} (slots {', '.join(sorted(slots)) or 'none'}"
                                     f"), but optim.name is {t.optim.name!r} (slots "
                                     f"{', '.join(sorted(t.optim.slots)) or 'none'}); to start from its weights, "
                                     "use it as checkpoint.init with a new checkpoint.dir")


def _load_here(t, path, reading):
    """This rank's pieces of one sharded checkpoint into host buffers (``reading["loaded"]``); its root attributes.

    What every data-parallel rank holds alike (the parameters; the optimizer state without ZeRO) is read and
    verified a 1/dp slice per data-parallel rank and all-gathered afterwards (``_place``): the disk and the
    hashing see it once per stage and tensor-parallel rank, spread evenly over its replicas."""
    index = ckpt_read.open_sharded(path, t.model.layout)
    state = index.state
    check_optimizer(t, path, state.optim_name, set(index.labels[1:]))
    params, slots = held(t.part, t.optim.pieces)
    opened = {}
    reading.update(loaded={}, by_rows=[], index=index)
    try:
        kept = [(k, v) for k, v in t.optim.slots.items() if k in index.labels]  # a missing one: ZERO_START_SLOTS
        for label, buf in [("params", t.params)] + kept:
            out = buf.data if not t.be.is_device else np.zeros(buf.layout.size, dtype=np.float32)
            wanted = params if label == "params" else slots
            whole_shards = label == "params" or not t.shard
            if t.mesh.tp > 1 and whole_shards:  # column splits stored otherwise: read by rows and traded in _place
                moved = _column_splits(index, label, wanted, t.mesh.tp_rank)
                reading["by_rows"] += [(label, out, w, rows) for w, rows in moved]  # read in _place, one at a time
                wanted = [w for w in wanted if all(w is not m for m, _ in moved)]
            parts = None
            if t.mesh.dp > 1 and whole_shards:  # replicated over data parallelism
                parts = split_range(0, max((p.at + p.size for p in wanted), default=0), t.mesh.dp)
                wanted = _clip(wanted, *parts[t.mesh.dp_rank])
            if label == "params" and getattr(getattr(t, "state", None), "gather", None) is not None:
                parts, wanted = None, [w for a, b in t.shard.pieces for w in _clip(params, a, b)]  # zero = 3
            ckpt_read.read_set(index, label, wanted, out, opened=opened)
            reading["loaded"][label] = (out, parts)
    finally:
        sharded.close_all(opened)
    return state


def _column_splits(index, label, wanted, tp_rank):
    """``(wanted piece, rows piece)`` for each whole column shard whose tensor the checkpoint stores split
    otherwise. Read as it is, each tensor-parallel rank would read and hash the whole tensor for its columns
    (rows are stored one after another); instead rank r reads rows ``row_bounds`` r of it, whole (a flat
    range of the full tensor), and ``_place`` trades the column blocks over the tp group (parallel/columns.py). The same
    choice on every rank of the group: it depends on the index and the layout only."""
    out = []
    for w in wanted:
        if w.kind != "cols" or len(w.shape) != 2 or (w.lo, w.hi) != (0, w.shape[0] * (w.shape[1] // w.tp)):
            continue
        stored = {(s.kind, s.tp) for s, *_ in index.pieces.get((label, w.name), [])}
        if stored != {("cols", w.tp)}:
            a, b = row_bounds(w.shape[0], w.tp)[tp_rank]
            out.append((w, dataclasses.replace(w, kind=None, tp_rank=0, tp=1, lo=a * w.shape[1], hi=b * w.shape[1],
                                               at=0)))
    return out


def _clip(pieces, a: int, b: int):
    """The parts of ``pieces`` that lie in [a, b) of the holder's flat buffer."""
    out = []
    for p in pieces:
        lo, hi = max(a, p.at), min(b, p.at + p.size)
        if lo < hi:
            out.append(dataclasses.replace(p, lo=p.lo + lo - p.at, hi=p.lo + hi - p.at, at=lo))
    return out


def _place(t, reading):
    """After every rank loaded its pieces: the replicated buffers' slices to every data-parallel rank
    (``Allgatherv`` in place), the column splits read and traded over tensor parallelism, a tied tensor's
    replica from its owner, and on a device the copy into its buffers (inside an agreement: a device may run
    out of memory on one rank alone). Returns ``agree_error``'s ``(bad, error)`` for the column splits' reads:
    ``(-1, None)`` when every block verified."""
    from mpi4py import MPI

    loaded, by_rows, index = reading.pop("loaded"), reading.pop("by_rows"), reading.pop("index")
    for out, parts in loaded.values():
        if parts is not None:
            t.mesh.dp_comm.Allgatherv(MPI.IN_PLACE, [out, [b - a for a, b in parts], [a for a, _ in parts], MPI.FLOAT])
    bad, error = agree_error(t.mesh.world, _read_column_splits(t, index, by_rows))
    if error is not None:
        return bad, error
    broadcast_tied(t.mesh, t.part, loaded["params"][0])
    if t.be.is_device:
        bufs = dict([("params", t.params)] + list(t.optim.slots.items()))
        run_everywhere(t.mesh.world, lambda: [t.be.copy_(bufs[k].data, t.be.asarray(v)) for k, (v, _) in
                                              loaded.items()])
    return -1, None


def _read_column_splits(t, index, by_rows):
    """The tensors ``_column_splits`` chose, one at a time: this rank's row block read (and verified) into one
    of two reused buffers, then traded over the tensor-parallel group for its columns (parallel/columns.py)
    while the next one is read into the other. Returns this rank's first read error, None if none; after one
    it still takes part in every trade (sending what the buffer holds), so no rank of its group is left
    waiting, and the caller agrees the error."""
    error, opened, trades = None, {}, []
    largest = max((rows.size for *_, rows in by_rows), default=0)
    blocks = [np.empty(largest, dtype=np.float32) for _ in range(min(2, len(by_rows)))]
    try:
        for i, (label, out, w, rows) in enumerate(by_rows):
            block = blocks[i % 2][: rows.size]
            if len(trades) == 2:  # the trade that used this buffer, done before it is read into again
                trades.pop(0).wait()
            if error is None:
                try:
                    ckpt_read.read_set(index, label, [rows], block, opened=opened)
                except HpctrainError as e:
                    error = e
            trades.append(start_trade(t.mesh.tp_comm, block, out[w.at : w.at + w.size], w.shape))
    finally:
        for trade in trades:
            trade.wait()
        sharded.close_all(opened)
    return error
