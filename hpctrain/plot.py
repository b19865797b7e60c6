"""``hpctrain plot``: a metrics file drawn as curves, or a trace drawn as a timeline, saved as PNG, PDF or SVG.

    hpctrain plot runs/digits/metrics.jsonl -o loss.png            # loss, val_loss, val_accuracy, throughput,
                                                                   # and each rank's memory
    hpctrain plot runs/digits-pp2/trace.json -o timeline.png --steps 10:12
    hpctrain plot runs/a/metrics.jsonl runs/b/metrics.jsonl -o ab.png   # runs overlaid, each named by its folder

One process, no MPI. Which kind of file it is comes from its content: a JSON object
with ``traceEvents`` (or a JSON array of events) is a trace (``train.trace``); anything
else is read as JSONL metrics (``train.metrics``), one object a line. matplotlib is an
optional dependency (``pip install 'hpctrain[plot]'``), imported only when drawing, and
only through its object API with the non-interactive Agg canvas (no pyplot state).
Input is checked before it is opened (a FIFO or a folder is refused, never read) and
capped at ``MAX_BYTES``; files are parsed with ``json`` only.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import stat

from ._files import read_capped, replaced_atomically
from .errors import DataError, HpctrainError

__all__ = ["FORMATS", "MAX_BYTES", "plot", "read_memory", "read_metrics", "read_text", "read_trace", "trace_events"]

MAX_BYTES = 1 << 30  # metrics of a few million logged steps; hpctrain's own traces stay near 0.3 GB
FORMATS = (".png", ".pdf", ".svg")
THROUGHPUT = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"),
              ("server_updates_per_s", "server updates/s"))  # the first one a file holds is drawn
RATES = tuple(key for key, _ in THROUGHPUT)
SERIES = ("loss", "val_loss", "val_accuracy") + RATES
_NON_SPACE = re.compile(r"\S")


def plot(path, output: str, *, steps: str | None = None) -> str:
    """Draw ``path`` (metrics or trace) to ``output``; returns a one-line summary. Raises DataError on bad input.
    Several metrics files (a list) are drawn over each other, each run named by its folder."""
    first, last = parse_steps(steps)
    out_format = check_output(output)
    if not isinstance(path, str):
        paths = list(path)
        if len(paths) > 1:
            return _plot_runs(paths, output, out_format, first=first, last=last)
        path = paths[0]
    text = read_text(path)
    events = trace_events(text)
    if events is not None:
        rows = read_trace(path, events, first=first, last=last)
        figure = _draw_timeline(rows, title=_title(path))
        what = f"{sum(len(spans) for _, spans in rows):,} spans on {len(rows)} track(s)"
    else:
        series, note = read_metrics(path, text, first=first, last=last)
        memory = read_memory(path, text, first=first, last=last)
        figure = _draw_metrics(series, title=_title(path), memory=memory)
        what = (f"{len(series['loss'][0]):,} training and {len(series['val_loss'][0]):,} validation records"
                + (f", the memory of {len(memory[1])} rank(s) at step {memory[0]}" if memory else "") + note)
    _save(figure, output, out_format)
    return f"{output}: {what}"


def _title(path) -> str:
    """A figure's title: the run (the folder of its metrics file or trace: runs/digits/metrics.jsonl -> digits), the
    file's name after it where it says more (a trace beside the metrics)."""
    run, name = run_names([path])[0], os.path.basename(path)
    return run if name in ("metrics.jsonl", "metrics.csv") else f"{run}: {name}"


def run_names(paths) -> list[str]:
    """Each metrics file's run: its folder's name (runs/a/metrics.jsonl -> a), or the file's own where the folders
    are alike."""
    folders = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    if len(set(folders)) == len(folders):
        return folders
    return [os.path.relpath(p) for p in paths]


def _plot_runs(paths, output, out_format, *, first, last) -> str:
    runs = []
    for path in paths:
        text = read_text(path)
        if trace_events(text) is not None:
            raise DataError(f"{path} is a trace: several files are overlaid only as metrics (one trace at a time)")
        runs.append(read_metrics(path, text, first=first, last=last)[0])
    names = run_names(paths)
    _save(_draw_runs(runs, names), output, out_format)
    return f"{output}: {len(runs)} runs overlaid ({', '.join(names)})"


def _draw_runs(runs, names):
    """One panel each for loss, validation accuracy and throughput; one colour a run (training solid, validation
    dots)."""
    Figure, Canvas = _matplotlib()
    rate = next(((key, label) for key, label in THROUGHPUT if any(r[key][0] for r in runs)), None)
    accuracy = any(r["val_accuracy"][0] for r in runs)
    panels = ["loss"] + (["accuracy"] if accuracy else []) + (["rate"] if rate else [])
    fig = Figure(figsize=(8, 2.6 * len(panels) + 0.6), layout="constrained")
    Canvas(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
    fig.suptitle(" vs ".join(names) if len(" vs ".join(names)) <= 80 else f"{len(names)} runs")
    values = []
    for i, (series, name) in enumerate(zip(runs, names)):
        color = f"C{i % 10}"
        if series["loss"][0]:
            axes[0].plot(*series["loss"], "-", color=color, label=name)
        if series["val_loss"][0]:
            axes[0].plot(*series["val_loss"], "o--", color=color, markersize=3,
                         label=f"{name} (validation)")
        values += [v for key in ("loss", "val_loss") for v in series[key][1] if math.isfinite(v)]
        if accuracy and series["val_accuracy"][0]:
            axes[panels.index("accuracy")].plot(*series["val_accuracy"], "o-", color=color, markersize=3, label=name)
        if rate and series[rate[0]][0]:
            axes[panels.index("rate")].plot(*series[rate[0]], color=color, label=name)
    if values and min(values) > 0:
        axes[0].set_yscale("log")
    axes[0].set_ylabel("loss")
    axes[0].legend(fontsize="small")
    if accuracy:
        axes[panels.index("accuracy")].set_ylabel("validation accuracy")
    if rate:
        axes[panels.index("rate")].set_ylabel(rate[1])
        axes[panels.index("rate")].set_ylim(bottom=0)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


def parse_steps(steps: str | None) -> tuple[int | None, int | None]:
    """``"FIRST:LAST"`` (inclusive, either side may be empty) or ``"STEP"`` -> (first, last)."""
    if steps is None:
        return None, None
    lo, sep, hi = steps.partition(":")
    try:
        first = int(lo) if lo.strip() else None
        last = (int(hi) if hi.strip() else None) if sep else first
    except ValueError:
        raise DataError(f"--steps {steps!r}: expected FIRST:LAST, FIRST:, :LAST or STEP (integers)") from None
    if first is not None and last is not None and first > last:
        raise DataError(f"--steps {steps!r}: FIRST is after LAST")
    return first, last


def check_output(output: str) -> str:
    """The image format of ``output`` ('png', 'pdf' or 'svg'), once its folder exists and it is no folder itself."""
    ext = os.path.splitext(output)[1].lower()
    if ext not in FORMATS:
        raise DataError(f"-o {output}: the image name must end in {', '.join(FORMATS[:-1])} or {FORMATS[-1]}")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise DataError(f"-o {output}: folder {os.path.dirname(output) or folder} does not exist")
    try:
        mode = os.stat(output).st_mode
    except FileNotFoundError:
        return ext[1:]
    except OSError as e:
        raise DataError(f"-o {output}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise DataError(f"-o {output} is a folder")
    if not stat.S_ISREG(mode):
        raise DataError(f"-o {output} exists and is not a regular file")
    return ext[1:]


def read_text(path: str) -> str:
    """The UTF-8 text of a regular file of at most MAX_BYTES; stat first, so a FIFO or device is never opened."""
    data = read_capped(path, f"metrics or trace file {path}", DataError, MAX_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: line {line} is not UTF-8 text (hpctrain plot reads JSONL metrics or a JSON trace)"
                        ) from None


def trace_events(text: str):
    """The event list when ``text`` is a Chrome/Perfetto trace, else None (then it is read as metrics)."""
    begin = _NON_SPACE.search(text)
    if begin is None or text[begin.start()] not in "{[":
        return None
    end = text.find("\n", begin.start())
    try:  # json.dump writes a trace on one line; a metrics file's first line is a record of its own
        doc = json.loads(text[begin.start() : end if end >= 0 else len(text)])
        if end >= 0 and _NON_SPACE.search(text, end):
            return None
    except (ValueError, RecursionError):
        try:  # an indented trace, or a broken metrics line (the metrics reader names it)
            doc = json.loads(text)
        except (ValueError, RecursionError):
            return None
    if isinstance(doc, dict) and "traceEvents" in doc:
        return doc["traceEvents"]
    return doc if isinstance(doc, list) else None


def read_metrics(path: str, text: str, *, first=None, last=None):
    """Series ``{key: (steps, values)}`` for SERIES from JSONL text, and a note for the summary line.

    Each line that is not blank must be a JSON object with an integer ``step``; ``null``
    (a skipped non-finite step) becomes NaN. A last line without its newline that does not
    parse is a run still writing it: it is left out, and the note says so.
    """
    note = ""
    if path.endswith(".csv"):  # train.metrics as a CSV table (train/sinks.py): the same records
        if text and not text.endswith("\n") and text.count("\n") >= 2:  # a row cut off: the run is writing it
            text = text[: text.rindex("\n") + 1]
            note = f" (line {text.count(chr(10)) + 1} is incomplete and was left out: is the run still writing it?)"
        text = _csv_as_jsonl(path, text)
    series = {key: ([], []) for key in SERIES}
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:
            if number == len(lines) and any(series[key][0] for key in SERIES):  # no newline after it
                note = f" (line {number} is incomplete and was left out: is the run still writing it?)"
                continue
            raise DataError(f"{path}: line {number} is not valid JSON ({getattr(e, 'msg', e)})") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise DataError(f"{path}: line {number} is not a metrics record (a JSON object with an integer \"step\")")
        if (first is not None and step < first) or (last is not None and step > last):
            continue
        for key in SERIES:
            if key not in record or (key in RATES and "loss" not in record):
                continue  # throughput of training lines only: a summary line's is a mean over the whole run
            value = record[key]
            if value is None:
                value = math.nan
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DataError(f"{path}: line {number}: \"{key}\" is {json.dumps(value)[:40]}, not a number")
            series[key][0].append(step)
            series[key][1].append(float(value))
    if not any(series[key][0] for key in SERIES):
        where = "" if first is None and last is None else " in the --steps range"
        raise DataError(f"{path} holds no metrics records{where} (JSON lines with \"step\" and \"loss\" or "
                        "\"val_loss\"; the file train.metrics names)")
    return series, note


def _csv_as_jsonl(path: str, text: str) -> str:
    """A metrics table (a ``step`` column first) as the JSON lines it records: empty cells left out, numbers as
    numbers (``nan`` too); a row whose step is not an integer is reported by read_metrics as any bad line is."""
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or not rows[0] or rows[0][0] != "step":
        raise DataError(f"{path}: not a metrics table (a CSV file whose first column is \"step\")")
    lines = []
    for row in rows[1:]:
        record = {}
        for name, cell in zip(rows[0], row):
            if cell == "":
                continue
            try:
                record[name] = int(cell) if name == "step" else float(cell)
            except ValueError:
                record[name] = cell
        lines.append(json.dumps(record))
    return "\n".join(lines) + "\n"


MEMORY_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer"),
                ("activation_bytes", "activations"), ("buffer_bytes", "buffers"), ("runtime_bytes", "runtime"))


def read_memory(path: str, text: str, *, first=None, last=None):
    """(step, ranks) of the last ``"memory"`` record a run wrote (train/memory.py) at a step in [first, last], or
    None when there is none."""
    found = None
    for number, line in enumerate(text.split("\n"), 1):
        if '"memory"' not in line:
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # read_metrics has named a broken line already, or it is the one still being written
        ranks = record.get("memory") if isinstance(record, dict) else None
        if ranks is None:
            continue
        step = record.get("step")
        if isinstance(step, int) and ((first is not None and step < first) or (last is not None and step > last)):
            continue
        keys = [key for key, _ in MEMORY_PARTS] + ["peak_rss_bytes"]
        if not isinstance(ranks, list) or not ranks or not all(
                isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                                            and r[k] >= 0 for k in keys) for r in ranks):
            raise DataError(f"{path}: line {number}: \"memory\" is not a list of ranks' byte counts "
                            f"({', '.join(keys)})")
        found = (step, ranks)
    return found


def read_trace(path: str, events, *, first=None, last=None):
    """Tracks ``[(label, [(category, start_ms, duration_ms), ...]), ...]`` from complete ("X") events."""
    if not isinstance(events, list):
        raise DataError(f"{path}: \"traceEvents\" is not a list")
    names, order, spans = {}, {}, {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise DataError(f"{path}: trace event {i} is not a JSON object")
        track = (e.get("pid", 0), e.get("tid", 0))
        if not all(isinstance(v, (int, str)) for v in track):
            raise DataError(f"{path}: trace event {i}: pid and tid must be integers or strings")
        if e.get("ph") == "M":
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            if e.get("name") == "thread_name" and isinstance(args.get("name"), str):
                names[track] = args["name"]
            elif e.get("name") == "thread_sort_index" and isinstance(args.get("sort_index"), int):
                order[track] = args["sort_index"]
            continue
        if e.get("ph") != "X":
            continue
        ts, dur = e.get("ts"), e.get("dur", 0)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (ts, dur)):
            raise DataError(f"{path}: trace event {i}: \"ts\" and \"dur\" must be finite numbers (microseconds)")
        step = e["args"].get("step") if isinstance(e.get("args"), dict) else None
        if isinstance(step, int) and ((first is not None and step < first) or (last is not None and step > last)):
            continue
        category = e.get("cat") or str(e.get("name", "?"))
        spans.setdefault(track, []).append((str(category), ts / 1e3, dur / 1e3))
    if not spans:
        where = "" if first is None and last is None else " in the --steps range"
        raise DataError(f"{path}: the trace holds no spans{where} (complete events, \"ph\": \"X\")")
    tracks = sorted(spans, key=lambda t: (order.get(t, math.inf), str(t[0]), str(t[1])))
    return [(names.get(t, f"pid {t[0]} tid {t[1]}"), spans[t]) for t in tracks]


def _matplotlib():
    """matplotlib's Figure and Agg canvas, or the one-line error that says how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise HpctrainError("hpctrain plot needs matplotlib: pip install 'hpctrain[plot]'") from None
    return Figure, FigureCanvasAgg


def _draw_metrics(series, *, title, memory=None):
    Figure, Canvas = _matplotlib()
    rate = next(((key, label) for key, label in THROUGHPUT if series[key][0]), None)
    panels = ["loss"] + (["accuracy"] if series["val_accuracy"][0] else []) + (["rate"] if rate else [])
    fig = Figure(figsize=(8, 2.6 * (len(panels) + bool(memory)) + 0.6), layout="constrained")
    Canvas(fig)
    grid = fig.subplots(len(panels) + bool(memory), 1, squeeze=False)[:, 0]
    axes = grid[: len(panels)]
    for ax in axes[1:]:
        ax.sharex(axes[0])
    if memory:
        _draw_memory(grid[-1], *memory)
    fig.suptitle(title)
    ax = axes[0]
    for key, label, style in (("loss", "training loss", "-"), ("val_loss", "validation loss", "o-")):
        if series[key][0]:
            ax.plot(*series[key], style, label=label, markersize=3)
    values = [v for key in ("loss", "val_loss") for v in series[key][1] if math.isfinite(v)]
    if values and min(values) > 0:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.legend()
    if "accuracy" in panels:
        ax = axes[panels.index("accuracy")]
        ax.plot(*series["val_accuracy"], "o-", color="tab:green", markersize=3)
        ax.set_ylabel("validation accuracy")
    if rate:
        ax = axes[panels.index("rate")]
        ax.plot(*series[rate[0]], color="tab:purple")
        ax.set_ylabel(rate[1])
        ax.set_ylim(bottom=0)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


def _draw_memory(ax, step, ranks):
    """Each rank's tracked bytes stacked by kind (hpctrain plan's fields), its peak RSS as a marker."""
    x = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for key, label in MEMORY_PARTS:
        heights = [r[key] / 1e6 for r in ranks]
        ax.bar(x, heights, bottom=bottom, label=label, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.plot(x, [r["peak_rss_bytes"] / 1e6 for r in ranks], "k_", markersize=24, markeredgewidth=2,
            label="peak RSS")
    ax.set_xticks(x, [str(r.get("rank", i)) for i, r in enumerate(ranks)])
    ax.set_xlabel("rank")
    ax.set_ylabel("MB")
    ax.set_title(f"memory at step {step}", fontsize="medium")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)


def _draw_timeline(rows, *, title):
    Figure, Canvas = _matplotlib()
    start = min(t for _, spans in rows for _, t, _ in spans)
    categories = list(dict.fromkeys(c for _, spans in rows for c, _, _ in spans))
    fig = Figure(figsize=(12, max(1.0 + 0.5 * len(rows), 0.5 + 0.22 * len(categories))), layout="constrained")
    Canvas(fig)
    ax = fig.subplots()
    colors = {c: f"C{i % 10}" for i, c in enumerate(categories)}
    labelled = set()
    for y, (_, spans) in enumerate(rows):
        for c in categories:
            bars = [(t - start, d) for cat, t, d in spans if cat == c]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors[c], label=None if c in labelled else c)
                labelled.add(c)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (ms) from the first span drawn")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def _save(fig, output, out_format):
    """Write to a temporary name beside ``output``, then rename: never a half-written image under its name."""
    with replaced_atomically(output, f"-o {output}: cannot write", DataError) as tmp:
        fig.savefig(tmp, format=out_format)
