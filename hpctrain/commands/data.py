"""``hpctrain data``: make data files (a text's tokens, a CSV or .npz table, nanoGPT's .bin).

    hpctrain data text2h5 input.txt chars.h5
    hpctrain data text2h5 input.txt train.h5 --tokenizer gpt2
    hpctrain data csv2h5 iris.csv iris.h5 --target species
    hpctrain data npz2h5 arrays.npz data.h5 --inputs X --targets y
    hpctrain data bin2h5 data/shakespeare_char/train.bin train.h5 --vocab-from data/shakespeare_char/input.txt
"""

from __future__ import annotations

import os

from ..errors import DataError

__all__ = ["run_data"]


def run_data(args) -> int:
    _check_output(args)
    convert = {"csv2h5": _csv, "npz2h5": _npz, "bin2h5": _bin, "text2h5": _text}[args.data_command]
    print(convert(args))
    return 0


def _check_output(args) -> None:
    """OUTPUT is a file to write: never a device or a FIFO, never the input, replaced only with --force."""
    from .._files import check_replaceable

    what = "the token file" if args.data_command in ("text2h5", "bin2h5") else "the data file"
    check_replaceable(args.output, f"cannot write {what} {args.output}", DataError)  # never a device or a FIFO
    if os.path.exists(args.output):
        if os.path.exists(args.input) and os.path.samefile(args.input, args.output):
            raise DataError(f"{args.output} is the input file itself")
        if not args.force:
            raise DataError(f"{args.output} exists; pass --force to replace it")


def _csv(args) -> str:
    from .. import convert

    header = {"auto": None, "yes": True, "no": False}[args.header]
    return convert.csv_to_h5(args.input, args.output, target=args.target, header=header, regression=args.regression)


def _npz(args) -> str:
    from .. import convert

    return convert.npz_to_h5(args.input, args.output, inputs=args.inputs, targets=args.targets,
                             regression=args.regression)


def _bin(args) -> str:
    from .. import convert

    if args.tokenizer and args.vocab_from:
        raise DataError("--tokenizer and --vocab-from: give one (subword or character tokens)")
    bpe = None
    if args.tokenizer:
        from ..tokens import load_bpe

        bpe = load_bpe(args.tokenizer)  # before anything is written
    line = convert.bin_to_h5(args.input, args.output, vocab_from=args.vocab_from)
    if bpe is not None:
        from ..tokens import attach_to_file

        try:
            line = attach_to_file(args.output, bpe)
        except DataError:
            os.remove(args.output)  # written just now, for these ids: nothing half-right is left
            raise
    return line


def _text(args) -> str:
    from .._files import read_capped
    from ..text import text_to_h5

    raw = read_capped(args.input, f"text file {args.input}", DataError, 1 << 32)  # a regular file, at most 4 GiB
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"cannot read {args.input} as UTF-8 text: {e}") from None
    if args.tokenizer:
        from ..tokens import load_bpe, write_bpe_tokens

        bpe = load_bpe(args.tokenizer)
        ids = bpe.encode(text)
        write_bpe_tokens(args.output, ids, bpe)
        return (f"{args.output}: {len(ids):,} tokens of {bpe.name} from {len(text):,} characters (dataset 'tokens'; "
                f"use data.tokens = \"tokens\"; model.vocab_size is read from it: {bpe.n_vocab})")
    tok = text_to_h5(text, args.output)
    return (f"{args.output}: {len(text):,} tokens, {len(tok)} characters in the vocabulary "
            f"(dataset 'tokens'; use data.tokens = \"tokens\" and model.vocab_size >= {len(tok)})")
