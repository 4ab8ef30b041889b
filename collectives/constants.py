"""``torch.distributed.constants``: the default group timeouts."""
import datetime

from .api.group import default_pg_timeout

# torch's nccl default (its CPU backends take default_pg_timeout, 30 minutes)
default_pg_nccl_timeout = datetime.timedelta(minutes=10)

__all__ = ["default_pg_timeout", "default_pg_nccl_timeout"]
