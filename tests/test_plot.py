"""``hpctrain plot``: metrics and traces of a real run to images; every bad input is one line and exit status 2."""

import json
import os
import subprocess
import sys

import pytest
from helpers import make_classification, toml_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_MATPLOTLIB = "hpctrain: error: hpctrain plot needs matplotlib: pip install 'hpctrain[plot]'\n"


def hpctrain(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short real run: 6 steps, a training line every 2, validation every 3, and a trace."""
    folder = tmp_path_factory.mktemp("run")
    make_classification(folder / "d.h5", n=96)
    (folder / "job.toml").write_text(toml_job(train={"steps": 6, "log_every": 2, "eval_every": 3,
                                                     "metrics": "out/metrics.jsonl", "trace": "out/trace.json"},
                                              data={"val_fraction": 0.25}))
    r = hpctrain("train", str(folder / "job.toml"))
    assert r.returncode == 0, r.stdout + r.stderr
    return folder / "out"


def test_a_real_runs_metrics_become_a_png(run, tmp_path):
    pytest.importorskip("matplotlib")
    r = hpctrain("plot", str(run / "metrics.jsonl"), "-o", str(tmp_path / "loss.png"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == (f"{tmp_path / 'loss.png'}: 3 training and 2 validation records, the memory of 1 rank(s) at "
                        "step 6\n")
    image = (tmp_path / "loss.png").read_bytes()
    assert image.startswith(b"\x89PNG\r\n\x1a\n") and len(image) > 10_000
    assert os.listdir(tmp_path) == ["loss.png"], "no temporary file is left behind"


def test_several_runs_are_overlaid_each_named_by_its_folder(run, tmp_path):
    pytest.importorskip("matplotlib")
    other = tmp_path / "lr-2"
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "samples_per_s": 100.0}) + "\n"
                                                 for s in (2, 4, 6)))
    r = hpctrain("plot", str(run / "metrics.jsonl"), str(other / "metrics.jsonl"), "-o", str(tmp_path / "ab.png"))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == f"{tmp_path / 'ab.png'}: 2 runs overlaid (out, lr-2)\n"
    assert (tmp_path / "ab.png").read_bytes().startswith(b"\x89PNG")
    bad = hpctrain("plot", str(run / "metrics.jsonl"), str(run / "trace.json"), "-o", str(tmp_path / "x.png"))
    assert bad.returncode == 2 and "is a trace: several files are overlaid only as metrics" in bad.stderr


def test_metrics_series_hold_what_the_file_says(run):
    from hpctrain.plot import read_metrics

    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    series, note = read_metrics(str(path), path.read_text())
    assert series["loss"] == ([2, 4, 6], [r["loss"] for r in records if "loss" in r]) and note == ""
    assert series["val_loss"][0] == [3, 6] and series["val_accuracy"][0] == [3, 6]
    assert series["samples_per_s"][0] == [2, 4, 6] and series["tokens_per_s"] == ([], [])
    series, _ = read_metrics(str(path), path.read_text(), first=3, last=4)
    assert series["loss"][0] == [4] and series["val_loss"][0] == [3]


@pytest.mark.parametrize("suffix, magic", [(".pdf", b"%PDF"), (".svg", b"<?xml"), (".PNG", b"\x89PNG")])
def test_the_extension_picks_the_format(run, tmp_path, suffix, magic):
    pytest.importorskip("matplotlib")
    from hpctrain.plot import plot

    out = tmp_path / f"loss{suffix}"
    plot(str(run / "metrics.jsonl"), str(out))
    assert out.read_bytes().startswith(magic)


def test_parameter_server_and_language_model_metrics_draw_their_throughput(tmp_path):
    pytest.importorskip("matplotlib")
    from hpctrain.plot import plot, read_metrics

    ps = tmp_path / "ps.jsonl"
    ps.write_text('{"step": 10, "updates": 20, "loss": 0.9, "server_updates_per_s": 400.0, "staleness_max": 1}\n'
                  '{"step": 20, "updates": 40, "loss": 0.5, "server_updates_per_s": 500.0, "staleness_max": 1}\n'
                  '{"step": 20, "updates": 40, "server_updates_per_s": 20.0, "val_loss": 0.6, "val_accuracy": 0.8}\n')
    series, _ = read_metrics(str(ps), ps.read_text())
    assert series["server_updates_per_s"] == ([10, 20], [400.0, 500.0]), "the summary line's mean is no point"
    gpt = tmp_path / "gpt.jsonl"
    gpt.write_text('{"step": 1, "loss": 2.5, "samples_per_s": 4.0, "tokens_per_s": 256.0}\n'
                   '{"step": 2, "loss": null, "samples_per_s": 4.0, "tokens_per_s": 256.0, "skipped": true}\n')
    assert read_metrics(str(gpt), gpt.read_text())[0]["loss"][0] == [1, 2]
    for path in (ps, gpt):
        assert "records" in plot(str(path), str(tmp_path / "out.png"))


def test_a_line_still_being_written_is_left_out_with_a_note(tmp_path):
    from hpctrain.plot import read_metrics

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    series, note = read_metrics(str(path), path.read_text())
    assert series["loss"] == ([1], [1.0]) and "line 2 is incomplete" in note
    table = tmp_path / "m.csv"  # the CSV table of a run killed mid-row: its last row was read as a record
    table.write_text("step,loss,val_loss\n1,1.0,\n2,0.5,0.7\n3,0.2")
    series, note = read_metrics(str(table), table.read_text())
    assert series["loss"] == ([1, 2], [1.0, 0.5]) and series["val_loss"] == ([2], [0.7])
    assert "line 4 is incomplete" in note
    table.write_text("step,loss\n1,1.0\n")  # whole: no note
    assert read_metrics(str(table), table.read_text())[1] == ""


def test_a_real_trace_becomes_a_timeline(run, tmp_path):
    pytest.importorskip("matplotlib")
    r = hpctrain("plot", str(run / "trace.json"), "-o", str(tmp_path / "timeline.png"), "--steps", "2:3")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.endswith(" spans on 1 track(s)\n"), r.stdout
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_trace_tracks_and_spans(run):
    from hpctrain.plot import read_text, read_trace, trace_events

    path = str(run / "trace.json")
    text = read_text(path)
    events = trace_events(text)
    assert events == json.loads(text)["traceEvents"]
    ((label, spans),) = read_trace(path, events)
    assert label == "rank 0 (stage 0, dp 0, tp 0)"
    kinds = {kind for kind, _, _ in spans}
    assert {"forward", "backward", "optimizer"} <= kinds
    complete = [e for e in events if e.get("ph") == "X"]
    assert len(spans) == len(complete)
    ((_, two_steps),) = read_trace(path, events, first=2, last=3)
    assert len(two_steps) == len([e for e in complete if e["args"]["step"] in (2, 3)]) > 0
    # the other layouts Chrome's format allows: an indented object, a bare array of events
    assert trace_events(json.dumps({"traceEvents": complete}, indent=1)) == complete
    assert trace_events(json.dumps(complete, indent=1)) == complete
    assert trace_events('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n') is None


def test_without_matplotlib_it_says_how_to_install_it(run, tmp_path):
    hide = ("import sys; sys.modules['matplotlib'] = None; from hpctrain.cli import main; "
            "sys.exit(main(['plot', sys.argv[1], '-o', sys.argv[2]]))")
    out = tmp_path / "loss.png"
    r = subprocess.run([sys.executable, "-c", hide, str(run / "metrics.jsonl"), str(out)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120, check=False)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", NO_MATPLOTLIB)
    assert not out.exists()


def test_help_explains_the_command_and_each_option(capsys):
    from hpctrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plot", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for words in ("metrics file", "trace", "timeline", "FILE", "-o IMAGE, --output IMAGE", ".png, .pdf or .svg",
                  "--steps FIRST:LAST", "pip install 'hpctrain[plot]'"):
        assert words in text, words


def _broken(t):
    (t / "m.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "loss": 0.8\n'
                               '{"step": 4, "loss": 0.7}\n')
    return ["m.jsonl", "-o", "x.png"]


def _write(name, text):
    def make(t):
        (t / name).write_text(text)
        return [name, "-o", "x.png"]
    return make


def _fifo(t):
    os.mkfifo(t / "pipe")  # nobody writes to it: opening it for reading would block forever
    return ["pipe", "-o", "x.png"]


def _huge(t):
    from hpctrain.plot import MAX_BYTES

    with open(t / "huge.jsonl", "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: no disk, no time
    return ["huge.jsonl", "-o", "x.png"]


def _binary(t):
    make_classification(t / "d.h5", n=8)
    return ["d.h5", "-o", "x.png"]


def _good(*rest):
    def make(t):
        (t / "m.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        return ["m.jsonl", *rest]
    return make


BAD = [
    ("broken-line", _broken, "m.jsonl: line 3 is not valid JSON (Expecting ',' delimiter)"),
    ("empty", _write("m.jsonl", ""), "m.jsonl holds no metrics records"),
    ("blank-lines", _write("m.jsonl", "\n\n  \n"), "m.jsonl holds no metrics records"),
    ("no-plotted-keys", _write("m.jsonl", '{"step": 1, "lr": 0.1}\n'), "m.jsonl holds no metrics records"),
    ("no-step", _write("m.jsonl", '{"step": 1, "loss": 1}\n{"loss": 2}\n'),
     'm.jsonl: line 2 is not a metrics record (a JSON object with an integer "step")'),
    ("not-an-object", _write("m.jsonl", "[1, 2]\n[3]\n"), "m.jsonl: line 1 is not a metrics record"),
    ("not-a-number", _write("m.jsonl", '{"step": 1, "loss": "low"}\n'), 'm.jsonl: line 1: "loss" is "low", not a number'),
    ("missing", lambda t: ["nothing.jsonl", "-o", "x.png"], "nothing.jsonl does not exist"),
    ("folder", lambda t: [".", "-o", "x.png"], "metrics or trace file . is a directory, not a file"),
    ("fifo", _fifo, "pipe is a FIFO (named pipe), not a regular file"),
    ("too-large", _huge, "huge.jsonl is larger than 1024 MiB, more than hpctrain reads from it"),
    ("binary", _binary, "d.h5: line 1 is not UTF-8 text"),
    ("trace-without-spans", _write("t.json", '{"traceEvents": [{"ph": "M", "name": "thread_name"}]}'),
     't.json: the trace holds no spans (complete events, "ph": "X")'),
    ("trace-bad-event", _write("t.json", '{"traceEvents": [{"ph": "X", "ts": "soon", "dur": 1}]}'),
     't.json: trace event 0: "ts" and "dur" must be finite numbers'),
    ("output-folder-missing", _good("-o", "no/such/folder/x.png"),
     "-o no/such/folder/x.png: folder no/such/folder does not exist"),
    ("output-is-a-folder", _good("-o", "dir.png"), "-o dir.png is a folder"),
    ("output-extension", _good("-o", "loss.jpg"), "-o loss.jpg: the image name must end in .png, .pdf or .svg"),
    ("steps", _good("-o", "x.png", "--steps", "9:3"), "--steps '9:3': FIRST is after LAST"),
    ("steps-empty-range", _good("-o", "x.png", "--steps", "5:"), "m.jsonl holds no metrics records in the --steps range"),
]


@pytest.mark.parametrize("name, make, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_status_2(tmp_path, name, make, message):
    (tmp_path / "dir.png").mkdir()
    r = hpctrain("plot", *make(tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("hpctrain: error: "), r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.png").exists()


def test_a_run_s_memory_is_drawn_per_rank(tmp_path):
    """The last "memory" record (train/memory.py) becomes a panel of stacked bars per rank."""
    import json

    ranks = [{"rank": r, "params_bytes": 4e6, "grads_bytes": 4e6, "optimizer_bytes": 8e6 / 2, "activation_bytes": 1e6,
              "buffer_bytes": 0, "runtime_bytes": 220e6, "total_bytes": 233e6, "peak_rss_bytes": 240e6}
             for r in range(2)]
    lines = [{"step": 1, "loss": 2.0, "samples_per_s": 10.0}, {"step": 1, "memory": ranks},
             {"step": 2, "loss": 1.5, "samples_per_s": 11.0}, {"step": 2, "memory": ranks}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    from hpctrain.plot import plot, read_memory

    assert read_memory(str(path), path.read_text()) == (2, ranks)
    said = plot(str(path), str(tmp_path / "m.png"))
    assert "the memory of 2 rank(s) at step 2" in said and (tmp_path / "m.png").stat().st_size > 1000
    # --steps: the memory panel too shows a record inside the range
    assert read_memory(str(path), path.read_text(), last=1) == (1, ranks)
    assert read_memory(str(path), path.read_text(), first=3) is None
    assert "the memory of 2 rank(s) at step 1" in plot(str(path), str(tmp_path / "m1.png"), steps="1:1")


def test_a_broken_memory_record_is_one_line(tmp_path):
    import json

    from hpctrain.errors import DataError
    from hpctrain.plot import plot

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + json.dumps({"step": 1, "memory": [{"rank": 0}]}) + "\n")
    with pytest.raises(DataError, match='line 2: "memory" is not a list of ranks'):
        plot(str(path), str(tmp_path / "m.png"))
