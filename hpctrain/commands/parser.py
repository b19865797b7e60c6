"""The command line's parser: ``hpctrain`` and one ``add_<command>`` per subcommand, each with its --help examples.

Imports nothing of hpctrain's but its version: ``hpctrain --help`` and a typo stay fast (cli.py parses first and
imports a command's module only to run it).
"""

from __future__ import annotations

import argparse
import os
import time

__all__ = ["parser", "PATHS"]


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


def _seed(text: str) -> int:
    """``--seed``'s value: a whole number that numpy's generators take (0 to 2**63 - 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63 - 1], got {value}")
    return value


def _add_overrides(p, help: str = "override a config value, as for train") -> None:
    """``--set SECTION.KEY=VALUE``, repeatable."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)


def parser() -> argparse.ArgumentParser:
    """``hpctrain``'s parser: the global options, then every subcommand."""
    from .. import __version__

    p = _Parser(prog="hpctrain", description="MPI-based training with Numba kernels.")
    p.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    p.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers layer kinds with hpctrain.register_layer); repeatable; "
                        "HPCTRAIN_PLUGINS=mod1,mod2 does the same")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (add_train, add_config, add_plan, add_env, add_inspect, add_export, add_sample, add_eval, add_predict,
                add_data, add_plot):
        add(sub)
    return p


def add_train(sub) -> None:
    """``hpctrain train``."""
    t = sub.add_parser("train", help="train a model from a TOML config", formatter_class=RAW,
                       epilog=_epilog("hpctrain train jobs/configs/digits.toml",
                                      "mpiexec -n 4 hpctrain train jobs/configs/gpt-char.toml --set train.steps=200",
                                      "hpctrain --plugin my_layers train my.toml     # layers of your own"))
    t.add_argument("config", help="path to the TOML config")
    _add_overrides(t, "override a config value (a TOML value; anything else is taken as a string); a relative path "
                      "given here resolves against the working directory, one in the file against the file's folder")


def add_config(sub) -> None:
    """``hpctrain config``."""
    c = sub.add_parser("config", help="print the fully resolved config (every default filled in) as TOML",
                       formatter_class=RAW, epilog=_epilog("hpctrain config jobs/configs/gpt-char.toml --set parallel.tp=2"))
    c.add_argument("config", help="path to the TOML config")
    _add_overrides(c)


def add_plan(sub) -> None:
    """``hpctrain plan``."""
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
    _add_overrides(pn)
    pn.add_argument("--json", action="store_true", help='print {"ranks": [{"rank": 0, ..., "total_bytes": ...}]}')
    pn.add_argument("--mem-per-rank", metavar="SIZE", help="say which ranks do not fit in SIZE (5.5GB, 40GiB, "
                                                           "512MB) and which change would make them fit")


def add_env(sub) -> None:
    """``hpctrain env``."""
    sub.add_parser("env", help="versions, the MPI library, CUDA-awareness, GPUs and BLAS threads of this machine",
                   formatter_class=RAW, epilog=_epilog("hpctrain env", "mpiexec -n 2 hpctrain env     # what each rank sees"))


def add_inspect(sub) -> None:
    """``hpctrain inspect``."""
    i = sub.add_parser("inspect", help="describe a checkpoint and verify its checksums", formatter_class=RAW,
                       epilog=_epilog("hpctrain inspect runs/digits/ckpt-00000600.h5"))
    i.add_argument("path")


def add_export(sub) -> None:
    """``hpctrain export``."""
    x = sub.add_parser("export", help="a checkpoint's parameters as safetensors or nanoGPT's ckpt.pt, or the whole "
                                      "of it as one HDF5 file",
                       description="Write a checkpoint's parameters (PyTorch names) as safetensors or, for a GPT, as "
                                   "nanoGPT's ckpt.pt (needs torch), or the whole checkpoint as one self-contained "
                                   "HDF5 file. The checkpoint is verified first.",
                       formatter_class=RAW,
                       epilog=_epilog("hpctrain export runs/gpt-char/ckpt-00001500.h5 gpt.safetensors",
                                      "hpctrain export runs/gpt-char/ckpt-00001500.h5 out-gpt/ckpt.pt",
                                      "hpctrain export runs/digits/ckpt-00000600.h5 digits-whole.h5",
                                      "hpctrain export runs/gpt-char/ckpt-00001500.h5 gpt-hf --format hf",
                                      "hpctrain export runs/gpt-char/ckpt-00001500.h5 gpt-bf16.safetensors --dtype bf16"))
    x.add_argument("checkpoint", help="a checkpoint (ckpt-<step>.h5)")
    x.add_argument("output", help="the file to write: .safetensors, .pt (nanoGPT) or .h5; the folder for --format hf")
    x.add_argument("--format", choices=("safetensors", "h5", "nanogpt", "hf"), default="",
                   help="default: from the output's extension; safetensors and hf (Hugging Face's GPT2LMHeadModel: "
                        "model.safetensors + config.json in a folder) need pip install 'hpctrain[export]', "
                        "nanogpt needs torch")
    x.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the parameters' type in the output: bf16 rounds the float32 master copy to bfloat16 (to "
                        "nearest even), half the bytes; safetensors, nanogpt and hf only (default: fp32)")
    x.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")


def add_sample(sub) -> None:
    """``hpctrain sample``."""
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


def add_eval(sub) -> None:
    """``hpctrain eval``."""
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
    _add_overrides(ev, "override a config value, as for train (e.g. parallel.pp=2)")


def add_predict(sub) -> None:
    """``hpctrain predict``."""
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


def add_data(sub) -> None:
    """``hpctrain data``."""
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
    c2h = _table_parser(dsub, "csv2h5", "a numeric CSV table", "hpctrain data csv2h5 iris.csv iris.h5 --target species",
                        "a UTF-8 CSV file, one sample a row, every cell a number")
    c2h.add_argument("--target", required=True, help="the target column: its header name or 0-based index")
    c2h.add_argument("--header", choices=("auto", "yes", "no"), default="auto",
                     help="whether the first row names the columns (auto: when it is not all numbers)")
    n2h = _table_parser(dsub, "npz2h5", "two arrays of a numpy .npz",
                        "hpctrain data npz2h5 arrays.npz data.h5 --inputs X --targets y",
                        "a .npz file (read without pickle)")
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


def _table_parser(dsub, name: str, what: str, example: str, input_help: str):
    """``hpctrain data NAME INPUT OUTPUT``, a converter to inputs and targets."""
    p = dsub.add_parser(name, help=f"{what} -> inputs and targets (HDF5)", epilog=_epilog(example), formatter_class=RAW)
    p.add_argument("input", help=input_help)
    p.add_argument("output", help="the HDF5 file to write (datasets 'inputs' and 'targets')")
    return p


def add_plot(sub) -> None:
    """``hpctrain plot``."""
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
