"""Typed rejections of coordinator operations.

Every operation either applies whole or raises one of these and changes nothing. Each class carries the
Anchor-style custom error code (6000 + n) that the on-chain program returns for the same rejection, so a
conformance test can match the specification's error with the program's, and clients of either backend
report the same names.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of every rejection; ``code`` is the program's custom error number."""

    code: int = 6000
    summary: str = "the coordinator rejected the operation"

    def __init__(self, detail: str | None = None) -> None:
        self.detail = detail or self.summary
        super().__init__(f"{type(self).__name__}: {self.detail}")


def _error(name: str, code: int, summary: str) -> type[CoordinatorError]:
    cls = type(name, (CoordinatorError,), {"code": code, "summary": summary, "__doc__": summary})
    return cls


InvalidConfig = _error("InvalidConfig", 6000, "the run config breaks a rule")
WrongRunId = _error("WrongRunId", 6001, "the operation names a different run")
AlreadyJoined = _error("AlreadyJoined", 6002, "this identity is already pending or admitted")
RunFull = _error("RunFull", 6003, "the run has no free client slot")
RunFinished = _error("RunFinished", 6004, "the run has finished")
NotAClient = _error("NotAClient", 6005, "the signer is not a client of the current epoch")
NotAWitness = _error("NotAWitness", 6006, "the signer is not an elected witness of this round")
WrongPhase = _error("WrongPhase", 6007, "the operation is not allowed in the current phase")
DuplicateWitness = _error("DuplicateWitness", 6008, "this witness already sent its proof for the round")
StaleRound = _error("StaleRound", 6009, "the message refers to a round other than the current one")
BadFilter = _error("BadFilter", 6010, "a bloom filter does not have the size the run's config fixes")
ClientHealthy = _error("ClientHealthy", 6011, "the named client is healthy by the previous round's witnesses")
NotAuthorized = _error("NotAuthorized", 6012, "the signer lacks the authority this operation needs")
NotHalted = _error("NotHalted", 6013, "the run must be paused or uninitialized for this operation")
NothingToTick = _error("NothingToTick", 6014, "no transition is due yet")
InvalidJoin = _error("InvalidJoin", 6015, "the join request names an invalid role or stage")
UnknownClient = _error("UnknownClient", 6016, "the named client is not in the current epoch")
InvalidCheckpoint = _error("InvalidCheckpoint", 6017, "the checkpoint record is malformed")
NotInitialized = _error("NotInitialized", 6018, "the run has no config yet")
NoPreviousRound = _error("NoPreviousRound", 6019, "there is no completed round in this epoch to check")
NotAWorker = _error("NotAWorker", 6020, "only a stage worker may report a checkpoint")
NotJoined = _error("NotJoined", 6021, "the identity is neither pending nor admitted")
InvalidRunId = _error("InvalidRunId", 6022, "a run id is 1-32 bytes of [A-Za-z0-9._-]")
NotHealthy = _error("NotHealthy", 6023, "the signer has been marked unhealthy or has withdrawn")
MalformedInstruction = _error("MalformedInstruction", 6024, "the instruction data cannot be decoded")
AlreadyMarked = _error("AlreadyMarked", 6025, "the named client is already leaving the epoch")
SlotTaken = _error("SlotTaken", 6026, "another key already holds this join authority's slot")
JoinExpired = _error("JoinExpired", 6027, "the join's countersignature is past its deadline")
CheckpointTaken = _error("CheckpointTaken", 6028, "the stage's checkpoint of this epoch is already at another place")
AlreadyCommitted = _error("AlreadyCommitted", 6029, "this witness already committed to the next round's seed")
NoCommitment = _error("NoCommitment", 6030, "this witness made no commitment to the next round's seed to open")
AlreadyRevealed = _error("AlreadyRevealed", 6031, "this witness already revealed its secret for the round")
BadReveal = _error("BadReveal", 6032, "the secret does not open this witness's commitment")

ALL_ERRORS: tuple[type[CoordinatorError], ...] = tuple(
    cls for cls in list(globals().values()) if isinstance(cls, type) and issubclass(cls, CoordinatorError)
    and cls is not CoordinatorError
)
BY_CODE: dict[int, type[CoordinatorError]] = {cls.code: cls for cls in ALL_ERRORS}
assert len(BY_CODE) == len(ALL_ERRORS), "error codes must be unique"
