"""The long docstrings of the op table's entries (collectives.api.opspec.SPECS): the one
copy of each, which api/_generated.py sets as its public functions' ``__doc__`` (written so
by ``python -m collectives.api.gen``). The one-line ones stay beside their entries in the
table."""

DOC_ALL_REDUCE = """Reduce ``tensor`` across the group, in place, on every rank.

    Args:
        tensor: a contiguous torch CPU tensor or NumPy array (any shape); under the nccl
            backend a CUDA tensor on this rank's device (the call is enqueued on the
            current torch stream, as torch's ProcessGroupNCCL does).
        op: a ReduceOp (AVG and PREMUL_SUM need floating or complex tensors).
        group: the group (default: the world).
        async_op: return a Work instead of waiting.

    Returns:
        None, or a Work when ``async_op`` (None on a rank outside ``group``).

    Raises:
        ValueError / TypeError: a bad tensor (not contiguous, an unsupported dtype, the
            op not defined for it) before anything is sent.
        DistError: the call failed or timed out (the group's timeout, default 1800 s);
            every rank raises, naming the ranks that did not arrive.

    Example:
        >>> t = torch.ones(2); dist.all_reduce(t)   # t == world_size
    """
DOC_BROADCAST = """Copy ``src``'s ``tensor`` into every other rank's ``tensor``, in place.

    Args:
        tensor: on ``src``, the data to send; elsewhere, where it lands. A contiguous
            torch CPU tensor or NumPy array of the same dtype and element count on every
            rank (a CUDA tensor under nccl).
        src: the global rank that sends (default 0); ``group_src`` names it by its rank
            in ``group`` instead.
        group: the group (default: the world).
        async_op: return a Work instead of waiting.

    Returns:
        None, or a Work when ``async_op`` (None on a rank outside ``group``).

    Raises:
        ValueError / TypeError: a bad tensor or root (not in ``group``) before anything
            is sent.
        DistError: the call failed or timed out, or the ranks' calls differ (another
            root, dtype or count): every rank raises, naming the other rank's call.

    Example:
        >>> t = torch.arange(4.0) if dist.get_rank() == 0 else torch.empty(4)
        >>> dist.broadcast(t, src=0)   # every rank: tensor([0., 1., 2., 3.])
    """
DOC_ALL_GATHER_SINGLE = """Gather every rank's ``input_tensor`` into ``output_tensor`` on
    every rank, rank r's at the r-th slice (torch's ``all_gather_into_tensor``).

    Args:
        output_tensor: ``group size * input_tensor.numel()`` elements of the input's dtype,
            contiguous: shaped ``(size * n, ...)`` (concatenated along dim 0) or ``(size,
            n, ...)`` (stacked), as torch accepts.
        input_tensor: this rank's part; a contiguous torch CPU tensor or NumPy array (CUDA
            tensors under nccl). It may be ``output_tensor``'s own r-th slice.
        group: the group (default: the world).
        async_op: return a Work instead of waiting.

    Returns:
        None, or a Work when ``async_op`` (None on a rank outside ``group``).

    Raises:
        ValueError / TypeError: sizes or dtypes that do not fit, before anything is sent.
        DistError: the call failed or timed out; every rank raises.

    Example:
        >>> out = torch.empty(dist.get_world_size() * 2)
        >>> dist.all_gather_into_tensor(out, torch.full((2,), float(dist.get_rank())))
        >>> # out == [0, 0, 1, 1, ...]
    """
DOC_SEND = """Send ``tensor`` to global rank ``dst``; returns when the tensor may
    be reused (it may still be on its way: the receiver's ``recv`` says when it arrived).

    Args:
        tensor: a contiguous torch CPU tensor or NumPy array (a CUDA tensor under nccl);
            the receiver's tensor must have the same dtype and element count.
        dst: the receiver's global rank (not this rank); ``group_dst`` names it by its
            rank in ``group`` instead.
        group: the group (default: the world).
        tag: matches this send with the receiver's ``recv`` of the same tag (default 0).

    Raises:
        ValueError / TypeError: a bad tensor or peer (this rank, or outside ``group``)
            before anything is sent.
        DistError: the receiver is gone or the group's timeout (default 1800 s) passed.

    Example:
        >>> if dist.get_rank() == 0:
        ...     dist.send(torch.arange(3.0), dst=1)
        ... elif dist.get_rank() == 1:
        ...     t = torch.empty(3); dist.recv(t, src=0)
    """
DOC_ALL_GATHER_COALESCED = """Gather every rank's ``input_tensor_list`` in one backend call
    (torch's deprecated coalesced form): ``output_tensor_lists[r][i]`` receives rank r's
    ``input_tensor_list[i]``. The tensors share one dtype, as torch's gloo requires; their
    shapes may differ.
    """
DOC_ALL_TO_ALL_SINGLE = """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``),
    send part q to rank q; receive rank r's part into ``output``'s r-th slice (``output_split_sizes``).
    """
DOC_BARRIER = """Block until every rank of the group has reached this barrier.

    ``timeout`` (a timedelta or seconds, > 0) bounds this barrier instead of the group's
    timeout; past it, DistBackendError ("Timed out waiting <n>ms ..."), as torch's gloo.
    """
DOC_RECV = """Receive into ``tensor`` from ``src`` (None: any rank). Returns the
    sender's global rank (-1 if this rank is not in ``group``).
    """
