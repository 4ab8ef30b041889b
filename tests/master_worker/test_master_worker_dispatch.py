"""Master-worker mode (issue 42): remote tensors take all of torch and NumPy.

Torch functions, Tensor methods and nn.functional calls given remote tensors run on
their node through ``__torch_function__``; NumPy's ufuncs and array functions through
``__array_ufunc__``/``__array_function__``. The wire names the function and the worker
checks the name against an allow-list built from the libraries' own lists. One torch job
(a master and two worker nodes) serves every test of this module; its master runs
functions of tests/master_worker/mw_job.py. NumPy mode's cases run in test_master_worker.py's job.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.requires import needs_gloo

from tests.master_worker.test_master_worker import ROOT

pytestmark = needs_gloo  # torch_job: tests/master_worker/conftest.py


# ---- torch: what a torch user writes gives torch's result ----------------------------------------
@pytest.mark.timeout(300)
def test_torch_workers_hold_torch_tensors(torch_job):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(torch_job("binary", a, b, "add", 0), a + b)
    prog = [("sum", (1, True)), ("mul", None), ("t", None), ("neg", None)]
    got = torch_job("run_program", a, np.ones((3, 1), np.float32), prog, 0)
    np.testing.assert_array_equal(got, -(a.sum(1, keepdims=True) * 1).T)
    assert torch_job("call", "mw.rpc_sync", 0, "describe", 1) == {"kind": "int", "extra": None}
    assert torch_job("torch_case") == ("Tensor", [2.0, 4.0], 1, "float32")



@pytest.mark.timeout(300)
def test_common_torch_calls_on_a_node_equal_local(torch_job):
    out = torch_job("torch_common_calls")
    bad = {k: d for k, (ok, d) in out.items() if not ok}
    assert len(out) >= 49 and not bad, bad
    # multi-output results come back as torch gives them, not as their first field
    assert out["max_dim"][1] == "max" and out["topk"][1] == "topk"
    assert out["svd"][1] == "linalg_svd"
    assert out["split"][1] == "tuple" and out["item"][1] == "float"


@pytest.mark.timeout(300)
def test_results_are_named_tuples_values_and_shapes_as_torch_gives_them(torch_job):
    out = torch_job("result_kinds")
    assert out["max"] == ("max", "torch.return_types", ("values", "indices"), "RemoteTensor",
                          [3, 3, 3])
    assert out["svd_fields"] == ("U", "S", "Vh")
    assert out["split"] == ["RemoteTensor"] * 3
    assert out["dim"] == 2 and out["numel"] == 12 and out["is_floating_point"] is True
    assert out["shape"] == ("Size", (3, 4)) and out["lazy_shape"] == "Size"
    assert out["dtype"] == "torch.bool" and out["device"] == "cpu" and out["equal"] is True
    assert out["unique"] == [[0, 1, 2], [4, 4, 4]]


@pytest.mark.timeout(300)
def test_opinfo_representative_slice_matches_local(torch_job):
    """The quick suite's slice of the OpInfo sweep: every OpInfo in it passes."""
    pytest.importorskip("expecttest")  # torch.testing._internal imports it
    out = torch_job("call_opinfo", None)
    failed = {k: v for k, v in out["results"].items() if v[0] not in ("pass", "close")}
    assert out["ops"] >= 40 and not failed, failed


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_opinfo_sweep_passes_95_percent(torch_job):
    """Every OpInfo supporting float32 on the CPU (bench/results/*-mw-opinfo.md has the
    classes of the rest)."""
    pytest.importorskip("expecttest")
    out = torch_job("call_opinfo", "all", timeout=1700)
    print(f"OpInfo pass fraction {out['fraction']:.3f} ({out['passed']}/{out['counted']}), "
          f"classes of failures {out['fail_classes']}")
    assert out["ops"] > 500
    assert out["fraction"] >= 0.95, out["fail_classes"]


# (the operator and list-function properties on torch tensors: test_master_worker.py's
# lib_job runs them on this torch job as on the NumPy one)


# ---- autograd, modules, optimizers ------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_autograd_through_matmul_softmax_cross_entropy_gives_torchs_gradients(torch_job):
    loss, rloss, grad, rgrad, leaf = torch_job("autograd_case")
    assert loss == rloss
    np.testing.assert_array_equal(rgrad, grad)
    assert leaf == (True, True, True, False)


@pytest.mark.timeout(300)
def test_no_grad_on_the_master_covers_the_nodes_commands(torch_job):
    inside, after, w = torch_job("no_grad_case")
    assert inside is False and after is True and w == [2.0, 2.0, 2.0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", ["SGD", "Adam"])
def test_module_and_optimizer_trained_on_a_node_equal_local_training(torch_job, opt):
    losses, diff, nodes, keys = torch_job("train_case", 5, opt)
    assert len(losses) == 5 and all(a == b for a, b in losses), losses
    assert losses[-1][0] < losses[0][0]  # it trained
    assert diff == 0.0
    assert nodes == [1, 1, 1, 1] and keys == ["0.bias", "0.weight", "2.bias", "2.weight"]


# ---- refusals and misuse ---------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_refused_names_raise_on_the_master_before_anything_is_sent(torch_job):
    out, commands = torch_job("refused_case")
    for name in ("torch.save", "torch.load", "torch.hub.load", "os.system", "builtins.exec",
                 "torch.Tensor.storage", "torch.Tensor.register_hook", "torch._C._foo"):
        assert out[name] is not None and "cannot run on a worker" in out[name], (name, out[name])
    assert "refused" in out["torch.save"] and "files" in out["torch.save"]
    assert "cannot be pickled" in out["pickle"]
    assert "refused on workers" in out["attr"]
    assert commands == 1, "only worker_stats itself reached the node"


@pytest.mark.timeout(300)
def test_a_worker_refuses_names_outside_its_list_too(torch_job):
    (command, msg), after = torch_job("worker_refuses_case")
    assert command.startswith("os.system") and "PermissionError" in msg and "allow-list" in msg
    assert after == [2.0, 2.0]


@pytest.mark.timeout(300)
def test_operands_on_different_nodes_raise_naming_both(torch_job):
    msg = torch_job("mixed_nodes_case")
    assert msg is not None and "node 1" in msg and "node 0" in msg and "to_node" in msg


# ---- no torch needed ---------------------------------------------------------------------------------
def test_master_worker_imports_without_torch():
    """The NumPy-only install: importing the package (and its torch-mode code) never
    imports torch."""
    code = ("import sys; import collectives, collectives.master_worker as mw; "
            "import collectives.master_worker.remote_call, collectives.master_worker.modules; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]


def test_allow_lists_come_from_the_libraries_own_lists():
    from collectives.master_worker.allow import numpy_table, refused
    by_name, _ = numpy_table()
    assert "numpy.exp" in by_name and "numpy.concatenate" in by_name
    assert "numpy.linalg.svd" in by_name and "numpy.add.reduce" in by_name
    for name in ("numpy.save", "numpy.load", "numpy.savetxt", "numpy.loadtxt", "numpy.fromfile"):
        assert name not in by_name
    assert refused("torch.nn.functional.huber_loss") is None  # 'hub' is a token, not a prefix
    assert refused("torch.Tensor.scatter_reduce") is None
    torch = pytest.importorskip("torch")
    from collectives.master_worker.allow import torch_table
    tn, tf = torch_table()
    assert tf[torch.matmul] == "torch.matmul" and tf[torch.nn.functional.relu] == \
        "torch.nn.functional.relu"
    assert "torch.Tensor.new_ones" in tn and tn["torch.Tensor.grad"].prop
    assert "torch.save" not in tn and "torch.load" not in tn and "torch.from_file" not in tn
    assert not any(n.startswith("torch.hub") for n in tn)
    assert np.all([not n.rsplit(".", 1)[1].startswith("_") or n.endswith("__") for n in tn])


def test_operator_lists_derive_from_one_table():
    """operators.OPERATORS is the one list: the remote tensor's methods, both allow-lists and
    the ufunc names follow it."""
    from collectives.master_worker import allow, operators
    from collectives.master_worker.tensor import RemoteTensor
    names = {d for op in operators.OPERATORS for d in (op.forward, op.reflected, op.inplace) if d}
    assert names == operators.dunders()
    assert {"__pow__", "__rpow__", "__ipow__", "__rlshift__", "__irshift__", "__rmatmul__",
            "__imatmul__", "__rdivmod__"} <= names
    for d in names:
        assert getattr(RemoteTensor, d).__name__ == d, d
        assert allow.refused("torch.Tensor." + d) is None, d
    by_name, _ = allow.numpy_table()
    for op in operators.OPERATORS:
        assert by_name[op.wire].fn is op.function() and not by_name[op.wire].inplace
        if op.inplace:
            assert by_name[op.inplace_wire].inplace
        assert isinstance(getattr(np, op.ufunc), np.ufunc)
    torch = pytest.importorskip("torch")
    tn, _ = allow.torch_table()
    for op in operators.OPERATORS:
        if op.torch is not None:
            assert callable(getattr(torch, op.torch)), op
        assert (op.wire in tn) == hasattr(torch.Tensor, op.forward), op
        if op.inplace:
            assert (op.inplace_wire in tn) == hasattr(torch.Tensor, op.inplace), op
            if hasattr(torch.Tensor, op.inplace):
                assert "torch.Tensor." + op.inplace in tn
    assert "operator.imatmul" not in tn and "builtins.divmod" not in tn  # torch has neither
    assert "numpy.concatenate" in tn and tn["numpy.concatenate"].fn is np.concatenate


# ---- the codec: plain data only ------------------------------------------------------------------------
def test_codec_round_trips_plain_data_and_builds_nothing_else():
    """Commands decode to plain values (numbers, str, containers, slices, handles, arrays,
    named constants, tensors by value); pickles and garbage raise CodecError."""
    import pickle
    import random

    from collectives.master_worker.codec import (
        CodecError, Const, Ref, TensorValue, decode, encode, encoded, frame, unframe)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    value = (None, True, False, -3, 2.5, 1 + 2j, "s", b"b", [1, (2, {"k": slice(1, None, 2)})],
             Ellipsis, Ref(7), arr, Const("dtype:float32"), TensorValue(arr, "float32", True))
    got, end = decode(encode(value))
    assert end == len(encode(value))
    assert got[:11] == value[:11] and got[12] == value[12]
    np.testing.assert_array_equal(got[11], arr)
    assert got[13].dtype == "float32" and got[13].requires_grad is True
    np.testing.assert_array_equal(got[13].array, arr)
    name = encoded("torch.matmul")  # encoded once, sent as a str
    assert unframe(frame(8, (name, 1, (Ref(2),))))[1] == ("torch.matmul", 1, (Ref(2),))
    for bad in (pickle.dumps(arr), pickle.dumps(print), b"\xff", b"A"):
        with pytest.raises(CodecError):
            decode(bad)
    rng = random.Random(0)
    blob = bytes(encode(value))
    for _ in range(500):  # mutated messages: a CodecError or a plain value, nothing else
        b = bytearray(blob)
        for _ in range(3):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            decode(bytes(b))
        except (ValueError, OverflowError, MemoryError):  # CodecError is a ValueError
            pass
    with pytest.raises(CodecError):
        encode(object())
