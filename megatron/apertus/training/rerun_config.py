"""Megatron-LM's result-validation flags (``--help``'s "result validation" group), its names,
defaults and meaning: megatron-core's rerun state machine checks results of a step and, when one
is rejected, runs the step again on the same inputs to tell a transient fault (the rerun differs)
from a reproducible result (:mod:`~megatron.apertus.training.rerun`).

The checks are Megatron-LM's, both non-fatal (``fatal=False`` in Megatron-LM): a rejected result
is logged and the step rerun once; the rerun's result is the one the step keeps, and the run goes
on either way. Without a check nothing is validated and the machine stays off, whatever
``--rerun-mode`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import version
from typing import Literal

from megatron.apertus.cli import check_output
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, require, switch


@dataclass(kw_only=True, frozen=True)
class RerunConfig:
    rerun_mode: Literal["disabled", "validate_results", "report_stats"] = flag_help(
        "what megatron-core's rerun state machine does with the checks' results: "
        "validate_results (a rejected result reruns the step in place to tell a transient fault "
        "from a reproducible result), report_stats (every step runs twice and the checked "
        "values' differences between the two runs are logged every 2 iterations; megatron-core "
        ">= 0.19) or disabled (a rejected result is only logged)",
        "validate_results",
    )
    check_for_spiky_loss: bool = switch(
        "check each micro-batch's loss sum: 10 times the largest of its first 100 values "
        "(sampled after the first iteration) or more is rejected as a spike"
    )
    check_for_large_grads: bool = switch(
        "check the gradient norm of each DDP bucket before the data-parallel reduction: 10 "
        "times the largest of its first 100 values or more is rejected"
    )
    error_injection_rate: int = flag_help(
        "inject a rejected result into about one in this many checks (0: never), to exercise "
        "the reruns",
        0,
    )
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = (
        flag_help(
            "what an injected rejection's rerun finds: transient_error (the rerun differs), "
            "persistent_error or correct_result (it reproduces)",
            "transient_error",
        )
    )
    result_rejected_tracker_filename: str | None = flag_help(
        "append each rejected result (iteration, rank, message, result, the reruns' verdicts) "
        "to this file",
        None,
    )

    def __post_init__(self) -> None:
        require(
            self.error_injection_rate >= 0,
            "--error-injection-rate",
            self.error_injection_rate,
            ">= 0",
        )
        if self.result_rejected_tracker_filename is not None:
            path = self.result_rejected_tracker_filename
            check_output("--result-rejected-tracker-filename", path, directory=False)
        found = version("megatron-core")
        if self.rerun_mode == "report_stats" and _release(found) < (0, 19):
            raise ConfigError(
                "--rerun-mode report_stats: the determinism statistics of megatron-core's rerun "
                f"state machine fail when they report before megatron-core 0.19 (found {found}); "
                "use validate_results"
            )

    @property
    def mode(self) -> str:
        """megatron-core's name of the mode (Megatron-LM passes report_stats unchanged, which
        megatron-core does not know)."""
        return {"report_stats": "report_determinism_stats"}.get(self.rerun_mode, self.rerun_mode)

    @property
    def checks(self) -> bool:
        """Whether any result is validated (else the machine stays off)."""
        return self.check_for_spiky_loss or self.check_for_large_grads


def _release(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as ``0.16.1`` or ``0.19.2+c8dfa25``."""
    return tuple(int(part) for part in text.split(".")[:2])
