"""Why a contributor stops taking part in the run: what ``Contributor.run`` raises when its own work ends it."""

from __future__ import annotations


class ContributorRemoved(RuntimeError):
    """This client withdrew from the run (its averaging kept failing); the message says why."""


class CannotContribute(RuntimeError):
    """This client cannot take part in the run as it was started, and trying again would fail the same way; the
    message names the problem and the fix."""


Ending = CannotContribute | ContributorRemoved
"""Either outcome: background work that raises one ends the client's part in the run instead of being retried."""
