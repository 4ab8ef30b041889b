"""``collectives-trace PATH_OR_PREFIX``: where the ranks of a job parted, from their
flight-recorder dumps (see :mod:`collectives.diagnostics.flight_recorder`).

It reads every rank's dump (the files whose names start with PREFIX; or every dump in a
directory; or a dump's file and those of its job beside it) and prints the verdict first:
for each group, the first collective that not every rank completed, the ranks that never
joined it (``missing ranks: {1}``), the ranks that called something else there and what,
the ranks that failed and their error, the ranks with no dump; then each rank's recent
history. ``--json`` prints the same as one JSON object.

Example::

    collectives-trace /tmp/collectives-fr-20261125-170102-host-4242-rank
    python -m collectives.diagnostics.trace /tmp/dumps/ --json
"""
import argparse
import glob
import json
import os
import re
import sys
import time

FORMAT = "collectives-flight-recorder"  # flight_recorder.FORMAT (this module imports nothing heavy)
HISTORY = 8


def _set(ranks):
    return "{" + ", ".join(str(r) for r in sorted(ranks)) + "}"


def find_dumps(where):
    """The dump files a PATH_OR_PREFIX names (see the module's docstring)."""
    if os.path.isdir(where):
        cands = [os.path.join(where, n) for n in os.listdir(where)]
    elif os.path.isfile(where):
        prefix = re.sub(r"\d+(\.json)?$", "", where)
        cands = glob.glob(glob.escape(prefix) + "*") if prefix != where else [where]
    else:
        cands = glob.glob(glob.escape(where) + "*")
    return sorted(c for c in cands if os.path.isfile(c) and not c.endswith(".tmp"))


def load(where):
    """(dumps by global rank, notes) for PATH_OR_PREFIX: one job's dumps (the newest job's
    where the files hold several)."""
    dumps, notes = [], []
    for path in find_dumps(where):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(d, dict) and d.get("format") == FORMAT:
            d["_path"] = path
            dumps.append(d)
    if not dumps:
        return {}, notes
    newest = max(dumps, key=lambda d: d.get("time", 0))
    job = newest.get("job")
    others = [d for d in dumps if d.get("job") != job]
    if others:
        notes.append(f"ignored {len(others)} dump(s) of other jobs "
                     f"({', '.join(sorted({str(d.get('job')) for d in others}))})")
    by_rank = {}
    for d in dumps:
        if d.get("job") == job:
            r = d.get("rank")
            if r not in by_rank or d.get("time", 0) > by_rank[r].get("time", 0):
                by_rank[r] = d
    return by_rank, notes


def _by_seq(g):
    """One rank's group record's entries by sequence number (made once, kept in it)."""
    idx = g.get("_by_seq")
    if idx is None:
        idx = g["_by_seq"] = {e["seq"]: e for e in g.get("entries", ())}
    return idx


def _state_at(g, s):
    """(state, call, error) of collective ``s`` in one rank's group record."""
    e = _by_seq(g).get(s)
    if e is not None:
        return e["state"], e["call"], e.get("error")
    if s > g["issued"]:
        return "not issued", None, None
    err = g.get("failed", {}).get(str(s))
    if err is not None:
        return "failed", None, err
    return ("completed" if s <= g["completed"] else "in progress"), None, None


def _call_at(g, s):
    e = _by_seq(g).get(s)
    return None if e is None else e["call"]


def group_verdict(name, members, recs):
    """The verdict for one group: ``recs`` maps the global ranks that dumped it to their
    record of it."""
    no_dump = sorted(r for r in members if r not in recs)
    v = {"group": name, "ranks": members, "no_dump": no_dump, "seq": None}
    if not recs:
        return v
    lo = min(g["completed"] for g in recs.values())
    hi = max(g["issued"] for g in recs.values())
    first = min((e["seq"] for g in recs.values() for e in g.get("entries", ())), default=lo + 1)
    part = None
    for s in range(max(first, 1), hi + 1):
        states = {r: _state_at(g, s) for r, g in recs.items()}
        calls = {c for _, c, _ in states.values() if c is not None}
        if any(st != "completed" for st, _, _ in states.values()) or len(calls) > 1:
            part = s
            break
    v["completed"] = lo
    v["issued"] = hi
    if part is None:
        return v
    v["seq"] = part
    missing, failed, calls, inside = [], {}, {}, []
    last = {}
    for r, g in sorted(recs.items()):
        st, call, err = _state_at(g, part)
        if st == "not issued":
            missing.append(r)
            done = g["completed"]
            last[r] = {"completed": done, "call": _call_at(g, done), "issued": g["issued"],
                       "issued_call": _call_at(g, g["issued"])}
            continue
        if call is not None:
            calls.setdefault(call, []).append(r)
        if st == "failed":
            failed[r] = err
        elif st in ("issued", "started", "in progress"):
            inside.append(r)
    v.update(missing=missing, last=last, calls=calls, failed=failed, in_progress=inside)
    return v


def analyse(dumps):
    """The verdicts of every group found in ``dumps`` (by global rank)."""
    world = max([d.get("world_size") or 0 for d in dumps.values()] + [max(dumps) + 1])
    groups = {}
    for r, d in dumps.items():
        for name, g in d.get("groups", {}).items():
            if g.get("destroyed"):
                continue
            groups.setdefault(name, (g["ranks"], {}))[1][r] = g
    verdicts = [group_verdict(name, members, recs)
                for name, (members, recs) in sorted(groups.items(), key=lambda kv: kv[0] != "default_pg")]
    return {"world_size": world, "dumps": sorted(dumps), "no_dump": [r for r in range(world)
                                                                   if r not in dumps],
            "groups": verdicts}


def _when(t):
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def history(dumps, n=HISTORY):
    """{rank: {group: [the last ``n`` entries, collectives and point-to-point in time order]}}."""
    out = {}
    for r, d in sorted(dumps.items()):
        per = {}
        for name, g in d.get("groups", {}).items():
            items = [dict(e, what=f"#{e['seq']} {e['call']}") for e in g.get("entries", ())]
            items += [dict(e, what=f"{e['kind']}(peer={e['peer']}, tag={e['tag']}, {e['dtype']}, "
                                   f"{e['count']})") for e in g.get("p2p", ())]
            items.sort(key=lambda e: e["time_issued"])
            per[name] = items[-n:]
        out[r] = per
    return out


def report(dumps, notes, n=HISTORY):
    """The text collectives-trace prints."""
    a = analyse(dumps)
    lines = []
    job = next(iter(dumps.values())).get("job")
    lines.append(f"collectives-trace: {len(dumps)} dump(s) of job {job} (world size {a['world_size']})")
    lines += [f"note: {x}" for x in notes]
    for r in a["no_dump"]:
        lines.append(f"no dump from rank {r} (died or never dumped)")
    for v in a["groups"]:
        lines.append("")
        head = f"group {v['group']} (ranks {v['ranks']})"
        if v["seq"] is None:
            if "completed" in v:
                lines.append(f"{head}: every rank that dumped completed #{v['completed']}; "
                             f"the ranks did not part")
            else:
                lines.append(f"{head}: no dump holds it")
            for r in v["no_dump"]:
                if r not in a["no_dump"]:
                    lines.append(f"  rank {r} dumped no record of this group")
            continue
        s = v["seq"]
        lines.append(f"{head}: the ranks part at collective #{s}")
        if v["missing"]:
            lines.append(f"  missing ranks: {_set(v['missing'])} (never joined #{s})")
            for r in v["missing"]:
                x = v["last"][r]
                where = (f"last completed #{x['completed']} {x['call'] or ''}".rstrip()
                         if x["completed"] else "completed no collective")
                if x["issued"] > x["completed"]:
                    where += f", still in #{x['issued']} {x['issued_call'] or ''}".rstrip()
                lines.append(f"    rank {r} {where}")
        if len(v["calls"]) > 1:
            lines.append(f"  different calls at #{s}:")
        for call, ranks in sorted(v["calls"].items(), key=lambda kv: -len(kv[1])):
            lines.append(f"    ranks {_set(ranks)} called {call}")
        if v["in_progress"]:
            lines.append(f"  in #{s} when they dumped: ranks {_set(v['in_progress'])}")
        for r, err in sorted(v["failed"].items()):
            lines.append(f"  rank {r} failed: {err}")
        for r in v["no_dump"]:
            lines.append(f"  no dump from rank {r} (died or never dumped)" if r in a["no_dump"]
                         else f"  rank {r} dumped no record of this group")
    lines.append("")
    lines.append(f"recent history (last {n} calls per rank and group):")
    for r, per in history(dumps, n).items():
        d = dumps[r]
        lines.append(f"rank {r} (pid {d.get('pid')}, {d.get('host')}), dumped {_when(d['time'])}: "
                     f"{d.get('reason')}")
        for name, items in per.items():
            g = d["groups"][name]
            lines.append(f"  group {name}: issued #{g['issued']}, completed #{g['completed']}")
            for e in items:
                lines.append(f"    {_when(e['time_issued'])}  {e['what']}  {e['state']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="collectives-trace",
        description="Say where the ranks of a job parted, from their flight-recorder dumps.")
    p.add_argument("where", metavar="PATH_OR_PREFIX",
                   help="the dumps' path prefix (every file starting with it), a directory of "
                        "dumps, or one dump file (its job's files beside it are read too)")
    p.add_argument("--json", action="store_true", help="print the verdict and history as JSON")
    p.add_argument("--last", type=int, default=HISTORY, metavar="N",
                   help=f"calls of history per rank and group (default {HISTORY})")
    args = p.parse_args(argv)
    dumps, notes = load(args.where)
    if not dumps:
        print(f"collectives-trace: no flight-recorder dumps found at {args.where!r}", file=sys.stderr)
        return 2
    if args.json:
        out = analyse(dumps)
        out["job"] = next(iter(dumps.values())).get("job")
        out["notes"] = notes
        out["files"] = {r: d["_path"] for r, d in dumps.items()}
        out["history"] = history(dumps, args.last)
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print(report(dumps, notes, args.last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
