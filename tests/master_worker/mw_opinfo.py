"""torch's OpInfo database run on remote tensors: every sample input of every OpInfo that
supports float32 on the CPU, once on a worker node and once locally, compared.

Runs on a torch-mode master (from tests/master_worker/mw_job.py, or alone as the sweep's bench run):

    collectives-run -n 2 -m tests.master_worker.mw_opinfo [--out bench/results/<date>-mw-opinfo.md]
                                            [--ops name,name] [--samples N]

An OpInfo passes when all its samples give torch's result (bit-exact, or within
``torch.testing.assert_close``'s float32 tolerances where the reduction order may
differ). A sample that fails is put in a class by what went wrong (see ``classify``):
samples whose local result differs between two local runs are random ops; they are
excluded, with their class, rather than counted as failures.
"""
import argparse
import collections
import datetime
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

import collectives.master_worker as mw

# a representative slice for the quick suite: element-wise, reductions with named-tuple
# results, shape ops, linear algebra, nn.functional, indexing, multi-output and sync-point
# results
QUICK = ("abs", "add", "mul", "div", "exp", "log_softmax", "softmax", "sum", "mean", "max",
         "topk", "sort", "cumsum", "matmul", "mm", "bmm", "einsum", "linalg.svd", "cat", "stack",
         "where", "masked_fill", "index_select", "gather", "expand", "repeat", "reshape",
         "transpose", "permute", "split", "unbind", "nn.functional.relu",
         "nn.functional.linear", "nn.functional.cross_entropy", "nn.functional.conv2d",
         "nn.functional.layer_norm", "pow", "norm", "clamp", "zeros_like", "new_ones", "var_mean",
         "unique", "argmax", "__getitem__")


def _remote(v, node):
    if isinstance(v, torch.Tensor):
        return mw.send(v.detach(), node=node)
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return type(v)(_remote(x, node) for x in v)
    if isinstance(v, dict):
        return {k: _remote(x, node) for k, x in v.items()}
    return v


def _local(v):
    if isinstance(v, mw.RemoteTensor):
        return v.get()
    if isinstance(v, (list, tuple)):
        return tuple(_local(x) for x in v)
    return v


def _plain(v):
    """A result made comparable: named tuples as tuples, torch.Size as tuple."""
    if isinstance(v, torch.Size):
        return tuple(v)
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def _is_tensor_method(f):
    """An unbound C method of Tensor (``torch.Tensor.item``): CPython checks its self's type
    before torch dispatches, so a user calls it as a method of the tensor."""
    return getattr(f, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase)


def _method_variant(op):
    for v in (op.method_variant, op.inplace_variant):
        name = getattr(v, "__name__", None)
        if name and getattr(torch.Tensor, name, None) is v:
            return name
    return None


def _same(got, want, exact):
    got, want = _plain(got), _plain(want)
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return False
        if exact:
            return got.dtype == want.dtype and got.shape == want.shape and bool(
                torch.equal(got, want) or (got.isnan() == want.isnan()).all()
                and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)))
        try:
            torch.testing.assert_close(got, want, equal_nan=True, check_stride=False)
            return True
        except AssertionError:
            return False
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(
            _same(g, w, exact) for g, w in zip(got, want))
    if isinstance(want, float) and isinstance(got, float):
        return got == want or (got != got and want != want) or (not exact and abs(got - want)
                                                                 <= 1e-5 + 1e-6 * abs(want))
    return got == want


def classify(exc_text):
    """The class of a failed sample, from what was raised."""
    t = exc_text
    if "torch._ops.aten" in t or "a private name" in t:
        return ("private operators (torch.ops.aten.*, torch._*): outside torch's overridable "
                "list, refused by the allow-list")
    if "descriptor" in t and "RemoteTensor" in t:
        return ("the OpInfo calls an unbound C method of Tensor (torch.Tensor.item(x)) that "
                "checks its self's type before torch dispatches, and has no method variant")
    if "cannot be sent" in t or "cannot come back" in t:
        return ("Python objects as arguments (an options object, a module as the distance "
                "function): not plain data, not sent")
    if "unsupported dtype uint" in t:
        return "uint16/32/64 results: the transport carries no unsigned type wider than 8 bits"
    if "complex32" in t:
        return "complex32 (chalf): NumPy has no such dtype for the wire"
    if "Sparse" in t or "memory format option" in t or "sparse" in t:
        return "sparse layouts: a remote tensor's data travels dense"
    if "cannot run on a worker" in t or "has no attribute" in t:
        return "not in the allow-list (a torch function outside the overridable list)"
    if "differs" in t:
        return ("storage-level ops (as_strided of a view reads its base's storage; a node holds "
                "a contiguous copy)")
    return "other"


def run_op(op, node, max_samples):
    """(status, detail) of one OpInfo: 'pass', 'close', 'random', 'skip' or 'fail'."""
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    except Exception as e:
        return "skip", f"no samples: {type(e).__name__}: {e}"
    samples = samples[:max_samples]
    close, ran = False, 0
    for s in samples:
        try:
            torch.manual_seed(0)
            want = op.op(s.input, *s.args, **s.kwargs)
        except Exception:
            continue  # torch itself refuses this sample
        ran += 1
        try:
            mw.manual_seed(42)  # node 0's generators as the local run's (wrapper_set_seed)
            torch.manual_seed(0)
            ri = _remote(s.input, node)
            ra, rk = _remote(s.args, node), _remote(s.kwargs, node)
            if _is_tensor_method(op.op):  # torch.Tensor.item(x) is spelled x.item()
                r = getattr(ri, op.op.__name__)(*ra, **rk)
            else:
                try:
                    r = op.op(ri, *ra, **rk)
                except TypeError as e:
                    # the OpInfo's lambda calls an unbound C method (torch.Tensor.uniform_(x)),
                    # which checks its self's type before torch dispatches: a user writes
                    # x.uniform_(), the OpInfo's method or in-place variant
                    variant = _method_variant(op)
                    if "descriptor" not in str(e) or variant is None:
                        raise
                    r = getattr(ri, variant)(*ra, **rk)
            got = _local(r)
        except Exception as e:
            try:
                mw.synchronize(node)
            except Exception:
                pass
            return "fail", f"{type(e).__name__}: {str(e)[:300]}"
        if _same(got, want, True):
            continue
        torch.manual_seed(1)
        again = op.op(s.input, *s.args, **s.kwargs)
        if not _same(again, want, True):
            return "random", "torch's own result differs between two local runs"
        if _same(got, want, False):
            close = True
            continue
        return "fail", "the remote result differs from torch's"
    if not ran:
        return "skip", "torch raised for every sample"
    return ("close" if close else "pass"), ""


def sweep(names=None, node=0, max_samples=20, log=None):
    """Run the OpInfos (all float32-on-CPU ones, or those named): a summary dict."""
    from torch.testing._internal.common_methods_invocations import op_db
    ops = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]
    if names is not None:
        want = set(names)
        ops = [op for op in ops if op.name in want or (op.name + "." + op.variant_test_name) in want]
    results = {}
    t0 = time.perf_counter()
    for op in ops:
        key = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        try:
            results[key] = run_op(op, node, max_samples)
        except Exception:
            results[key] = ("fail", traceback.format_exc(limit=2)[-300:])
        if log:
            print(key, *results[key], file=log, flush=True)
    counts = collections.Counter(st for st, _ in results.values())
    classes = collections.Counter(classify(d) for st, d in results.values() if st == "fail")
    counted = len(results) - counts["random"] - counts["skip"]
    passed = counts["pass"] + counts["close"]
    return {"ops": len(results), "counts": dict(counts), "passed": passed, "counted": counted,
            "fraction": passed / counted if counted else 0.0,
            "fraction_all": passed / len(results) if results else 0.0,
            "fail_classes": dict(classes), "secs": time.perf_counter() - t0,
            "results": results}


def report(summary, args):
    lines = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    lines.append(f"# Master-worker: torch's OpInfo samples on a remote tensor ({datetime.date.today()})\n")
    lines.append(f"- command: `collectives-run -n 2 -m tests.master_worker.mw_opinfo --samples {args.samples}"
                 f"{' --out ' + args.out if args.out else ''}`")
    lines.append(f"- commit: {commit}; torch {torch.__version__}; {platform.machine()}, "
                 f"{os.cpu_count()} cores, {platform.platform()}")
    lines.append(f"- OpInfos supporting float32 on CPU: {summary['ops']}; samples per OpInfo: "
                 f"up to {args.samples}; {summary['secs']:.0f} s\n")
    c = summary["counts"]
    lines.append(f"**{summary['passed']} of {summary['counted']} pass "
                 f"({100 * summary['fraction']:.1f}%)**, excluding {c.get('random', 0)} random "
                 f"ops and {c.get('skip', 0)} without a sample torch accepts; "
                 f"{100 * summary['fraction_all']:.1f}% of all {summary['ops']}.\n")
    lines.append("| status | OpInfos |\n|---|---|")
    for k in ("pass", "close", "random", "skip", "fail"):
        lines.append(f"| {k} | {c.get(k, 0)} |")
    lines.append("\npass: bit-exact; close: within assert_close's float32 tolerances; random: "
                 "torch's own result differs between two local runs (uninitialised memory: "
                 "empty*, or sampling the seed does not fix); skip: torch raised for every "
                 "sample (or the OpInfo has none). Random ops pass where seeded: each sample "
                 "seeds the node (mw.manual_seed(42)) as OpInfo's wrapper_set_seed seeds the "
                 "master. Methods (torch.Tensor.item as the op) are called as methods.\n")
    lines.append("## Failures by class\n")
    for cls, n in sorted(summary["fail_classes"].items(), key=lambda x: -x[1]):
        lines.append(f"### {cls} ({n})\n")
        for k, (st, d) in sorted(summary["results"].items()):
            if st == "fail" and classify(d) == cls:
                lines.append(f"- `{k}`: {d.splitlines()[0][:200] if d else ''}")
        lines.append("")
    lines.append("## Random ops (excluded)\n")
    lines.append(", ".join(f"`{k}`" for k, (st, _) in sorted(summary["results"].items())
                           if st == "random") + "\n")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=None, help="comma-separated OpInfo names (default: all)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import collectives as dist
    dist.init_master_worker(backend="tcp", library="torch", timeout=120)
    s = sweep(args.ops.split(",") if args.ops else None, max_samples=args.samples,
              log=sys.stderr)
    text = report(s, args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
