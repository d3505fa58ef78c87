"""The README's table, the results page's tables and figures, from the files benchmarks write.

  python benchmarks/figures.py            # all of it; then bash scripts/docs.sh shows it
  python benchmarks/figures.py --check    # exit 1 if the READMEs' tables are not what the files say

Nothing here is typed in by hand: every number comes from one of these files
under ``benchmarks/results/`` (each optional; what a missing file would give is
left out):

* ``network_4proc.json`` (``python benchmarks/network.py``): the headline's bytes
  and seconds, ``collectives.trees.resnet50.rates[RATE].modes[MODE]``'s
  ``hlo_bytes_sent`` and ``seconds``, at 100 Mbit/s and 1 Gbit/s a node. A mode
  ``NAME/two_phase`` or ``NAME/ring`` is the row ``NAME``, ``fp32_pmean`` is
  ``fp32``; other methods (``/psum``, ``/all_gather``, ``/fused``,
  ``/wire_only``) are left to the full tables. Every ``network_*.json`` below
  ``benchmarks/results`` with a ``training`` part gives a panel of the
  time-to-accuracy figure: ``training.rate`` and ``training.modes[MODE].curve``
  (``train_seconds``, ``eval_accuracy``, and ``eval_loss`` where recorded).
* ``digits_comparison.json`` (``python -m examples.imagenet.compare --seeds=0,1,2
  --workdir=runs/digits_seeds --results=benchmarks/results/digits_comparison``):
  the headline's accuracy, ``modes[MODE].eval_accuracy`` (``mean``, ``min``,
  ``max`` over ``runs`` seeds), and the accuracy-against-bits figure with
  ``modes[MODE].runs[0].compression_ratio``.
* ``lm_comparison.json`` (``examples/lm/compare.py``'s ``comparison.json``,
  copied): the results page's second table, the language model with Adam(W): each run's
  ``eval_loss``, ``eval_loss_minus_fp32`` and ``_bf16``, ``wire_bytes_per_step``
  and ``freeze_step``.
* ``network_2proc_lm.json`` (``python benchmarks/network.py --parts lm``): the
  results page's table of seconds to float32's final loss, ``network_lm_table.md``.
* ``compressed_adam_bytes.json`` (``python benchmarks/compressed_adam_bytes.py``):
  bytes a step before and after the compressed Adams' freeze,
  ``modes[MODE].steps[t].wire_bytes`` and ``.loss``.

* ``digits_sparse*.json`` and ``lm_sparse*.json`` (``examples/imagenet/compare.py`` and
  ``examples/lm/compare.py``, the sparse modes): ``headline_sparse.md``, the optimizers guide's
  table of top-k, DGC and DeMo.
* ``lm_diloco.json`` (``python benchmarks/diloco_sweep.py``): the DiLoCo table,
  ``headline_diloco.md`` and ``examples/lm/README.md``'s: each run's ``settings``,
  ``eval_loss``, ``eval_loss_minus_fp32`` and ``_bf16``, ``bytes_per_step`` and
  ``fp32_bytes_over_bytes`` and ``bf16_``.

The README's table (:func:`front_page_table`) takes a row a family from these
files (and ``lm_hybrid.json``, ``examples/lm/compare.py --config.parallelism=hybrid``'s),
and the seconds where ``network_2proc_lm*.json`` ran the same method.

Writes ``benchmarks/results/headline.md``, ``headline_lm.md``, ``headline_diloco.md`` and
``headline_sparse.md``, the tables between their markers in ``README.md`` and
``examples/lm/README.md``, and ``benchmarks/results/figures/*.png``.
"""

import argparse
import json
import math
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
RESULTS = _HERE / "results"
README = _HERE.parent / "README.md"
LM_README = _HERE.parent / "examples" / "lm" / "README.md"
DILOCO_BEGIN = ("<!-- The DiLoCo table: made by python benchmarks/figures.py from"
                " benchmarks/results. -->")
DILOCO_END = "<!-- End of the DiLoCo table. -->"
HEADLINE_RATES = ("100 Mbit/s", "1 Gbit/s")
TREE = "resnet50"
BASELINES = ("fp32", "bf16")
LEFT_TO_FULL_TABLES = {"psum", "all_gather", "fused", "wire_only"}


def _load(path: pathlib.Path) -> dict | None:
  return json.loads(path.read_text()) if path.exists() else None


def row_name(network_mode: str) -> str | None:
  """The headline row of a network benchmark mode, or ``None`` for another method's."""
  name, *method = network_mode.split("/")
  if set(method) & LEFT_TO_FULL_TABLES:
    return None
  return "fp32" if name == "fp32_pmean" else name


def headline_rows(results: pathlib.Path = RESULTS) -> tuple[list[str], dict[str, dict]]:
  """``(columns, {row: {column: text}})`` of the headline table."""
  rows: dict[str, dict] = {}
  columns = []
  network = _load(results / "network_4proc.json")
  if network is not None:
    tree = network["collectives"]["trees"][TREE]
    bytes_column = "bytes a device sends (vs fp32 / bf16)"
    columns.append(bytes_column)
    first_rate = tree["rates"][next(iter(tree["rates"]))]["modes"]
    sent = {row_name(mode): tree["modes"][mode]["hlo_bytes_sent"] for mode in first_rate
            if row_name(mode) is not None and "hlo_bytes_sent" in tree["modes"].get(mode, {})}
    for name, value in sent.items():
      rows.setdefault(name, {})[bytes_column] = (
          f"{value / 1e6:,.1f} MB ({_ratio(sent, 'fp32', value)} / {_ratio(sent, 'bf16', value)})")
    for rate in HEADLINE_RATES:
      if rate not in tree["rates"]:
        continue
      column = f"seconds at {rate} a node (vs fp32 / bf16)"
      columns.append(column)
      seconds = {row_name(mode): result["seconds"]
                 for mode, result in tree["rates"][rate]["modes"].items()
                 if row_name(mode) is not None}
      for name, value in seconds.items():
        rows.setdefault(name, {})[column] = (
            f"{value:.2f} ({_ratio(seconds, 'fp32', value)} / {_ratio(seconds, 'bf16', value)})")
  digits = _load(results / "digits_comparison.json")
  if digits is not None:
    runs = {mode: result["eval_accuracy"]["runs"] for mode, result in digits["modes"].items()}
    column = f"digits accuracy, {min(runs.values())} seeds (range)"
    columns.append(column)
    for mode, result in digits["modes"].items():
      spread = result["eval_accuracy"]
      rows.setdefault(mode, {})[column] = (
          f"{spread['mean']:.1%} ({spread['min']:.1%}-{spread['max']:.1%})")
  return columns, rows


def _ratio(values: dict, baseline: str, value: float) -> str:
  return f"{values[baseline] / value:.1f}x" if baseline in values and value else "-"


def _order(rows: dict[str, dict], columns: list[str]) -> list[str]:
  """The baselines first, then by bytes sent, most first (unmeasured last)."""

  def megabytes(name):
    cell = rows[name].get(columns[0], "") if columns else ""
    return -float(cell.split(" ")[0].replace(",", "")) if cell.endswith(")") else math.inf

  others = sorted((name for name in rows if name not in BASELINES), key=megabytes)
  return [name for name in BASELINES if name in rows] + others


def headline_table(results: pathlib.Path = RESULTS) -> str:
  """The results page's headline table, with the lines that say what its columns are."""
  columns, rows = headline_rows(results)
  lines = ["| mode | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
  for name in _order(rows, columns):
    lines.append(f"| {name} | " + " | ".join(rows[name].get(c, "-") for c in columns) + " |")
  notes = []
  if any(c.startswith("bytes") for c in columns):
    notes.append(
        "Bytes and seconds: averaging ResNet-50's gradient (25.6M parameters) in"
        " `benchmarks/network.py`: 4 processes of one CPU device, joined by `jax.distributed`"
        " over TCP, each node's link limited by `tc`; bytes read from the compiled program,"
        " seconds the median of 3 calls; fp32 is `jax.lax.pmean`, decentralized8 one exchange"
        " with two ring neighbours (not an average).")
  if any(c.startswith("digits") for c in columns):
    notes.append(
        "Accuracy: the digits example (`examples/imagenet`, ResNet-8, 8 simulated devices),"
        " mean over seeds and, in brackets, the range; one held-out digit is 0.28%.")
  return "\n".join(lines) + "\n\n" + "\n\n".join(notes) + "\n"


def lm_table(results: pathlib.Path = RESULTS) -> str:
  """The results page's table of the language model trained with Adam(W), or ``""``.

  From ``lm_comparison.json`` (``examples/lm/compare.py``'s ``comparison.json``): a
  row a run, its held-out loss against the ``fp32`` and ``bf16`` runs', and the bytes a
  device sent in the run's last step (a compressed Adam's after its freeze).
  """
  lm = _load(results / "lm_comparison.json")
  if lm is None:
    return ""
  runs = {run["mode"]: run for run in lm["runs"]}
  sent = {mode: run["wire_bytes_per_step"] or run["hlo_wire_bytes_per_step"]
          for mode, run in runs.items()}
  lines = ["| mode | held-out loss (vs fp32 / bf16) "
           "| bytes a device sends a step (vs fp32 / bf16) |", "|---|---|---|"]
  for mode, run in runs.items():
    froze = run.get("freeze_step")
    name = mode if froze is None else f"{mode} (froze at step {froze})"
    differences = " / ".join(f"{run[f'eval_loss_minus_{b}']:+.3f}"
                             if f"eval_loss_minus_{b}" in run else "-" for b in BASELINES)
    lines.append(f"| {name} | {run['eval_loss']:.3f} ({differences}) "
                 f"| {sent[mode] / 1e3:,.0f} kB ({_ratio(sent, 'fp32', sent[mode])} / "
                 f"{_ratio(sent, 'bf16', sent[mode])}) |")
  some, config = next(iter(runs.values())), lm["config"]
  note = (
      f"`examples/lm`: a byte-level GPT of {some['num_params']:,} parameters,"
      f" {some['steps']} steps, peak learning rate {config['learning_rate']:g}, each device's"
      f" gradient clipped at {config['grad_clip_norm']:g} before the compressed Adams (the"
      f" average's before AdamW), {some['num_devices']} simulated devices; held-out loss in nats"
      " a byte, one seed. A compressed Adam's bytes are those of its steps after the freeze.")
  return "\n".join(lines) + "\n\n" + note + "\n"


def _times(ratio: float) -> str:
  return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def diloco_table(results: pathlib.Path = RESULTS) -> str:
  """The language model's DiLoCo table (examples/lm/README.md, the guides), or ``""``.

  From ``lm_diloco.json`` (``benchmarks/diloco_sweep.py``): a row a run, its
  held-out loss against float32 and bfloat16 data parallel's of as many steps,
  and the bytes a device sends a step on average over the run (DiLoCo's across
  workers) against theirs.
  """
  sweep = _load(results / "lm_diloco.json")
  if sweep is None:
    return ""
  lines = ["| run | workers | H | outer average | outer optimizer | steps "
           "| held-out loss (vs fp32 / bf16 DP) | bytes a device sends a step (fewer than "
           "fp32 / bf16 DP) |", "|---" * 8 + "|"]
  for run in sweep["runs"]:
    settings = run["settings"]
    diloco = settings["optimizer"] == "diloco"
    if diloco:
      momentum = settings["outer_momentum"]
      outer = ("SGD" if not momentum else f"Nesterov {momentum:g}"
               if settings["outer_nesterov"] else f"momentum {momentum:g}")
      outer += f", lr {settings['outer_learning_rate']:g}"
      every = str(settings["sync_every"]) + (
          f" ({settings['fragments']} fragment{'s' if settings['fragments'] > 1 else ''}, "
          f"delay {settings['fragment_delay']}"
          + (f", alpha {settings['fragment_alpha']:g}" if settings["fragment_alpha"] else "")
          + ")" if settings["fragments"] > 1 or settings["fragment_delay"] else "")
      average = settings["outer_average"] + (", split" if settings.get("outer_split") else "")
      if settings["outer_average"] == "sparseloco":
        average += sparseloco_settings(settings)
      cells = [str(settings["diloco_workers"]), every, average, outer]
      name = "DiLoCo" + (f", inner lr {settings['learning_rate']:g}"
                         if settings["learning_rate"] != sweep["config"]["learning_rate"] else "")
    else:
      cells = ["-", "-", "-", "-"]
      name = f"{settings['average']} data parallel"
    if settings["seed"] != sweep["config"]["seed"]:
      name += f", seed {settings['seed']}"
    differences = " / ".join("-" if run[f"eval_loss_minus_{b}"] is None
                             else f"{run[f'eval_loss_minus_{b}']:+.3f}" for b in BASELINES)
    ratios = " / ".join("-" if run[f"{b}_bytes_over_bytes"] is None
                        else _times(run[f"{b}_bytes_over_bytes"]) for b in BASELINES)
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {run['steps']} "
                 f"| {run['eval_loss']:.3f} ({differences}) "
                 f"| {run['bytes_per_step'] / 1e3:,.1f} kB ({ratios}) |")
  some = sweep["runs"][0]
  note = (
      f"`examples/lm/configs/small.py` ({some['num_params']:,} parameters, batch"
      f" {sweep['config']['batch_size']} x {sweep['config']['context_length']} bytes),"
      f" {some['num_devices']} simulated devices, seed 0 unless the run says:"
      " `python benchmarks/diloco_sweep.py`."
      " DiLoCo's devices form the workers, float32 averaging inside each every step; its bytes"
      " are those that cross between workers (each device's exchange of the outer gradient, none"
      " between syncs), data parallel's (DP) a device's part of the all-reduce over all"
      " devices every step. Held-out loss in nats a byte, against DP trained as many steps.")
  return "\n".join(lines) + "\n\n" + note + "\n"


def _digits_hlo_cell(run: dict, fp32: dict) -> str:
  """A digits run's bytes a step read from its compiled program, against float32's: its
  lightest step's, and where a warm-up's float32 steps send more, theirs besides (a run
  without a warm-up, recorded before these two were kept, reads its one figure)."""
  least = run.get("hlo_wire_bytes_least", run["hlo_wire_bytes_per_step"])
  most = run.get("hlo_wire_bytes_most", least)
  cell = f"{least:,.0f} ({fp32['hlo_wire_bytes_per_step'] / least:.1f}x"
  return cell + (")" if most == least else f"; the warm-up's steps {most:,.0f})")


def sparse_table(results: pathlib.Path = RESULTS) -> str:
  """The sparse family's measurements (the optimizers guide, the results page), or ``""``.

  Digits rows from every ``digits_sparse*.json`` (``examples/imagenet/compare.py``'s
  ``comparison.json``, one file a setting of ``topk_warmup_steps``): the accuracy over the
  seeds and the bytes a device sends a step, by the optimizer's account (the last step's) and
  in the compiled program's collectives (BatchNorm's statistics included), against the file's
  (or the first file's) fp32 run. Language-model rows from every ``lm_sparse*.json``
  (``examples/lm/compare.py``'s): the held-out loss and the bytes a step against the fp32 run
  of as many steps.
  """
  lines = []
  digits_files = sorted(results.glob("digits_sparse*.json"))
  if digits_files:
    lines += ["| digits (ResNet-8) | accuracy (range) | bytes a step, last (vs fp32) "
              "| HLO bytes a step (vs fp32) |", "|---|---|---|---|"]
    reference = None
    for path in digits_files:
      digits = json.loads(path.read_text())
      fp32 = digits["modes"].get("fp32", reference)
      reference = reference or fp32
      warmup = digits["config"].get("topk_warmup_steps", 0)
      for mode, result in digits["modes"].items():
        if mode == "fp32" and fp32 is not reference:
          continue
        run, spread, base = result["runs"][0], result["eval_accuracy"], fp32["runs"][0]
        name = mode + (f", warm-up {warmup} steps" if warmup and mode != "fp32" else "")
        lines.append(
            f"| {name} | {spread['mean']:.1%} ({spread['min']:.1%}-{spread['max']:.1%}) "
            f"| {run['wire_bytes_per_step']:,.0f} "
            f"({base['wire_bytes_per_step'] / run['wire_bytes_per_step']:.1f}x) "
            f"| {_digits_hlo_cell(run, base)} |")
    seeds = reference["eval_accuracy"]["runs"]
    lines += ["", f"ResNet-8 on digits, 8 simulated devices, {seeds} seeds, the mean accuracy "
              "and its range; one held-out digit is 0.28%. HLO bytes include BatchNorm's "
              "statistics, 9,450 bytes a step in every mode.", ""]
  lm_files = sorted(results.glob("lm_sparse*.json"))
  if lm_files:
    lines += ["| language model | steps | held-out loss (vs fp32 AdamW) "
              "| bytes a step (vs fp32 AdamW) |", "|---|---|---|---|"]
  for path in lm_files:  # Each file's runs against its own fp32 run of as many steps.
    lm = json.loads(path.read_text())
    baselines = {run["steps"]: run for run in lm["runs"] if run["mode"].split("+")[0] == "fp32"}
    for run in lm["runs"]:
      base = baselines.get(run["steps"])
      sent = run["wire_bytes_per_step"] or run["hlo_wire_bytes_per_step"]
      versus = ("-" if base is None else
                f"{run['eval_loss'] - base['eval_loss']:+.3f}")
      ratio = "-" if base is None else f"{base['wire_bytes_per_step'] / sent:.1f}x"
      lines.append(f"| `{run['mode']}` | {run['steps']} | {run['eval_loss']:.3f} ({versus}) "
                   f"| {sent:,.0f} ({ratio}) |")
  if lm_files:
    lines += ["", "`examples/lm/configs/small.py` on 8 simulated devices, one seed; DeMo"
              " (`--config.optimizer=demo`) against AdamW after a float32 average, trained as"
              " long.", ""]
  return "\n".join(lines)


def sparseloco_settings(settings: dict) -> str:
  """A SparseLoCo run's density, and its decay and average where not the defaults."""
  text = f" {settings['sparseloco_density']:.2%}"
  if settings.get("sparseloco_error_decay", 0.95) != 0.95:
    text += f", decay {settings['sparseloco_error_decay']:g}"
  if settings.get("sparseloco_aggregation", "mean_over_contributors") != "mean_over_contributors":
    text += ", mean over workers"
  return text


def network_lm_table(results: pathlib.Path = RESULTS) -> str:
  """Seconds to float32's final loss on real processes (``network.py --parts lm``), or ``""``.

  From ``network_2proc_lm.json``'s ``lm.modes[MODE]``: a step's seconds at the
  rate trained in full (``lm.full_rate``), and each rate's ``seconds_to_target``
  (``measured`` or derived) with its speedups over fp32 and bf16.
  """
  report = _load(results / "network_2proc_lm.json")
  if report is None:
    return ""
  lm = report["lm"]
  rates = list(next(iter(lm["modes"].values()))["rates"])
  lines = ["| mode | s a step at " + lm["full_rate"] + " | "
           + " | ".join(f"s to fp32's final loss at {rate} (vs fp32 / bf16)" for rate in rates)
           + " |", "|---" * (len(rates) + 2) + "|"]
  for mode, result in lm["modes"].items():
    cells = []
    for rate in rates:
      entry = result["rates"][rate]
      if entry.get("seconds_to_target") is None:
        cells.append(f"not reached (+{result['gap_to_target']:.3f} nats at the end)")
        continue
      kind = "" if entry["measured"] else ", derived"
      cells.append(f"{entry['seconds_to_target']:.1f} ({entry['speedup_vs_fp32']:.1f}x / "
                   f"{entry['speedup_vs_bf16']:.1f}x{kind})")
    lines.append(f"| {mode} | {result['rates'][lm['full_rate']]['seconds_per_step']:.3f} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


# The front page's rows: (family, what runs, results file, mode or run, network file, its
# mode). Each compares a run with the float32 and bf16 runs of the same file.
FRONT_ROWS = (
    ("element-wise: 4-bit QSGD", "`qsgd(axis, bits=4)`, ResNet-8 on digits", "digits_comparison",
     "qsgd4", None, None),
    ("element-wise: 1-bit SGD", "`onebit_sgd(axis)`, ResNet-8 on digits", "digits_comparison",
     "onebit", None, None),
    ("sparse: top-k 1%", "`compressed_allreduce(TopK(0.01), axis, error_feedback=True,"
     " warmup_steps=22)`, digits", "digits_sparse_warmup22", "topk_ef", None, None),
    ("sparse: DeMo", "`demo(lr, axis, k=24, decay=0.99, value_dtype=jnp.bfloat16)`, GPT",
     "lm_sparse_long", "demo+learning_rate=0.003+demo_decay=0.99+demo_k=24"
     "+demo_value_dtype=bfloat16+num_train_steps=4800+warmup_steps=480", "network_2proc_lm_sparse",
     "demo"),
    ("compressed Adam", "`onebit_adam(lr, axis)`, byte-level GPT", "lm_comparison",
     "onebit_adam", None, None),
    ("low rank", "`powersgd(axis, rank=16)` before AdamW, GPT", "lm_comparison",
     "powersgd+powersgd_rank=16+powersgd_matrix_view=last_axis", None, None),
    ("model sharded too", "`data_parallel(..., axis_name=\"data\")` on data x fsdp x tensor,"
     " `qsgd(\"data\", bits=4, error_feedback=True)`, GPT", "lm_hybrid", "qsgd4_ef",
     "network_2proc_lm_hybrid", "qsgd4_ef"),
    ("local updates: DiLoCo", "`diloco(adamw, axis, sync_every=20)`, 4-bit outer average, GPT",
     "lm_diloco", "diloco+fp32+num_train_steps=4800+warmup_steps=480", "network_2proc_lm_diloco",
     "diloco"),
    ("local updates: SparseLoCo", "`diloco(..., average=sparseloco_average(axis))`, GPT",
     "lm_diloco", "diloco+fp32+outer_average=sparseloco+num_train_steps=4800+warmup_steps=480",
     "network_2proc_lm_sparse", "sparseloco"),
)
FRONT_BEGIN = ("<!-- The front page's table: made by python benchmarks/figures.py from"
               " benchmarks/results. -->")
FRONT_END = "<!-- End of the front page's table. -->"
FRONT_RATE = "100 Mbit/s"


def _front_cells(results: pathlib.Path, name: str, mode: str) -> tuple[str, str] | None:
  """``(bytes, quality)`` cells of ``mode``'s run in ``name``.json against its fp32 and bf16
  runs, or ``None`` where the file or the run is missing."""
  report = _load(results / f"{name}.json")
  if report is None:
    return None
  if "modes" in report:  # examples/imagenet/compare.py: accuracy over seeds.
    if mode not in report["modes"]:
      return None
    # A baseline the file lacks is the digits comparison's (the same config); for the sparse
    # comparisons (a warm-up's file has none), the float32 run trained alongside them first.
    references = ["digits_comparison"] + (["digits_sparse"] if name.startswith("digits_sparse")
                                          else [])
    runs = {}
    for reference in references:
      runs |= (_load(results / f"{reference}.json") or {"modes": {}})["modes"]
    runs |= report["modes"]
    sent = {m: r["runs"][0]["wire_bytes_per_step"] for m, r in runs.items()}
    accuracy = {m: r["eval_accuracy"]["mean"] for m, r in runs.items()}
    difference = " / ".join(f"{100 * (accuracy[mode] - accuracy[b]):+.1f}"
                            if b in accuracy else "-" for b in BASELINES)
    return (f"{_ratio(sent, 'fp32', sent[mode])} / {_ratio(sent, 'bf16', sent[mode])}",
            f"{accuracy[mode]:.1%} accuracy ({difference} points)")
  own = report["runs"]
  run = next((r for r in own if r["mode"] == mode), None)
  if run is None:
    return None
  # A baseline the file lacks is the LM comparison's (the same example and config).
  reference = (_load(results / "lm_comparison.json") or {"runs": []})["runs"]

  def baseline(kind: str, same_steps: bool) -> dict | None:
    """The ``kind`` (fp32 or bf16) run of the file, else of the LM comparison; with
    ``same_steps``, only one trained as long as ``run``."""
    return next((r for r in [*own, *reference]
                 if (r["mode"] == kind or r["mode"].startswith(f"{kind}+num_train_steps="))
                 and (not same_steps or r["steps"] == run["steps"])), None)

  if "bytes_per_step" in run:  # The DiLoCo sweep: across workers, against DP trained as long.
    ratios = [run[f"{b}_bytes_over_bytes"] for b in BASELINES]
    gaps = [run.get(f"eval_loss_minus_{b}") for b in BASELINES]
  else:
    def sent(r: dict) -> float:  # On a hybrid mesh, across the data axis.
      if "hlo_across_data_bytes_least" in run:
        return r["hlo_across_data_bytes_least"]
      return r["wire_bytes_per_step"] or r["hlo_wire_bytes_per_step"]

    ratios = [sent(baseline(b, same_steps=False)) / sent(run) for b in BASELINES]
    gaps = [None if (base := baseline(b, same_steps=True)) is None
            else run["eval_loss"] - base["eval_loss"] for b in BASELINES]
  difference = " / ".join("-" if gap is None else f"{gap:+.3f}" for gap in gaps)
  return (" / ".join(_times(r) for r in ratios),
          f"{run['eval_loss']:.3f} nats a byte ({difference}), {run['steps']} steps")


def _front_seconds(results: pathlib.Path, name: str | None, mode: str | None) -> str:
  report = None if name is None else _load(results / f"{name}.json")
  if report is None:
    return "-"
  lm = report.get("lm") or report.get("lm_hybrid")
  entry = lm["modes"].get(mode, {}).get("rates", {}).get(FRONT_RATE, {})
  if entry.get("speedup_vs_fp32") is None:
    return "-"
  return f"{entry['speedup_vs_fp32']:.1f}x / {entry['speedup_vs_bf16']:.1f}x"


def front_page_table(results: pathlib.Path = RESULTS) -> str:
  """The README's table: one measured row a family, each with the figures that say what it
  buys and what it costs against float32 and bf16 on the same workload."""
  lines = ["| family | what ran | fewer bytes than fp32 / bf16 | quality (vs fp32 / bf16) "
           f"| sooner to fp32's loss at {FRONT_RATE} (vs fp32 / bf16) |", "|---" * 5 + "|"]
  for family, ran, name, mode, network, network_mode in FRONT_ROWS:
    cells = _front_cells(results, name, mode)
    if cells is not None:
      lines.append(f"| {family} | {ran} | {cells[0]} | {cells[1]} "
                   f"| {_front_seconds(results, network, network_mode)} |")
  note = (
      "Bytes: what a device sends a step (DiLoCo's and SparseLoCo's across workers, averaged"
      " over the run; on the sharded model's mesh, across the data axis), against float32 and"
      " bf16 data parallel on the same workload. Digits: 8 simulated devices, three seeds'"
      " mean; GPT: `examples/lm/configs/small.py`, 8 simulated devices, one seed. Seconds: the"
      " same method on `examples/lm/configs/network.py`, 2 real processes joined by a"
      " rate-limited link (`benchmarks/network.py`), one run each on a shared 2-core CPU"
      " machine, none on GPUs: a wider model, one sequence a process a step, 200 to 400 steps."
      " The runs of 4,800 steps are against float32 data parallel trained as long (bf16's was"
      " trained 300: \"-\"). [Results](docs/results.md) has every run, its caveats and its"
      " command.")
  return "\n".join(lines) + "\n\n" + note + "\n"


def readme_with(table: str, readme: str, begin: str, end: str) -> str:
  start, stop = readme.index(begin) + len(begin), readme.index(end)
  return readme[:start] + "\n" + table + readme[stop:]


def readme_with_tables(readme: str, results: pathlib.Path) -> str:
  """``readme`` with its table as the results files give it."""
  return readme_with(front_page_table(results), readme, FRONT_BEGIN, FRONT_END)


# Figures ---------------------------------------------------------------------


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  return plt


def plot_time_to_accuracy(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path | None:
  """Eval accuracy (and loss, where recorded) against training seconds, a panel a link rate."""
  trainings = []
  for path in sorted(results.rglob("network_*.json")):
    report = json.loads(path.read_text())
    if "training" in report:
      trainings.append((report["processes"], report["training"]))
  if not trainings:
    return None
  plt = _pyplot()
  has_loss = any("eval_loss" in point for _, training in trainings
                 for mode in training["modes"].values() for point in mode["curve"])
  figure, axes = plt.subplots(2 if has_loss else 1, len(trainings), squeeze=False,
                              figsize=(5.5 * len(trainings), 4.2 * (2 if has_loss else 1)))
  for column, (processes, training) in enumerate(trainings):
    for mode, result in training["modes"].items():
      curve = result["curve"]
      seconds = [point["train_seconds"] for point in curve]
      axes[0][column].plot(seconds, [point["eval_accuracy"] for point in curve], marker="o",
                           label=mode)
      if has_loss:
        axes[1][column].plot(seconds, [point.get("eval_loss", math.nan) for point in curve],
                             marker="o", label=mode)
    axes[0][column].axhline(training["target_accuracy"], color="gray", linestyle=":")
    axes[0][column].set(title=f"{pathlib.Path(training['config']).stem}, {processes} processes,"
                              f" {training['rate']} a node",
                        xlabel="training seconds", ylabel="held-out accuracy")
    if has_loss:
      axes[1][column].set(xlabel="training seconds", ylabel="held-out loss", yscale="log")
  for axis in axes.flat:
    axis.grid(alpha=0.3)
    axis.legend()
  figure.tight_layout()
  return _save(figure, out / "network_time_to_accuracy.png")


def plot_seconds_against_rate(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path | None:
  """Seconds to average ResNet-50's gradient against the link rate, a line a mode."""
  network = _load(results / "network_4proc.json")
  if network is None:
    return None
  plt = _pyplot()
  tree = network["collectives"]["trees"][TREE]
  rates = list(tree["rates"])
  figure, axis = plt.subplots(figsize=(7, 4.5))
  modes = [mode for mode in tree["rates"][rates[0]]["modes"] if row_name(mode) is not None]
  for mode in modes:
    seconds = [tree["rates"][rate]["modes"].get(mode, {}).get("seconds", math.nan)
               for rate in rates]
    axis.plot(range(len(rates)), seconds, marker="o", label=row_name(mode))
  axis.set(xticks=range(len(rates)), xticklabels=rates, yscale="log",
           xlabel="link rate a node", ylabel="seconds to average the gradient",
           title=f"ResNet-50's gradient, {network['processes']} processes over TCP")
  axis.grid(alpha=0.3, which="both")
  axis.legend(fontsize="small", ncol=2)
  figure.tight_layout()
  return _save(figure, out / "network_seconds_against_rate.png")


def plot_accuracy_against_bits(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path | None:
  """The digits example's accuracy over seeds against the bits a coordinate it sent."""
  digits = _load(results / "digits_comparison.json")
  if digits is None:
    return None
  plt = _pyplot()
  figure, axis = plt.subplots(figsize=(7, 4.5))
  for mode, result in digits["modes"].items():
    spread = result["eval_accuracy"]
    bits = 32 / result["runs"][0]["compression_ratio"]
    axis.errorbar([bits], [100 * spread["mean"]], fmt="o", capsize=4,
                  yerr=[[100 * (spread["mean"] - spread["min"])],
                        [100 * (spread["max"] - spread["mean"])]])
    axis.annotate(mode, (bits, 100 * spread["mean"]), textcoords="offset points", xytext=(6, 4))
  seeds = min(result["eval_accuracy"]["runs"] for result in digits["modes"].values())
  axis.set(xscale="log", xlabel="bits a coordinate sent (32 / compression ratio)",
           ylabel="held-out accuracy, %",
           title=f"ResNet-8 on digits, {digits['devices']} devices: mean and range of {seeds}"
                 " seeds")
  axis.grid(alpha=0.3, which="both")
  figure.tight_layout()
  return _save(figure, out / "accuracy_against_bits.png")


def plot_compressed_adam_bytes(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path | None:
  """Bytes a step and training loss against steps, the freeze marked."""
  report = _load(results / "compressed_adam_bytes.json")
  if report is None:
    return None
  plt = _pyplot()
  figure, (bytes_axis, loss_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
  for index, (mode, result) in enumerate(report["modes"].items()):
    steps = [record["step"] for record in result["steps"]]
    # Points, not lines (0/1 Adam alternates), each mode's smaller than the last's: where
    # two modes send the same, both show.
    bytes_axis.plot(steps, [record["wire_bytes"] for record in result["steps"]], label=mode,
                    marker="o", markersize=max(2, 8 - 2 * index), linestyle="none")
    loss_axis.plot(steps, [record["loss"] for record in result["steps"]], label=mode)
  for axis in (bytes_axis, loss_axis):
    axis.axvline(report["freeze_step"], color="gray", linestyle=":", label="freeze step")
    axis.grid(alpha=0.3, which="both")
    axis.legend(loc="center right" if axis is bytes_axis else "upper right")
  bytes_axis.set(xlabel="step", ylabel="bytes a device sends", yscale="log",
                 title=f"MLP {'-'.join(map(str, report['widths']))} on digits,"
                       f" {report['devices']} devices")
  loss_axis.set(xlabel="step", ylabel="training loss", yscale="log")
  figure.tight_layout()
  return _save(figure, out / "compressed_adam_bytes.png")


def _save(figure, path: pathlib.Path) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=110)
  return path


PLOTS = (plot_time_to_accuracy, plot_seconds_against_rate, plot_accuracy_against_bits,
         plot_compressed_adam_bytes)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
  parser.add_argument("--readme", type=pathlib.Path, default=README)
  parser.add_argument("--lm_readme", type=pathlib.Path, default=LM_README,
                      help="examples/lm/README.md: its DiLoCo table")
  parser.add_argument("--check", action="store_true",
                      help="only compare README.md's table with the results files")
  args = parser.parse_args(argv)
  readme = args.readme.read_text()
  if args.check:
    lm_readme = args.lm_readme.read_text()
    for path, stale in ((args.readme, readme_with_tables(readme, args.results) != readme),
                        (args.lm_readme, readme_with(diloco_table(args.results), lm_readme,
                                                     DILOCO_BEGIN, DILOCO_END) != lm_readme)):
      if stale:
        print(f"{path}'s tables are not what {args.results} says: run"
              " python benchmarks/figures.py", file=sys.stderr)
        return 1
    return 0
  table, lm = headline_table(args.results), lm_table(args.results)
  (args.results / "headline.md").write_text(table)
  (args.results / "headline_lm.md").write_text(lm)
  (args.results / "network_lm_table.md").write_text(network_lm_table(args.results))
  (args.results / "headline_diloco.md").write_text(diloco_table(args.results))
  (args.results / "headline_sparse.md").write_text(sparse_table(args.results))
  args.readme.write_text(readme_with_tables(readme, args.results))
  args.lm_readme.write_text(readme_with(diloco_table(args.results), args.lm_readme.read_text(),
                                        DILOCO_BEGIN, DILOCO_END))
  print(table + "\n" + lm)
  for plot in PLOTS:
    path = plot(args.results, args.results / "figures")
    if path is not None:
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
