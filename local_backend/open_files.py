"""The process's open-file limit, raised as far as a service's connection cap needs: a process starts with a
soft limit (often 1024) below its hard one, and past the soft limit accept fails and the service serves no one."""

from __future__ import annotations

import math
import resource


def open_file_limit(need: int) -> float:
    """The soft open-file limit, first raised toward ``need`` as far as the hard limit allows (``math.inf`` when
    there is none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return math.inf if soft == resource.RLIM_INFINITY else soft
