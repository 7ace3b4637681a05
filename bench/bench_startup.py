"""Start-up of the entry points, and preprocessing end to end against Megatron-LM's way.

Every measurement is a fresh Python process, timed from launch to exit, as a user meets it:

* ``--help`` of every tool under ``tools/`` and of ``pretrain_gpt.py``, and an argument error
  (an unknown flag: one line, exit 2) of each; either is over budget past
  :data:`START_UP_BUDGET_S` of CPU time, and the run then exits 1 naming them (so is
  the start-up of preprocess_data.py with its cache filled);
* ``tools/preprocess_data.py`` on a one-document corpus (start-up: imports, tokenizer, output),
  with the tokenizer's vocabulary cache filled (every start but the first on a machine) and
  empty (each run with a fresh cache directory: the first start, which fills it);
* ``tools/preprocess_data.py`` on the embedded corpus repeated ``--copies`` times, against the
  loop of Megatron-LM's ``tools/preprocess_data.py`` (``json.loads``, encode, megatron-core's
  ``IndexedDatasetBuilder``, as ``bench_preprocess.py``'s baseline, which imports
  megatron-core as Megatron-LM's tool does), same corpus, same tekken tokenizer, one process each.

Each row gives the median over ``--repeat`` runs of the wall time and of the CPU time (user +
system) of the process and its children: on a shared machine the wall time grows with the load,
the CPU time much less. The load average at the start is recorded with the results.

    python bench/bench_startup.py [--copies 4] [--repeat 3] [--preprocess-only]

``--preprocess-only`` leaves out the ``--help`` rows and writes ``startup_preprocess_*.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = sorted(REPO.glob("tools/*.py")) + sorted(REPO.glob("tools/checkpoint/*.py"))
START_UP_BUDGET_S = 1.0
"""CPU seconds that ``--help`` or an argument error of an entry point may take: what is left
when neither torch nor megatron-core is imported (both together cost about 7 s)."""


def timed(command: list[str], expect: int = 0, cold: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process tree) of one run, which must exit ``expect``;
    ``cold``: with an empty cache directory (a fresh ``HOME``)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if cold:
        with tempfile.TemporaryDirectory() as home:
            return timed_in(command, expect, dict(env, HOME=home))
    return timed_in(command, expect, env)


def timed_in(command: list[str], expect: int, env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != expect:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def median_of(command: list[str], repeat: int, expect: int = 0, cold: bool = False) -> dict:
    runs = [timed(command, expect, cold) for _ in range(repeat)]
    return {
        "wall_s": round(statistics.median(w for w, _ in runs), 3),
        "cpu_s": round(statistics.median(c for _, c in runs), 3),
    }


def write_corpus(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


def megatron_style(source: str, prefix: str) -> None:
    """Child mode: Megatron-LM's preprocessing loop (``bench_preprocess.baseline``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_preprocess import baseline

    baseline(Path(source), prefix)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--preprocess-only", action="store_true")
    parser.add_argument(
        "--megatron-style", nargs=2, metavar=("SOURCE", "PREFIX"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.megatron_style:
        return megatron_style(*args.megatron_style)

    from _common import write_results

    from megatron.apertus.prep.corpus import embedded_documents

    load = os.getloadavg()[0]
    python = sys.executable
    rows = []
    for script in [] if args.preprocess_only else [*TOOLS, REPO / "pretrain_gpt.py"]:
        name = str(script.relative_to(REPO))
        for flag, expect in (("--help", 0), ("--no-such-flag", 2)):
            command = [python, str(script), flag]
            rows.append({"name": f"{name} {flag}", **median_of(command, args.repeat, expect)})
            print(
                f"{rows[-1]['name']:56s} {rows[-1]['wall_s']:7.2f} s wall "
                f"{rows[-1]['cpu_s']:7.2f} s CPU"
            )
    over_budget = [row["name"] for row in rows if row["cpu_s"] > START_UP_BUDGET_S]
    with tempfile.TemporaryDirectory() as tmp:
        docs = embedded_documents()
        one = write_corpus(Path(tmp) / "one.jsonl", docs[:1])
        corpus = write_corpus(Path(tmp) / "corpus.jsonl", docs * args.copies)
        tool = [python, str(REPO / "tools" / "preprocess_data.py")]
        start_up = tool + ["--input", str(one), "--output-prefix", f"{tmp}/one"]
        name = "preprocess_data.py start-up (1 document), empty tokenizer cache"
        rows.append({"name": name, **median_of(start_up, args.repeat, cold=True)})
        print(f"{name:48s} {rows[-1]['wall_s']:7.2f} s wall {rows[-1]['cpu_s']:7.2f} s CPU")
        timed(start_up)  # fills the cache, as any first start does
        cases = [
            ("preprocess_data.py start-up (1 document)", start_up),
            (
                f"preprocess_data.py, embedded corpus x{args.copies}",
                tool + ["--input", str(corpus), "--output-prefix", f"{tmp}/ours"],
            ),
            (
                f"Megatron-LM's loop (megatron-core builder), embedded corpus x{args.copies}",
                [python, __file__, "--megatron-style", str(corpus), f"{tmp}/theirs"],
            ),
        ]
        for name, command in cases:
            rows.append({"name": name, **median_of(command, args.repeat)})
            print(f"{name:48s} {rows[-1]['wall_s']:7.2f} s wall {rows[-1]['cpu_s']:7.2f} s CPU")
        if rows[-3]["cpu_s"] > START_UP_BUDGET_S:
            over_budget.append(rows[-3]["name"])
        ours = Path(f"{tmp}/ours_text_document.bin").read_bytes()
        assert ours == Path(f"{tmp}/theirs.bin").read_bytes(), "the two wrote different tokens"
    speedup = {key: round(rows[-1][key] / rows[-2][key], 2) for key in ("wall_s", "cpu_s")}
    print(f"end to end: ours {speedup['wall_s']}x faster (wall), {speedup['cpu_s']}x (CPU)")
    path = write_results(
        "startup_preprocess" if args.preprocess_only else "startup",
        rows,
        {
            "load_average_1min": round(load, 2),
            "documents": len(docs) * args.copies,
            "speedup_over_megatron_style": speedup,
            "start_up_budget_cpu_s": START_UP_BUDGET_S,
            "over_budget": over_budget,
            "repeat": args.repeat,
        },
    )
    print(f"wrote {path}")
    if over_budget:
        sys.exit(f"over the start-up budget of {START_UP_BUDGET_S} s CPU: {', '.join(over_budget)}")


if __name__ == "__main__":
    main()
