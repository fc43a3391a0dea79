"""`dta import`: agent conversations -> training records (JSONL), one per generated agent
message, as AReaL's τ² example exports them (``export_style: individual``).

    dta import --from tau2 results.json --tokenizer DIR --out calls.jsonl
    dta import --from openai conversations.jsonl --tokenizer DIR --out calls.jsonl

Rendering and tokenization by a local Hugging Face tokenizer directory and its chat template
(nothing is downloaded); see :mod:`dta.importing`. Prints the records' sizes and where their
prefix sharing comes from (:mod:`dta.planning.sharing`); ``--json`` prints one JSON object as
the last line: ``records``, ``conversations``, ``out``, ``call_tokens`` / ``trained_tokens``
(min/median/max per record), ``sharing``, ``skipped`` (conversations left out by
``--skip-invalid``: ``total``, ``by_reason``, ``conversations``) and ``without_calls``
(conversations with no generated message, hence no record).

A conversation that cannot be rendered as a chain of prefixes fails the import naming the
file, conversation, message and why; ``--skip-invalid`` leaves it out and counts it.
"""
from __future__ import annotations

import argparse
import os
import sys

from dta_cli.common import emit_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the conversations (see --from)")
    parser.add_argument("--from", dest="source", required=True, choices=("tau2", "openai"),
                        help="tau2: a τ²-bench results JSON; openai: JSONL, one conversation "
                             "per line (messages, optional tools, reward, group_id, id)")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="a local Hugging Face tokenizer directory with a chat template")
    parser.add_argument("--out", required=True, metavar="FILE.jsonl",
                        help="the records to write (refused if it exists, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--thinking", default="keep", choices=("keep", "drop"),
                        help="reasoning carried by the source: keep it in the trained message "
                             "(the template must render it) or drop it (default: keep)")
    parser.add_argument("--skip-invalid", action="store_true",
                        help="leave out a conversation that cannot be rendered as a chain of "
                             "prefixes (counted by reason in the summary) instead of failing")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the summary as the last line")


def _spread(values) -> dict:
    import numpy as np

    v = np.asarray(values, dtype=float)
    return dict(min=int(v.min()), median=float(np.median(v)), max=int(v.max()))


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dta.importing import REASONS, ImportError_, import_file, load_tokenizer
    from dta.paths import check_path
    from dta.planning.sharing import format_breakdown, sharing_breakdown
    from dta.records.jsonl import write_jsonl

    try:  # the user's paths, before the tokenizer is loaded (it checks --tokenizer first)
        check_path(args.file, "file", f"--from {args.source} FILE", error=ImportError_)
        check_path(args.out, "file", "--out", create=True, write=True, error=ImportError_)
        if os.path.exists(args.out) and not args.overwrite:
            raise ImportError_(f"--out {args.out} exists; give --overwrite to replace it")
        tok = load_tokenizer(args.tokenizer)
        show = not args.json and sys.stderr.isatty()
        got = import_file(
            args.source, args.file, tok, thinking=args.thinking, skip_invalid=args.skip_invalid,
            progress=lambda xs: tqdm(xs, desc="import", unit="conv", disable=not show,
                                     file=sys.stderr))
    except ImportError_ as e:
        print(f"dta import: {e}", file=sys.stderr)
        return 2
    records, convs = got.records, got.conversations
    tmp = f"{args.out}.tmp-{os.getpid()}"
    write_jsonl(tmp, records)
    os.replace(tmp, args.out)  # atomic: a failed import leaves no half-written --out
    lengths = [len(r["input_ids"]) for r in records]
    trained = [sum(r["loss_mask"]) for r in records]
    breakdown = sharing_breakdown(records)
    used = len(convs) - len(got.skipped)
    print(f"{args.file}: {used} conversations -> {len(records)} records "
          f"(one per generated agent message) in {args.out}")
    by_reason = got.skipped_by_reason()
    if got.skipped:
        print(f"  skipped (--skip-invalid): {len(got.skipped)} of {len(convs)} conversations: "
              + "; ".join(f"{n} {r} ({REASONS[r]})" for r, n in by_reason.items()))
        for e in got.skipped:
            print(f"    {e}")
    if got.without_calls:
        n = len(got.without_calls)
        print(f"  {n} conversation{'s have' if n > 1 else ' has'} no generated agent message "
              f"(no record): {', '.join(got.without_calls[:5])}"
              + (" ..." if len(got.without_calls) > 5 else ""))
    s, t = _spread(lengths), _spread(trained)
    print(f"  tokens per record: min {s['min']:,}  median {s['median']:,.0f}  max {s['max']:,}; "
          f"trained per record: min {t['min']:,}  median {t['median']:,.0f}  max {t['max']:,}")
    print("\n".join(format_breakdown(breakdown)))
    if args.json:
        emit_json(dict(source=args.source, file=args.file, out=args.out,
                       conversations=len(convs), imported_conversations=used,
                       records=len(records), thinking=args.thinking,
                       skipped=dict(total=len(got.skipped), by_reason=by_reason,
                                    conversations=[dict(where=e.where, reason=e.reason)
                                                   for e in got.skipped]),
                       without_calls=got.without_calls,
                       vocab_size=len(tok), max_id=max(max(r["input_ids"]) for r in records),
                       call_tokens=s, trained_tokens=t, sharing=breakdown))
    return 0
