"""The compiled engines: the Cython extensions and the C they wrap, by component.

``_core`` (the reduction kernels in ``kernels/``, the dispatcher, the flight recorder's
ring), ``_buffer`` (the compiled Buffer), ``_tcp`` (the TCP engine in ``tcp/``), ``_shm``
(the shared-memory engine in ``shm/``), ``_mpilog`` (the mpi backend's call log) and
``_ncclcall`` (calls into libnccl by address). Each has a pure-Python/NumPy twin elsewhere
in the package, taken where the extension is not built or COLLECTIVES_NO_EXTENSIONS hides it.
"""
