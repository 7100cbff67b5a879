"""What a run records and reports: each operation as a client saw it (`Op`), the cluster
after healing (`Final`), and the run's figures (`Report`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.local.chaos.faults import Schedule


@dataclass
class Op:
    """One operation as a client saw it: what it asked, when, and what it was told."""

    client: int
    kind: str  # store | store-no-wait | rollback | gather | remove
    name: str
    content: str | None  # the content's SHA-256 (stores), or what a gather returned
    path: str  # the file stored (unique per store), or the gather's output
    invoked: float  # wall-clock seconds
    completed: float | None = None
    exit: int | None = None  # None: killed at CLI_TIMEOUT_S, outcome unknown
    output: str = ""  # its stdout
    error: str = ""  # its stderr


@dataclass
class Final:
    """The cluster after healing, as the checker needs it."""

    requests: dict[str, dict[str, str]]  # request id -> record (args decoded)
    versions: list[dict]  # `smoltorrent ls --json`
    gathered: dict[str, str | None]  # vkey -> SHA-256 gathered (None: the gather failed)
    current: dict[str, str | None]  # name -> SHA-256 gathered of its current version
    open_requests: list[str]
    unsettled: list[str]  # vkeys still pending or removing
    under_replicated: list[dict]
    diagnosis: str = ""  # what the sweeps were doing, when the run did not settle (JSON)


@dataclass
class Report:
    seed: int
    schedule: Schedule
    ops: list[Op]
    faults_applied: list[dict]
    violations: list[str]
    seconds: float

    def effective_faults(self) -> list[dict]:
        """The faults that took effect: only these count (a kill of a process that was
        already down, a fiu-ctrl that failed, do not)."""
        return [f for f in self.faults_applied if f.get("took_effect")]

    def figures(self) -> dict:
        """Operations by kind and outcome, faults by kind, violations: plain data."""
        ops: dict[str, dict[str, int]] = {}
        for op in self.ops:
            outcome = {0: "ok", 3: "unknown", None: "timed out"}.get(op.exit, "failed")
            counts = ops.setdefault(op.kind, {})
            counts[outcome] = counts.get(outcome, 0) + 1
        faults: dict[str, int] = {}
        for f in self.effective_faults():
            faults[f["kind"]] = faults.get(f["kind"], 0) + 1
        return {
            "seed": self.seed,
            "seconds": round(self.seconds, 1),
            "operations": ops,
            "faults": faults,
            "faults_without_effect": len(self.faults_applied) - len(self.effective_faults()),
            # of those: copy-destroying faults skipped, the cluster not back at R in time
            "skipped_not_at_r": sum("skipped" in f for f in self.faults_applied),
            "violations": self.violations,
        }

    def summary(self) -> str:
        f = self.figures()
        ops = "; ".join(
            f"{kind} " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
            for kind, counts in f["operations"].items()
        )
        faults = ", ".join(f"{n} {kind}" for kind, n in f["faults"].items())
        return (
            f"seed {self.seed}: {len(self.ops)} operations ({ops}); "
            f"{len(self.effective_faults())} faults ({faults}; "
            f"{f['faults_without_effect']} more without effect, of which"
            f" {f['skipped_not_at_r']} skipped as the cluster was not back at R); "
            f"{len(self.violations)} violations; {self.seconds:.0f} s"
        )
