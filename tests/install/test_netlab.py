"""The emulated cluster of bench/netlab.py, and bench/model.py's agreement with the engine.

The lab test builds two rate-limited "hosts" (network namespaces on a bridge), runs a
collectives-run job across them that checks every collective against NumPy, and checks
that nothing of the lab is left afterwards. It needs root, ``ip``, ``tc`` and
``unshare`` and is skipped with the reason otherwise. Timings are not asserted here
(they are bench/netlab.py's to report).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.ranks import ROOT
from tests.support.requires import needs_gloo, skip_unless_required

sys.path.insert(0, os.path.join(ROOT, "bench"))
import model  # noqa: E402
import netlab  # noqa: E402

OPS = "all_reduce,broadcast,all_gather,reduce_scatter,all_to_all"


@needs_gloo
def test_the_model_chooses_as_the_engine_does():
    """bench/model.py's thresholds are the TCP engine's defaults, so its choice of
    algorithm is the code's."""
    from collectives.backends.tcp import TcpBackend
    from collectives.store import HashStore
    tuning = TcpBackend(HashStore(), 0, 1, 10).tuning()
    assert tuning["allreduce_rd_max"] == model.RD_MAX
    assert tuning["tree_max"] == model.TREE_MAX
    assert tuning["segment"] == model.SEGMENT
    assert tuning["direct_max"] == model.DIRECT_MAX
    assert tuning["allreduce_direct_world"] == model.DIRECT_WORLD  # on one host
    assert tuning["seg_split"] == 1  # on one host blocks go whole (docs/between-hosts.md)
    from collectives.backends.tcp import placement_defaults
    across = placement_defaults(True, 4)
    assert across["allreduce_rd_max"] == model.RD_MAX_HOSTS
    assert across["allreduce_hd_max"] == model.HD_MAX_HOSTS
    assert tuning["allreduce_hd_max"] == 0  # on one host: never
    assert model.choose("all_reduce", 8, 48 << 10) == "rabenseifner"
    assert across["allreduce_direct_world"] == model.DIRECT_WORLD_HOSTS
    assert placement_defaults(True, 2).get("allreduce_rd_max", model.RD_MAX) == model.RD_MAX
    assert model.choose("all_reduce", 4, 128 << 10) == "ring_ar"
    assert model.choose("all_reduce", 2, 64 << 10) == "rd"
    # reduce_scatter's ring reduces what comes in: gamma counts there, not in all_gather's
    assert model.choose("reduce_scatter", 4, 1 << 20) == "ring_rs"
    assert model.choose("reduce_scatter", 4, 1 << 10) == "direct_rs"
    p = model.Params(gamma=5e-9)
    assert model.predict("reduce_scatter", 4, 1 << 20, p, 1e9, share=0.1) > \
        model.predict("all_gather", 4, 1 << 20, p, 1e9, share=0.1)
    # across hosts the engine takes the ring (the lab job's verify checks that it does)
    assert model.choose("all_reduce", 4, 16 << 20) == "ring_ar"


def test_the_model_reaches_the_link_bound_for_large_messages():
    """With no latency the bandwidth terms are the link bound: the bound is what the
    model's large-message algorithms move over the busiest link."""
    p = model.Params(alpha=0.0, msg=0.0, call=0.0, eta=1.0)
    s = 1 << 30
    for n in (2, 4, 8, 64):
        for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"):
            t = model.predict(op, n, s, p, 1e9)
            b = model.bound(op, n, s, 1e9)
            # the chain broadcast's pipeline fill (n - 2 segments) is all it adds
            assert b * (1 - 1e-9) <= t <= b * (1.07 if op == "broadcast" else 1.01), (op, n)
            assert model.bound(op, n, s, 1e9) == pytest.approx(
                netlab.bound_s(op, n, s, 1e9)), (op, n)


def test_the_bound_counts_every_rank_of_a_host_where_data_is_each_ranks_own():
    """Several ranks per host: a reduced or broadcast buffer crosses a host's link once,
    gathered or exchanged data once per rank of the host."""
    s = 1 << 20
    for op in ("all_reduce", "broadcast"):
        assert netlab.link_bytes(op, 4, s, 3) == netlab.link_bytes(op, 4, s, 1)
    assert netlab.link_bytes("all_gather", 4, s, 3) == 3 * 3 * s
    assert netlab.link_bytes("reduce_scatter", 2, s, 2) == 2 * s
    assert netlab.link_bytes("all_to_all", 4, s, 2) == 2 * 3 / 4 * s
    assert netlab.bound_s("all_gather", 2, s, 1e9, 2) == pytest.approx(2 * s * 8 / 1e9)


def test_the_model_fits_what_it_generated():
    """Fitting recovers the parameters of synthetic measurements made by the model."""
    # 8 hosts on 2 cores: their stacks and reductions outlast the wire (the CPU terms)
    truth = model.Params(alpha=80e-6, msg=30e-6, call=15e-6, eta=0.9, cpu=1.5e-9, gamma=3e-9)
    rows = []
    for op in ("all_reduce", "broadcast", "all_gather"):
        for n in (2, 4, 8):
            for s in (4, 65536, 1 << 20, 16 << 20):
                share = model.lab_share(2, n)
                rows.append({"op": op, "hosts": n, "nbytes": s, "share": share,
                             "us": model.predict(op, n, s, truth, 1e9, share=share) * 1e6})
    assert model.predict("all_gather", 8, 16 << 20, truth, 1e9, share=0.25) > \
        1.2 * model.predict("all_gather", 8, 16 << 20, truth, 1e9)
    got = model.fit(rows, 1e9)
    _, worst = model.check(rows, got, 1e9, min_bytes=0)
    assert worst < 0.02, got


def _missing():
    why = netlab.missing()
    if why:
        return why
    if shutil.which("unshare") is None:
        return "needs util-linux's 'unshare'"
    return None


@needs_gloo
@pytest.mark.timeout(240)
# 3 hosts of one rank: a group past a power of two across hosts, whose 64 KiB all_reduce
# runs halving-doubling with a folded rank (tcp.placement_defaults); 2 hosts of 2 ranks
@pytest.mark.parametrize("hosts,ranks_per_host", [(3, 1), (2, 2)], ids=["tcp", "hierarchical"])
def test_a_job_over_rate_limited_links_is_correct_and_the_lab_is_removed(tmp_path, hosts,
                                                                       ranks_per_host):
    why = _missing()
    if why:
        skip_unless_required("netns", why)
    args = argparse.Namespace(ops=OPS, sizes="4,64k", budget=0.05, ranks_per_host=ranks_per_host,
                              rdzv="static", job_timeout=150)
    with netlab.Lab(hosts, "200mbit", tag=f"nlt{os.getpid() % 10000}") as lab:
        names = list(lab.names) + [lab.switch]
        res = netlab.launch(lab, "collectives", args, 29721, str(tmp_path / "out.json"),
                            verify=True)
        if ranks_per_host == 1:  # raw TCP streams: one fraction per sending host
            ring = netlab.probe(lab, "ring", nbytes=1 << 20, reps=2)
            oneway = netlab.probe(lab, "oneway", nbytes=1 << 20, reps=2)
            assert len(ring) == hosts and len(oneway) == 1, (ring, oneway)
            # 200 Mbit/s links: a stream cannot pass the rate (beyond a bucket's burst)
            assert all(0.2 < f < 1.2 for f in ring + oneway), (ring, oneway)
    assert res["bad"] == [], res["bad"]
    assert {r["op"] for r in res["rows"]} == set(OPS.split(","))
    assert all(r["world"] == hosts * ranks_per_host and r["us"] > 0 for r in res["rows"]), \
        res["rows"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names), left


def test_the_report_joins_runs_and_writes_the_plots_csv(tmp_path, capsys):
    """--report takes the medians over every launch of the files given, with the launches'
    range of the fraction of the bound; --csv writes bench/plot.py's layout."""
    def run(us_c, us_t):
        rows = [{"hosts": 2, "op": "broadcast", "nbytes": 1 << 20, "impl": "collectives",
                 "us": us_c, "round": 0},
                {"hosts": 2, "op": "broadcast", "nbytes": 1 << 20, "impl": "torch",
                 "us": us_t, "round": 0}]
        return {"rate": "1gbit", "bps": 1e9, "ranks_per_host": 1, "cores": 2, "rows": rows,
                "probes": [{"hosts": 2, "round": 0, "pattern": "ring", "fractions": [0.9, 0.95]}]}
    paths = []
    for i, (c, t) in enumerate(((10000.0, 20000.0), (12000.0, 20000.0), (11000.0, 22000.0))):
        paths.append(str(tmp_path / f"run{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(run(c, t), f)
    csv_path = tmp_path / "out.csv"
    assert netlab.main(["--report", ",".join(paths), "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    bound_us = (1 << 20) * 8 / 1e9 * 1e6
    line = next(x for x in out.splitlines() if "collectives" in x).split()
    assert float(line[4]) == 11000.0                       # the median launch
    assert line[5] == f"{bound_us / 11000:.3f}"
    assert line[6] == f"{bound_us / 12000:.3f}-{bound_us / 10000:.3f}"
    assert line[7] == "0.55"                               # 11000 / 20000
    assert "raw TCP, 2 hosts, round 0, ring  : 0.900-0.950" in out
    rows = csv_path.read_text().splitlines()
    assert rows[0] == "world,op,size_bytes,impl,us,busbw_gbs"
    assert rows[1] == f"2,broadcast,1048576,collectives:gloo,11000.0,{(1 << 20) / 11000 / 1e3:.4f}"
    with open(paths[0]) as f:
        other = json.load(f)
    other["bps"] = 1e10
    with open(paths[0], "w") as f:
        json.dump(other, f)
    with pytest.raises(SystemExit, match="another rate"):
        netlab.main(["--report", ",".join(paths)])

