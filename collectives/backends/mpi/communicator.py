"""The MPI communicator of a new 'mpi' group: MPI_COMM_WORLD's duplicate under mpiexec,
or one made with MPI_Comm_create_group from the members a store names."""
import sys

from ...core.errors import DistBackendError
from .library import launcher_world_size


def communicator(store, rank, size, load_mpi):
    """The communicator of a group of ``size`` ranks where this process is ``rank``.

    ``store`` None: the world group under mpiexec (a duplicate of MPI_COMM_WORLD).
    Otherwise a group whose members rendezvoused through ``store`` (a world group
    given an init_method, or a subgroup of a non-MPI parent): members exchange their
    MPI world ranks and build the communicator with MPI_Comm_create_group.
    """
    launched = launcher_world_size()
    if store is not None and "mpi4py.MPI" not in sys.modules and size < launched:
        # MPI_Init is collective over all mpiexec's processes: members alone would hang in it
        raise DistBackendError(
            f"an 'mpi' group of {size} of the {launched} processes needs MPI initialised on every "
            f"process first: run 'from mpi4py import MPI' on all ranks before new_group(..., "
            f"backend='mpi'), or use init_process_group('mpi')")
    MPI = load_mpi()
    world = MPI.COMM_WORLD
    wrank, wsize = world.Get_rank(), world.Get_size()
    if wsize == 1 and size > 1:
        raise DistBackendError(
            f"the 'mpi' backend found a one-process MPI world but world_size={size}: start the "
            f"program with mpiexec (mpiexec -n {size} python prog.py)")
    if store is None:
        if (rank, size) != (wrank, wsize):
            raise DistBackendError(
                f"the 'mpi' backend got rank={rank}, world_size={size}, but MPI_COMM_WORLD has "
                f"rank {wrank} of {wsize}; under mpiexec let init_process_group('mpi') take both "
                f"from MPI")
        return world.Dup()
    if size > wsize:
        raise DistBackendError(f"the 'mpi' backend got world_size={size} but MPI_COMM_WORLD has "
                               f"only {wsize} processes (mpiexec -n {size})")
    store.set(f"mpi_world_rank/{rank}", str(wrank).encode())
    members = [int(store.get(f"mpi_world_rank/{r}")) for r in range(size)]
    group = world.Get_group().Incl(members)
    try:
        return world.Create_group(group)
    finally:
        group.Free()
