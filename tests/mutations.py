"""Do the tests fail when a guarantee breaks? One-line mutations of the guarantees the docs name, each applied to a
temporary copy of the working tree (never to the tree itself), and the tests that hold the guarantee run there:
every mutation must make them fail. ``make mutation``; exit 1 names each mutation that survived.

    python -m tests.mutations              # all of them
    python -m tests.mutations fair-share   # the ones whose name contains this

A mutation finds its line by its text within a package (not by file and line number: modules move), and that text
must occur exactly once there, so a stale mutation fails loudly instead of mutating nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    guarantee: str
    package: str  # where the text is searched (a directory of the repository)
    old: str  # one line's text, found exactly once in the package
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail once it is applied


MUTATIONS = (
    Mutation("projection", "the projection is idempotent and orthogonal (π² = π)", "teleport",
             "return grad.addmm_(c, basis.kept.T, alpha=-1) if inplace else torch.addmm(grad, c, basis.kept.T, "
             "alpha=-1)",
             "return grad.addmm_(c, basis.kept.T, alpha=-2) if inplace else torch.addmm(grad, c, basis.kept.T, "
             "alpha=-2)",
             ("tests/teleport/test_teleport.py::test_projection_is_idempotent_and_orthogonal_for_both_forms",)),
    Mutation("job-redis-keys", "a job's Redis user reaches its own keys only", "service/launch",
             '*(f"~{keys.glob_escape(k)}" for k in keys.own_keys(job_id))', '"~*"',
             ("tests/service/launch/test_job_acl.py::test_a_jobs_user_reaches_its_own_keys_only",)),
    Mutation("sandbox-home", "the service's home is covered inside the sandbox", "workers/job",
             'argv += [a for p in mounts.hidden if _under(p, outer) for a in ("--tmpfs", str(p))]', "argv += []",
             ("tests/workers/job/test_sandbox_home.py::test_a_home_under_a_bound_directory_is_covered",)),
    Mutation("sandbox-pid-namespace", "a job sees only its own processes", "workers/job",
             '*identity(uid), "--unshare-pid",', "*identity(uid),",
             ("tests/workers/job/test_sandbox_home.py::test_a_job_sees_only_its_own_processes",)),
    Mutation("epoch-dedup", "an epoch redone after a restart is recorded once", "workers/train",
             """return f"epoch:{record['epoch']}\"""", 'return ""',
             ("tests/workers/job/test_redis_sink.py::test_events_arrive_in_order_and_reemitted_epochs_are_not_duplicated",
              "tests/workers/job/test_redis_sink.py::test_jsonl_sink_writes_each_epoch_once_across_a_resume")),
    Mutation("fair-share", "the user with less decayed usage starts first", "service/rules",
             "return (neg_prio, usage.get(user, 0.0), created, job_id)", "return (neg_prio, 0.0, created, job_id)",
             ("tests/service/rules/test_policy.py::test_priority_then_fair_share_then_age",)),
    Mutation("link-refusal", "a link below a root is refused, never followed", "api_schemas",
             "DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC",
             "DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC",
             ("tests/api_schemas/test_gate.py::test_a_link_anywhere_below_the_root_is_refused",)),
    Mutation("reset-optimizer", "teleport.reset_optimizer clears our loop's optimizer state", "workers/train",
             "if tp.reset_optimizer and ran:", "if False and ran:",
             ("tests/workers/train/test_reset_optimizer.py",)),
)


def tree_files() -> list[str]:
    """The working tree's files as git sees them (tracked and untracked, less the ignored)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                         check=True)
    return [f for f in out.stdout.decode().split("\0") if f and (REPO / f).is_file()]


def copy_tree(dest: Path, files: list[str]) -> None:
    for f in files:
        if (REPO / f).is_file():  # (one removed since the listing: the tree is shared with work in progress)
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)


def apply(m: Mutation, root: Path) -> Path:
    """Mutate ``m``'s one line in the copy at ``root``: the file it was in."""
    hits = [(p, p.read_text().count(m.old)) for p in sorted((root / m.package).rglob("*.py"))]
    hits = [(p, n) for p, n in hits if n]
    if [n for _, n in hits] != [1]:
        raise SystemExit(f"mutation {m.name}: its text occurs {sum(n for _, n in hits)} times in {m.package} "
                         f"({', '.join(str(p.relative_to(root)) for p, _ in hits) or 'nowhere'}): update it")
    path = hits[0][0]
    path.write_text(path.read_text().replace(m.old, m.new))
    return path


def pytest(root: Path, tests: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """The tests run in the copy at ``root`` (its packages first on the path, not the tree's editable install)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-n", "0",
                           "--timeout", "300", "-rs", *tests], cwd=root, env=env, capture_output=True, text=True)


def run(m: Mutation, files: list[str]) -> tuple[str, str, float]:
    """(caught / SURVIVED / skipped, what pytest said last, seconds) for ``m`` in a fresh copy of the tree."""
    with tempfile.TemporaryDirectory(prefix="tlab-mutant-") as tmp:
        root = Path(tmp)
        copy_tree(root, files)
        where = apply(m, root).relative_to(root)
        t0 = time.monotonic()
        done = pytest(root, m.tests)
        took = time.monotonic() - t0
        if done.returncode not in (0, 1):  # 2-5: pytest could not run them (a test renamed, an import error)
            raise SystemExit(f"mutation {m.name} ({where}): pytest exited {done.returncode}:\n"
                             f"{done.stdout[-3000:]}{done.stderr[-2000:]}")
        last = (done.stdout.strip().splitlines() or [""])[-1]
        if done.returncode == 0 and "passed" not in last:
            return "skipped", f"{where}: {last}", took  # (a sandbox test where bubblewrap cannot run)
        return ("caught" if done.returncode == 1 else "SURVIVED"), f"{where}: {last}", took


def baseline(chosen: list[Mutation], files: list[str]) -> None:
    """The named tests pass on the tree as it is (else a mutation they fail on proves nothing)."""
    with tempfile.TemporaryDirectory(prefix="tlab-unmutated-") as tmp:
        copy_tree(Path(tmp), files)
        done = pytest(Path(tmp), tuple(dict.fromkeys(t for m in chosen for t in m.tests)))
        if done.returncode != 0:
            raise SystemExit(f"the tests fail without a mutation:\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
        print(f"unmutated: {done.stdout.strip().splitlines()[-1]}", flush=True)


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or any(a in m.name for a in argv)]
    files = tree_files()
    baseline(chosen, files)
    survived = []
    for m in chosen:
        verdict, said, took = run(m, files)
        print(f"{verdict:<8} {m.name:<22} {took:5.1f} s  {m.guarantee}  ({said})", flush=True)
        if verdict == "SURVIVED":
            survived.append(m.name)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
