"""The torch job, shared by the package's modules: test_master_worker.py runs its operator
and list-function properties on it as on the NumPy job, test_master_worker_dispatch.py the
torch-only cases."""
import pytest


@pytest.fixture(scope="package")
def torch_job():
    """A master and two worker nodes whose workers hold torch tensors."""
    pytest.importorskip("torch")
    from tests.master_worker.test_master_worker import Job
    j = Job(3, {"MW_TEST_LIBRARY": "torch"})
    yield j
    assert j.close() == [], "processes left running at the end"
