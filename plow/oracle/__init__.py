"""The oracle: payloads derived from a plan, checked by the extracted Rocq checker.

`run_checkpoint(checkpoint_id, payload)` starts the `plow-oracle` binary as a separate
process, feeds it the payload and returns a `Certificate`.
"""

from plow.oracle.models import Certificate, Verdict
from plow.oracle.runner import oracle_binary, run_checkpoint

__all__ = ["Certificate", "Verdict", "oracle_binary", "run_checkpoint"]
