"""Every file and folder name a run directory holds, in one place: the stages, the runner,
the report and the tests read these names, never their own spelling of them.

    <run_dir>/records.jsonl          token records (generate; target resolution rewrites them)
    <run_dir>/attempt_errors.jsonl   one line per failed attempt, with what it cost
    <run_dir>/summary.json           the generate run's summary
    <run_dir>/spend_journal.jsonl    money booked before each call (store/spend_journal.py)
    <run_dir>/.lock                  one process per run directory (store/run_lock.py)
    <run_dir>/reconstructed.jsonl    the reconstruct stage's records
    <run_dir>/audit.json, audit.md   the fidelity audit
    <run_dir>/serving_auto.json      serving=auto's fitted route; probe runs in serving_auto/
    <run_dir>/serving_auto/prompts.jsonl  the probe battery's prompts (from the bundled battery)
    <run_dir>/probes/                the probe stage's runs and conformance.json / .md
    <run_dir>/report.json, report.md the report stage's output
"""

from __future__ import annotations

RECORDS = "records.jsonl"
ATTEMPT_ERRORS = "attempt_errors.jsonl"
SUMMARY = "summary.json"
JOURNAL = "spend_journal.jsonl"
LOCK = ".lock"
RECONSTRUCTED = "reconstructed.jsonl"
AUDIT_JSON = "audit.json"
AUDIT_MD = "audit.md"
SERVING_AUTO_RUN = "serving_auto.json"
SERVING_AUTO_DIR = "serving_auto"
PROBE_PROMPTS = "prompts.jsonl"
PROBES_DIR = "probes"
CONFORMANCE_JSON = "conformance.json"
CONFORMANCE_MD = "conformance.md"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"

# Every file a generate run writes in its directory: none may be a symlink.
RUN_FILES = (
    RECORDS,
    ATTEMPT_ERRORS,
    JOURNAL,
    SUMMARY,
    LOCK,
    RECORDS + ".torn",
    ATTEMPT_ERRORS + ".torn",
    JOURNAL + ".torn",
)
